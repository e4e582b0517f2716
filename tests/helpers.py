"""Shared test helpers: meshes, routings, running a per-rank function under shard_map."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ffi_path


def make_mesh(num_ranks, dp=1, devices=None):
    """A mesh ("dp", "ep") of dp x num_ranks devices, or ("ep",) when dp == 1."""
    devices = devices if devices is not None else jax.devices()
    grid = np.array(devices[: dp * num_ranks])
    if dp == 1:
        return jax.sharding.Mesh(grid, ("ep",))
    return jax.sharding.Mesh(grid.reshape(dp, num_ranks), ("dp", "ep"))


def all_axes(mesh):
    return P(tuple(mesh.axis_names))


def put(mesh, *arrays):
    sharding = NamedSharding(mesh, all_axes(mesh))
    return [jax.device_put(a, sharding) for a in arrays]


def _per_rank(value):
    return value[None] if value.ndim == 0 else value


def runner(mesh, fn):
    """jit(shard_map(fn)) over every mesh axis, jitted once: calls with inputs of the same
    shapes and dtypes reuse one compiled program (an XLA compile per call is most of a CPU test
    run's time). Scalars come back with one entry per rank."""
    spec = all_axes(mesh)

    def body(*shards):
        return jax.tree.map(_per_rank, fn(*shards))

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return lambda *args: program(*put(mesh, *args))


def run(mesh, fn, *args):
    """runner(mesh, fn)(*args): one call, compiled for it."""
    return runner(mesh, fn)(*args)


def per_rank(array, num_devices):
    """Global [devices * n, ...] result -> [devices, n, ...] numpy."""
    a = np.asarray(array)
    return a.reshape((num_devices, -1) + a.shape[1:])


ROUTINGS = ("random", "one_expert", "sparse", "skip_rank", "duplicates", "empty")


def routing(kind, rng, num_tokens, num_experts, num_topk, num_ranks):
    """topk_idx [num_tokens, K] of one of the routing kinds the tests cover."""
    idx = np.stack([rng.permutation(num_experts)[:num_topk] for _ in range(num_tokens)])
    if kind == "one_expert":  # every token to expert 0 (one rank gets everything)
        idx[:] = -1
        idx[:, 0] = 0
    elif kind == "sparse":  # most slots unused
        idx[rng.random(idx.shape) < 0.7] = -1
    elif kind == "skip_rank":  # nothing goes to the last rank
        experts_per_rank = num_experts // num_ranks
        idx = np.where(idx >= num_experts - experts_per_rank, -1, idx) if num_ranks > 1 else idx
    elif kind == "duplicates":  # the same expert twice in a token's top-k
        idx[:, -1] = idx[:, 0]
    elif kind == "late_duplicates":  # ... in its last two slots (past 32: both in the 2nd group)
        idx[:, -1] = idx[:, -2]
    elif kind == "empty":  # no token goes anywhere
        idx[:] = -1
    return idx.astype(np.int32)


def random_inputs(
    rng, devices, num_tokens, hidden, num_experts, num_topk, num_ranks, kind, dtype=jnp.bfloat16
):
    """Global x, topk_idx, topk_weights for `devices` ranks of num_tokens each."""
    n = devices * num_tokens
    x = jnp.asarray(rng.standard_normal((n, hidden)) * rng.choice([0.01, 1.0, 30.0], (n, 1)), dtype)
    idx = np.concatenate(
        [routing(kind, rng, num_tokens, num_experts, num_topk, num_ranks) for _ in range(devices)]
    )
    w = rng.random((n, num_topk)).astype(np.float32)
    return x, jnp.asarray(idx), jnp.asarray(w)


def buffers(mesh, axis="ep", **kwargs):
    """{impl: Buffer} on both paths."""
    return {impl: jax_ep.Buffer(mesh, axis, impl=impl, **kwargs) for impl in ("reference", "ffi")}


def bits(a):
    """A view that compares floats bit for bit (fp8 and bf16 included)."""
    a = np.asarray(a)
    if a.dtype.kind in "fV" or a.dtype.itemsize == 1 and a.dtype.kind not in "iub":
        return a.view(np.dtype(f"u{a.dtype.itemsize}"))
    return a


def settle(out):
    """Waits until every device is done with `out`'s step, one that raised: block_until_ready
    stops at the first error, and XLA's CPU runtime (jax 0.12) skips a step enqueued on a device
    whose failed step still runs, so the next step's collectives would wait for that device (in
    one process XLA aborts after 40 s; docs/API.md, check_invalid)."""
    for leaf in jax.tree.leaves(out):
        for piece in leaf.addressable_shards:
            try:
                piece.data.block_until_ready()
            except Exception:  # noqa: BLE001  (the step's error, on each device)
                pass


def assert_bitwise_equal(a, b, what=""):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b, f"{what}: structures differ"
    for i, (u, v) in enumerate(zip(leaves_a, leaves_b)):
        np.testing.assert_array_equal(bits(u), bits(v), err_msg=f"{what} leaf {i}")


def _platform(a):
    devices = getattr(a, "devices", None)
    return next(iter(devices())).platform if callable(devices) else jax.default_backend()


def assert_sums_equal(got, want, what=""):
    """Two combines' results (or two paths' gradients): bitwise equal on CPU devices, where every
    path sums a token's rows in the order docs/API.md states (float32, rank order), so a row
    lost, a weight off by 0.1% or a partial rounded to bf16 is caught; on GPUs, where XLA may
    reorder the reference path's float32 sums, within calc_diff < 5e-6."""
    if _platform(got) == "cpu":
        assert_bitwise_equal(got, want, what)
    else:
        diff = calc_diff(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert diff < 5e-6, f"{what}: calc_diff {diff}"


def relative_error(got, want):
    """|got - want| / |want| in float64 (Frobenius norms)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def calc_diff(x, y):
    """DeepEP's similarity measure: 0 for identical tensors."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def pipeline(
    buf,
    layout="rank",
    expert_alignment=1,
    fp8=False,
    round_scale=False,
    capacity=None,
    weighted=True,
    split=False,
    mode="auto",
):
    """A per-rank MoE step: dispatch, a fake expert (row * (1 + expert id)), combine with bias,
    then a cached dispatch of a second x. split: through the *_send / *_recv halves, with work
    on the op's input between them (Pending.run_between). Returns every output and the handle's
    arrays (send_pos, private to each implementation, left out)."""

    def step(x, topk_idx, topk_weights, bias, x2):
        between = []  # what the work between the halves computed
        valid = None  # expert_padded: the rows of data (its padding rows are unspecified)

        def data(rows):
            """rows with the unspecified ones zeroed, for comparing."""
            if rows is None or valid is None:
                return rows
            return jnp.where(valid, rows, jnp.zeros((), rows.dtype))

        def work(pending, value):
            pending, out = pending.run_between(lambda v: (v.astype(jnp.float32) * 3).sum(0), value)
            between.append(out)
            return pending

        def dispatch(x, *args, **kwargs):
            if "handle" not in kwargs:
                kwargs["mode"] = mode
            if split:
                return buf.dispatch_recv(work(buf.dispatch_send(x, *args, **kwargs), x))
            return buf.dispatch(x, *args, **kwargs)

        def combine(rows, *args, **kwargs):
            if split:
                return buf.combine_recv(work(buf.combine_send(rows, *args, **kwargs), data(rows)))
            return buf.combine(rows, *args, **kwargs)

        d = dispatch(
            x,
            topk_idx,
            topk_weights if weighted else None,
            layout=layout,
            expert_alignment=expert_alignment,
            fp8=fp8,
            round_scale=round_scale,
            capacity=capacity,
        )
        if layout == "expert_padded":
            valid = (d.topk_idx >= 0)[..., None]
        if fp8:
            rows = jax_ep.dequantize_fp8(
                d.x.reshape(-1, d.x.shape[-1]), d.scales.reshape(-1, d.scales.shape[-1])
            )
            rows = rows.reshape(d.x.shape)
        else:
            rows = d.x.astype(jnp.float32)
        expert = d.topk_idx if layout != "rank" else d.topk_idx.max(axis=1)
        expert_out = (rows * (1 + expert[..., None])).astype(x.dtype)
        y = combine(
            expert_out,
            d.handle,
            topk_weights=d.topk_weights if layout != "rank" else None,
            bias=bias,
        )
        again = dispatch(x2, handle=d.handle, fp8=fp8, round_scale=round_scale)
        h = d.handle
        return dict(
            d=d._replace(handle=None, x=data(d.x), scales=data(d.scales)),
            y=y,
            expert_out=data(expert_out),  # combine took it unmasked
            cached_x=data(again.x),
            cached_scales=data(again.scales),
            handle=dict(
                recv_counts=h.recv_counts,
                num_rows=h.num_rows,
                expert_src=h.expert_src,
                expert_rows=h.expert_rows,
            ),
            send_pos=h.send_pos,
            between=tuple(between),
        )

    return step


def out_of_order(buf, mode="low_latency", rounds=2):
    """Split ops whose recv halves run out of send order, and a whole op while a sent one waits,
    forced by data dependencies, over `rounds` (the low-latency slots get reused): a per-rank
    step returning every op's outputs."""

    def after(a, b):  # a, once b exists
        return jax.lax.optimization_barrier((a, b))[0]

    def step(x, topk_idx, topk_weights):
        xs = [x * (i + 1) for i in range(4)]
        outs = []
        for _ in range(rounds):
            send = functools.partial(
                buf.dispatch_send, topk_idx=topk_idx, topk_weights=topk_weights, mode=mode
            )
            pa = send(xs[0])
            db = buf.dispatch(after(xs[1], pa), topk_idx, topk_weights, mode=mode)
            da = buf.dispatch_recv(after(pa, db.x))
            pc = send(after(xs[2], da.x))
            pd = send(after(xs[3], pc))
            dd = buf.dispatch_recv(pd)
            dc = buf.dispatch_recv(after(pc, dd.x))
            qa = buf.combine_send(after(da.x, dc.x), da.handle)
            qc = buf.combine_send(after(dc.x, qa), dc.handle)
            yc = buf.combine_recv(qc)
            ya = buf.combine_recv(after(qa, yc))
            outs += [d._replace(handle=None) for d in (da, db, dc, dd)] + [ya, yc]
            xs = [after(xi, ya) for xi in xs]
        return outs

    return step


def assert_same_ops(got, want):
    """Outputs of out_of_order: dispatches bitwise equal, combines as assert_sums_equal."""
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, jax_ep.DispatchResult):
            assert_bitwise_equal(g, w, f"op {i}")
        else:
            assert_sums_equal(g, w, f"op {i}")


def assert_matches_reference(step, *args):
    """Runs pipeline `step` on both paths: dispatch outputs bitwise equal, combine as
    assert_sums_equal, and the custom-call path bitwise equal run to run."""
    want = step["reference"](*args)
    got = step["ffi"](*args)
    for part in ("d", "handle", "cached_x", "cached_scales", "expert_out", "between"):
        assert_bitwise_equal(got[part], want[part], part)
    assert_sums_equal(got["y"], want["y"], "y")
    assert_bitwise_equal(step["ffi"](*args), got, "run to run")


def layer_gradients(
    mesh,
    impl,
    remat,
    layout="rank",
    mode="auto",
    second_order=False,
    fp8=False,
    tokens=8,
    hidden=128,
    num_experts=16,
    num_topk=4,
    axis="ep",
):
    """d/dx of a MoE layer (dispatch, tanh, combine) on `impl`'s path, the layer under
    jax.checkpoint when `remat`: a whole op recomputed in the backward pass. second_order: a
    Hessian-vector product instead (the gradient's own ops differentiated). fp8: the rows sent
    in FP8 and used through Buffer.dequantize."""
    rng = np.random.default_rng(5)
    x, idx, w = random_inputs(
        rng, mesh.size, tokens, hidden, num_experts, num_topk, mesh.size, "random", jnp.float32
    )
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    buf = jax_ep.Buffer(
        mesh,
        axis,
        num_experts=num_experts,
        hidden=hidden,
        num_topk=num_topk,
        max_tokens_per_rank=tokens,
        impl=impl,
    )

    def layer(x, idx, w):
        d = buf.dispatch(x, idx, w, layout=layout, mode=mode, fp8=fp8)
        weights = d.topk_weights if layout != "rank" else None
        rows = buf.dequantize(d, x) if fp8 else d.x
        return buf.combine(jnp.tanh(rows), d.handle, topk_weights=weights)

    f = jax.shard_map(
        jax.checkpoint(layer) if remat else layer, mesh=mesh, in_specs=P(axis), out_specs=P(axis)
    )
    if second_order:  # curvature after the layer too
        first = jax.grad(lambda x: jnp.vdot(jnp.tanh(f(x, idx, w)), cotangent))
        grad = jax.grad(lambda x: jnp.vdot(first(x), cotangent))
    else:
        grad = jax.grad(lambda x: jnp.vdot(f(x, idx, w), cotangent))
    return np.asarray(jax.jit(grad)(*put(mesh, x)))


def branching_dispatch(buf, layout="rank"):
    """Rank 0 dispatches FP8 rows, the others bfloat16 rows, at the same op (a cond on the rank):
    ranks that run different ops at one op number. -> (x as float32, topk_idx, num_recv,
    topk_weights) of each rank (the weights all 1)."""

    def step(x, i):
        def dispatch(x, i, fp8):
            d = buf.dispatch(x, i, jnp.ones(i.shape, jnp.float32), layout=layout, fp8=fp8)
            return d.x.astype(jnp.float32), d.topk_idx, d.num_recv, d.topk_weights

        fp8, plain = (functools.partial(dispatch, fp8=f) for f in (True, False))
        return jax.lax.cond(jax.lax.axis_index("ep") == 0, fp8, plain, x, i)

    return step


def skipping_dispatches(buf):
    """Rank 0 skips the first of two alike dispatches (a cond on the rank), called from two
    places; the others run both. Op 1 pairs rank 0's second with the others' first. -> the second
    dispatch's rows, and the first's num_recv (0 on rank 0), of each rank."""

    def step(x, i):
        w = jnp.ones(i.shape, jnp.float32)

        def first(x):
            return buf.dispatch(x, i, w).num_recv

        def skip(x):
            return jnp.zeros_like(x, jnp.int32)[0, 0]  # varying over the ranks, like first's

        first_recv = jax.lax.cond(jax.lax.axis_index("ep") == 0, skip, first, x)
        second = buf.dispatch(x, i, w)
        return second.x, first_recv

    return step


def assert_matches_oracle(
    out,
    inputs,
    num_ranks,
    dp,
    lay,
    alignment,
    fp8,
    round_scale,
    capacity,
    ranks_per_node=None,
):
    """A pipeline's outputs (run on every rank; inputs x, topk_idx, topk_weights, bias) against
    the numpy oracle of docs/API.md: dp groups of num_ranks ranks, tokens_per_rank = what x
    gives. ranks_per_node: a Buffer over ("node", "ep") (its combine sums by node; its
    send_pos is private)."""
    import oracle

    from jax_ep import layout

    x, idx, w, bias = (np.asarray(a) for a in inputs)
    devices = num_ranks * dp
    tokens, hidden = x.shape[0] // devices, x.shape[1]

    def groups(a):  # [devices, ...] -> [dp, R, ...]
        a = per_rank(a, devices)
        return a.reshape((dp, num_ranks) + a.shape[1:])

    xs, idxs, ws, biases = (groups(a) for a in (x, idx, w, bias))
    d = {k: groups(v) for k, v in out["d"]._asdict().items() if v is not None}
    y, expert_out = groups(out["y"]), groups(out["expert_out"])
    el = d["tokens_per_expert"].shape[-1]
    num_experts = el * num_ranks
    padded = lay == "expert_padded"
    if padded:  # [dp, R, E_l, B, ...] -> [dp, R, E_l * B, ...]
        block = d["x"].shape[3]
        assert d["x"].shape[2] == el
        assert block == (capacity or num_ranks * tokens)
        for f in ("x", "scales", "topk_idx", "topk_weights"):
            if f in d:
                d[f] = d[f].reshape(d[f].shape[:2] + (-1,) + d[f].shape[4:])
        expert_out = expert_out.reshape(expert_out.shape[:2] + (-1, hidden))
    for g in range(dp):
        rows = capacity if lay == "rank" else num_ranks * tokens
        if lay == "rank" and capacity is None:
            rows = num_ranks * tokens
        want = oracle.dispatch_rank(xs[g], idxs[g], ws[g], num_experts, rows, fp8, round_scale)
        if ranks_per_node is None:
            np.testing.assert_array_equal(groups(out["send_pos"])[g], want["send_pos"])
        np.testing.assert_array_equal(d["num_invalid"][g][:, 0], want["num_invalid"])
        if lay == "rank":
            n = want["x"].shape[1]  # default capacity is R*N rows with N = T here
            for f in ("topk_idx", "topk_weights", "tokens_per_expert"):
                np.testing.assert_array_equal(d[f][g], want[f], err_msg=f)
            np.testing.assert_array_equal(d["x"][g][:, :n].view(np.uint8), want["x"].view(np.uint8))
            if fp8:
                np.testing.assert_array_equal(d["scales"][g], want["scales"])
            np.testing.assert_array_equal(d["num_recv"][g][:, 0], want["num_recv"])
            np.testing.assert_array_equal(d["num_dropped"][g][:, 0], want["num_dropped"])
            partial = expert_out[g]
        else:
            partial = []
            cap = d["x"].shape[2]  # expert rows (all experts' blocks when padded)
            for r in range(num_ranks):
                src, expert, weight, present, dropped = oracle.expert_layout(
                    want["topk_idx"][r],
                    want["topk_weights"][r],
                    el,
                    alignment,
                    cap,
                    block if padded else 0,
                )
                np.testing.assert_array_equal(d["topk_idx"][g][r], expert)
                np.testing.assert_allclose(d["topk_weights"][g][r], weight, rtol=1e-6)
                np.testing.assert_array_equal(d["tokens_per_expert"][g][r], present)
                assert d["num_dropped"][g][r, 0] == dropped
                gathered = np.where((src >= 0)[:, None], want["x"][r][np.maximum(src, 0)], 0)
                np.testing.assert_array_equal(
                    d["x"][g][r].view(np.uint8), gathered.astype(want["x"].dtype).view(np.uint8)
                )
                sizes = layout.align_up(present, alignment)
                assert d["num_recv"][g][r, 0] == sizes.sum()
                # The expert rows of each rank-level row, weighted, in expert order.
                acc = np.zeros((rows, hidden), np.float32)
                for i in range(cap):
                    if src[i] >= 0:
                        acc[src[i]] += weight[i] * expert_out[g][r][i].astype(np.float32)
                partial.append(acc)
        want_y = oracle.combine(partial, want["send_pos"], biases[g], ranks_per_node)
        assert_sums_equal(y[g], want_y.astype(x.dtype), f"y, group {g}")


@functools.cache
def _padded_call(capacity, experts_per_rank):
    ffi_path.register_targets()
    ops = ffi_path.Ffi(0, 1, experts_per_rank)
    return jax.jit(
        lambda topk, w, x, scales: ops.expert_padded(
            topk, w, (x, scales), experts_per_rank=experts_per_rank, capacity=capacity
        )
    )


# The expert_padded call's cases that take the GPU kernel's other paths (the CPU backend runs
# them too): (routing, capacity) over 2500 rank-level rows, three chunks of the kernel's count
# (C=300 drops); and (routing, local experts, top-k, hidden) over 1500 rows.
EXPERT_PADDED_CHUNKS = [
    (kind, capacity) for kind in ("random", "duplicates", "one_expert") for capacity in (2500, 300)
]
EXPERT_PADDED_SHAPES = [
    ("duplicates", 48, 40, 8),  # more than 32 slots a row: the slots in two groups
    ("late_duplicates", 48, 40, 8),  # an expert named twice, both in the second group
    ("duplicates", 6, 4, 5000),  # rows of 20000 bytes: staged in two pieces
    ("duplicates", 6, 4, 4099),  # rows not a multiple of 16 bytes: copied byte by byte
]


def check_expert_padded_call(rng, kind, rows, capacity, num_local=6, k=4, hidden=8):
    """The expert_padded custom call alone, on the default device, against the oracle: maps,
    weights, counts, drops, and the rows ([rows, hidden] float32) and scales placed; the rows
    past an expert's count are unspecified, not compared."""
    topk = routing(kind, rng, rows, num_local, k, 1)
    w = rng.random((rows, k)).astype(np.float32)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    scales = rng.standard_normal((rows, 2)).astype(np.float32)
    maps, weights, (x_out, scales_out) = _padded_call(capacity, num_local)(topk, w, x, scales)
    src, expert, weight, present, dropped = oracle.expert_layout(
        topk, w, num_local, 1, num_local * capacity, block_rows=capacity
    )
    np.testing.assert_array_equal(maps.expert_src, src)
    np.testing.assert_array_equal(maps.expert_of_row, expert)
    np.testing.assert_allclose(weights, weight, rtol=1e-6)
    np.testing.assert_array_equal(maps.tokens_per_expert, present)
    assert int(maps.num_dropped) == dropped
    valid = src >= 0
    np.testing.assert_array_equal(np.asarray(x_out)[valid], x[src[valid]])
    np.testing.assert_array_equal(np.asarray(scales_out)[valid], scales[src[valid]])
    # expert_rows: column m of a row is the place of its m-th distinct expert, -1 if dropped
    expected = np.full((rows, min(k, num_local)), -1, np.int32)
    for r in range(rows):
        for m, e in enumerate(sorted(set(topk[r][topk[r] >= 0]))):
            expected[r, m] = next(iter(np.flatnonzero((src == r) & (expert == e))), -1)
    np.testing.assert_array_equal(maps.expert_rows, expected)


def fp8_edge_values(rng, shape):
    """float32 values [..., R, C] (R, C multiples of 128) for the FP8 rule's edge cases: a
    block of zeros (amax clamped to 1e-4), a block 10^4 larger, one 10^-6 smaller (e4m3's
    subnormals and zeros), a NaN (left out of its block's amax), the rest normal."""
    x = rng.standard_normal(shape).astype(np.float32)
    corner = (0,) * (len(shape) - 2)
    x[corner + (1, 200)] = np.nan
    x[corner + (slice(0, 128), slice(0, 128))] = 0
    x[corner + (slice(-128, None), slice(-128, None))] *= 1e4
    x[corner + (slice(0, 128), slice(-128, None))] *= 1e-6
    return x


def check_fp8_quantize_calls(rows_shape, weights_shape, seed=0):
    """The FP8 quantization calls (ffi_path.quantize_rows, quantize_weights) on the default
    device: the bytes of jax_ep.fp8's rule (quantize_fp8; quantize_weights_fp8 and its
    transpose_weights_fp8), for float32 and bfloat16 values with its edge cases."""
    from jax_ep.fp8 import quantize_weights_fp8, transpose_weights_fp8

    rng = np.random.default_rng(seed)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(fp8_edge_values(rng, rows_shape), dtype)
        for round_scale in (False, True):
            got = jax.jit(functools.partial(ffi_path.quantize_rows, round_scale=round_scale))(x)
            want = jax.jit(lambda a, r=round_scale: jax_ep.quantize_fp8(a, r))(x)
            assert_bitwise_equal(got, want, f"rows {jnp.dtype(dtype).name} {round_scale}")
        w = jnp.asarray(fp8_edge_values(rng, weights_shape), dtype)
        q, scales = jax.jit(quantize_weights_fp8)(w)
        want = (q, scales) + transpose_weights_fp8(q, scales)
        for transposed in (False, True):
            got = jax.jit(lambda a, t=transposed: ffi_path.quantize_weights(a, t))(w)
            assert_bitwise_equal(got, want[: 4 if transposed else 2], f"weights {transposed}")

"""What each process of tests/test_processes.py runs (see processes.py): jax_ep on a mesh that
spans processes, against the reference path on the same mesh. Every process checks its own
shards and raises on a mismatch."""

from __future__ import annotations

import functools
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from helpers import (
    assert_sums_equal,
    bits,
    buffers,
    pipeline,
    random_inputs,
    relative_error,
    settle,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _testing, nn
from jax_ep._jax import distributed_client

E, H, K, T = 16, 256, 4, 16


def global_mesh():
    """All devices; with DP=2 a ("dp", "ep") mesh whose EP groups each span every process."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    dp = int(os.environ.get("DP", "1"))
    if dp == 1:
        return jax.sharding.Mesh(np.array(devices), ("ep",))
    per = len(devices) // jax.process_count()
    grid = np.array(devices).reshape(jax.process_count(), dp, per // dp).transpose(1, 0, 2)
    return jax.sharding.Mesh(grid.reshape(dp, -1), ("dp", "ep"))


def shard(mesh, value):
    """A global array sharded over every mesh axis from the same host value on each process."""
    value = np.asarray(value)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def runner(mesh, fn):
    """jit(shard_map(fn)) over every mesh axis, jitted once: calls with inputs of the same shapes
    reuse one compiled program (compiling is most of these processes' time)."""
    spec = P(tuple(mesh.axis_names))

    def body(*shards):
        return jax.tree.map(lambda v: v[None] if v.ndim == 0 else v, fn(*shards))

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return lambda *values: program(*(shard(mesh, v) for v in values))


def run(mesh, fn, *values):
    return runner(mesh, fn)(*values)


def local(tree):
    """This process's shards of every leaf, by device."""
    return [
        {s.device.id: np.asarray(s.data) for s in leaf.addressable_shards}
        for leaf in jax.tree.leaves(tree)
    ]


def assert_same_shards(got, want, what):
    for i, (g, w) in enumerate(zip(local(got), local(want))):
        for device in g:
            np.testing.assert_array_equal(
                bits(g[device]), bits(w[device]), err_msg=f"{what}: leaf {i} on device {device}"
            )


def inputs(mesh, kind="random", dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)  # the same on every process
    x, idx, w = random_inputs(rng, mesh.size, T, H, E, K, mesh.shape["ep"], kind, dtype)
    bias = np.asarray(rng.standard_normal(x.shape), np.float32).astype(x.dtype)
    return np.asarray(x), np.asarray(idx), np.asarray(w), bias


def flat():
    """A Buffer over "ep" on a mesh across processes: the custom calls against the reference
    path in every layout, gradients, invalid ids."""
    mesh = global_mesh()
    bufs = buffers(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=10
    )
    cases = [
        ("rank", 1, False, None, False),
        ("expert", 4, True, None, True),
        ("expert_padded", 1, False, None, True),
        ("rank", 1, True, 9, False),
        ("expert", 2, False, 24, False),
    ]
    matches_reference(mesh, bufs, cases)
    gradients(mesh, bufs)
    invalid_ids(mesh, bufs, "ep")
    layer_traced_first_on_one_process(mesh)


def layer_traced_first_on_one_process(mesh):
    """jax_ep.nn's layer (which jits itself) in a jitted gradient step; process 0 alone first
    asks for its output's shape through a helper (jax.eval_shape traces it, from other lines).
    Every process's ops still carry one call site: the gradients equal the reference path's."""
    cfg = nn.MoEConfig(num_experts=E, num_topk=K, hidden=H, ffn_hidden=64)
    tokens = T * mesh.size // mesh.shape["ep"]  # the layer splits the tokens over "ep" only
    layers = {
        impl: nn.MoELayer(
            cfg, mesh, expert_axis="ep", tokens_per_rank=tokens, impl=impl, timeout_s=20
        )
        for impl in ("ffi", "reference")
    }
    params = nn.init_params(jax.random.key(0), cfg, mesh=mesh, expert_axis="ep")
    x = shard(mesh, np.random.default_rng(6).standard_normal((mesh.size * T, H), np.float32))

    def output_shape(layer):
        return jax.eval_shape(lambda p, x: layer(p, x)[0], params, x)

    if jax.process_index() == 0:
        output_shape(layers["ffi"])
    grads = {
        impl: jax.jit(jax.grad(lambda p, x, layer=layer: (layer(p, x)[0] ** 2).mean()))(params, x)
        for impl, layer in layers.items()
    }
    for g, r in zip(local(grads["ffi"]), local(grads["reference"])):
        for device in g:
            error = relative_error(g[device], r[device])
            assert error < 1e-5, f"the layer's gradient: {error}"


def matches_reference(mesh, bufs, cases):
    for lay, alignment, fp8, capacity, split in cases:
        step = {
            impl: runner(mesh, pipeline(buf, lay, alignment, fp8, False, capacity, split=split))
            for impl, buf in bufs.items()
        }  # one compile per path, shared by both routings
        for kind in ("random", "one_expert"):
            x, idx, w, bias = inputs(mesh, kind)
            out = {impl: step[impl](x, idx, w, bias, x * 2) for impl in bufs}
            what = f"{lay} fp8={fp8} capacity={capacity} split={split} {kind}"
            for part in ("d", "handle", "cached_x", "cached_scales", "expert_out", "between"):
                assert_same_shards(out["ffi"][part], out["reference"][part], f"{what} {part}")
            for g, r in zip(local(out["ffi"]["y"]), local(out["reference"]["y"])):
                for device in g:
                    assert_sums_equal(g[device], r[device], f"{what} y")


def gradients(mesh, bufs):
    x, idx, w, _ = inputs(mesh, dtype=jnp.float32, seed=3)
    cotangent = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    spec = P(tuple(mesh.axis_names))
    for lay in ("rank", "expert"):
        grads = {}
        for impl, buf in bufs.items():

            def layer(x, idx, w, buf=buf):
                d = buf.dispatch(x, idx, w, layout=lay)
                weights = d.topk_weights if lay != "rank" else None
                return buf.combine(jnp.tanh(d.x), d.handle, topk_weights=weights)

            f = jax.shard_map(layer, mesh=mesh, in_specs=spec, out_specs=spec)
            loss = lambda x, w, i, c, f=f: jnp.vdot(f(x, i, w), c)  # noqa: E731
            grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(
                *(shard(mesh, v) for v in (x, w, idx, cotangent))
            )
        for g, r in zip(local(grads["ffi"]), local(grads["reference"])):
            for device in g:  # XLA fuses the two paths' backward sums differently
                error = relative_error(g[device], r[device])
                assert error < 1e-6, f"gradient, {lay} layout: {error}"


def invalid_ids(mesh, bufs, axis):
    x, idx, w, _ = inputs(mesh, seed=5)
    bad = idx.copy()
    bad[3, 1], bad[-1, 0] = E, -9  # on the first and the last rank
    clean = bad.copy()
    clean[3, 1] = clean[-1, 0] = -1

    def counts(buf):  # one compiled program per Buffer, for the bad and the clean ids
        return runner(mesh, lambda x, i, w: buf.dispatch(x, i, w)._replace(handle=None))

    reference = counts(bufs["reference"])
    want = reference(x, bad, w)
    assert_same_shards(counts(bufs["ffi"])(x, bad, w), want, "invalid ids")
    if jax.local_device_count() > 1:
        # The raise with one device per process only: where processes hold several devices,
        # XLA's CPU runtime (jax 0.12) left the devices' gloo collectives out of step after it,
        # and the next steps hung (docs/API.md, check_invalid).
        return
    for impl in ("reference", "ffi"):
        checking = counts(
            jax_ep.Buffer(
                mesh,
                axis,
                num_experts=E,
                hidden=H,
                num_topk=K,
                max_tokens_per_rank=T,
                impl=impl,
                check_invalid=True,
            )
        )
        out = None  # (the call itself may raise: where each process has one device)
        try:
            out = checking(x, bad, w)
            jax.block_until_ready(out)
        except Exception as e:  # every process raises, also those whose ids were all valid
            assert "topk_idx holds 2 expert id" in str(e), e
        else:
            raise AssertionError(f"check_invalid did not raise ({impl})")
        after_failure(out, f"invalid ids {impl}")
        assert_same_shards(checking(x, clean, w), reference(x, clean, w), "after the check")


def after_failure(out, name):
    """Waits until every device here is done with the step that raised (block_until_ready stops
    at the first error), then for every process (the key-value store's barrier, no collective).
    Without it a process went on to the next steps while a peer was still in the failed one's
    gloo collectives, and both hung (once, CI, jax 0.12: process 0 in an all-reduce of a later
    step, process 1 in the failed step's all-gather)."""
    settle(out)
    distributed_client().wait_at_barrier(f"after {name}", 120_000)


def mismatched_arguments():
    mesh = global_mesh()
    topk = K + jax.process_index()  # process 1 asks for another Buffer
    try:
        jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=topk, max_tokens_per_rank=T, timeout_s=60
        )
    except ValueError as e:
        assert "num_topk" in str(e) and "asked for another Buffer" in str(e), e
        print("RAISED:", e)
    else:
        raise AssertionError("no error for a Buffer that differs between processes")
    # The same two processes go on (process start-up is what costs in CI):
    soak(mesh)
    counter_not_skewed(mesh)
    mismatched_ops(mesh)
    timeout_nan(mesh)
    op_numbers_past_2_to_the_32(mesh)
    late_first_process(mesh)


def late_first_process(mesh, timeout_s=4.0):
    """Process 0 (which gives the verdict on the arguments) reaches a Buffer after process 1
    gave up on it: it fails at once with process 1's word, not after a timeout of its own, so
    that both processes' retries meet."""
    started = time.perf_counter()
    if jax.process_index() == 0:
        time.sleep(timeout_s + 1)
    errors = []
    for _ in range(2):
        attempt = time.perf_counter()
        try:
            buf = jax_ep.Buffer(
                mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T,
                timeout_s=timeout_s,
            )  # fmt: skip
        except ValueError as e:
            errors.append((str(e), time.perf_counter() - attempt))
        else:
            break
    assert len(errors) == 1 and "process 1 gave up waiting" in errors[0][0], errors
    if jax.process_index() == 0:
        assert errors[0][1] < timeout_s / 2, errors  # at once
    assert time.perf_counter() - started < 3 * timeout_s
    reference = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )
    matches_reference(mesh, dict(ffi=buf, reference=reference), [("rank", 1, False, None, False)])


def soak(mesh):
    """$SOAK_OPS dispatch and combine ops (default 1000; the issue's soak: 10000) on a mesh that
    spans the processes, every result checked against the reference path."""
    from test_fuzz import soak as run_soak

    ops = int(os.environ.get("SOAK_OPS", "1000"))
    start = time.perf_counter()
    assert run_soak(ops, mesh) == ops
    print(f"SOAK: {ops} ops in {time.perf_counter() - start:.1f} s", flush=True)


def counter_not_skewed(mesh):
    """A Buffer refused by a local check on process 1 only: the next Buffer still pairs up."""
    if jax.process_index() == 1:
        try:
            with _testing.buffers(first_op=-1):
                jax_ep.Buffer(
                    mesh,
                    "ep",
                    num_experts=E,
                    hidden=H,
                    num_topk=K,
                    max_tokens_per_rank=T,
                    timeout_s=30,
                )
        except ValueError as e:
            assert "first_op" in str(e), e
        else:
            raise AssertionError("a bad first_op was accepted")
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=30
    )
    x, idx, w, _ = inputs(mesh)
    d = run(mesh, lambda x, i, w: buf.dispatch(x, i, w).num_recv, x, idx, w)
    assert buf.status() is None and all(int(v[0]) >= 0 for v in local(d)[0].values())


def _nan_everywhere(d):
    """A dispatch's outputs as a failed op leaves them: NaN rows, ids -1, counts 0."""
    for device, rows in local(d.x)[0].items():
        rows = np.asarray(rows)
        nan = (
            rows.view(np.uint8) == 0x7F
            if rows.dtype.itemsize == 1
            else np.isnan(rows.astype(np.float32))
        )
        assert nan.all(), f"device {device}: not all rows are NaN"
    for leaf in (d.topk_idx,):
        assert all((v == -1).all() for v in local(leaf)[0].values())
    for leaf in (d.num_recv, d.tokens_per_expert):
        assert all((v == 0).all() for v in local(leaf)[0].values())


def mismatched_ops(mesh):
    """Process 0 dispatches FP8 rows, process 1 bfloat16 rows, at the same op: both steps
    return NaN at once (not after timeout_s), both Buffers name both ops, the next call raises
    so on every process."""
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
    )
    x, idx, w, _ = inputs(mesh)
    fp8 = jax.process_index() == 0
    start = time.perf_counter()
    d = run(mesh, lambda x, i, w: buf.dispatch(x, i, w, fp8=fp8)._replace(handle=None), x, idx, w)
    jax.block_until_ready(d)
    assert time.perf_counter() - start < 30, "a mismatch waited for the timeout"
    _nan_everywhere(d)
    both = (
        "dispatch(fp8 rows of bfloat16 x, hidden 256, 16 tokens, top-4 of 16 experts)",
        "dispatch(bfloat16 rows, hidden 256, 16 tokens, top-4 of 16 experts)",
    )
    status = buf.status()
    assert status and all(op in status for op in both), status
    try:
        jax.block_until_ready(run(mesh, lambda x, i, w: buf.dispatch(x, i, w).x, x, idx, w))
    except Exception as e:
        assert all(op in str(e) for op in both), e
        print("MISMATCH RAISED:", str(e).splitlines()[0])
    else:
        raise AssertionError("the call after a mismatch did not raise")


def timeout_nan(mesh):
    """Process 1 stays away from an op for longer than timeout_s: process 0's op returns NaN in
    its own step and writes the abort into process 1's window; process 1's op of that number
    returns NaN too once it comes, and the next call raises on both, naming the wait."""
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=2
    )
    x, idx, w, _ = inputs(mesh)

    def step():
        return run(mesh, lambda x, i, w: buf.dispatch(x, i, w)._replace(handle=None), x, idx, w)

    jax.block_until_ready(step())  # both
    if jax.process_index() == 1:
        time.sleep(5)
    d = step()
    jax.block_until_ready(d)
    _nan_everywhere(d)
    status = buf.status()
    assert status and "rank 0 of EP group 0 waited more than 2" in status, status
    try:
        jax.block_until_ready(step())
    except Exception as e:
        assert "waited more than 2" in str(e) and "for rank 1" in str(e), e
        print("TIMEOUT RAISED:", str(e).splitlines()[0])
    else:
        raise AssertionError("the call after a timed-out op did not raise")


def op_numbers_past_2_to_the_32(mesh):
    """Ops numbered across 2^32 (whole and split: the recv halves' tickets too) on a mesh that
    spans processes equal the reference path."""
    with _testing.buffers(first_op=2**32 - 3):
        bufs = buffers(
            mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=30
        )
    x, idx, w, bias = inputs(mesh, seed=9)
    for split in (True, False):  # ops 2^32 - 2 to 2^32 + 3
        out = {
            impl: run(
                mesh,
                pipeline(buf, "rank", 1, False, False, None, split=split),
                x,
                idx,
                w,
                bias,
                x * 2,
            )
            for impl, buf in bufs.items()
        }
        for part in ("d", "handle", "cached_x", "between"):
            assert_same_shards(out["ffi"][part], out["reference"][part], f"past 2^32 {part}")
    assert bufs["ffi"].status() is None


def early_exit():
    """Process 1 stops before the first op: process 0's op returns NaN at once (its liveness
    watch saw process 1 end; timeout_s is 60 s), its next call raises naming rank 1, and it goes
    on (a Buffer of its own devices works)."""
    mesh = global_mesh()
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
    )
    if jax.process_index() == 1:
        os._exit(0)
    x, idx, w, _ = inputs(mesh)
    start = time.perf_counter()
    rows = run(mesh, lambda x, i, w: buf.dispatch(x, i, w).x, x, idx, w)  # the op that stopped
    assert all(np.isnan(v.astype(np.float32)).all() for v in local(rows)[0].values())
    assert time.perf_counter() - start < 30, "the op waited for the timeout"
    ended = "stopped waiting for rank 1 (op 1): the process of rank 1 has ended"
    status = buf.status()
    assert ended in status, status
    assert "process 1 (rank 1 of 'ep') stopped: it has ended" in status, status
    try:  # the next call raises
        jax.block_until_ready(run(mesh, lambda x, i, w: buf.dispatch(x, i, w).x, x, idx, w))
    except Exception as e:
        assert ended in str(e), e
        print("RAISED:", str(e).splitlines()[0])
    else:
        raise AssertionError("no error for a peer that never came")
    mine = jax.sharding.Mesh(np.array(jax.local_devices()), ("ep",))
    alone = jax_ep.Buffer(mine, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    d = jax.jit(
        jax.shard_map(
            lambda x, i: alone.dispatch(x, i).num_recv[None],
            mesh=mine,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
    )(jnp.ones((mine.size * T, H), jnp.bfloat16), jnp.zeros((mine.size * T, K), jnp.int32))
    assert int(np.asarray(d)[0]) == mine.size * T
    print("SCENARIO OK", flush=True)
    os._exit(0)  # the coordination service would wait for process 1 at shutdown


def many_ranks():
    """More ranks than a 32-bit mask holds, in one process."""
    mesh = global_mesh()
    assert mesh.size > 32
    bufs = buffers(mesh, num_experts=2 * mesh.size, hidden=H, num_topk=K, max_tokens_per_rank=4)
    rng = np.random.default_rng(7)
    x, idx, w = random_inputs(rng, mesh.size, 4, H, 2 * mesh.size, K, mesh.size, "random")
    out = {
        impl: run(
            mesh,
            functools.partial(lambda b, x, i, w: b.dispatch(x, i, w)._replace(handle=None), buf),
            np.asarray(x),
            np.asarray(idx),
            np.asarray(w),
        )
        for impl, buf in bufs.items()
    }
    assert_same_shards(out["ffi"], out["reference"], "many ranks")


def node_mesh():
    """("node", "ep"): each process one node, its devices the node's ranks."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(jax.process_count(), -1), ("node", "ep"))


NODE_CASES = {  # (layout, alignment, fp8, capacity, split) per launch, sharing the processes
    "2x2": [("rank", 1, False, None, False), ("expert", 4, True, None, True)],
    "4x2": [("expert", 2, False, 24, False)],
    "2x4": [("rank", 1, True, 9, True), ("expert_padded", 1, False, None, False)],
    "2x1": [("expert", 1, False, None, False)],
}


def nodes():
    """A Buffer over ("node", "ep") with processes as nodes (the node leg through gloo): the
    custom calls against the reference path; with $MISSING_NODE also gradients and invalid ids,
    then process 1 stops and process 0's next op ends in an error, not a hang."""
    mesh = node_mesh()
    axis = ("node", "ep")
    bufs = buffers(
        mesh, axis, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=10
    )
    shape = f"{mesh.shape['node']}x{mesh.shape['ep']}"
    matches_reference(mesh, bufs, NODE_CASES[shape])
    if os.environ.get("CHECK_INVALID"):  # check_invalid's raise: one device per process
        invalid_ids(mesh, bufs, axis)
    if os.environ.get("MISSING_NODE"):  # the launch that checks the rest too (CI's time)
        gradients(mesh, bufs)
        invalid_ids(mesh, bufs, axis)
        missing_node(mesh, bufs["ffi"])


def missing_node(mesh, buf):
    x, idx, w, _ = inputs(mesh)
    step = runner(mesh, lambda x, i, w: buf.dispatch(x, i, w).x)
    jax.block_until_ready(step(x, idx, w))
    if jax.process_index() == 1:
        print("CHECKS OK", flush=True)  # its own checks passed: it stops on purpose
        os._exit(0)
    start = time.perf_counter()
    try:
        jax.block_until_ready(step(x, idx, w))
    except Exception as e:
        assert "Connection reset by peer" in str(e) or "closed" in str(e), e
        print("RAISED:", str(e).splitlines()[0], flush=True)
    else:
        raise AssertionError("no error for a node that stopped")
    # XLA's error names a socket; the Buffer names the node.
    status = buf.status()
    assert "process 1 (node 1 of ('node', 'ep')) stopped: it has ended" in status, status
    print("STATUS:", status, flush=True)
    assert time.perf_counter() - start < 60
    print("SCENARIO OK", flush=True)
    os._exit(0)  # the coordination service would wait for process 1 at shutdown


def nodes_running_different_ops():
    """Over ("node", "ep"), process 1 runs a cached dispatch where process 0 runs a combine of
    the same payload size (the node leg alone would pair them and bring process 0 wrong rows):
    both steps return NaN at once, both Buffers name both ops, the next call raises on both."""
    mesh = node_mesh()
    buf = jax_ep.Buffer(
        mesh, ("node", "ep"), num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T,
        timeout_s=60,
    )  # fmt: skip
    x, idx, w, _ = inputs(mesh, dtype=jnp.float32)

    def step(cached):
        def body(x, i, w):
            d = buf.dispatch(x, i, w)
            if cached:  # the rows of a cached dispatch, in the combine's shape
                return buf.dispatch((x + d.x[: x.shape[0]]) * 100, handle=d.handle).x[: x.shape[0]]
            return buf.combine(d.x, d.handle)

        return runner(mesh, body)

    assert all(np.isfinite(y).all() for y in local(step(False)(x, idx, w))[0].values())
    start = time.perf_counter()
    got = local(step(jax.process_index() == 1)(x, idx, w))[0]
    for device, y in got.items():
        if not np.isnan(y).all():
            print(f"device {device}: not all NaN after nodes ran different ops", flush=True)
            os._exit(1)  # at once: an exception would wait for process 1 at shutdown
    assert time.perf_counter() - start < 30, "a mismatch waited for the timeout"
    both = (
        "node 1 ran cached dispatch(float32 rows, hidden 256, 16 tokens, a handle's routes)"
        if jax.process_index() == 0
        else "node 0 ran combine(float32 rows, width 256, 64 rows)",
        "combine(float32 rows, width 256, 64 rows)",
        "cached dispatch(float32 rows, hidden 256, 16 tokens, a handle's routes)",
    )
    status = buf.status()
    assert status and all(op in status for op in both), status
    try:
        jax.block_until_ready(step(False)(x, idx, w))
    except Exception as e:  # noqa: BLE001 - the contract's outcome
        assert all(op in str(e) for op in both[1:]), e
        print("RAISED:", str(e).splitlines()[0], flush=True)
    else:
        raise AssertionError("the call after nodes ran different ops did not raise")
    print("SCENARIO OK", flush=True)
    os._exit(0)


# ---- jobs that end abruptly (tests/test_process_failures.py)


def _held_at(step):
    """Stops this process inside Buffer creation at `step` (a meeting or an exchange of
    jax_ep.meeting), after saying so, until it is killed."""
    from jax_ep import meeting

    def holding(real):
        def held(p, what, *args, **kwargs):
            if what == step:
                print(f"AT {step}", flush=True)
                while True:
                    time.sleep(60)
            return real(p, what, *args, **kwargs)

        return held

    for name in ("meet", "exchange"):
        setattr(meeting, name, holding(getattr(meeting, name)))


def killed():
    """Runs until it is killed, at $STAGE: created (inside Buffer creation, once every process
    made its windows, before any maps its peers'), connected (once each mapped its peers', before
    the processes meet to say so), idle (a Buffer made) or running (ops in a loop)."""
    stage = os.environ["STAGE"]
    if stage in ("created", "connected"):
        _held_at(stage)
    mesh = global_mesh()
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
    )
    if stage == "idle":
        from jax_ep import liveness

        listener = liveness._listener
        host, port = listener.server.getsockname()[:2]
        published = distributed_client().key_value_try_get(f"jax_ep/alive/{jax.process_index()}")
        print(f"LISTENER bound {host}:{port} published {published}", flush=True)
        print("AT idle", flush=True)
        while True:
            time.sleep(60)
    x, idx, w, _ = inputs(mesh)
    step = runner(mesh, lambda x, i, w: buf.dispatch(x, i, w).x)
    jax.block_until_ready(step(x, idx, w))
    print("AT running", flush=True)
    while True:
        jax.block_until_ready(step(x, idx, w))


def interrupted():
    """Process 0 creates a Buffer that process 1 never creates, and is interrupted (SIGINT, as
    Ctrl-C) while it waits: it says after how long the KeyboardInterrupt came."""
    mesh = global_mesh()
    if jax.process_index() == 1:
        print("AT idle", flush=True)
        while True:
            time.sleep(60)
    print("AT waiting", flush=True)
    start = time.monotonic()
    try:
        jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
        )
    except KeyboardInterrupt:
        print(f"INTERRUPTED after {time.monotonic() - start:.2f} s", flush=True)
        os._exit(0)  # the coordination service would wait for process 1 at shutdown
    print("NOT INTERRUPTED", flush=True)
    os._exit(1)


def dying():
    """Dispatches in a loop until a process is killed (tests/test_process_failures.py sends
    SIGKILL): each step's rows carry the step's number, so a survivor's step has this step's rows
    or NaN, never another step's; the first NaN comes at once (the Buffer's timeout_s is 60 s: not
    what ends it), status() names the killed process and the next call raises. A survivor then
    waits: process 0 to be killed next ($THEN_PROCESS_0), the others for JAX to end them when it
    is, printing what they saw meanwhile."""
    mesh = global_mesh()
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
    )
    tokens = mesh.size * T
    idx = np.full((tokens, K), -1, np.int32)
    idx[:, 0] = np.arange(tokens) * 7 % E
    step = runner(mesh, lambda x, i: buf.dispatch(x, i)._replace(handle=None))
    me = jax.process_index()
    for n in itertools.count():
        tag = n * 1024 + np.arange(tokens, dtype=np.float32)  # every row: its step and token
        d = step(np.repeat(tag[:, None], H, axis=1), idx)
        if n == 1:
            print("AT running", flush=True)
        rows, ids, received = (local(leaf)[0] for leaf in (d.x, d.topk_idx, d.num_recv))
        failed = {device for device, r in rows.items() if np.isnan(r).all()}
        for device, r in rows.items():  # a rank's op may end before a peer's fails
            valid = int(received[device][0])
            if device in failed:
                assert valid == 0 and (ids[device] == -1).all(), f"step {n}: a failed op's ids"
                continue
            assert valid > 0 and (r[:valid] // 1024 == n).all(), f"step {n}: another step's rows"
            assert (r[valid:] == 0).all(), f"step {n}: padding rows that are not zeros"
        if failed:
            print(f"NAN at {time.time():.6f} in step {n}", flush=True)
            break
    status = buf.status()
    print("STATUS:", status.replace("\n", " | "), flush=True)
    try:
        jax.block_until_ready(step(np.zeros((tokens, H), np.float32), idx))
    except Exception as e:  # noqa: BLE001 - the contract's outcome
        print("RAISED:", str(e).splitlines()[0], flush=True)
    else:
        raise AssertionError("the call after a process ended did not raise")
    print("SURVIVED", flush=True)
    if me == 0 and not os.environ.get("THEN_PROCESS_0"):
        os._exit(0)  # the coordination service would wait for the killed process at shutdown
    while True:
        time.sleep(60)

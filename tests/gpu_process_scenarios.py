"""What each process of tests/test_gpu_processes.py runs (through tests/processes.py): several
processes on one GPU, each a rank of one global mesh, the Buffer on the CUDA-IPC engine. XLA's
collectives cannot run with two ranks on one GPU, so nothing here runs the reference path:
every process checks the shards of its own rank against the numpy oracle (tests/oracle.py).

suite() runs every case on fresh Buffers and prints one line per case, "CASE <name> OK" or
"CASE <name> FAIL <why>", and goes on after a failure (the processes stay in step: every process
runs the same ops); its last two cases break a Buffer on purpose (a rank that skips an op, then a
process that exits)."""

from __future__ import annotations

import functools
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import oracle
from helpers import bits, calc_diff, pipeline, random_inputs, relative_error
from jax.sharding import PartitionSpec as P
from process_scenarios import global_mesh, run, shard

import jax_ep
from jax_ep import _testing
from jax_ep._jax import distributed_client

E, K = 16, 4

# tokens, hidden, layout, fp8, alignment, capacity, split; each runs in its mode with its kinds.
NORMAL = [
    (1, 2048, "rank", True, 1, None, False),
    (64, 7168, "expert", False, 1, None, False),
    (128, 2048, "expert", True, 128, None, False),
    (128, 2048, "rank", False, 1, 100, False),
    (96, 2048, "expert_padded", False, 1, 24, False),
    (256, 2048, "rank", True, 1, None, True),
    (4096, 7168, "rank", True, 1, None, False),  # the route kernel's several chunks
]
LOW_LATENCY = [
    (7, 2048, "rank", True, 1, None, True),
    (64, 7168, "expert_padded", True, 1, None, True),
    (128, 2048, "rank", True, 1, 100, True),
    (64, 2048, "expert", False, 2, 40, False),
    (128, 2048, "rank", False, 1, None, False),
]
KINDS = {"normal": ("random", "one_expert"), "low_latency": ("random", "sparse", "empty")}
GRADIENTS = [
    ("rank", "normal", False),
    ("expert", "low_latency", False),
    ("expert", "normal", True),
]  # layout, mode, fp8


def layer_name(case, mode, direct_local):
    tokens, hidden, lay, fp8, alignment, capacity, split = case
    return (
        f"{mode}-{tokens}-{hidden}-{lay}-fp8={fp8}-align={alignment}-cap={capacity}"
        f"-{'halves' if split else 'whole'}-{'direct' if direct_local else 'window'}"
    )


def layer_cases():
    """(name, case, mode, direct_local): whole ops both ways of direct_local, halves once."""
    out = []
    for mode, cases in (("normal", NORMAL), ("low_latency", LOW_LATENCY)):
        for case in cases:
            for direct_local in (False,) if case[-1] else (True, False):
                out.append((layer_name(case, mode, direct_local), case, mode, direct_local))
    return out


def case_names():
    """Every case suite() reports, in order (test ids of tests/test_gpu_processes.py)."""
    return (
        [name for name, *_ in layer_cases()]
        + [f"gradients-{lay}-{mode}-fp8={fp8}" for lay, mode, fp8 in GRADIENTS]
        + ["invalid-ids-normal", "invalid-ids-low_latency", "timing", "mismatch", "skipped-op"]
        + ["timeout", "early-exit"]
    )


# ---- this process's shards


def mine(mesh, tree):
    """{rank: this rank's shard of every leaf (numpy)} for the ranks of this process."""
    rank_of = {d: r for r, d in enumerate(mesh.devices.flat)}
    leaves, treedef = jax.tree.flatten(tree)
    shards = [
        {rank_of[s.device]: np.asarray(s.data) for s in leaf.addressable_shards} for leaf in leaves
    ]
    return {r: jax.tree.unflatten(treedef, [s[r] for s in shards]) for r in shards[0]}


def equal(got, want, what):
    np.testing.assert_array_equal(bits(got), bits(np.asarray(want, got.dtype)), err_msg=what)


def dequantized(want, fp8):
    """The oracle's rows as float32 (FP8: q * scale per 128 channels)."""
    if not fp8:
        return want["x"].astype(np.float32)
    q = want["x"].astype(np.float32)
    return (q.reshape(q.shape[:-1] + (-1, 128)) * want["scales"][..., None]).reshape(q.shape)


# ---- a MoE step (helpers.pipeline) against the oracle


def check_pipeline(mesh, out, x, idx, w, bias, x2, tokens, lay, alignment, fp8, capacity):
    R, H = mesh.size, x.shape[-1]
    el, dtype = E // R, x.dtype
    per = lambda a: np.asarray(a).reshape((R, tokens) + a.shape[1:])  # noqa: E731
    rows = capacity if lay == "rank" and capacity else R * tokens
    want = oracle.dispatch_rank(per(x), per(idx), per(w), E, rows, fp8)
    again = oracle.dispatch_rank(per(x2), per(idx), per(w), E, rows, fp8)
    values = dequantized(want, fp8)
    local = mine(mesh, {k: out[k] for k in ("d", "y", "expert_out", "cached_x", "cached_scales")})
    partial, checks = [], []
    for dest in range(R):
        if lay == "rank":
            expert = want["topk_idx"][dest].max(axis=1)
            expert_out = (values[dest] * (1 + expert)[:, None]).astype(dtype)
            partial.append(expert_out)
            if dest in local:
                checks.append((dest, expert_out, None, None))
            continue
        padded = lay == "expert_padded"
        got_x = next(iter(local.values()))["d"].x
        block = got_x.shape[1] if padded else 0
        cap = got_x.shape[0] * got_x.shape[1] if padded else got_x.shape[0]
        src, expert, weight, present, dropped = oracle.expert_layout(
            want["topk_idx"][dest], want["topk_weights"][dest], el, alignment, cap, block
        )
        kept = (src >= 0)[:, None]
        expert_out = (
            np.where(kept, values[dest][np.maximum(src, 0)], 0) * (1 + expert)[:, None]
        ).astype(dtype)
        acc = np.zeros((rows, H), np.float32)
        for i in np.flatnonzero(src >= 0):
            acc[src[i]] += weight[i] * expert_out[i].astype(np.float32)
        partial.append(acc)
        if dest in local:
            checks.append((dest, expert_out, (src, expert, weight, present, dropped), kept))
    want_y = oracle.combine(partial, want["send_pos"], per(bias))
    for r, expert_out, maps, kept in checks:
        got = local[r]
        d = {
            k: (
                v.reshape((-1,) + v.shape[2:])
                if lay == "expert_padded" and k in ("x", "scales", "topk_idx", "topk_weights")
                else v
            )
            for k, v in got["d"]._asdict().items()
            if v is not None
        }
        equal(d["num_invalid"][0], want["num_invalid"][r], f"rank {r} num_invalid")
        if lay == "rank":
            for f in ("topk_idx", "topk_weights", "tokens_per_expert"):
                equal(d[f], want[f][r], f"rank {r} {f}")
            equal(d["x"], want["x"][r], f"rank {r} x")
            equal(d["num_recv"][0], want["num_recv"][r], f"rank {r} num_recv")
            equal(d["num_dropped"][0], want["num_dropped"][r], f"rank {r} num_dropped")
            equal(got["cached_x"], again["x"][r], f"rank {r} cached x")
            if fp8:
                equal(d["scales"], want["scales"][r], f"rank {r} scales")
                equal(got["cached_scales"], again["scales"][r], f"rank {r} cached scales")
        else:
            src, expert, weight, present, dropped = maps
            gather = lambda a: np.where(kept, a[np.maximum(src, 0)], 0).astype(a.dtype)  # noqa
            equal(d["topk_idx"], expert, f"rank {r} expert ids")
            np.testing.assert_allclose(d["topk_weights"], weight, rtol=1e-6)
            equal(d["tokens_per_expert"], present, f"rank {r} tokens_per_expert")
            equal(d["num_dropped"][0], dropped, f"rank {r} num_dropped")
            equal(
                d["num_recv"][0], (-(-present // alignment) * alignment).sum(), f"rank {r} num_recv"
            )
            equal(d["x"], gather(want["x"][r]), f"rank {r} x")
            cached = got["cached_x"].reshape((-1,) + got["cached_x"].shape[-1:])
            equal(cached, gather(again["x"][r]), f"rank {r} cached x")
            if fp8:
                equal(d["scales"], gather(want["scales"][r]), f"rank {r} scales")
        equal(got["expert_out"].reshape(expert_out.shape), expert_out, f"rank {r} expert_out")
        diff = calc_diff(got["y"].astype(np.float32), want_y[r].astype(dtype).astype(np.float32))
        assert diff < 5e-6, f"rank {r} combine: calc_diff {diff}"


def layer_case(mesh, case, mode, direct_local):
    tokens, hidden, lay, fp8, alignment, capacity, split = case
    with _testing.buffers(direct_local=direct_local):
        buf = jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=E,
            hidden=hidden,
            num_topk=K,
            max_tokens_per_rank=tokens,
            timeout_s=20.0,
        )
    assert buf.engine == "cuda_ipc", buf.engine
    step = pipeline(buf, lay, alignment, fp8, False, capacity, split=split, mode=mode)
    for kind in KINDS[mode]:
        rng = np.random.default_rng(tokens + hidden)  # the same on every process
        x, idx, w = (
            np.asarray(a)
            for a in random_inputs(rng, mesh.size, tokens, hidden, E, K, mesh.size, kind)
        )
        bias = np.asarray(rng.standard_normal(x.shape), np.float32).astype(x.dtype)
        x2 = np.asarray(rng.standard_normal(x.shape), np.float32).astype(x.dtype)
        out = run(mesh, step, x, idx, w, bias, x2)
        try:
            check_pipeline(mesh, out, x, idx, w, bias, x2, tokens, lay, alignment, fp8, capacity)
        except AssertionError as e:
            raise AssertionError(f"routing {kind}: {e}") from None


# ---- gradients against their closed form


def gradient_case(mesh, lay, mode, fp8):
    """d/dx and d/dw of vdot(combine(tanh(dispatch(x))), c): every token's rows come back
    unchanged but for tanh, so y = S * tanh(x') with S its destination ranks (rank layout) or
    its valid weights' sum (expert layout), x' = x (FP8: its dequantized value, straight
    through)."""
    R, tokens, hidden = mesh.size, 8, 256
    rng = np.random.default_rng(21)
    x, idx, w = (
        np.asarray(a) for a in random_inputs(rng, R, tokens, hidden, E, K, R, "random", jnp.float32)
    )
    c = rng.standard_normal(x.shape).astype(np.float32)
    buf = jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=E,
        hidden=hidden,
        num_topk=K,
        max_tokens_per_rank=tokens,
        timeout_s=20.0,
    )

    def layer(x, idx, w):
        d = buf.dispatch(x, idx, w, layout=lay, mode=mode, fp8=fp8)
        rows = buf.dequantize(d, x) if fp8 else d.x
        return buf.combine(
            jnp.tanh(rows), d.handle, topk_weights=d.topk_weights if lay != "rank" else None
        )

    def pulled(x, idx, w, c):  # the vjp per rank: a loss summed over ranks would be an
        _, pull = jax.vjp(lambda x, w: layer(x, idx, w), x, w)  # XLA collective
        return pull(c)

    spec = P("ep")
    grads = jax.jit(jax.shard_map(pulled, mesh=mesh, in_specs=spec, out_specs=spec))(
        *(shard(mesh, v) for v in (x, idx, w, c))
    )
    want_x, want_w = oracle.layer_gradients(x, idx, w, c, lay, fp8, E, R)
    per = lambda a: a.reshape((R, tokens) + a.shape[1:])  # noqa: E731
    for r, (gx, gw) in mine(mesh, grads).items():
        assert relative_error(gx, per(want_x)[r]) < 1e-5, f"rank {r} d/dx"
        assert relative_error(gw, per(want_w)[r]) < 1e-5 or not np.abs(want_w).max(), (
            f"rank {r} d/dw"
        )
        if lay == "rank":
            assert not np.abs(gw).max(), f"rank {r} d/dw of an unweighted combine"


# ---- invalid ids, a rank that skips an op, a process that exits


def invalid_ids_case(mesh, mode):
    """Ids outside [-1, E) on the first and the last rank: excluded and counted on every rank;
    then a Buffer with check_invalid=True raises on every process (each learns the group's
    count with the op's counts: no XLA collective, which ranks sharing a GPU could not run)
    and goes on."""
    R, tokens, hidden = mesh.size, 16, 256
    rng = np.random.default_rng(5)
    x, idx, w = (np.asarray(a) for a in random_inputs(rng, R, tokens, hidden, E, K, R, "random"))
    bad = idx.copy()
    bad[3, 1], bad[-1, 0] = E, -9  # on the first and the last rank
    kwargs = dict(
        num_experts=E, hidden=hidden, num_topk=K, max_tokens_per_rank=tokens, timeout_s=20.0
    )
    per = lambda a: a.reshape((R, tokens) + a.shape[1:])  # noqa: E731

    def counts(buf):
        return lambda x, i, w: buf.dispatch(x, i, w, mode=mode)._replace(handle=None)

    def check(got, ids):
        want = oracle.dispatch_rank(per(x), per(ids), per(w), E, R * tokens)
        for r, d in mine(mesh, got).items():
            for f in ("x", "topk_idx", "topk_weights", "tokens_per_expert"):
                equal(getattr(d, f), want[f][r], f"rank {r} {f}")
            for f in ("num_recv", "num_invalid", "num_dropped"):
                equal(getattr(d, f)[0], want[f][r], f"rank {r} {f}")

    check(run(mesh, counts(jax_ep.Buffer(mesh, "ep", **kwargs)), x, bad, w), bad)
    buf = jax_ep.Buffer(mesh, "ep", check_invalid=True, **kwargs)
    try:
        jax.block_until_ready(run(mesh, counts(buf), x, bad, w))
    except Exception as e:  # every process raises, also those whose ids were all valid
        assert "topk_idx holds 2 expert id" in str(e), str(e)[:2000]
    else:
        raise AssertionError("check_invalid did not raise")
    clean = bad.copy()
    clean[3, 1] = clean[-1, 0] = -1
    check(run(mesh, counts(buf), x, clean, w), clean)  # the Buffer goes on


def timing_case(mesh):
    """A protocol-cost figure: a decode step (LL shape: 128 tokens, H 7168, top-8, FP8
    dispatch, bf16 combine) on every rank of the one GPU, through HBM, not NVLink. Times are
    per step, the median of 5 runs of 10 steps in one program; prints "TIME ...". Then the same
    on this process's GPU alone (EP=1, its own engine), on process 0 only."""
    import time

    def measure(mesh, label):
        R, tokens, hidden, experts, topk = mesh.size, 128, 7168, 64, 8
        buf = jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=experts,
            hidden=hidden,
            num_topk=topk,
            max_tokens_per_rank=tokens,
            timeout_s=20.0,
        )
        rng = np.random.default_rng(1)
        x, idx, w = (
            np.asarray(a) for a in random_inputs(rng, R, tokens, hidden, experts, topk, R, "random")
        )

        def steps(x, i, w):
            def one(_, y):
                d = buf.dispatch(y, i, w, layout="expert_padded", fp8=True, mode="low_latency")
                rows = jax_ep.dequantize_fp8(
                    d.x.reshape(-1, hidden), d.scales.reshape(-1, hidden // 128)
                )
                out = buf.combine(
                    rows.reshape(d.x.shape).astype(y.dtype), d.handle, topk_weights=d.topk_weights
                )
                return (out * 0.01).astype(y.dtype) + y

            return jax.lax.fori_loop(0, 10, one, x)

        spec = P("ep")
        program = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=spec, out_specs=spec))
        args = [shard(mesh, v) for v in (x, idx, w)]
        jax.block_until_ready(program(*args))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            times.append((time.perf_counter() - start) / 10)
        print(
            f"TIME {label} engine={buf.engine}: {np.median(times) * 1e6:.1f} us per decode "
            f"step (dispatch + combine), process {jax.process_index()}",
            flush=True,
        )

    measure(mesh, f"EP={mesh.size} on one GPU")
    if jax.process_index() == 0:
        measure(jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("ep",)), "EP=1")


def tiny(mesh, timeout_s):
    return jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=E,
        hidden=128,
        num_topk=2,
        max_tokens_per_rank=4,
        timeout_s=timeout_s,
    )


def tiny_dispatch(mesh, buf, fp8=False, dispatch=None):
    """A compiled dispatch (`dispatch(x, idx)`, by default buf.dispatch) on the ranks of `mesh`
    (every token to rank 0 and the last rank), and its arguments. Every process compiles it, also
    one that will not run it: XLA shares GPU autotuning between the processes of a program, so
    compiling alone would wait for them."""
    R = mesh.size
    x = np.ones((R * 4, 128), np.float32)
    idx = np.tile(np.array([[0, E - 1]], np.int32), (R * 4, 1))
    spec = P("ep")

    def body(x, i):
        return jax.tree.map(
            lambda v: v[None] if v.ndim == 0 else v,
            (dispatch or functools.partial(buf.dispatch, fp8=fp8))(x, i)._replace(handle=None),
        )

    args = [shard(mesh, v) for v in (x, idx)]
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return program.lower(*args).compile(), args


def expect_peer_error(program, args, peer, why=("waited too long", "waited more than")):
    """GPUs: the first call's kernel gives up (after timeout_s, or at once for a peer whose
    process ended) and the next call raises; CPUs: the first call raises. Either way the error
    names the peer, and one of `why`."""
    for _ in range(2):
        try:
            jax.block_until_ready(program(*args))
        except Exception as e:
            message = str(e)
            assert f"rank {peer}" in message and any(w in message for w in why), message[:2000]
            return message.splitlines()[0]
    raise AssertionError(f"no error for rank {peer}, which never ran the op")


def mismatch_case(mesh):
    """Process 0 dispatches FP8 rows, the others float32 rows, at the same op: every rank's
    step returns NaN at once (not after timeout_s), status() names both ops, and the next call
    raises so on every process."""
    buf = tiny(mesh, 60.0)
    plain, args = tiny_dispatch(mesh, buf)
    fp8, _ = tiny_dispatch(mesh, buf, fp8=True)  # every process compiles both programs
    meet_all("mismatch")
    program = fp8 if jax.process_index() == 0 else plain
    start = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    assert time.perf_counter() - start < 30, "a mismatch waited for the timeout"
    for r, d in mine(mesh, out).items():
        nan = d.x.view(np.uint8) == 0x7F if d.x.dtype.itemsize == 1 else np.isnan(d.x)
        assert nan.all() and int(d.num_recv[0]) == 0, (r, d.num_recv)
    both = ("dispatch(fp8 rows of float32 x, hidden 128", "dispatch(float32 rows, hidden 128")
    status = buf.status()
    assert status and all(op in status for op in both), status
    try:
        jax.block_until_ready(program(*args))
    except Exception as e:
        assert all(op in str(e) for op in both), str(e)[:2000]
        print("RAISED:", str(e).splitlines()[0], flush=True)
    else:
        raise AssertionError("the call after a mismatch did not raise")


def skipped_op_case(mesh):
    """Process 0 skips the first of two alike dispatches, called from two places; the others run
    both. Op 1 pairs process 0's second with the others' first: every rank's step returns NaN at
    once, status() names both call sites, and the others' next call raises. (Paired, their rows
    would have been the other op's, with no error.)"""
    buf = tiny(mesh, 60.0)

    def first(x, i):
        return buf.dispatch(x, i)

    def second(x, i):
        return buf.dispatch(x, i)

    first, args = tiny_dispatch(mesh, buf, dispatch=first)
    second, _ = tiny_dispatch(mesh, buf, dispatch=second)
    meet_all("skipped-op")
    start = time.perf_counter()
    out = jax.block_until_ready((second if jax.process_index() == 0 else first)(*args))
    assert time.perf_counter() - start < 30, "a skipped op waited for the timeout"
    for r, d in mine(mesh, out).items():
        assert np.isnan(d.x).all() and int(d.num_recv[0]) == 0, (r, d.num_recv)
    status = buf.status()
    assert status.count("call site") == 2, status
    if jax.process_index() == 0:
        return
    try:
        jax.block_until_ready(second(*args))
    except Exception as e:
        assert "call site" in str(e), str(e)[:2000]
        print("RAISED:", str(e).splitlines()[0], flush=True)
    else:
        raise AssertionError("the call after a skipped op did not raise")


def timeout_case(mesh):
    """The last rank skips an op: every other rank's wait gives up after timeout_s, names it
    in the next call, and the processes go on together with a new Buffer."""
    R, last = mesh.size, mesh.size - 1
    program, args = tiny_dispatch(mesh, tiny(mesh, 3.0))
    if jax.process_index() != last:
        print("RAISED:", expect_peer_error(program, args, last), flush=True)
    program, args = tiny_dispatch(mesh, tiny(mesh, 20.0))
    for r, d in mine(mesh, program(*args)).items():
        want = R * 4 if r in (0, last) else 0
        assert int(d.num_recv[0]) == want, (r, d.num_recv)


def early_exit_case(mesh):
    """The last process exits after creating a Buffer: the others' ops end at once (their
    liveness watch saw it end; timeout_s is 60 s) in an error naming its rank, and each goes on
    with a Buffer of its own GPU."""
    last = mesh.size - 1
    program, args = tiny_dispatch(mesh, tiny(mesh, 60.0))
    meet_all("early-exit")  # every process compiled
    if jax.process_index() == last:
        print("CASE early-exit OK", flush=True)
        os._exit(0)
    start = time.perf_counter()
    ended = f"the process of rank {last} has ended"
    print("RAISED:", expect_peer_error(program, args, last, (ended,)), flush=True)
    assert time.perf_counter() - start < 30, "the op waited for the timeout"
    alone = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("ep",))
    program, args = tiny_dispatch(alone, tiny(alone, 20.0))
    assert int(np.asarray(program(*args).num_recv)[0]) == 4


def leave_together(survivors):
    """Process 0 hosts jax.distributed's coordination service: it waits until every other
    survivor has reported its last verdict, since its exit ends their processes."""
    client = distributed_client()
    me = jax.process_index()
    if me:
        client.key_value_set(f"gpu_process_scenarios/done/{me}", "1")
        return
    for q in survivors:
        if q:
            client.blocking_key_value_get(f"gpu_process_scenarios/done/{q}", 60_000)


def meet_all(name, timeout_s=60):
    """A barrier of every process (jax.distributed's key-value store)."""
    client = distributed_client()
    client.key_value_set(f"gpu_process_scenarios/{name}/{jax.process_index()}", "1")
    for q in range(jax.process_count()):
        client.blocking_key_value_get(f"gpu_process_scenarios/{name}/{q}", timeout_s * 1000)


def suite():
    mesh = global_mesh()
    assert mesh.size == jax.process_count()  # one rank per process (GPUs; CPUs for a dry run)
    cases = (
        [
            (name, lambda c=c, m=m, dl=dl: layer_case(mesh, c, m, dl))
            for name, c, m, dl in layer_cases()
        ]
        + [
            (
                f"gradients-{lay}-{mode}-fp8={fp8}",
                lambda lay=lay, mode=mode, fp8=fp8: gradient_case(mesh, lay, mode, fp8),
            )
            for lay, mode, fp8 in GRADIENTS
        ]
        + [
            ("invalid-ids-normal", lambda: invalid_ids_case(mesh, "normal")),
            ("invalid-ids-low_latency", lambda: invalid_ids_case(mesh, "low_latency")),
            ("timing", lambda: timing_case(mesh)),
            ("mismatch", lambda: mismatch_case(mesh)),
            ("skipped-op", lambda: skipped_op_case(mesh)),
            ("timeout", lambda: timeout_case(mesh)),
            ("early-exit", lambda: early_exit_case(mesh)),
        ]
    )
    assert [name for name, _ in cases] == case_names()
    only = os.environ.get("JAX_EP_CASES")  # a comma-separated subset, to reproduce one
    ran = [name for name, _ in cases if not only or name in only.split(",")]
    for name, case in cases:
        if name not in ran:
            continue
        try:
            case()
            print(f"CASE {name} OK", flush=True)
        except Exception as e:
            traceback.print_exc()
            print(
                f"CASE {name} FAIL {type(e).__name__}: "
                + " | ".join(str(e).splitlines()[:6])[:1500],
                flush=True,
            )
    print("SCENARIO OK", flush=True)
    leave_together(range(mesh.size - 1 if "early-exit" in ran else mesh.size))  # it ends the last
    os._exit(0)  # after early-exit, the coordination service would wait for the last process

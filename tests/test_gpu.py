"""The CUDA backend on the GPUs of this machine (EP = number of GPUs; 1 GPU gives EP=1), against
the reference path running on the same GPUs. Skipped where JAX sees no GPU (CI). Tests marked
`window` also run with direct_local=False: every row, a rank's own ones too, goes through the
window, so the peers' protocol runs on one GPU as well. Run there with bench/run_gpu.sh tests."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXPERT_PADDED_CHUNKS,
    EXPERT_PADDED_SHAPES,
    assert_bitwise_equal,
    assert_matches_reference,
    buffers,
    calc_diff,
    check_expert_padded_call,
    layer_gradients,
    make_mesh,
    pipeline,
    random_inputs,
    run,
)
from test_autodiff import check_nan_in_padding

import jax_ep
from jax_ep import _testing

pytestmark = pytest.mark.gpu
E, K = 16, 4


def gpus():
    return jax.devices("gpu")


@functools.cache
def steps(
    tokens,
    hidden,
    lay,
    fp8,
    alignment,
    capacity,
    mode="normal",
    split=False,
    direct_local=True,
    num_sms=24,
):
    mesh = make_mesh(len(gpus()), devices=gpus())
    with _testing.buffers(direct_local=direct_local):
        bufs = buffers(
            mesh,
            num_experts=E,
            hidden=hidden,
            num_topk=K,
            max_tokens_per_rank=tokens,
            timeout_s=20.0,
            num_sms=num_sms,
        )
    return mesh, {
        impl: functools.partial(
            run, mesh, pipeline(buf, lay, alignment, fp8, False, capacity, split=split, mode=mode)
        )
        for impl, buf in bufs.items()
    }


CASES = [  # tokens, hidden, layout, fp8, alignment, capacity: the throughput kernels
    (1, 2048, "rank", True, 1, None),
    (1, 7168, "expert", False, 1, None),
    (128, 7168, "rank", True, 1, None),
    (128, 2048, "expert", True, 128, None),
    (128, 2048, "rank", False, 1, 100),
    (4096, 7168, "rank", True, 1, None),
    (4096, 7168, "rank", False, 1, None),
    (4096, 2048, "expert", True, 64, None),
    (1536, 2048, "expert_padded", False, 1, None),  # rows in two chunks of the GPUs' placement
    (2048, 2048, "expert_padded", True, 1, 300),  # and drops past C
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", ["random", "one_expert"])
@pytest.mark.parametrize("direct_local", [True, False], ids=["direct", "window"])
def test_cuda_matches_reference(case, kind, direct_local):
    tokens, hidden, lay, fp8, alignment, capacity = case
    mesh, step = steps(tokens, hidden, lay, fp8, alignment, capacity, direct_local=direct_local)
    rng = np.random.default_rng(tokens + hidden)
    x, idx, w = random_inputs(rng, mesh.size, tokens, hidden, E, K, mesh.size, kind)
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    x2 = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    assert_matches_reference(step, x, idx, w, bias, x2)


@pytest.mark.parametrize("num_sms", [1, 5, "all"])
@pytest.mark.parametrize(
    "case,mode",
    [
        ((4096, 7168, "rank", True, 1, None), "normal"),
        ((4096, 2048, "expert", True, 64, None), "normal"),
        ((1536, 2048, "expert_padded", False, 1, None), "normal"),
        ((128, 7168, "rank", False, 1, None), "low_latency"),
    ],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c,
)
def test_cuda_any_sm_count_matches_reference(case, mode, num_sms):
    """The kernels on one block, an odd count of blocks and every SM of the GPU: the same rows
    (no kernel relies on a count of blocks, or on blocks that run at once beyond those)."""
    tokens, hidden, lay, fp8, alignment, capacity = case
    sms = gpus()[0].core_count if num_sms == "all" else num_sms
    mesh, step = steps(tokens, hidden, lay, fp8, alignment, capacity, mode, num_sms=sms)
    rng = np.random.default_rng(tokens + hidden + 2)
    x, idx, w = random_inputs(rng, mesh.size, tokens, hidden, E, K, mesh.size, "random")
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    x2 = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    assert_matches_reference(step, x, idx, w, bias, x2)


@pytest.mark.parametrize("lay,fp8", [("rank", True), ("expert", False)])
def test_cuda_node_axis_of_one_node(lay, fp8):
    """Buffer(mesh, ("node", "ep")) of 1 x 1 GPU (every GPU node of the tuple axis with one
    node; two nodes need GPUs across hosts): the custom calls equal the reference path."""
    mesh = jax.sharding.Mesh(np.array(gpus()[:1]).reshape(1, 1), ("node", "ep"))
    bufs = buffers(
        mesh, ("node", "ep"), num_experts=E, hidden=2048, num_topk=K, max_tokens_per_rank=64
    )
    assert bufs["ffi"].num_nodes == 1 and bufs["ffi"].num_ranks == 1
    step = {
        impl: functools.partial(run, mesh, pipeline(buf, lay, 1, fp8)) for impl, buf in bufs.items()
    }
    rng = np.random.default_rng(11)
    x, idx, w = random_inputs(rng, 1, 64, 2048, E, K, 1, "random")
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    assert_matches_reference(step, x, idx, w, bias, x * 2)


LOW_LATENCY_CASES = [  # tokens, hidden, layout, fp8, capacity, split
    (1, 7168, "expert_padded", True, None, False),
    (7, 2048, "rank", True, None, True),
    (7, 2048, "expert", False, None, False),
    (128, 7168, "expert_padded", True, None, True),
    (128, 7168, "rank", False, None, False),
    (128, 2048, "rank", True, 100, True),
    (256, 2048, "expert", True, None, True),
    (256, 7168, "expert_padded", False, 64, False),
]


@pytest.mark.parametrize("case", LOW_LATENCY_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", ["random", "sparse", "empty"])
def test_cuda_low_latency_matches_reference(case, kind):
    tokens, hidden, lay, fp8, capacity, split = case
    mesh, step = steps(
        tokens, hidden, lay, fp8, 1, capacity, "low_latency", split, direct_local=not split
    )
    rng = np.random.default_rng(tokens + hidden + 1)
    x, idx, w = random_inputs(rng, mesh.size, tokens, hidden, E, K, mesh.size, kind)
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    x2 = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    assert_matches_reference(step, x, idx, w, bias, x2)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_float32_and_odd_widths(mode):
    """float32 rows and rows that are no multiple of 16 bytes (the non-vector paths)."""
    for hidden, dtype in ((2048, jnp.float32), (100, jnp.bfloat16), (6, jnp.float32)):
        mesh, step = steps(64, hidden, "rank", False, 1, None, mode)
        rng = np.random.default_rng(hidden)
        x, idx, w = random_inputs(rng, mesh.size, 64, hidden, E, K, mesh.size, "random", dtype)
        bias = jnp.asarray(rng.standard_normal(x.shape), dtype)
        want = step["reference"](x, idx, w, bias, x)
        got = step["ffi"](x, idx, w, bias, x)
        assert_bitwise_equal(got["d"], want["d"], f"hidden {hidden}")
        assert calc_diff(got["y"].astype(jnp.float32), want["y"].astype(jnp.float32)) < 5e-6


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_fp8_wide_rows(mode):
    """FP8 rows so wide that a kernel's static and dynamic shared memory pass 48 KB together."""
    mesh, step = steps(4, 61440, "rank", True, 1, None, mode)
    rng = np.random.default_rng(5)
    x, idx, w = random_inputs(rng, mesh.size, 4, 61440, E, K, mesh.size, "random")
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    assert_matches_reference(step, x, idx, w, bias, x)


def test_cuda_fp8_rows_past_the_staged_scales_are_refused():
    """FP8 rows wider than the CUDA dispatch stages scales for: refused when traced, not when
    run."""
    widest = jax_ep.limits()["max_scales_per_row"] * 128
    mesh = make_mesh(len(gpus()), devices=gpus())
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=widest + 128, num_topk=K, max_tokens_per_rank=2
    )
    x = jnp.zeros((2 * mesh.size, widest + 128), jnp.bfloat16)
    idx = jnp.zeros((2 * mesh.size, K), jnp.int32)
    with pytest.raises(ValueError, match=f"fp8 rows on GPUs take hidden up to {widest}"):
        run(mesh, lambda x, i: buf.dispatch(x, i, fp8=True).x, x, idx)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_inside_loops_and_gradients(mode):
    """Many ops in one jitted fori_loop (sequence numbers live on device), and a gradient."""
    mesh, _ = steps(128, 2048, "expert", False, 1, None)
    bufs = buffers(mesh, num_experts=E, hidden=2048, num_topk=K, max_tokens_per_rank=128)
    rng = np.random.default_rng(3)
    x, idx, w = random_inputs(rng, mesh.size, 128, 2048, E, K, mesh.size, "random", jnp.float32)
    results = {}
    for impl, buf in bufs.items():

        def body(x, idx, w, buf=buf):
            def one(i, x):
                d = buf.dispatch(x, idx, w, layout="expert", mode=mode)
                return buf.combine(jnp.tanh(d.x), d.handle, topk_weights=d.topk_weights) * 0.5 + x

            return jax.lax.fori_loop(0, 10, one, x)

        loss = lambda x: jnp.sum(run_raw(mesh, body, x, idx, w) ** 2)  # noqa: E731
        results[impl] = jax.jit(jax.value_and_grad(loss))(x)
    np.testing.assert_allclose(results["ffi"][0], results["reference"][0], rtol=1e-5)
    np.testing.assert_allclose(results["ffi"][1], results["reference"][1], rtol=1e-4, atol=1e-6)


def run_raw(mesh, fn, *args):
    from jax.sharding import PartitionSpec as P

    spec = P(tuple(mesh.axis_names))
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(*args)


def _subprocess(code, env_extra, timeout):
    # This process holds most of the GPU memory already: the child allocates as it goes.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )


@pytest.mark.parametrize(
    "mode,split,concurrent",
    [
        ("normal", False, False),
        ("low_latency", False, False),
        ("low_latency", True, False),
        ("low_latency", True, True),
    ],
)
def test_cuda_command_buffers(mode, split, concurrent):
    """Decode steps in a loop under XLA command buffers (CUDA graphs): captured and correct;
    split, with work between the halves; concurrent: the commands ordered only by the buffers
    they share (the work runs beside the halves)."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import PartitionSpec as P
        from jax_ep import dequantize_fp8
        from helpers import assert_bitwise_equal, buffers, calc_diff, make_mesh, random_inputs, run
        MODE, SPLIT = %r, %r
        mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
        bufs = buffers(mesh, num_experts=16, hidden=2048, num_topk=4, max_tokens_per_rank=64)
        x, idx, w = random_inputs(np.random.default_rng(0), mesh.size, 64, 2048, 16, 4, mesh.size,
                                  "random")

        def decode_steps(buf):  # five decode steps in one loop; each step's result is kept
            def steps(x, idx, w):
                def one(i, total):
                    xi = x * (i + 1).astype(x.dtype)
                    kw = dict(layout="expert_padded", fp8=True, mode=MODE)
                    work = jnp.zeros((), jnp.float32)
                    if SPLIT:
                        p, work = buf.dispatch_send(xi, idx, w, **kw).run_between(
                            lambda v: (v @ v.T).sum(), xi)
                        d = buf.dispatch_recv(p)
                    else:
                        d = buf.dispatch(xi, idx, w, **kw)
                    out = dequantize_fp8(d.x.reshape(-1, 2048), d.scales.reshape(-1, 16))
                    out = out.reshape(d.x.shape).astype(x.dtype)
                    if SPLIT:
                        p, more = buf.combine_send(out, d.handle, d.topk_weights).run_between(
                            lambda v: (v.reshape(-1, 2048)[:64] @ xi.T).sum(), out)
                        # (expert_padded padding rows are unspecified: more may be NaN)
                        y = buf.combine_recv(p) + jnp.nan_to_num(work + more) * 0
                    else:
                        y = buf.combine(out, d.handle, topk_weights=d.topk_weights)
                    return total + y.astype(jnp.float32)
                return jax.lax.fori_loop(0, 5, one, x.astype(jnp.float32) * 0)
            return steps

        from jax_ep import _testing
        spec = P("ep")
        outs = {}
        for impl, buf in bufs.items():
            program = jax.jit(jax.shard_map(decode_steps(buf), mesh=mesh, in_specs=spec,
                                            out_specs=spec))
            args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in (x, idx, w)]
            outs[impl] = [program(*args)]
            before = _testing.cuda_handler_calls()
            outs[impl] += [program(*args) for _ in range(4)]
            replayed = _testing.cuda_handler_calls() - before
        for got in outs["ffi"]:
            assert calc_diff(got, outs["reference"][0]) < 1e-5, calc_diff(got, outs["reference"][0])
        assert_bitwise_equal(outs["ffi"][0], outs["ffi"][4])
        # Without command buffers every execution runs each handler (4 runs x 5 steps x 2 ops,
        # 4 when split, x devices); replayed command buffers run none.
        calls = 4 * 5 * (4 if SPLIT else 2) * mesh.size
        print("handler calls in 4 more runs:", replayed, "of", calls)
        print("COMMAND_BUFFER" if replayed < calls else "NO_COMMAND_BUFFER")
        print("OK")
    """ % (mode, split)
    flags = (
        "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
        + " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT" * concurrent
    )
    out = _subprocess(code, {"XLA_FLAGS": flags}, 600)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout
    assert "COMMAND_BUFFER" in out.stdout.split()


def test_cuda_low_latency_recv_halves_out_of_send_order():
    """The low-latency kernels with recv halves in the other order than their sends, and a whole
    op while a sent one waits (helpers.out_of_order), against the reference path. In a child
    process: a slot protocol that deadlocks ends in the timeout's trap, which loses the context."""
    code = """
        import jax, numpy as np
        from helpers import assert_same_ops, buffers, make_mesh, out_of_order, random_inputs, run
        mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
        bufs = buffers(mesh, num_experts=%d, hidden=2048, num_topk=%d, max_tokens_per_rank=128,
                       timeout_s=10.0)
        x, idx, w = random_inputs(np.random.default_rng(12), mesh.size, 128, 2048, %d, %d,
                                  mesh.size, "random")
        got, want = (run(mesh, out_of_order(bufs[impl], rounds=3), x, idx, w)
                     for impl in ("ffi", "reference"))
        assert_same_ops(got, want)
        print("OK")
    """ % (E, K, E, K)
    out = _subprocess(code, {}, 300)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split(), f"exit status {out.returncode}"


@pytest.mark.skipif(
    len(jax.devices()) < 2 if jax.default_backend() == "gpu" else True, reason="needs 2 GPUs"
)
def test_cuda_peer_that_never_arrives_times_out():
    """Only GPU 0 runs the op: its wait for rank 1 gives up after timeout_s, its kernel ends,
    its next call raises naming rank 1, and the GPUs stay usable."""
    code = """
        import jax, jax.numpy as jnp, numpy as np, jax_ep
        from helpers import make_mesh, run
        mesh = make_mesh(2, devices=jax.devices("gpu"))
        buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2,
                            max_tokens_per_rank=4, timeout_s=2.0)
        x = jax.device_put(jnp.zeros((4, 128), jnp.float32), jax.devices("gpu")[0])
        i = jax.device_put(jnp.zeros((4, 2), jnp.int32), jax.devices("gpu")[0])
        f = jax.jit(lambda x, i: buf._ops.dispatch(x, i, jnp.zeros(i.shape), rows=8, fp8=False,
                                                   round_scale=False)[0].x)
        jax.block_until_ready(f(x, i))
        try:
            jax.block_until_ready(f(x, i))
            print("NO ERROR")
        except Exception as e:
            print("RAISED:", str(e).splitlines()[0])
        again = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2,
                              max_tokens_per_rank=4)
        d = run(mesh, lambda x, i: again.dispatch(x, i)._replace(handle=None),
                jnp.ones((8, 128), jnp.float32), jnp.zeros((8, 2), jnp.int32))
        assert list(np.asarray(d.num_recv)) == [8, 0]
        print("OK")
    """
    out = _subprocess(code, {}, 300)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split(), f"exit status {out.returncode}"
    assert "RAISED: " in out.stdout and "for rank 1" in out.stdout


def test_cuda_fp8_matches_oracle():
    """FP8 rows from the CUDA kernels equal the numpy statement of the FP8 rule in oracle.py (and
    say how the reference path on this GPU compares)."""
    import oracle

    mesh = make_mesh(len(gpus()), devices=gpus())
    rng = np.random.default_rng(11)
    x, idx, w = random_inputs(rng, mesh.size, 64, 2048, E, K, mesh.size, "random")
    found = {}
    for impl, buf in buffers(
        mesh, num_experts=E, hidden=2048, num_topk=K, max_tokens_per_rank=64
    ).items():
        d = run(
            mesh,
            lambda x, i, w, buf=buf: buf.dispatch(x, i, w, fp8=True)._replace(handle=None),
            x,
            idx,
            w,
        )
        found[impl] = d
    want = oracle.dispatch_rank(
        np.asarray(x).reshape(mesh.size, 64, -1),
        np.asarray(idx).reshape(mesh.size, 64, -1),
        np.asarray(w).reshape(mesh.size, 64, -1),
        E,
        mesh.size * 64,
        fp8=True,
    )
    for impl, d in found.items():
        q = np.asarray(d.x).reshape(want["x"].shape).view(np.uint8)
        s = np.asarray(d.scales).reshape(want["scales"].shape)
        bad_q = int((q != want["x"].view(np.uint8)).sum())
        bad_s = int((s != want["scales"]).sum())
        print(f"{impl}: {bad_q} e4m3 values and {bad_s} scales differ from the oracle")
        if bad_q:
            r, p, c = np.argwhere(q != want["x"].view(np.uint8))[0]
            group = c // 128
            print(
                f"  first at rank {r} row {p} channel {c}: got {q[r, p, c]} want "
                f"{want['x'].view(np.uint8)[r, p, c]}; scale got {s[r, p, group]!r} want "
                f"{want['scales'][r, p, group]!r}"
            )
    assert (
        np.asarray(found["ffi"].x).view(np.uint8).reshape(want["x"].shape)
        == want["x"].view(np.uint8)
    ).all()
    assert (np.asarray(found["ffi"].scales).reshape(want["scales"].shape) == want["scales"]).all()


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_invalid_ids_are_counted_and_the_checking_mode_raises(mode):
    mesh = make_mesh(len(gpus()), devices=gpus())
    rng = np.random.default_rng(13)
    x, idx, w = random_inputs(rng, mesh.size, 64, 2048, E, K, mesh.size, "random")
    bad = np.asarray(idx).copy()
    bad[3, 1], bad[-1, 0] = E, -9
    clean = bad.copy()
    clean[3, 1] = clean[-1, 0] = -1
    kwargs = dict(num_experts=E, hidden=2048, num_topk=K, max_tokens_per_rank=64)

    def counts(buf):
        return lambda x, i, w: buf.dispatch(x, i, w, mode=mode)._replace(handle=None)

    ffi = jax_ep.Buffer(mesh, "ep", **kwargs)
    got = run(mesh, counts(ffi), x, jnp.asarray(bad), w)
    assert int(np.asarray(got.num_invalid).sum()) == 2
    want = run(
        mesh,
        counts(jax_ep.Buffer(mesh, "ep", impl="reference", **kwargs)),
        x,
        jnp.asarray(clean),
        w,
    )
    assert_bitwise_equal(got._replace(num_invalid=None), want._replace(num_invalid=None))
    checking = jax_ep.Buffer(mesh, "ep", check_invalid=True, **kwargs)
    with pytest.raises(Exception, match="topk_idx holds 2 expert id"):
        jax.block_until_ready(run(mesh, counts(checking), x, jnp.asarray(bad), w))
    assert_bitwise_equal(
        run(mesh, counts(checking), x, jnp.asarray(clean), w)._replace(num_invalid=None),
        want._replace(num_invalid=None),
    )


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_gradients_under_remat(mode):
    """jax.checkpoint around a layer: its ops recomputed in the backward pass on the GPUs."""
    mesh = make_mesh(len(gpus()), devices=gpus())
    want = layer_gradients(mesh, "reference", False, "expert", mode)
    got = layer_gradients(mesh, "ffi", True, "expert", mode)
    assert calc_diff(got, want) < 1e-6 and np.abs(want).max() > 0


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_cuda_second_order_and_fp8_gradients(mode):
    """A Hessian-vector product through the ops, and the gradient of FP8 rows used through
    Buffer.dequantize (whose backward skips the float8 rows' zero cotangents), against the
    reference path on the same GPUs."""
    mesh = make_mesh(len(gpus()), devices=gpus())
    for kwargs in (dict(second_order=True), dict(fp8=True)):
        want = layer_gradients(mesh, "reference", False, "expert", mode, **kwargs)
        got = layer_gradients(mesh, "ffi", False, "expert", mode, **kwargs)
        assert calc_diff(got, want) < 1e-6 and np.abs(want).max() > 0, kwargs


CONCURRENT_COMMAND_BUFFERS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
)


def _run_under_concurrent_command_buffers(code):
    """Runs `code` in a process whose XLA commands are ordered only by the buffers they share;
    it prints OK when every check passed."""
    out = _subprocess(code, {"XLA_FLAGS": CONCURRENT_COMMAND_BUFFERS}, 600)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split(), f"exit status {out.returncode}"


def test_cuda_two_layer_gradients_under_concurrent_command_buffers():
    """The gradients of a two-layer model, step after step, under command buffers whose commands
    XLA orders only by the buffers they share: the Buffer's ordered effect keeps its calls
    (forward, and the backward's combines and cached dispatches) apart. Equal to the reference
    path, and bitwise equal run to run."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from helpers import buffers, calc_diff, make_mesh, put, random_inputs
        from jax.sharding import PartitionSpec as P
        mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
        bufs = buffers(mesh, num_experts=16, hidden=2048, num_topk=4, max_tokens_per_rank=128)
        x, idx, w = random_inputs(np.random.default_rng(1), mesh.size, 128, 2048, 16, 4,
                                  mesh.size, "random", jnp.float32)
        got = {}
        for impl, buf in bufs.items():
            def model(x, idx, w, buf=buf):
                for layout in ("expert", "rank"):
                    d = buf.dispatch(x, idx, w, layout=layout)
                    weights = d.topk_weights if layout == "expert" else None
                    x = buf.combine(jnp.tanh(d.x), d.handle, topk_weights=weights) + 0.5 * x
                return x
            f = jax.shard_map(model, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
            step = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, idx, w) ** 2), argnums=(0, 1)))
            args = put(mesh, x, w)
            got[impl] = [step(*args) for _ in range(6)]
        for run in got["ffi"]:
            for g, r in zip(run, got["reference"][0]):
                assert calc_diff(np.asarray(g), np.asarray(r)) < 1e-6, calc_diff(g, r)
        for g, r in zip(got["ffi"][0], got["ffi"][-1]):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
        print("OK")
    """
    _run_under_concurrent_command_buffers(code)


def test_cuda_two_shard_maps_of_one_jit_under_concurrent_command_buffers():
    """Two shard_maps of one jit call the same Buffer on independent data, so only the Buffer's
    ordered effect orders them; under CONCURRENT command buffers, rows through the window
    (direct_local=False): every one of 20 steps equals the reference path."""
    code = """
        import jax, jax.numpy as jnp, numpy as np, jax_ep
        from helpers import calc_diff, make_mesh, put, random_inputs
        from jax.sharding import PartitionSpec as P
        from jax_ep import _testing
        mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
        kw = dict(num_experts=16, hidden=2048, num_topk=4, max_tokens_per_rank=128)
        with _testing.buffers(direct_local=False):
            bufs = {"ffi": jax_ep.Buffer(mesh, "ep", **kw),
                    "reference": jax_ep.Buffer(mesh, "ep", impl="reference", **kw)}
        x, idx, w = random_inputs(np.random.default_rng(2), mesh.size, 128, 2048, 16, 4,
                                  mesh.size, "random")
        programs = {}
        for impl, buf in bufs.items():
            def layer(x, idx, w, buf=buf):
                d = buf.dispatch(x, idx, w, layout="expert")
                return buf.combine(jnp.tanh(d.x), d.handle, topk_weights=d.topk_weights)
            one = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
            two = jax.shard_map(lambda x, idx, w, buf=buf: buf.dispatch(x, idx, w).x.sum(0)[None],
                                mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
            programs[impl] = jax.jit(lambda x, y, idx, w, one=one, two=two: (one(x, idx, w),
                                                                           two(y, idx, w)))
        wrong = 0
        for step in range(20):
            a, b = put(mesh, x * (step + 1), x * (step + 2))
            i, v = put(mesh, idx, w)
            got = programs["ffi"](a, b, i, v)
            want = programs["reference"](a, b, i, v)
            wrong += any(calc_diff(np.asarray(g, np.float32), np.asarray(r, np.float32)) > 1e-5
                         for g, r in zip(got, want))
        print("wrong steps:", wrong, "of 20")
        assert wrong == 0
        print("OK")
    """
    _run_under_concurrent_command_buffers(code)


def test_cuda_a_wait_that_times_out_ends_the_kernel_and_keeps_the_context():
    """A recv half for an op no rank ever sent: its wait gives up after timeout_s, the kernel
    ends (no trap) with NaN in that call's own results, Buffer.status() says why, the next call
    on the Buffer raises what happened, and the same process goes on using the GPU (a new
    Buffer works)."""
    code = """
        import time, jax, jax.numpy as jnp, numpy as np, jax_ep
        from jax_ep import ffi_path
        from helpers import make_mesh, put, run
        from jax.sharding import PartitionSpec as P
        mesh = make_mesh(1, devices=jax.devices("gpu")[:1])
        buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2,
                            max_tokens_per_rank=8, timeout_s=1.0)
        cfg = buf._ops._cfg._replace(x_dtype="float32")
        lonely = jax.jit(jax.shard_map(
            lambda t: ffi_path._recv(cfg, "dispatch_cached_recv",
                                     ffi_path._rows_shapes(cfg, 8, 128), t)[0],
            mesh=mesh, in_specs=P("ep"), out_specs=P("ep"), check_vma=False))
        assert buf.status() is None
        start = time.perf_counter()
        rows = np.asarray(lonely(jnp.full((1,), 7, jnp.int32)))
        print("kernel ended after %.1f s" % (time.perf_counter() - start))
        assert rows.shape == (8, 128) and np.isnan(rows).all(), rows  # NaN in its own step
        status = buf.status()  # says why at once, without a sync
        assert status and "waited more than 1" in status, status
        x = jnp.ones((8, 128), jnp.float32)
        i = jnp.zeros((8, 2), jnp.int32)
        try:
            jax.block_until_ready(run(mesh, lambda x, i: buf.dispatch(x, i).x, x, i))
            print("NO ERROR")
        except Exception as e:
            print("RAISED:", str(e).splitlines()[0])
        again = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2,
                              max_tokens_per_rank=8)
        d = run(mesh, lambda x, i: again.dispatch(x, i)._replace(handle=None), x, i)
        assert int(np.asarray(d.num_recv)[0]) == 8
        print("OK")
    """
    out = _subprocess(code, {}, 300)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split(), f"exit status {out.returncode}"
    assert "RAISED: " in out.stdout and "waited more than" in out.stdout


@pytest.mark.skipif(
    len(jax.devices()) < 2 if jax.default_backend() == "gpu" else True, reason="needs 2 GPUs"
)
@pytest.mark.parametrize("direct_local", [True, False], ids=["direct", "window"])
def test_cuda_ranks_that_run_different_ops_stop_naming_both(direct_local):
    """GPU 0 dispatches FP8 rows, GPU 1 bfloat16 rows, at the same op (a cond on the rank): both
    stop at once (not after timeout_s) with NaN in that step's results, Buffer.status() names
    both ops, and the next call raises naming both."""
    code = (
        """
        import time, jax, jax.numpy as jnp, numpy as np, jax_ep
        from helpers import branching_dispatch, make_mesh, run
        from jax_ep import _testing
        mesh = make_mesh(2, devices=jax.devices("gpu"))
        with _testing.buffers(direct_local=%s):
            buf = jax_ep.Buffer(mesh, "ep", num_experts=8, hidden=128, num_topk=2,
                                max_tokens_per_rank=8, timeout_s=60.0)

        step = branching_dispatch(buf)

        x = jnp.ones((16, 128), jnp.bfloat16)
        i = jnp.tile(jnp.arange(2, dtype=jnp.int32), (16, 1)) * 3
        start = time.perf_counter()
        rows, ids, num_recv, weights = run(mesh, step, x, i)
        jax.block_until_ready(rows)
        assert time.perf_counter() - start < 50, "waited for the timeout"
        assert np.isnan(np.asarray(rows)).all() and np.isnan(np.asarray(weights)).all()
        assert (np.asarray(ids) == -1).all()
        assert (np.asarray(num_recv) == 0).all()
        both = ("dispatch(fp8 rows of bfloat16 x, hidden 128, 8 tokens, top-2 of 8 experts)",
                "dispatch(bfloat16 rows, hidden 128, 8 tokens, top-2 of 8 experts)")
        assert all(op in buf.status() for op in both), buf.status()
        try:
            jax.block_until_ready(run(mesh, lambda x, i: buf.dispatch(x, i).x, x, i))
            print("NO ERROR")
        except Exception as e:
            assert all(op in str(e) for op in both), e
            print("RAISED:", str(e).splitlines()[0])
        print("OK")
    """
        % direct_local
    )
    out = _subprocess(code, {}, 300)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split(), f"exit status {out.returncode}"
    assert "RAISED: " in out.stdout


def test_cuda_check_invalid_is_refused_between_halves_and_raises_after_them():
    """check_invalid between another op's halves is refused while tracing (its raise would stop
    the program before that op's recv half); after the recv it raises, and the Buffer's
    following ops work."""
    code = """
        import jax, jax.numpy as jnp, numpy as np, jax_ep
        from helpers import make_mesh, run
        mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
        n = mesh.size
        buf = jax_ep.Buffer(mesh, "ep", num_experts=4 * n, hidden=128, num_topk=2,
                            max_tokens_per_rank=8, timeout_s=5.0, check_invalid=True)
        x = jnp.ones((8 * n, 128), jnp.float32)
        good = jnp.zeros((8 * n, 2), jnp.int32)
        bad = good.at[3, 1].set(99)

        def between(x, good, bad):
            pending = buf.dispatch_send(x, good)
            d = buf.dispatch(x, bad)
            return buf.dispatch_recv(pending).num_recv, d.num_recv

        def after(x, good, bad):
            received = buf.dispatch_recv(buf.dispatch_send(x, good)).num_recv
            return received, buf.dispatch(x, bad).num_recv

        try:
            run(mesh, between, x, good, bad)
            print("NO ERROR")
        except ValueError as e:
            assert "while another op's halves are open" in str(e), e
        try:
            jax.block_until_ready(run(mesh, after, x, good, bad))
            print("NO ERROR")
        except Exception as e:
            assert "topk_idx holds 1 expert id" in str(e), e
        for _ in range(3):
            d = run(mesh, lambda x, i: buf.dispatch(x, i)._replace(handle=None), x, good)
            assert int(np.asarray(d.num_recv)[0]) == 8 * n, np.asarray(d.num_recv)
        assert buf.status() is None, buf.status()
        print("OK")
    """
    out = _subprocess(code, {}, 300)
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert "OK" in out.stdout.split() and "NO ERROR" not in out.stdout, f"exit {out.returncode}"


@pytest.mark.parametrize("kind,capacity", EXPERT_PADDED_CHUNKS)
def test_cuda_expert_padded_call_over_chunks(kind, capacity):
    """The expert_padded call alone over 2500 rank-level rows: three chunks of the kernel's
    count, so a row's place adds the counts of the chunks before it; C=300 drops."""
    check_expert_padded_call(np.random.default_rng(capacity), kind, 2500, capacity)


@pytest.mark.parametrize("kind,num_local,k,hidden", EXPERT_PADDED_SHAPES)
def test_cuda_expert_padded_call_shapes(kind, num_local, k, hidden):
    """The expert_padded call alone, with duplicate experts and drops, for slot counts and row
    sizes that take the kernel's other paths."""
    check_expert_padded_call(np.random.default_rng(k), kind, 1500, 300, num_local, k, hidden)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_cuda_nan_in_padding_reaches_no_result_or_gradient(layout, fp8):
    check_nan_in_padding(layout, fp8, gpus())

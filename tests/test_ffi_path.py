"""The custom-call path (CPU backend here, CUDA with -m gpu on GPUs) against the reference path:
dispatch bitwise equal, combine as helpers.assert_sums_equal and bitwise run to run."""

import functools
import os
import subprocess
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EXPERT_PADDED_CHUNKS,
    EXPERT_PADDED_SHAPES,
    ROUTINGS,
    assert_bitwise_equal,
    assert_matches_reference,
    assert_same_ops,
    assert_sums_equal,
    buffers,
    check_expert_padded_call,
    check_fp8_quantize_calls,
    make_mesh,
    out_of_order,
    pipeline,
    random_inputs,
    run,
    runner,
    settle,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import ffi_path

T, H, E, K = 16, 256, 16, 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout

CONFIGS = [  # num_ranks, dp, layout, alignment, fp8, round_scale, capacity, dtype
    (1, 1, "rank", 1, False, False, None, jnp.bfloat16),
    (1, 1, "expert", 128, True, False, None, jnp.bfloat16),
    (2, 1, "rank", 1, True, False, None, jnp.bfloat16),
    (2, 1, "expert", 128, False, False, None, jnp.float32),
    (4, 2, "rank", 4, True, True, None, jnp.bfloat16),
    (4, 2, "expert", 1, True, False, None, jnp.bfloat16),
    (8, 1, "rank", 1, False, False, 60, jnp.float32),
    (8, 1, "expert", 8, True, True, 48, jnp.bfloat16),
    (8, 1, "expert", 1, False, False, None, jnp.bfloat16),
    (4, 1, "rank", 1, True, False, 50, jnp.float32),
    (2, 1, "expert", 2, True, False, None, jnp.float32),
]


@functools.cache
def compiled(num_ranks, dp, lay, alignment, fp8, round_scale, capacity):
    """One jitted pipeline per path and static config: hypothesis's examples vary only the data
    (the shapes are fixed), so they share one compile instead of three each."""
    mesh = make_mesh(num_ranks, dp)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    return mesh, {
        impl: runner(mesh, pipeline(buf, lay, alignment, fp8, round_scale, capacity))
        for impl, buf in bufs.items()
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c[:7])))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(ROUTINGS))
def test_ffi_matches_reference(config, seed, kind):
    num_ranks, dp, lay, alignment, fp8, round_scale, capacity, dtype = config
    mesh, step = compiled(num_ranks, dp, lay, alignment, fp8, round_scale, capacity)
    rng = np.random.default_rng(seed)
    x, idx, w = random_inputs(rng, mesh.size, T, H, E, K, num_ranks, kind, dtype)
    bias = jnp.asarray(rng.standard_normal(x.shape), dtype)
    x2 = jnp.asarray(rng.standard_normal(x.shape), dtype)
    assert_matches_reference(step, x, idx, w, bias, x2)


SPLIT_CONFIGS = [  # num_ranks, dp, layout, fp8 (True, or "round": round_scale too),
    # capacity (rows per expert when padded), dtype, weighted
    (1, 1, "expert_padded", "round", None, jnp.float32, True),
    (2, 1, "expert_padded", True, None, jnp.bfloat16, False),
    (4, 2, "expert_padded", False, 7, jnp.float32, True),
    (8, 1, "expert_padded", True, 3, jnp.bfloat16, True),
    (8, 1, "rank", True, None, jnp.bfloat16, True),
    (4, 1, "expert", False, 40, jnp.bfloat16, True),
    (2, 1, "expert", "round", None, jnp.float32, False),
]


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_padded_layout_and_split_ops_match_reference(config, split):
    """Also without weights (the expert layouts' weights are then 1) and with round_scale."""
    num_ranks, dp, lay, fp8, capacity, dtype, weighted = config
    mesh = make_mesh(num_ranks, dp)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    step = {
        impl: runner(
            mesh,
            pipeline(
                buf, lay, 1, bool(fp8), fp8 == "round", capacity, weighted=weighted, split=split
            ),
        )
        for impl, buf in bufs.items()
    }  # one compile per path, shared by the three routings
    for seed, kind in enumerate(("random", "one_expert", "sparse")):
        rng = np.random.default_rng(seed)
        x, idx, w = random_inputs(rng, mesh.size, T, H, E, K, num_ranks, kind, dtype)
        bias = jnp.asarray(rng.standard_normal(x.shape), dtype)
        x2 = jnp.asarray(rng.standard_normal(x.shape), dtype)
        assert_matches_reference(step, x, idx, w, bias, x2)


def test_several_buffers_and_results_alive():
    mesh = make_mesh(4, 2)
    a = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    b = jax_ep.Buffer(mesh, "ep", num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=8)
    rng = np.random.default_rng(0)
    x, idx, w = random_inputs(rng, 8, T, H, E, K, 4, "random")
    xb, idxb, wb = random_inputs(rng, 8, 8, 128, 8, 2, 4, "random")

    def both(x, idx, w, xb, idxb, wb):
        d1 = a.dispatch(x, idx, w)
        e1 = b.dispatch(xb, idxb, wb, layout="expert")
        d2 = a.dispatch(x * 2, idx, w)  # a second result of the same Buffer
        y1 = a.combine(d1.x, d1.handle)
        y2 = a.combine(d2.x, d2.handle)
        yb = b.combine(e1.x, e1.handle, topk_weights=e1.topk_weights)
        return y1, y2, yb

    y1, y2, yb = run(mesh, both, x, idx, w, xb, idxb, wb)
    # Unweighted rank-layout round trip: each token comes back once per rank it visited.
    ranks_hit = (np.asarray(idx)[:, :, None] // (E // 4) == np.arange(4)).any(1).sum(1)
    np.testing.assert_allclose(
        np.asarray(y1, np.float32), np.asarray(x, np.float32) * ranks_hit[:, None], rtol=1e-2
    )
    np.testing.assert_allclose(
        np.asarray(y2, np.float32), 2 * np.asarray(y1, np.float32), rtol=1e-2
    )
    # Weighted expert-layout round trip with identity experts: x times its weights' sum.
    np.testing.assert_allclose(
        np.asarray(yb, np.float32),
        np.asarray(xb, np.float32) * np.asarray(wb).sum(1, keepdims=True),
        rtol=2e-2,
        atol=1e-2,
    )
    a.close()
    b.close()


def test_the_native_side_keeps_no_python_object_alive():
    """The registry and a compiled program's state share the C++ object, not the Python one:
    once its Buffer is closed, the Python object of a native side that a cached program still
    uses has no references but ours (one that C++ kept alive would be left to the interpreter's
    teardown: nanobind's leak report at exit)."""
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x, i = jnp.ones((2 * T, H), jnp.float32), jnp.zeros((2 * T, K), jnp.int32)
    step = runner(mesh, lambda x, i: buf.dispatch(x, i).num_recv)
    step(x, i).block_until_ready()
    native = buf._native
    buf.close()
    assert sys.getrefcount(native) <= 2  # `native` and getrefcount's argument (C++ held: 3)
    np.testing.assert_array_equal(step(x, i), [2 * T, 0])  # the program still runs


def test_targets_registered_before_any_device_leave_the_backends_working():
    """A jax_ep call traced before any device was asked for (jax.eval_shape of the first use)
    registers the targets; the backends must still start afterwards (jaxlib replays what came
    before a backend's start with the targets ahead of their state's type)."""
    code = (
        "import jax; from jax_ep import ffi_path; ffi_path.register_targets(); "
        "print(jax.devices()[0].platform)"
    )
    out = _python(code, JAX_PLATFORMS="cpu")
    assert out.returncode == 0 and out.stdout.split() == ["cpu"], out.stderr[-2000:]


def _python(code, cwd=ROOT, **env):
    """`python -c code` with this checkout's jax_ep, in a new process (env added to ours)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT, **env),
        cwd=cwd,
    )


X64_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np, jax_ep
from helpers import make_mesh, run
mesh = make_mesh(2)
x = jnp.ones((8, 128), jnp.float32)
i = jnp.tile(jnp.arange(2, dtype=jnp.int32), (8, 1))
for lay in ("rank", "expert", "expert_padded"):
    ys = []
    for impl in ("ffi", "reference"):
        buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2,
                            max_tokens_per_rank=4, impl=impl)
        def step(x, i):
            d = buf.dispatch(x, i, layout=lay)
            return buf.combine(d.x, d.handle), d.num_recv
        y, num_recv = run(mesh, step, x, i)
        assert num_recv.dtype == jnp.int32, (impl, lay, num_recv.dtype)
        ys.append(np.asarray(y))
    assert np.array_equal(*ys) and ys[0].min() >= 1.0, lay
print("OK")
"""


def test_handles_and_counts_are_int32_under_jax_enable_x64():
    """With 64-bit types on, every layout's dispatch and combine work on both paths and the
    counts stay int32 (the reference path's sums of int32 counts were int64, which its own
    handles then carried)."""
    out = _python(X64_PROGRAM, os.path.join(ROOT, "tests"), JAX_ENABLE_X64="1")
    assert out.returncode == 0 and out.stdout.split() == ["OK"], out.stderr[-3000:]


def test_invalid_expert_ids_are_excluded_and_reported():
    mesh = make_mesh(4)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    rng = np.random.default_rng(5)
    x, idx, w = random_inputs(rng, 4, T, H, E, K, 4, "random")
    bad = np.asarray(idx).copy()
    bad[3, 1] = E  # out of range
    bad[20, 0] = -7  # below -1
    clean = bad.copy()
    clean[3, 1] = clean[20, 0] = -1

    def counts(buf):
        return lambda x, i, w: buf.dispatch(x, i, w)._replace(handle=None)

    # The reference counts them and treats them as unused slots.
    ref_bad = run(mesh, counts(bufs["reference"]), x, jnp.asarray(bad), w)
    ref_clean = run(mesh, counts(bufs["reference"]), x, jnp.asarray(clean), w)
    np.testing.assert_array_equal(ref_bad.num_invalid, [1, 1, 0, 0])
    assert_bitwise_equal(ref_bad._replace(num_invalid=None), ref_clean._replace(num_invalid=None))
    # The custom calls exclude and count them alike, and every rank's op completes.
    got = run(mesh, counts(bufs["ffi"]), x, jnp.asarray(bad), w)
    assert_bitwise_equal(got, ref_bad)
    # The Buffer still works afterwards.
    assert_bitwise_equal(run(mesh, counts(bufs["ffi"]), x, jnp.asarray(clean), w), ref_clean)
    # The checking mode raises a Python exception on every rank and the Buffer stays usable. The
    # custom calls only: a program of XLA's own collectives (the reference path) on several CPU
    # devices of one process was aborted by XLA now and then under jax 0.12 (docs/API.md,
    # check_invalid); tests/process_scenarios.py raises on the reference path with one device
    # per process.
    for impl in ("ffi",):
        checking = jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=E,
            hidden=H,
            num_topk=K,
            max_tokens_per_rank=T,
            impl=impl,
            check_invalid=True,
        )
        out = None
        with pytest.raises(Exception, match="topk_idx holds 2 expert id"):
            out = run(mesh, counts(checking), x, jnp.asarray(bad), w)
            jax.block_until_ready(out)
        settle(out)
        assert_bitwise_equal(run(mesh, counts(checking), x, jnp.asarray(clean), w), ref_clean)


def test_a_rank_that_never_arrives_is_an_error_not_a_hang():
    # The dispatch custom call alone, on one device of a 2-rank group.
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, timeout_s=0.5
    )
    x = jax.device_put(jnp.zeros((4, 128), jnp.float32), jax.devices()[0])
    idx = jax.device_put(jnp.zeros((4, 2), jnp.int32), jax.devices()[0])
    lonely = jax.jit(
        lambda x, i: buf._ops.dispatch(
            x, i, jnp.zeros(i.shape), rows=8, fp8=False, round_scale=False
        )
    )
    # The op that timed out returns NaN rows and no counts in its own step, and says why.
    moved, routing = lonely(x, idx)
    assert np.isnan(np.asarray(moved.x)).all() and int(routing.num_recv) == 0
    assert "waited more than 0.5" in buf.status() and "for rank 1" in buf.status()
    # The Buffer raises at once from then on; a new Buffer works.
    with pytest.raises(Exception, match="this Buffer stopped"):
        jax.block_until_ready(lonely(x, idx))
    buf.close()  # and its error with it (else JAX raises it again at exit)
    again = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)
    d = run(
        mesh,
        lambda x, i: again.dispatch(x, i)._replace(handle=None),
        jnp.ones((8, 128), jnp.float32),
        jnp.zeros((8, 2), jnp.int32),
    )
    np.testing.assert_array_equal(d.num_recv, [8, 0])


@pytest.mark.parametrize("num_ranks", [1, 4])
def test_recv_halves_out_of_send_order(num_ranks):
    """Recv halves in the other order than their sends, and a whole op while a sent one waits,
    give every op its own results, round after round."""
    mesh = make_mesh(num_ranks)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x, idx, w = random_inputs(np.random.default_rng(11), num_ranks, T, H, E, K, num_ranks, "random")
    got, want = (run(mesh, out_of_order(bufs[impl]), x, idx, w) for impl in ("ffi", "reference"))
    assert_same_ops(got, want)


def test_vmap_runs_one_op_per_batch_element():
    """jax.vmap over dispatch and combine: one op per element, the reference path's results;
    the halves refuse to batch (their sends would outnumber the slots)."""
    mesh = make_mesh(4)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x, idx, w = random_inputs(np.random.default_rng(21), 4, T, H, E, K, 4, "random")
    xs = jnp.stack([x * (i + 1) for i in range(3)], axis=1)  # [R*T, 3, H]: a batch per rank

    def batched(buf):
        def one(x, idx, w):
            d = buf.dispatch(x, idx, w, layout="expert")
            return d._replace(handle=None), buf.combine(d.x, d.handle, d.topk_weights)

        return lambda xs, idx, w: jax.vmap(one, in_axes=(1, None, None))(xs, idx, w)

    got, want = (run(mesh, batched(bufs[impl]), xs, idx, w) for impl in ("ffi", "reference"))
    assert_bitwise_equal(got[0], want[0], "dispatch")
    assert_sums_equal(got[1], want[1], "combine")
    with pytest.raises(Exception, match="vmap"):
        run(
            mesh,
            lambda xs, idx, w: jax.vmap(
                lambda x: bufs["ffi"].dispatch_send(x, idx, w).arrays[0], in_axes=1
            )(xs),
            xs,
            idx,
            w,
        )


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(ROUTINGS),
    capacity=st.sampled_from([40, 3]),
)
def test_expert_padded_call_matches_oracle(seed, kind, capacity):
    """The expert_padded call alone (maps, weights, rows and scales placed in one step) against
    the oracle, drops included."""
    check_expert_padded_call(np.random.default_rng(seed), kind, 40, capacity)


@pytest.mark.parametrize("kind", ["duplicates", "late_duplicates"])
def test_expert_padded_call_many_slots(kind):
    """More than 32 slots a row (the GPUs' kernel takes them in groups of 32), with an expert
    named twice: first in the first group and again in the second, or twice in the second."""
    check_expert_padded_call(np.random.default_rng(0), kind, 60, 20, num_local=48, k=40)


@pytest.mark.parametrize("kind,capacity", EXPERT_PADDED_CHUNKS)
def test_expert_padded_call_over_chunks(kind, capacity):
    """The GPU kernel's chunked cases (2500 rows, drops), on this backend."""
    check_expert_padded_call(np.random.default_rng(capacity), kind, 2500, capacity)


@pytest.mark.parametrize("kind,num_local,k,hidden", EXPERT_PADDED_SHAPES)
def test_expert_padded_call_shapes(kind, num_local, k, hidden):
    """The GPU kernel's slot counts and row sizes (wide and odd rows), on this backend."""
    check_expert_padded_call(np.random.default_rng(k), kind, 1500, 300, num_local, k, hidden)


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_dispatch_of_special_values_is_the_reference(round_scale):
    """NaN (left out of its block's amax, and first in a block), +-inf, a block below the amax
    clamp and signed zeros: an FP8 dispatch's rows and scales bitwise the reference path's."""
    mesh = make_mesh(2)
    bufs = buffers(mesh, num_experts=2, hidden=H, num_topk=1, max_tokens_per_rank=8)
    x = np.random.default_rng(3).standard_normal((16, H)).astype(np.float32)
    x[0, 5], x[1, 0], x[2, 7], x[3, 130] = np.nan, np.nan, np.inf, -np.inf
    x[4, :128] = 1e-30
    x[5, :128] = 0.0
    x[5, 3] = -0.0
    idx = (np.arange(16) % 2).astype(np.int32)[:, None]
    got, want = (
        run(
            mesh,
            lambda x, i, buf=bufs[impl]: buf.dispatch(x, i, fp8=True, round_scale=round_scale)[:2],
            jnp.asarray(x),
            jnp.asarray(idx),
        )
        for impl in ("ffi", "reference")
    )
    assert_bitwise_equal(got, want, "rows and scales")
    assert np.isnan(np.asarray(got[0], np.float32)).sum() == 4  # the NaNs, and each inf's own


def test_denormals_are_flushed_as_xla_flushes_them():
    """XLA:CPU flushes denormals to zero; so do the CPU backend's threads: a combine's sums of
    denormal rows onto a bias, and the program's own arithmetic after an op (completing an op
    runs the device's next work on them), are bitwise the reference path's."""
    mesh = make_mesh(2)
    bufs = buffers(mesh, num_experts=4, hidden=H, num_topk=1, max_tokens_per_rank=2)
    x = np.zeros((4, H), np.float32)
    x[:, 0], x[:, 1], x[:, 2], x[:, 3] = 1e-40, -3e-39, 1.0, 1e-45
    bias = np.zeros((4, H), np.float32)
    bias[:, 4] = 2e-39
    idx = np.array([[0], [2], [3], [1]], np.int32)

    def step(buf, x, i, bias):
        d = buf.dispatch(x, i)
        return buf.combine(d.x, d.handle, bias=bias), d.x * 2

    got, want = (
        run(mesh, functools.partial(step, bufs[impl]), *map(jnp.asarray, (x, idx, bias)))
        for impl in ("ffi", "reference")
    )
    assert_bitwise_equal(got, want, "y and d.x * 2")
    assert not np.asarray(got[1])[:, [0, 1, 3]].any()  # 2e-40 and the like: flushed


def test_bf16_values_computed_in_the_program_are_rounded_alike():
    """A bf16 bias, or x sent in FP8, computed in the same program: XLA may fuse the reference
    path's conversion to float32 with their producer and skip the rounding to bf16 (excess
    precision), where the custom calls read the stored bf16 values. The paths give the same
    bits, over one axis and over ("node", "ep") (y differed in 188 of 1024 elements, FP8 rows
    in 34)."""
    nodes = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "ep"))
    flat = jax.sharding.Mesh(nodes.devices.reshape(-1), ("ep",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4 * 4, 128)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, 8, (4 * 4, 2)), jnp.int32)
    w = jnp.asarray(rng.random((4 * 4, 2)), jnp.float32)
    shared = jnp.asarray(rng.standard_normal((128, 128)) * 0.1, jnp.bfloat16)
    got = {}
    for mesh, axis in ((flat, "ep"), (nodes, ("node", "ep"))):
        for impl, buf in buffers(
            mesh, axis=axis, num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=4
        ).items():

            def step(x, idx, w, shared, buf=buf):
                d = buf.dispatch(x, idx, w, layout="expert")
                bias = jnp.tanh(x @ shared) * 3 + x  # a shared expert's output, in bf16
                y = buf.combine(d.x, d.handle, topk_weights=d.topk_weights, bias=bias)
                sent = buf.dispatch(x + 1, idx, fp8=True)  # x + 1: in bf16
                return y, sent.x.astype(jnp.float32), sent.scales

            f = jax.shard_map(step, mesh=mesh, in_specs=(P(axis),) * 3 + (P(),), out_specs=P(axis))
            got[axis, impl] = jax.jit(f)(x, idx, w, shared)
    want = got["ep", "reference"]
    for key, value in got.items():
        assert_bitwise_equal(value, want, f"y, FP8 rows and scales of {key}")


@pytest.mark.parametrize("lay", ["expert", "expert_padded"])
def test_an_expert_named_in_several_slots_weighs_their_sum_in_slot_order(lay):
    """Token 0 names expert 0 in slots 0, 1 and 3 (weights 1, 2^-24, 2^-24): its expert row's
    weight is ((1 + 2^-24) + 2^-24) = 1 on both paths (XLA's own sum took another order at
    this shape: 1 + 2^-23)."""
    mesh = make_mesh(2)
    bufs = buffers(mesh, num_experts=4, hidden=H, num_topk=16, max_tokens_per_rank=64)
    idx = np.full((128, 16), -1, np.int32)
    w = np.zeros((128, 16), np.float32)
    idx[0, [0, 1, 3]] = 0
    w[0, [0, 1, 3]] = [1.0, 2.0**-24, 2.0**-24]
    x = jnp.ones((128, H), jnp.float32)
    got = {
        impl: run(
            mesh, lambda x, i, w, b=b: b.dispatch(x, i, w, layout=lay).topk_weights, x, idx, w
        )
        for impl, b in bufs.items()
    }
    assert_bitwise_equal(got["ffi"], got["reference"], "topk_weights")
    assert np.asarray(got["ffi"]).reshape(-1)[0] == np.float32(1.0)


def test_fp8_quantize_calls_are_the_fp8_rule():
    """The CPU backend's FP8 quantization calls: jax_ep.fp8's bytes (rows and weights); under a
    gradient they are constants (as the FP8 matmul's forward reads them)."""
    check_fp8_quantize_calls((48, 384), (2, 256, 384))
    w = jnp.ones((2, 128, 256), jnp.bfloat16)
    grads = jax.grad(
        lambda w: (
            sum(a.astype(jnp.float32).sum() for a in ffi_path.quantize_weights(w, True))
            + sum(a.astype(jnp.float32).sum() for a in ffi_path.quantize_rows(w[0]))
        )
    )(w)
    assert not np.asarray(grads, np.float32).any()


def test_fp8_quantize_calls_refuse_partial_blocks():
    with pytest.raises(Exception, match="hidden must be a multiple of 128"):
        jax.block_until_ready(ffi_path.quantize_rows(jnp.ones((4, 200), jnp.float32)))
    with pytest.raises(Exception, match="K and N must be multiples of 128"):
        jax.block_until_ready(ffi_path.quantize_weights(jnp.ones((1, 128, 200), jnp.float32)))


def test_a_call_site_is_the_programs_place_not_its_caller_nor_its_path():
    """The same op traced from two callers of its jit, and the same code under two file names,
    have one site; two lines of a program have two; a library's lines count only where no
    program frame lies between the op and a jit."""
    source = (
        "def program(x):\n"
        "    sites.append(call_site())\n"
        "    return x\n"
        "def other(x):\n"
        "    sites.append(call_site())\n"
        "    return x\n"
    )
    sites = []

    def traced(filename, name, width):
        scope = {"sites": sites, "call_site": ffi_path.call_site}
        exec(compile(source, filename, "exec"), scope)
        jax.jit(scope[name])(jnp.zeros(width))  # a new width: a new trace
        return sites[-1]

    def caller_a():
        return traced("/tmp/a/notebook_cell_1.py", "program", 1)

    def caller_b():
        return traced("/tmp/b/notebook_cell_7.py", "program", 2)

    assert caller_a() == caller_b() != 0
    assert traced("/tmp/a/notebook_cell_1.py", "other", 3) not in (0, sites[0])
    # A library (an installed package) that the program calls under its jit: the site is where
    # the program calls into it, whichever of the library's lines calls the op.
    library = os.path.join(sysconfig.get_paths()["purelib"], "a_package", "module.py")
    scope = {"sites": sites, "call_site": ffi_path.call_site, "jax": jax}
    exec(compile(source + "jitted = jax.jit(program)\n", library, "exec"), scope)
    for name, width in (("program", 4), ("other", 5)):
        jax.jit(lambda x: scope[name](x))(jnp.zeros(width))
    assert sites[-1] == sites[-2] not in (0, sites[0])

    # A library's op under the library's own jit (jax_ep.nn's layer): its own frames, the same
    # whatever line first traced it (the walk stops at JAX's frames).

    def first_caller():
        return scope["jitted"](jnp.zeros(6))

    first_caller()
    scope["jitted"](jnp.zeros(7))
    assert sites[-1] == sites[-2] != 0

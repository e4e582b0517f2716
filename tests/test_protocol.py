"""The protocol's failure paths on the CPU backend in one process (the cases that need
processes that disagree are in process_scenarios.py): a timed-out op leaves NaN in its own
step and the next call raises, Buffer.status() says why; op numbers past 2^32; a corrupted
handle cannot write outside the window; /dev/shm too small is an error naming the size."""

import functools
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_matches_reference,
    branching_dispatch,
    buffers,
    make_mesh,
    pipeline,
    random_inputs,
    run,
    settle,
    skipping_dispatches,
)
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _testing, ffi_path

E, H, K, T = 8, 128, 2, 8


def _lonely_recv(buf, mesh):
    """A recv half of an op no rank ever sent: its wait can only time out."""
    cfg = buf._ops._cfg._replace(x_dtype="float32")
    return jax.jit(
        jax.shard_map(
            lambda t: ffi_path._recv(
                cfg, "dispatch_cached_recv", ffi_path._rows_shapes(cfg, T, H), t
            )[0],
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
            check_vma=False,
        )
    )


def test_a_timed_out_op_returns_nan_in_its_own_step_and_the_next_call_raises():
    mesh = make_mesh(1)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=0.5
    )
    assert buf.status() is None
    start = time.perf_counter()
    rows = np.asarray(_lonely_recv(buf, mesh)(jnp.full((1,), 7, jnp.int32)))
    assert time.perf_counter() - start < 30
    assert rows.shape == (T, H) and np.isnan(rows).all(), rows
    status = buf.status()
    assert status and "waited more than 0.5" in status, status
    x = jnp.ones((T, H), jnp.float32)
    i = jnp.zeros((T, K), jnp.int32)
    with pytest.raises(Exception, match="waited more than 0.5"):
        jax.block_until_ready(run(mesh, lambda x, i: buf.dispatch(x, i).x, x, i))
    buf.close()  # and its error with it (else JAX raises it again at exit)
    again = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    d = run(mesh, lambda x, i: again.dispatch(x, i)._replace(handle=None), x, i)
    assert int(np.asarray(d.num_recv)[0]) == T and again.status() is None


def test_op_numbers_past_2_to_the_32():
    """Ops numbered from just below 2^32 on: every op across the boundary (whole and split,
    so also the tickets of recv halves) equals the reference path."""
    mesh = make_mesh(2)
    with _testing.buffers(first_op=2**32 - 3):
        bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    rng = np.random.default_rng(26)
    x, idx, w = random_inputs(rng, mesh.size, T, H, E, K, mesh.size, "random")
    bias = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    # 3 ops per step (split dispatch and combine, a cached dispatch), run twice: ops 2^32 - 2
    # to 2^32 + 3.
    step = {
        impl: functools.partial(run, mesh, pipeline(buf, "rank", split=True))
        for impl, buf in bufs.items()
    }
    assert_matches_reference(step, x, idx, w, bias, x * 2)
    assert bufs["ffi"].status() is None


def test_a_corrupted_handle_cannot_write_outside_the_window():
    """Combine's send half clamps the handle's counts to the window and the rows given."""
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=20
    )
    rows = 2 * T

    def bad_combine(data):
        send_pos = jnp.zeros((T, 2), jnp.int32)
        counts = jnp.array([1 << 30, -5], jnp.int32)
        num_rows = jnp.array(1 << 30, jnp.int32)
        return buf._ops.combine(data, send_pos, num_rows, counts, None, out_dtype=jnp.float32)

    data = jnp.arange(1, 2 * rows + 1, dtype=jnp.float32)[:, None] * jnp.ones((1, H))
    y = np.asarray(run(mesh, bad_combine, data))
    # Each rank kept its rows for source 0 (2^30 clamped to T) and none for source 1 (-5 to 0),
    # and send_pos names row 0 everywhere: rank 0's tokens get row 0 of each rank (1 + 17),
    # rank 1's get nothing.
    np.testing.assert_array_equal(y[:T], np.full((T, H), 1 + (rows + 1), np.float32))
    np.testing.assert_array_equal(y[T:], np.zeros((T, H), np.float32))
    assert buf.status() is None
    x = jnp.ones((2 * T, H), jnp.float32)
    i = jnp.zeros((2 * T, K), jnp.int32)
    d = run(mesh, lambda x, i: buf.dispatch(x, i)._replace(handle=None), x, i)
    assert list(np.asarray(d.num_recv)) == [2 * T, 0]


def test_shared_memory_too_small_is_an_error_naming_the_size():
    mesh = make_mesh(1)
    n = (1 << 28) - 1  # about 2 TiB of window: more than any /dev/shm
    with pytest.raises(RuntimeError, match=r"cannot allocate \d+ bytes .*/dev/shm is too small"):
        jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=E,
            hidden=1024,
            num_topk=K,
            max_tokens_per_rank=n,
            low_latency_tokens=0,
        )
    again = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x = jnp.ones((T, H), jnp.float32)
    d = run(
        mesh,
        lambda x, i: again.dispatch(x, i)._replace(handle=None),
        x,
        jnp.zeros((T, K), jnp.int32),
    )
    assert int(np.asarray(d.num_recv)[0]) == T


def _two_ranks(dtype):
    """A Buffer of 2 ranks (a 60 s timeout), and x of `dtype` with ids sending every token to
    both ranks."""
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, timeout_s=60
    )
    x = jnp.ones((2 * T, H), dtype)
    i = jnp.tile(jnp.arange(K, dtype=jnp.int32), (2 * T, 1)) * (E // 2 - 1)
    return mesh, buf, x, i


@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_ranks_that_run_different_ops_stop_naming_both(layout):
    """Both ranks' op fails at once, NaN in its same step: the weights, and the rows (but in
    expert_padded, whose rows past each expert's count, here all, are unspecified)."""
    mesh, buf, x, i = _two_ranks(jnp.bfloat16)
    start = time.perf_counter()
    rows, ids, num_recv, weights = run(mesh, branching_dispatch(buf, layout), x, i)
    assert time.perf_counter() - start < 50, "a mismatch waited for the timeout"
    assert np.isnan(np.asarray(weights)).all() and (np.asarray(ids) == -1).all()
    assert (np.asarray(num_recv) == 0).all()
    if layout != "expert_padded":
        assert np.isnan(np.asarray(rows)).all()
    both = (
        "dispatch(fp8 rows of bfloat16 x, hidden 128, 8 tokens, top-2 of 8 experts)",
        "dispatch(bfloat16 rows, hidden 128, 8 tokens, top-2 of 8 experts)",
    )
    assert all(op in buf.status() for op in both), buf.status()
    with pytest.raises(Exception, match=r"ran dispatch\(.* while rank . ran dispatch\("):
        jax.block_until_ready(run(mesh, lambda x, i: buf.dispatch(x, i).x, x, i))
    buf.close()


def test_a_rank_that_skips_an_op_stops_at_the_next_one():
    """Two alike dispatches from two places; rank 0 skips the first. Its second pairs with rank
    1's first, and their signatures differ only in the call site: the step raises at once, naming
    both sites (without the sites the rows were the other op's, and rank 1's second op waited for
    the timeout)."""
    mesh, buf, x, i = _two_ranks(jnp.float32)
    start = time.perf_counter()
    sites = r"dispatch\(float32 rows.* \(called from call site [0-9a-f]{8} and from call site "
    with pytest.raises(Exception, match=sites):
        jax.block_until_ready(run(mesh, skipping_dispatches(buf), x, i))
    assert time.perf_counter() - start < 50, "a skipped op waited for the timeout"
    assert buf.status().count("call site") == 2, buf.status()
    buf.close()


STOPPED_THEN_EXIT = """
import jax, jax.numpy as jnp, numpy as np
import jax_ep
from helpers import branching_dispatch, make_mesh, run
mesh = make_mesh(2)
buf = jax_ep.Buffer(mesh, "ep", num_experts={E}, hidden={H}, num_topk={K},
                    max_tokens_per_rank={T}, timeout_s=60)
x = jnp.ones((2 * {T}, {H}), jnp.bfloat16)
i = jnp.zeros((2 * {T}, {K}), jnp.int32)
np.asarray(run(mesh, branching_dispatch(buf), x, i)[0])
try:
    jax.block_until_ready(run(mesh, lambda x, i: buf.dispatch(x, i).x, x, i))
except Exception as e:
    print("RAISED", "ran dispatch(" in str(e))
if {close!r} == "here":
    buf.close()
elif {close!r} == "collected":  # its finalizer, then the exit, let it go
    import gc
    del buf
    gc.collect()
elif {close!r} == "thread":
    import threading
    closing = threading.Thread(target=buf.close)
    closing.start()
    closing.join()
"""


@pytest.mark.parametrize("close", ["here", "thread", "collected", "no"])
def test_a_stopped_buffer_exits_cleanly_once_closed(close):
    """A program that met a Buffer's error and closed the Buffer (from its thread or another,
    or let it be collected) exits without JAX raising that error again at exit. Closed or not,
    the native side never outlives the interpreter as Python objects (nanobind's leak report)."""
    code = STOPPED_THEN_EXIT.format(E=E, H=H, K=K, T=T, close=close)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=here
    )
    assert out.returncode == 0 and out.stdout.split() == ["RAISED", "True"], out.stderr[-3000:]
    assert "leaked" not in out.stderr, out.stderr[-3000:]
    at_exit = "Exception ignored in atexit callback" in out.stderr
    assert at_exit == (close == "no"), out.stderr[-3000:]


def test_check_invalid_between_the_halves_of_another_op_is_refused_at_trace_time():
    """A check_invalid dispatch would raise at run time before another op's recv half, and
    strand that op's slot: it is refused while tracing, and the Buffer goes on."""
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=E,
        hidden=H,
        num_topk=K,
        max_tokens_per_rank=T,
        timeout_s=5,
        check_invalid=True,
    )
    x = jnp.ones((2 * T, H), jnp.float32)
    good = jnp.zeros((2 * T, K), jnp.int32)
    bad = good.at[3, 1].set(E + 1)

    def between(x, good, bad):
        pending = buf.dispatch_send(x, good)
        d = buf.dispatch(x, bad)
        return buf.dispatch_recv(pending).num_recv, d.num_recv

    with pytest.raises(ValueError, match="while another op's halves are open"):
        run(mesh, between, x, good, bad)

    def after(x, good, bad):  # the same ops, the checked one after the recv: it raises
        pending = buf.dispatch_send(x, good)
        received = buf.dispatch_recv(pending).num_recv
        return received, buf.dispatch(x, bad).num_recv

    out = None
    with pytest.raises(Exception, match="topk_idx holds 1 expert id"):
        out = run(mesh, after, x, good, bad)
        jax.block_until_ready(out)
    settle(out)
    for _ in range(3):  # more ops than the two slots
        d = run(mesh, lambda x, i: buf.dispatch(x, i)._replace(handle=None), x, good)
        assert list(np.asarray(d.num_recv)) == [2 * T, 0]
    assert buf.status() is None

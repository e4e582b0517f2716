"""Property tests of the CPU custom calls: random routings (invalid ids included),
capacities, row dtypes, FP8, layouts and token counts (0 included) against tests/oracle.py (rank
layout) and the reference path (expert layouts, itself checked against the oracle in
test_reference.py). Each class of example (the static shapes and options) compiles once; the
examples vary the data."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from helpers import all_axes, assert_sums_equal, bits, buffers, make_mesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

R, E, H, K, N = 2, 4, 128, 2, 6


def compiled(mesh, fn):
    """jit(shard_map(fn)) made once (helpers.run makes a new one, compiled again, per call)."""
    spec = all_axes(mesh)
    body = lambda *a: jax.tree.map(lambda v: v[None] if v.ndim == 0 else v, fn(*a))  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    sharding = jax.sharding.NamedSharding(mesh, spec)

    def shard(value):  # the same host value on every process: each takes its shards
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return lambda *args: f(*map(shard, args))


def _shards(a):
    """This process's shards of a global array, by device."""
    return {s.device.id: np.asarray(s.data) for s in a.addressable_shards}


@functools.cache
def _buffers():
    mesh = make_mesh(R)
    return mesh, buffers(
        mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=N, timeout_s=60
    )


@functools.cache
def _program(impl, lay, fp8, capacity, alignment):
    """dispatch, rows * 2 as the experts' output, combine: one compiled program per class."""
    mesh, bufs = _buffers()
    buf = bufs[impl]

    def step(x, idx, w):
        d = buf.dispatch(
            x, idx, w, layout=lay, fp8=fp8, capacity=capacity, expert_alignment=alignment
        )
        rows = (buf.dequantize(d, x) if fp8 else d.x) * 2
        weights = None if lay == "rank" else d.topk_weights
        y = buf.combine(rows.astype(x.dtype), d.handle, topk_weights=weights)
        return d._replace(handle=None), y

    return compiled(mesh, step)


CLASSES = list(
    itertools.product(
        ["rank", "expert"], [False, True], [jnp.bfloat16, jnp.float32], [0, 1, 5, N], [None, 3]
    )
)


@pytest.mark.parametrize(
    "cls", CLASSES, ids=lambda c: "-".join(getattr(v, "__name__", str(v)) for v in c)
)
@settings(
    max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(seeds=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=3))
def test_random_ops_match_the_oracle(cls, seeds):
    """Every class (layout, FP8, row dtype, tokens, capacity), each on a few random routings."""
    for seed in seeds:  # the class's program, compiled once, on several data
        _check(*cls, seed)


def _check(lay, fp8, dtype, tokens, capacity, seed):
    alignment = 2 if lay == "expert" else 1
    if lay == "expert" and capacity is not None:
        capacity = 4  # a multiple of the alignment
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * tokens, H)) * rng.choice([0.01, 1, 30], (R * tokens, 1))
    x = jnp.asarray(x, dtype)
    idx = rng.integers(-1, E, (R * tokens, K)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.05] = E + 3  # invalid: excluded and counted
    w = rng.random((R * tokens, K)).astype(np.float32)
    got, y = _program("ffi", lay, fp8, capacity, alignment)(x, jnp.asarray(idx), jnp.asarray(w))
    if lay != "rank":  # the expert layouts against the reference path
        want, want_y = _program("reference", lay, fp8, capacity, alignment)(
            x, jnp.asarray(idx), jnp.asarray(w)
        )
        for name in got._fields:
            if getattr(got, name) is not None:
                np.testing.assert_array_equal(
                    bits(getattr(got, name)), bits(getattr(want, name)), err_msg=name
                )
        assert_sums_equal(y, want_y, "y")
        return
    rows = R * N if capacity is None else capacity
    per = lambda a: np.asarray(a).reshape((R, tokens) + np.asarray(a).shape[1:])  # noqa: E731
    want = oracle.dispatch_rank(
        per(x.astype(jnp.float32)).astype(np.dtype(dtype)), per(idx), per(w), E, rows, fp8=fp8
    )
    shaped = lambda a: np.asarray(a).reshape((R, -1) + np.asarray(a).shape[1:])  # noqa: E731
    np.testing.assert_array_equal(bits(shaped(got.x)), bits(want["x"]), err_msg="x")
    if fp8:
        np.testing.assert_array_equal(shaped(got.scales), want["scales"], err_msg="scales")
    for name in ("topk_idx", "topk_weights", "tokens_per_expert"):
        np.testing.assert_array_equal(shaped(getattr(got, name)), want[name], err_msg=name)
    for name in ("num_recv", "num_dropped", "num_invalid"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, name)).reshape(R), want[name], err_msg=name
        )
    sent = want["x"].astype(np.float32) * (want["scales"].repeat(128, -1) if fp8 else 1)
    expert_out = [
        (sent[d].astype(np.dtype(dtype)).astype(np.float32) * 2).astype(np.dtype(dtype))
        for d in range(R)
    ]
    want_y = oracle.combine(expert_out, want["send_pos"]).astype(np.dtype(dtype))
    np.testing.assert_array_equal(
        bits(np.asarray(y).reshape(want_y.shape)), bits(want_y), err_msg="combine"
    )


def soak(ops, mesh=None, seed=0):
    """`ops` dispatch + combine ops (two per step) on a Buffer, every result checked against the
    reference path computed from the same inputs; returns the number of ops run."""
    mesh = mesh or make_mesh(R)
    bufs = buffers(mesh, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=N, timeout_s=60)

    def step(buf):
        def f(x, idx, w):
            d = buf.dispatch(x, idx, w)
            return d._replace(handle=None), buf.combine(d.x * 3, d.handle)

        return f

    programs = {impl: compiled(mesh, step(buf)) for impl, buf in bufs.items()}
    rng = np.random.default_rng(seed)
    done = 0
    while done < ops:
        x = jnp.asarray(rng.standard_normal((mesh.size * N, H)), jnp.float32)
        idx = jnp.asarray(rng.integers(-1, E, (mesh.size * N, K)), jnp.int32)
        w = jnp.asarray(rng.random((mesh.size * N, K)), jnp.float32)
        got, want = programs["ffi"](x, idx, w), programs["reference"](x, idx, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = _shards(a), _shards(b)
            for device in a:
                np.testing.assert_array_equal(
                    bits(a[device]), bits(b[device]), err_msg=f"op {done}, device {device}"
                )
        done += 2
    assert bufs["ffi"].status() is None
    return done


def test_soak_short():
    """The CI length of the soak in one process (process_scenarios.soak: 2 processes)."""
    assert soak(2000) == 2000


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

"""jax_ep.layout, the plain-JAX statement of the rules, against the numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from helpers import bits, routing
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_ep
from jax_ep import layout
from jax_ep.fp8 import dequantize_fp8, divide_rounded, float_to_e4m3
from jax_ep.memory import default_capacity


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_rule_matches_oracle(dtype, round_scale):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 512)) * rng.choice([1e-7, 1e-3, 1.0, 1e4], (6, 1))
    x[0, :128] = 0.0  # amax floor 1e-4
    x[1, 5] = 448.0 * 3  # one large value in a block
    x = jnp.asarray(x, dtype)
    q, scales = jax.jit(jax_ep.quantize_fp8, static_argnums=1)(x, round_scale)
    for t in range(x.shape[0]):
        want_q, want_scales = oracle.quantize(np.asarray(x[t], np.float32), round_scale)
        np.testing.assert_array_equal(bits(q[t]), bits(want_q))
        np.testing.assert_array_equal(np.asarray(scales[t]), want_scales)


def test_fp8_dequantize_is_close():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 256)), jnp.float32)
    q, scales = jax_ep.quantize_fp8(x, False)
    assert float(jnp.max(jnp.abs(dequantize_fp8(q, scales) - x))) < 0.07 * float(
        jnp.max(jnp.abs(x))
    )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    alignment=st.sampled_from([1, 3, 8]),
    kind=st.sampled_from(["random", "one_expert", "sparse", "duplicates", "empty"]),
    cut=st.sampled_from([None, 0.5]),
)
def test_expert_layout_matches_oracle(seed, alignment, kind, cut):
    rng = np.random.default_rng(seed)
    rows, k, num_local = 24, 4, 6
    topk = routing(kind, rng, rows, num_local, k, 1)
    w = rng.random((rows, k)).astype(np.float32)
    full = default_capacity("expert", 1, rows, k, num_local, alignment)
    capacity = full if cut is None else layout.align_up(int(full * cut), alignment)
    maps = layout.expert_layout(jnp.asarray(topk), num_local, alignment, capacity)
    weights = layout.expert_weights(
        jnp.asarray(w), jnp.asarray(topk), maps.expert_src, maps.expert_of_row
    )
    src, expert, weight, present, dropped = oracle.expert_layout(
        topk, w, num_local, alignment, capacity
    )
    np.testing.assert_array_equal(maps.expert_src, src)
    np.testing.assert_array_equal(maps.expert_of_row, expert)
    np.testing.assert_allclose(weights, weight, rtol=1e-6)
    np.testing.assert_array_equal(maps.tokens_per_expert, present)
    assert int(maps.num_dropped) == dropped
    # expert_rows is the inverse of expert_src, by expert within each row.
    for r in range(rows):
        mine = sorted(p for p in range(capacity) if src[p] == r)
        got = [p for p in np.asarray(maps.expert_rows[r]) if p >= 0]
        assert got == mine
    # Blocks start where ragged_dot expects them.
    group_sizes = np.asarray(layout.align_up(maps.tokens_per_expert, alignment))
    assert group_sizes.sum() <= capacity
    for e in range(num_local):
        first = group_sizes[:e].sum()
        assert all(expert[first : first + present[e]] == e)


def test_expand_and_reduce_are_adjoint():
    rng = np.random.default_rng(3)
    topk = jnp.asarray(routing("random", rng, 10, 4, 3, 1))
    maps = layout.expert_layout(topk, 4, 2, 32)
    a = jnp.asarray(rng.standard_normal((10, 5)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((32, 5)), jnp.float32)
    lhs = jnp.vdot(layout.expand_rows(a, maps.expert_src, maps.expert_rows), b)
    rhs = jnp.vdot(a, layout.reduce_expert_rows(b, None, maps.expert_src, maps.expert_rows))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5)
    # and their custom gradients are each other
    g = jax.grad(lambda v: jnp.vdot(layout.expand_rows(v, maps.expert_src, maps.expert_rows), b))(a)
    np.testing.assert_allclose(
        g, layout.reduce_expert_rows(b, None, maps.expert_src, maps.expert_rows), rtol=1e-6
    )


@pytest.mark.parametrize(
    "dtype,width",
    [
        (jnp.bfloat16, 6),  # whole words: gathered as words
        (jnp.bfloat16, 5),  # a half word at the end: by element
        (jnp.float8_e4m3fn, 8),
        (jnp.float8_e4m3fn, 6),
        (jnp.float32, 3),  # already words
    ],
)
def test_take_rows_is_take_bit_for_bit(dtype, width):
    """take_rows (4-byte words where a row is whole words) equals take, NaN and -0 included,
    with zeros where the index is -1."""
    rng = np.random.default_rng(width)
    raw = rng.integers(0, 256, (7, width * jnp.dtype(dtype).itemsize), dtype=np.uint8)
    rows = jnp.asarray(raw.view(jnp.dtype(dtype)))
    index = jnp.asarray([3, -1, 0, 6, 6, -1, 2, 1, 5, 4], jnp.int32)
    got = jax.jit(layout.take_rows)(rows, index)
    np.testing.assert_array_equal(bits(got), bits(layout.take(rows, index)))
    np.testing.assert_array_equal(bits(got[1]), np.zeros(width, bits(got).dtype))
    none = jax.jit(layout.take_rows)(rows[:0], index)  # no rows: zeros everywhere
    np.testing.assert_array_equal(bits(none), np.zeros((10, width), bits(got).dtype))


def test_e4m3_rounding_matches_ml_dtypes_everywhere():
    """Every e4m3 value, every midpoint between two and its neighbours, and random floats."""
    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = np.sort(codes[np.isfinite(codes)])
    mids = (codes[1:] + codes[:-1]) / 2
    values = np.concatenate(
        [
            codes,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, -np.float32(np.inf)),
            np.random.default_rng(0).standard_normal(100000).astype(np.float32) * 100,
        ]
    ).astype(np.float32)
    values = values[np.abs(values) <= 448]
    got = np.asarray(jax.jit(float_to_e4m3)(values))
    np.testing.assert_array_equal(bits(got), bits(values.astype(ml_dtypes.float8_e4m3fn)))


def test_divide_rounded_is_ieee_division():
    rng = np.random.default_rng(4)
    a = np.concatenate([np.full(4096, 448.0), rng.random(20000) * 1e3 + 1e-3]).astype(np.float32)
    b = np.concatenate(
        [np.exp(rng.uniform(np.log(1e-4), np.log(1e30), 4096)), rng.random(20000) * 7 + 1e-4]
    ).astype(np.float32)
    b[:8] = [1e-4, 1.0, 2.0, 448.0, 3.0, 0.1, 7.0, 1.5]  # exact and inexact quotients
    got = np.asarray(jax.jit(divide_rounded)(a, b))
    np.testing.assert_array_equal(got, a / b)


def test_the_kernels_take_the_rows_the_reference_path_states():
    """One limit on a rank's rows, stated by the reference path and followed by the kernels."""
    assert jax_ep.limits()["max_rank_rows"] == layout.MAX_RANK_ROWS

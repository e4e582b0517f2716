"""jax_ep.nn.grouped_matmul on its XLA path (the path on CPU): the forward and both gradients
against jax.lax.ragged_dot and a numpy loop over the groups, gradients of second order, under
shard_map and jax.checkpoint; and which implementation it takes. The FP8 forward
(fp8_grouped_matmul): its weight blocks, the dequantized product, its bf16 gradients. (The
Mosaic GPU kernels: tests/test_gpu_grouped.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, relative_error
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ep
from jax_ep.fp8 import dequantize_fp8, quantize_weights_fp8, transpose_weights_fp8
from jax_ep.nn import grouped

M, K, N = 24, 16, 12
GROUP_SIZES = {  # G = 4 groups of M = 24 rows
    "full": [5, 7, 8, 4],
    "empty_groups": [0, 10, 0, 14],
    "padding_rows": [3, 0, 6, 2],  # rows 11.. belong to no group
    "one_group": [0, 0, 24, 0],
    "no_rows": [0, 0, 0, 0],
}


def operands(seed, m=M, k=K, n=N, groups=4):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((m, k)).astype(np.float32),
        rng.standard_normal((groups, k, n)).astype(np.float32),
        rng.standard_normal((m, n)).astype(np.float32),
    )


def loop_products(lhs, rhs, ct, sizes):
    """The forward, d lhs and d rhs of sum(ct * grouped_matmul) group by group, in float64."""
    lhs, rhs, ct = (np.asarray(a, np.float64) for a in (lhs, rhs, ct))
    out, d_lhs, d_rhs = np.zeros(ct.shape), np.zeros(lhs.shape), np.zeros(rhs.shape)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[g]
        d_lhs[rows] = ct[rows] @ rhs[g].T
        d_rhs[g] = lhs[rows].T @ ct[rows]
        start += size
    return out, d_lhs, d_rhs


def value_and_grads(matmul, lhs, rhs, ct, sizes):
    def objective(lhs, rhs):
        out = matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        return jnp.vdot(out, ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return (out,) + grads


@pytest.mark.parametrize("name", sorted(GROUP_SIZES))
def test_matches_ragged_dot_and_a_loop(name):
    sizes = GROUP_SIZES[name]
    lhs, rhs, ct = operands(1)
    got = value_and_grads(lambda *a: grouped.grouped_matmul(*a, impl="xla"), lhs, rhs, ct, sizes)
    ragged = value_and_grads(jax.lax.ragged_dot, lhs, rhs, ct, sizes)
    loop = loop_products(lhs, rhs, ct, sizes)
    for what, g, r, want in zip(("forward", "d lhs", "d rhs"), got, ragged, loop):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5, err_msg=what)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=what)
    past = sum(sizes)  # rows of no group: zero, and so is their gradient
    assert not np.asarray(got[0])[past:].any() and not np.asarray(got[1])[past:].any()


def test_casts_rhs_to_the_lhs_dtype():
    lhs, rhs, _ = operands(2)
    sizes = jnp.asarray(GROUP_SIZES["full"], jnp.int32)
    out = grouped.grouped_matmul(jnp.asarray(lhs, jnp.bfloat16), rhs, sizes, impl="xla")
    assert out.dtype == jnp.bfloat16
    d_rhs = jax.grad(
        lambda r: (
            grouped.grouped_matmul(jnp.asarray(lhs, jnp.bfloat16), r, sizes, impl="xla")
            .astype(jnp.float32)
            .sum()
        )
    )(rhs)
    assert d_rhs.dtype == jnp.float32


@pytest.mark.parametrize("name", ["full", "padding_rows"])
def test_gradients_of_first_and_second_order(name):
    """Numerical against automatic derivatives: the three products are each other's adjoints."""
    lhs, rhs, _ = operands(3, m=8, k=4, n=3, groups=3)
    sizes = jnp.asarray({"full": [3, 1, 4], "padding_rows": [2, 0, 3]}[name], jnp.int32)
    check_grads(
        lambda a, b: grouped.grouped_matmul(a, b, sizes, impl="xla"),
        (lhs, rhs),
        order=2,
        modes=["rev"],
        atol=1e-2,
        rtol=1e-2,
    )


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("rhs_spec", [P("ep"), P()], ids=["experts_sharded", "replicated"])
def test_under_shard_map(remat, rhs_spec):
    """Each of 4 ranks multiplies its own rows and group sizes, with its rank's experts (rhs
    sharded) or all ranks with the same experts (replicated: d rhs sums over the ranks)."""
    mesh = make_mesh(4)
    ranks, groups = mesh.size, 3
    lhs, rhs, ct = operands(
        4, m=ranks * M, groups=ranks * groups if rhs_spec == P("ep") else groups
    )
    rng = np.random.default_rng(5)
    sizes = np.stack([rng.multinomial(M - 2 * r, np.ones(groups) / groups) for r in range(ranks)])

    def per_rank(lhs, rhs, sizes):
        return grouped.grouped_matmul(lhs, rhs, sizes.reshape(-1), impl="xla")

    f = jax.checkpoint(per_rank) if remat else per_rank
    f = jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), rhs_spec, P("ep")), out_specs=P("ep"))
    args = [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in ((lhs, P("ep")), (rhs, rhs_spec), (jnp.asarray(sizes, jnp.int32), P("ep")))
    ]
    out, grads = jax.jit(
        jax.value_and_grad(lambda a, b, s: jnp.vdot(f(a, b, s), ct), argnums=(0, 1))
    )(*args)
    want = [
        loop_products(
            lhs[r * M : (r + 1) * M],
            rhs[r * groups : (r + 1) * groups] if rhs_spec == P("ep") else rhs,
            ct[r * M : (r + 1) * M],
            sizes[r],
        )
        for r in range(ranks)
    ]
    np.testing.assert_allclose(
        out, sum(np.vdot(w[0], ct[r * M : (r + 1) * M]) for r, w in enumerate(want)), rtol=1e-5
    )
    np.testing.assert_allclose(grads[0], np.concatenate([w[1] for w in want]), rtol=1e-5, atol=1e-5)
    d_rhs = np.concatenate([w[2] for w in want]) if rhs_spec == P("ep") else sum(w[2] for w in want)
    np.testing.assert_allclose(grads[1], d_rhs, rtol=1e-5, atol=1e-5)


def test_which_implementation():
    shape = ((256, 256), (4, 256, 256))
    assert grouped.resolve_impl("xla", *shape, jnp.bfloat16) == "xla"
    if jax.devices()[0].platform == "cpu":
        assert grouped.resolve_impl("auto", *shape, jnp.bfloat16) == "xla"
        with pytest.raises(ValueError, match="not a CUDA GPU of compute capability 9"):
            grouped.grouped_matmul(
                jnp.zeros(shape[0], jnp.bfloat16),
                jnp.zeros(shape[1], jnp.bfloat16),
                jnp.zeros(4, jnp.int32),
                impl="mosaic",
            )
    blocks = grouped.MosaicBlocks(
        gmm=grouped.Blocks(128, 128, 64, 4, 8),
        gmm_t=grouped.Blocks(128, 128, 64, 4, 8),
        tgmm=grouped.Blocks(128, 128, 32, 4, 8),
    )
    problems = grouped.mosaic_misfits((200, 100), (4, 100, 96), jnp.float32, blocks)
    for expected in (
        "dtype float32",
        "gmm: M=200 is not a positive multiple of 128",
        "gmm: K=100 is not a positive multiple of 64",
        "gmm_t: N=96 is not a positive multiple of 64",
        "tgmm: M=200 is not a positive multiple of 32",
        "tgmm: N=96 is not a positive multiple of 128",
    ):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    problems = grouped.cutlass_misfits((200, 100), (0, 100, 96), jnp.float32)
    for expected in (
        "dtype float32",
        "cutlass: K=100 is not a positive multiple of 8",
        "cutlass: G=0 is not in [1, 65535]",
    ):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert not any("M=" in p or "N=" in p for p in problems), problems  # any M; N=96 fits
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="impl='cutlass' cannot run: the default device"):
            grouped.resolve_impl("cutlass", *shape, jnp.bfloat16)
        with pytest.raises(ValueError, match="impl='deepgemm' cannot run: the default device"):
            grouped.resolve_impl("deepgemm", *shape, jnp.bfloat16, group_alignment=128)
    problems = grouped.deepgemm_misfits((200, 100), (4, 100, 128), jnp.bfloat16, 64)
    for expected in (
        "deepgemm: group_alignment=64 is not a multiple of 128 rows",
        "deepgemm: K=100 is not a positive multiple of 64",
    ):
        assert expected in problems, (expected, problems)
    assert not any(p.startswith("deepgemm: N=") for p in problems), problems
    problems = grouped.deepgemm_misfits((0, 256), (4, 256, 96), None, 256, fp8=True)
    for expected in (
        "deepgemm: M=0 rows (its kernels take 1 to 2147483520)",
        "deepgemm: N=96 is not a positive multiple of 128",
    ):
        assert expected in problems, (expected, problems)
    assert not any("group_alignment" in p or "K=" in p for p in problems), problems
    problems = grouped.deepgemm_misfits((128, 32768), (4, 32768, 128), None, 128, fp8=True)
    assert "deepgemm: K=32768 is more than 16384 (FP8)" in problems, problems
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped.resolve_impl("cuBLAS", *shape, jnp.bfloat16)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"lhs must be \[M, K\] and rhs \[G, K, N\]"):
        grouped.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 4, 3)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(2,\)"):
        grouped.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 3, 3)), jnp.zeros(3, jnp.int32))


# ---------------------------------------------------------------- FP8 forward (block-scaled)


def fp8_operands(seed, m=256, k=256, n=128, groups=3):
    """lhs quantized 1 x 128 as dispatch(fp8=True) does, its dequantized value, bf16 weights."""
    lhs, rhs, ct = operands(seed, m, k, n, groups)
    lhs_q, scales = jax_ep.quantize_fp8(jnp.asarray(lhs, jnp.bfloat16), False)
    return (
        dequantize_fp8(lhs_q, scales).astype(jnp.bfloat16),
        lhs_q,
        scales,
        jnp.asarray(rhs / np.sqrt(k), jnp.bfloat16),
        jnp.asarray(ct, jnp.bfloat16),
    )


def test_fp8_weights_are_128_blocks_k_innermost():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((2, 256, 384)).astype(np.float32)
    w[1, 128:, :128] *= 1000  # one block far larger: its scale alone changes
    q, scales = quantize_weights_fp8(jnp.asarray(w))
    assert q.shape == (2, 384, 256) and q.dtype == jnp.float8_e4m3fn
    assert scales.shape == (2, 3, 2)
    blocks = np.abs(w).reshape(2, 2, 128, 3, 128).max(axis=(2, 4))  # [G, K/128, N/128]
    np.testing.assert_allclose(scales, blocks.transpose(0, 2, 1) / 448, rtol=1e-6)
    back = (
        np.asarray(q, np.float32).reshape(2, 3, 128, 2, 128)
        * np.asarray(scales)[:, :, None, :, None]
    ).reshape(2, 384, 256)
    error = (
        np.abs(back - w.transpose(0, 2, 1))
        / np.repeat(np.repeat(np.asarray(scales), 128, axis=1), 128, axis=2)
        / 448
    )
    assert error.max() <= 2.0**-4  # e4m3: 3 mantissa bits, half an ulp of the block's amax


@pytest.mark.parametrize("name", ["full", "padding_rows", "no_rows"])
def test_fp8_forward_is_the_dequantized_product(name):
    """The FP8 matmul's forward = the float32 grouped product of the dequantized operands (the
    block scales applied exactly), rows past the groups zero; within FP8's error of bf16's."""
    sizes = {"full": [64, 128, 64], "padding_rows": [64, 0, 128], "no_rows": [0, 0, 0]}[name]
    lhs, lhs_q, scales, rhs, _ = fp8_operands(7)
    out = grouped.fp8_grouped_matmul(
        lhs, lhs_q, scales, rhs, jnp.asarray(sizes, jnp.int32), impl="xla"
    )
    assert out.dtype == jnp.bfloat16
    rhs_q, rhs_scales = quantize_weights_fp8(rhs)
    weights = (
        np.asarray(rhs_q, np.float32).reshape(3, 1, 128, 2, 128)
        * np.asarray(rhs_scales)[:, :, None, :, None]
    ).reshape(3, 128, 256)
    want = loop_products(
        np.asarray(dequantize_fp8(lhs_q, scales)),
        weights.transpose(0, 2, 1),
        np.zeros((256, 128)),
        sizes,
    )[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)
    bf16 = grouped.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), impl="xla")
    if sum(sizes):
        assert relative_error(out, bf16) < 0.05  # e4m3 weights: ~2^-5 relative per element
    assert not np.asarray(out)[sum(sizes) :].any()


def test_fp8_gradients_are_the_bf16_ones():
    """The backward is grouped_matmul's from lhs and rhs; none reaches the FP8 values."""
    lhs, lhs_q, scales, rhs, ct = fp8_operands(8)
    sizes = jnp.asarray([128, 64, 0], jnp.int32)

    def objective(matmul):
        return lambda a, b: jnp.vdot(matmul(a, b).astype(jnp.float32), ct.astype(jnp.float32))

    fp8 = jax.grad(
        objective(lambda a, b: grouped.fp8_grouped_matmul(a, lhs_q, scales, b, sizes, impl="xla")),
        argnums=(0, 1),
    )(lhs, rhs)
    bf16 = jax.grad(
        objective(lambda a, b: grouped.grouped_matmul(a, b, sizes, impl="xla")), argnums=(0, 1)
    )(lhs, rhs)
    for g, w in zip(fp8, bf16):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    d_q, d_scales = jax.grad(
        lambda q, s: (
            grouped.fp8_grouped_matmul(lhs, q, s, rhs, sizes, impl="xla").astype(jnp.float32).sum()
        ),
        argnums=(0, 1),
    )(lhs_q, scales)
    assert not np.asarray(d_q, np.float32).any() and not np.asarray(d_scales).any()


def test_fp8_dgrad_second_order_is_the_straight_through_one():
    """A gradient of fp8_dgrad's gradient: its FP8 row gradient is differentiated as the product
    it stands for (ct @ rhs_g^T), so the mixed second derivative d/d rhs <d/d lhs, v> is
    tgmm(v, ct), exactly as without fp8_dgrad (it was silently zero)."""
    lhs, lhs_q, scales, rhs, ct = fp8_operands(11)
    sizes = jnp.asarray([128, 64, 0], jnp.int32)
    v = jax.random.normal(jax.random.key(12), lhs.shape, lhs.dtype)
    mixed = {}
    for dgrad in (False, True):

        def objective(a, b, dgrad=dgrad):
            y = grouped.fp8_grouped_matmul(a, lhs_q, scales, b, sizes, fp8_dgrad=dgrad, impl="xla")
            return jnp.vdot(y.astype(jnp.float32), ct.astype(jnp.float32))

        def along_v(a, b, objective=objective):
            d_lhs = jax.grad(objective)(a, b)
            return jnp.vdot(d_lhs.astype(jnp.float32), v.astype(jnp.float32))

        mixed[dgrad] = np.asarray(jax.jit(jax.grad(along_v, argnums=1))(lhs, rhs), np.float32)
    assert np.abs(mixed[False]).max() > 0
    np.testing.assert_array_equal(mixed[True], mixed[False])


@pytest.mark.parametrize("sizes", [[128, 64, 0], [0, 0, 0]])
def test_fp8_dgrad_is_the_fp8_product_of_the_cotangent(sizes):
    """fp8_dgrad: lhs's gradient = the float32 grouped product of the cotangent quantized 1 x 128
    and the forward's FP8 weights (their dequantized values, transposed), rows past the groups
    zero, within FP8's error of bf16's; rhs's gradient is still the bf16 one, exactly."""
    lhs, lhs_q, scales, rhs, ct = fp8_operands(10)
    sizes = jnp.asarray(sizes, jnp.int32)

    def grads(matmul):
        def objective(a, b):
            return jnp.vdot(matmul(a, b).astype(jnp.float32), ct.astype(jnp.float32))

        return jax.jit(jax.grad(objective, argnums=(0, 1)))(lhs, rhs)

    d_lhs, d_rhs = grads(
        lambda a, b: grouped.fp8_grouped_matmul(
            a, lhs_q, scales, b, sizes, fp8_dgrad=True, impl="xla"
        )
    )
    made_once = quantize_weights_fp8(rhs)
    made_once += transpose_weights_fp8(*made_once)
    for weights in (made_once, made_once[:2]):  # the transposes made once, or in the backward
        same = grads(
            lambda a, b, w=weights: grouped.fp8_grouped_matmul(
                a, lhs_q, scales, b, sizes, rhs_fp8=w, fp8_dgrad=True, impl="xla"
            )
        )
        for got, want in zip(same, (d_lhs, d_rhs)):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    bf16_lhs, bf16_rhs = grads(lambda a, b: grouped.grouped_matmul(a, b, sizes, impl="xla"))
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.asarray(bf16_rhs, np.float32))
    assert d_lhs.dtype == lhs.dtype
    ct_q, ct_scales = jax_ep.quantize_fp8(ct, False)
    rhs_q, rhs_scales = quantize_weights_fp8(rhs)  # [G, N, K]
    weights = (
        np.asarray(rhs_q, np.float32).reshape(3, 1, 128, 2, 128)
        * np.asarray(rhs_scales)[:, :, None, :, None]
    ).reshape(3, 128, 256)
    want = loop_products(
        np.zeros(lhs.shape),
        weights.transpose(0, 2, 1),
        np.asarray(dequantize_fp8(ct_q, ct_scales)),
        np.asarray(sizes),
    )[1]
    np.testing.assert_allclose(np.asarray(d_lhs, np.float32), want, rtol=1e-2, atol=1e-2)
    past = int(sizes.sum())
    assert not np.asarray(d_lhs, np.float32)[past:].any()
    if past:  # e4m3 cotangent and weights against bf16 ones
        assert 0 < relative_error(d_lhs, bf16_lhs) < 0.08


def test_fp8_which_implementation_and_errors():
    lhs, lhs_q, scales, rhs, _ = fp8_operands(9)
    sizes = jnp.asarray([128, 64, 64], jnp.int32)
    problems = grouped.fp8_misfits((200, 256), (3, 256, 96), 32)
    for expected in (
        "fp8: M=200 is not a positive multiple of 64",
        "fp8: N=96 is not a positive multiple of 128",
        "fp8: group_alignment=32 is not a positive multiple of 64",
    ):
        assert expected in problems, (expected, problems)
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="impl='mosaic' cannot run: the default device"):
            grouped.fp8_grouped_matmul(
                lhs, lhs_q, scales, rhs, sizes, impl="mosaic", group_alignment=64
            )
    with pytest.raises(ValueError, match=r"rhs_fp8 is \(q, scales\) or"):
        grouped.fp8_grouped_matmul(lhs, lhs_q, scales, rhs, sizes, rhs_fp8=(rhs,))
    wider = grouped.quantize_weights_fp8(jnp.concatenate([rhs, rhs], axis=2))  # another rhs's
    with pytest.raises(ValueError, match="rhs_fp8 must be quantize_weights_fp8"):
        grouped.fp8_grouped_matmul(lhs, lhs_q, scales, rhs, sizes, rhs_fp8=wider)
    both = grouped.quantize_weights_fp8(rhs)
    with pytest.raises(ValueError, match="rhs_fp8 must be quantize_weights_fp8"):
        grouped.fp8_grouped_matmul(lhs, lhs_q, scales, rhs, sizes, rhs_fp8=both + both)
    with pytest.raises(ValueError, match="lhs_q must be e4m3fn like lhs"):
        grouped.fp8_grouped_matmul(lhs, lhs, scales, rhs, sizes)
    with pytest.raises(ValueError, match="lhs_q must be e4m3fn like lhs"):
        grouped.fp8_grouped_matmul(lhs, lhs_q, scales[:, :1], rhs, sizes)
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="impl='cutlass' cannot run: the default device"):
            grouped.fp8_grouped_matmul(lhs, lhs_q, scales, rhs, sizes, impl="cutlass")
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped.fp8_grouped_matmul(lhs, lhs_q, scales, rhs, sizes, impl="cuBLAS")


def test_masked_matmul_is_the_product_of_the_rows_of_data():
    """The decode MLP's matmul over expert_padded rows: the valid rows are each group's product
    (rows past them are unspecified: here NaN, which must not reach a valid row)."""
    rng = np.random.default_rng(3)
    groups, capacity, k, n = 4, 32, 64, 48
    rows = np.array([5, 0, 32, 17], np.int32)
    lhs = rng.standard_normal((groups, capacity, k)).astype(np.float32)
    valid = np.arange(capacity)[None, :] < rows[:, None]
    lhs[~valid] = np.nan
    rhs = rng.standard_normal((groups, k, n)).astype(np.float32)
    got = np.asarray(grouped.masked_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(rows)))
    for g in range(groups):
        want = lhs[g, : rows[g]] @ rhs[g]
        np.testing.assert_allclose(got[g, : rows[g]], want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="lhs must be"):
        grouped.masked_matmul(jnp.asarray(lhs[0]), jnp.asarray(rhs), jnp.asarray(rows))
    with pytest.raises(ValueError, match="rows_per_group must have shape"):
        grouped.masked_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(rows[:2]))
    with pytest.raises(ValueError, match="only DeepGEMM's kernels for consecutive groups"):
        grouped.masked_matmul(jnp.asarray(lhs), jnp.asarray(rhs), rows, impl="deepgemm")
    if grouped._platform_misfits():
        with pytest.raises(ValueError, match="cannot run"):
            grouped.masked_matmul(jnp.asarray(lhs), jnp.asarray(rhs), rows, impl="mosaic")

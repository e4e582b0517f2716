"""jax_ep.nn.grouped_matmul's GPU kernels (Hopper: CUTLASS's, DeepGEMM's and the Mosaic ones)
against its XLA path computing in float32 on the same bfloat16 values: the forward and both
gradients, uniform, skewed, unaligned and empty groups, rows past sum(group_sizes) zero, both
Mosaic forward kernels (rows aligned to the block or not), group sizes past M, under shard_map,
jax.checkpoint and command buffers; DeepGEMM's kernels on groups they cannot all take (the
promise of 128-row groups broken); the masked forward over expert_padded rows; the FP8 forward
kernels against the XLA path on the same FP8 values, their bf16 backward, and the FP8 MoE layer
on them. Skipped where JAX sees no GPU."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_fp8_quantize_calls, make_mesh, relative_error
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.fp8 import dequantize_fp8
from jax_ep.nn import cutlass, grouped

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-2  # bfloat16 outputs of float32 sums: ~2^-9 relative per element

SIZES = {  # 8 groups of at most 1024 rows
    "uniform": [128] * 8,
    "skewed": [512, 256, 0, 128, 0, 0, 128, 0],
    "empty_first_and_padding_rows": [0, 256, 128, 0, 0, 0, 384, 0],
    "unaligned": [100, 3, 0, 421, 77, 0, 150, 50],
    "no_rows": [0] * 8,
}


def operands(m, k, n, groups, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (m, k), jnp.bfloat16),
        (jax.random.normal(keys[1], (groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16),
        jax.random.normal(keys[2], (m, n), jnp.bfloat16),
    )


def forward_and_gradients(lhs, rhs, ct, sizes, **kwargs):
    def objective(lhs, rhs):
        out = grouped.grouped_matmul(lhs, rhs, sizes, **kwargs)
        return jnp.vdot(out.astype(jnp.float32), ct.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return (out,) + grads


KERNELS = ["mosaic", "cutlass"]  # the masked forward's
ALIGNED_KERNELS = KERNELS + ["deepgemm"]  # 128-row groups


def group_alignment(impl):
    """The alignment the tests promise: 128 rows for the kernels that need it."""
    return 1 if impl == "cutlass" else 128


def assert_like_xla(lhs, rhs, ct, sizes, impl="mosaic", **kwargs):
    got = forward_and_gradients(lhs, rhs, ct, sizes, impl=impl, **kwargs)
    f32 = [a.astype(jnp.float32) for a in (lhs, rhs, ct)]
    want = forward_and_gradients(*f32, sizes, impl="xla")
    for what, g, w in zip(("forward", "d lhs", "d rhs"), got, want):
        assert g.dtype == jnp.bfloat16, what
        if np.any(np.asarray(w)):
            assert relative_error(g, w) < TOLERANCE, (what, relative_error(g, w))
        else:
            assert not np.any(np.asarray(g)), what
    past = int(np.sum(sizes))
    assert not np.asarray(got[0])[past:].any() and not np.asarray(got[1])[past:].any()


def test_auto_takes_the_kernels_here():
    assert jax_ep._native.has_grouped_gemm, "the GPU tests need a build with CUTLASS's kernels"
    assert jax_ep._native.has_deep_gemm, "the GPU tests need a build with DeepGEMM's kernels"
    assert grouped.resolve_impl("auto", (1024, 256), (8, 256, 384), jnp.bfloat16) == "cutlass"
    aligned = ((1024, 256), (8, 256, 384), jnp.bfloat16)
    assert grouped.resolve_impl("auto", *aligned, group_alignment=128) == "deepgemm"
    assert grouped.resolve_impl("deepgemm", *aligned, group_alignment=128) == "deepgemm"
    with pytest.raises(ValueError, match="not a multiple of 128 rows"):
        grouped.resolve_impl("deepgemm", (1024, 256), (8, 256, 384), jnp.bfloat16)
    assert grouped.resolve_impl("auto", (1024, 256), (8, 256, 384), jnp.float16) == "mosaic"
    assert grouped.resolve_impl("auto", (1024, 256), (8, 256, 384), jnp.float32) == "xla"


@pytest.mark.parametrize(
    "name,impl,group_alignment",
    [  # 128: the aligned Mosaic forward kernels; CUTLASS's take any groups
        (name, "mosaic", alignment)
        for name in sorted(SIZES)
        for alignment in (1, 128)
        if not np.any(np.asarray(SIZES[name]) % alignment)
    ]
    + [(name, "cutlass", 1) for name in sorted(SIZES)]
    + [
        (name, "deepgemm", 128)
        for name in sorted(SIZES)
        if not np.any(np.asarray(SIZES[name]) % 128)
    ],
)
def test_matches_xla(name, impl, group_alignment):
    sizes = np.asarray(SIZES[name], np.int32)
    lhs, rhs, ct = operands(1024, 256, 384, len(sizes))
    assert_like_xla(lhs, rhs, ct, jnp.asarray(sizes), impl=impl, group_alignment=group_alignment)


def test_cutlass_clamps_groups_past_m():
    """Group sizes that add up past M (or are negative) never reach past lhs: each group keeps
    the rows left, as the XLA path on the clamped sizes computes."""
    asked = np.asarray([300, -5, 500, 400, 100, 0, 0, 50], np.int32)  # 1350 rows of 1024
    clamped = np.asarray([300, 0, 500, 224, 0, 0, 0, 0], np.int32)
    lhs, rhs, ct = operands(1024, 256, 384, len(asked), seed=4)
    got = forward_and_gradients(lhs, rhs, ct, jnp.asarray(asked), impl="cutlass")
    want = forward_and_gradients(lhs, rhs, ct, jnp.asarray(clamped), impl="cutlass")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert_like_xla(lhs, rhs, ct, jnp.asarray(clamped), impl="cutlass")


DEEP_GEMM_SIZES = dict(
    SIZES,
    past_m=[300, -5, 512, 400, 100, 0, 0, 50],
    aligned_then_not=[256, 128, 100, 28, 0, 384, 0, 0],
    last_one_ragged=[128, 256, 0, 77, 0, 0, 0, 0],
    ragged_then_aligned=[0, 0, 0, 0, 0, 0, 3, 1000],
)


def clamped_sizes(asked, m):
    """The sizes the kernels compute: each group the rows left of M."""
    asked = np.maximum(np.asarray(asked, np.int64), 0)
    offsets = np.minimum(np.concatenate([[0], np.cumsum(asked)[:-1]]), m)
    return np.minimum(asked, m - offsets).astype(np.int32)


@pytest.mark.parametrize("m", [1024, 1000, 4096])  # 4096: most rows past the groups
@pytest.mark.parametrize("name", sorted(DEEP_GEMM_SIZES))
def test_deep_gemm_computes_the_groups_it_takes_and_cutlass_the_others(name, m):
    """With deep_gemm the calls take any group sizes (the promise of 128-row groups broken
    too): DeepGEMM's kernel computes the groups on 128-row boundaries, CUTLASS's the others
    (gmm, gmm_t and the FP8 gmm; tgmm: DeepGEMM's every group or none), as the XLA path on the
    clamped sizes; rows past the groups and empty groups' weight gradients are zero even where
    the operands hold NaN past the groups."""
    asked = jnp.asarray(DEEP_GEMM_SIZES[name], jnp.int32)
    sizes = clamped_sizes(asked, m)
    past = int(sizes.sum())
    lhs, rhs, ct = operands(m, 256, 384, len(sizes), seed=5)
    lhs = lhs.at[past:].set(jnp.nan)
    ct = ct.at[past:].set(jnp.nan)
    for kind, a, b in (("gmm", lhs, rhs), ("gmm_t", ct, rhs)):
        got = jax.jit(functools.partial(cutlass.product, kind, deep_gemm=True))(a, b, asked)
        dims = grouped._XLA_DIMENSIONS[kind]
        want = jax.lax.ragged_dot_general(
            jnp.nan_to_num(a).astype(jnp.float32),
            b.astype(jnp.float32),
            jnp.asarray(sizes),
            jax.lax.RaggedDotDimensionNumbers(*dims),
        )
        assert not np.asarray(got)[past:].any(), kind
        if past:
            assert relative_error(got[:past], want[:past]) < TOLERANCE, kind
    # tgmm: DeepGEMM's where every group has a multiple of 128 rows, else CUTLASS's
    got = jax.jit(functools.partial(cutlass.product, "tgmm", deep_gemm=True))(lhs, ct, asked)
    want = jax.lax.ragged_dot_general(
        jnp.nan_to_num(lhs).astype(jnp.float32),
        jnp.nan_to_num(ct).astype(jnp.float32),
        jnp.asarray(sizes),
        jax.lax.RaggedDotDimensionNumbers(*grouped._XLA_DIMENSIONS["tgmm"]),
    )
    assert not np.asarray(got)[sizes == 0].any()
    if past:
        assert relative_error(got, want) < TOLERANCE
    _, lhs_q, scales, _, _ = fp8_inputs(m, 256, 384, len(sizes))
    assert_fp8_deep_gemm_like_cutlass(lhs_q, scales, rhs, asked, past)


def assert_fp8_deep_gemm_like_cutlass(lhs_q, scales, rhs, asked, past):
    """The FP8 product with deep_gemm (DeepGEMM's kernel for the groups it takes, CUTLASS's for
    the others) as CUTLASS's kernel alone computes it, the rows past the groups zero."""
    rhs_q, rhs_scales = jax.jit(grouped.quantize_weights_fp8)(rhs)
    fp8 = jax.jit(cutlass.gmm_fp8, static_argnames=("out_dtype", "deep_gemm"))
    got, cutlass_only = (
        fp8(lhs_q, scales, rhs_q, rhs_scales, asked, jnp.bfloat16, deep_gemm=deep)
        for deep in (True, False)
    )
    assert not np.asarray(got)[past:].any()
    if past:
        assert relative_error(got, cutlass_only) < TOLERANCE


@pytest.mark.parametrize("m", [1024, 4096])
@pytest.mark.parametrize("name", ["past_m", "aligned_then_not", "ragged_then_aligned", "skewed"])
def test_deep_gemm_fp8_v3_down_projection_takes_any_groups(name, m):
    """V3's FP8 down projection (K 2048, N 7168) runs on clusters of two CTAs that share each
    weight tile's loads, which DeepGEMM's scheduler must turn off where the cluster's two row
    tiles fall in different groups (groups of one tile, of three, ragged, empty): the groups'
    rows as CUTLASS's kernel alone computes them, the rows past them zero."""
    asked = jnp.asarray(DEEP_GEMM_SIZES[name], jnp.int32)
    past = int(clamped_sizes(asked, m).sum())
    _, lhs_q, scales, rhs, _ = fp8_inputs(m, 2048, 7168, len(asked))
    assert_fp8_deep_gemm_like_cutlass(lhs_q, scales, rhs, asked, past)


@pytest.mark.parametrize("name", ["uniform", "skewed", "unaligned"])
def test_deep_gemm_weight_gradient_over_several_k_tiles_and_a_partial_n_tile(name):
    """tgmm with K = 768 (three of DeepGEMM's 256-row output tiles per group) and N = 320 (a last
    tile of 64 columns): DeepGEMM's where every group has a multiple of 128 rows, else CUTLASS's,
    as the XLA path computes; an empty group's gradient is zero."""
    sizes = np.asarray(SIZES[name], np.int32)
    lhs, _, ct = operands(1024, 768, 320, len(sizes), seed=7)
    got = jax.jit(functools.partial(cutlass.product, "tgmm", deep_gemm=True))(
        lhs, ct, jnp.asarray(sizes)
    )
    want = jax.lax.ragged_dot_general(
        lhs.astype(jnp.float32),
        ct.astype(jnp.float32),
        jnp.asarray(sizes),
        jax.lax.RaggedDotDimensionNumbers(*grouped._XLA_DIMENSIONS["tgmm"]),
    )
    assert got.shape == (len(sizes), 768, 320)
    assert not np.asarray(got)[sizes == 0].any()
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize(
    "rows", [[5, 0, 256, 130, 1, 0, 0, 64], [0] * 8, [256] * 8], ids=["mixed", "none", "full"]
)
@pytest.mark.parametrize("impl", KERNELS)
def test_masked_matmul_kernel_matches_xla(rows, impl):
    """The decode MLP's kernel over expert_padded rows: each group's rows of data against the
    float32 einsum; the other rows hold NaN, which must not reach a row of data."""
    rows = np.asarray(rows, np.int32)
    groups, capacity, k, n = len(rows), 256, 512, 384
    lhs, rhs, _ = operands(groups * capacity, k, n, groups, seed=2)
    valid = jnp.asarray(np.arange(capacity)[None, :, None] < rows[:, None, None])
    lhs = jnp.where(valid, lhs.reshape(groups, capacity, k), jnp.nan).astype(jnp.bfloat16)
    masked = jax.jit(grouped.masked_matmul, static_argnames="impl")
    got = np.asarray(masked(lhs, rhs, jnp.asarray(rows), impl=impl), np.float32)
    want = np.asarray(
        masked(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.asarray(rows), impl="xla")
    )
    for g in range(groups):
        if rows[g]:
            assert relative_error(got[g, : rows[g]], want[g, : rows[g]]) < TOLERANCE, g


def zipf_sizes(rows, groups, alignment):
    weights = 1 / np.arange(1, groups + 1)
    sizes = np.floor(weights / weights.sum() * rows / alignment).astype(np.int32) * alignment
    sizes[0] += rows - sizes.sum()
    return sizes


@pytest.mark.parametrize("impl", ALIGNED_KERNELS)
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])
def test_v3_expert_shapes(k, n, impl):
    """32 experts of DeepSeek-V3's shapes, 4096 rows, skewed (Zipf); aligned to 128 for the
    Mosaic and DeepGEMM kernels, not for CUTLASS's."""
    alignment = group_alignment(impl)
    lhs, rhs, ct = operands(4096, k, n, 32, seed=1)
    sizes = zipf_sizes(4096, 32, alignment)
    assert_like_xla(lhs, rhs, ct, jnp.asarray(sizes), impl=impl, group_alignment=alignment)


@pytest.mark.parametrize("impl", ALIGNED_KERNELS)
@pytest.mark.parametrize("remat", [False, True])
def test_under_shard_map(remat, impl):
    """On a mesh of this machine's GPUs, each its own rows and experts, under check_vma."""
    mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
    ranks, groups, rows = mesh.size, 4, 512
    lhs, rhs, ct = operands(ranks * rows, 256, 256, ranks * groups, seed=2)
    sizes = jnp.asarray(np.tile([128, 0, 256, 0], ranks), jnp.int32)

    def layer(impl):
        def per_rank(lhs, rhs, sizes):
            return jax.nn.silu(
                grouped.grouped_matmul(lhs, rhs, sizes, impl=impl, group_alignment=128)
            )

        f = jax.shard_map(
            jax.checkpoint(per_rank) if remat else per_rank,
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
        return jax.jit(
            jax.grad(
                lambda a, b: jnp.vdot(f(a, b, sizes).astype(jnp.float32), ct.astype(jnp.float32)),
                argnums=(0, 1),
            )
        )

    got = layer(impl)(lhs, rhs)
    want = layer("xla")(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOLERANCE


@pytest.mark.parametrize("impl", ALIGNED_KERNELS)
def test_under_command_buffers(impl):
    """A jitted loop of forward and backward passes under XLA command buffers (CUDA graphs):
    the Mosaic kernels inside them, CUTLASS's and DeepGEMM's calls between them (their scratch
    is per call)."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from jax_ep.nn import grouped
        keys = jax.random.split(jax.random.key(0), 2)
        lhs = jax.random.normal(keys[0], (1024, 256), jnp.bfloat16)
        rhs = (jax.random.normal(keys[1], (8, 256, 256)) / 16).astype(jnp.bfloat16)
        sizes = jnp.asarray([256, 0, 128, 128, 0, 256, 0, 128], jnp.int32)

        def steps(impl):
            def step(i, carry):
                lhs, rhs = carry
                f = lambda a, b: jnp.sum(grouped.grouped_matmul(a, b, sizes, impl=impl,
                                                                group_alignment=128) ** 2)
                da, db = jax.grad(f, argnums=(0, 1))(lhs, rhs)
                return lhs - 1e-3 * da.astype(lhs.dtype), rhs - 1e-3 * db.astype(rhs.dtype)
            return jax.jit(lambda a, b: jax.lax.fori_loop(0, 3, step, (a, b)))

        got = steps(IMPL)(lhs, rhs)
        got_again = steps(IMPL)(lhs, rhs)
        want = steps("xla")(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        for g, a, w in zip(got, got_again, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(a, np.float32))
            err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(w, np.float64))
            assert err / np.linalg.norm(np.asarray(w, np.float64)) < 1e-2, err
        print("OK")
    """
    env = dict(
        os.environ,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
        "--xla_gpu_graph_min_graph_size=1",
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code).replace("IMPL", repr(impl))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert "OK" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------- the FP8 forward


FP8_CASES = [  # group sizes and kernels (unaligned groups: CUTLASS's alone)
    (name, impl)
    for name in ["uniform", "skewed", "empty_first_and_padding_rows", "no_rows", "unaligned"]
    for impl in ALIGNED_KERNELS
    if impl == "cutlass" or name != "unaligned"
]


def fp8_inputs(m, k, n, groups, seed=3):
    lhs, rhs, ct = operands(m, k, n, groups, seed)
    lhs_q, scales = jax.jit(lambda a: jax_ep.quantize_fp8(a, False))(lhs)
    return dequantize_fp8(lhs_q, scales).astype(jnp.bfloat16), lhs_q, scales, rhs, ct


def fp8_forward_and_gradients(
    lhs, lhs_q, scales, rhs, ct, sizes, impl, alignment=128, fp8_dgrad=False
):
    def objective(lhs, rhs):
        out = grouped.fp8_grouped_matmul(
            lhs,
            lhs_q,
            scales,
            rhs,
            sizes,
            fp8_dgrad=fp8_dgrad,
            impl=impl,
            group_alignment=alignment,
        )
        return jnp.vdot(out.astype(jnp.float32), ct.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(lhs, rhs)
    return (out,) + grads


def assert_fp8_like_xla(m, k, n, sizes, impl):
    alignment = group_alignment(impl)
    lhs, lhs_q, scales, rhs, ct = fp8_inputs(m, k, n, len(sizes))
    sizes = jnp.asarray(sizes, jnp.int32)
    auto = grouped.resolve_fp8_impl("auto", (m, k), (len(sizes), k, n), alignment)
    assert auto == ("cutlass" if alignment == 1 else "deepgemm")
    got = fp8_forward_and_gradients(lhs, lhs_q, scales, rhs, ct, sizes, impl, alignment)
    want = fp8_forward_and_gradients(lhs, lhs_q, scales, rhs, ct, sizes, "xla", alignment)
    backward = impl if impl in ("cutlass", "deepgemm") else auto  # the FP8 call's backward
    bf16 = forward_and_gradients(lhs, rhs, ct, sizes, impl=backward, group_alignment=alignment)
    past = int(np.sum(sizes))
    assert got[0].dtype == jnp.bfloat16 and not np.asarray(got[0])[past:].any()
    if past:  # the same FP8 values: equal up to float32 summation order and bf16 rounding
        assert relative_error(got[0], want[0]) < TOLERANCE, relative_error(got[0], want[0])
        assert relative_error(got[0], bf16[0]) < 0.08  # e4m3 operands against bf16 ones
    for g, b in zip(got[1:], bf16[1:]):  # the backward is the bf16 kernels'
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("name,impl", FP8_CASES)
def test_fp8_matches_xla(name, impl):
    assert_fp8_like_xla(1024, 256, 384, SIZES[name], impl)


@pytest.mark.parametrize("impl", ALIGNED_KERNELS)
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])
def test_fp8_v3_expert_shapes(k, n, impl):
    assert_fp8_like_xla(4096, k, n, zipf_sizes(4096, 32, group_alignment(impl)), impl)


def assert_fp8_dgrad_like_xla(m, k, n, sizes, impl):
    """fp8_dgrad on the kernels: lhs's gradient as the XLA path's FP8 product of the same
    quantized cotangent and weights, within FP8's error of bf16's; rhs's the bf16 kernel's."""
    alignment = group_alignment(impl)
    lhs, lhs_q, scales, rhs, ct = fp8_inputs(m, k, n, len(sizes))
    sizes = jnp.asarray(sizes, jnp.int32)
    run = functools.partial(fp8_forward_and_gradients, lhs, lhs_q, scales, rhs, ct, sizes)
    got = run(impl, alignment, fp8_dgrad=True)
    want = run("xla", alignment, fp8_dgrad=True)
    bf16 = forward_and_gradients(lhs, rhs, ct, sizes, group_alignment=alignment)
    past = int(np.sum(sizes))
    assert got[1].dtype == lhs.dtype and not np.asarray(got[1])[past:].any()
    if past:
        assert relative_error(got[1], want[1]) < TOLERANCE, relative_error(got[1], want[1])
        assert relative_error(got[1], bf16[1]) < 0.08
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(bf16[2], np.float32))


@pytest.mark.parametrize("name,impl", FP8_CASES)
def test_fp8_dgrad_matches_xla(name, impl):
    assert_fp8_dgrad_like_xla(1024, 256, 384, SIZES[name], impl)


@pytest.mark.parametrize("impl", ["cutlass", "deepgemm"])
@pytest.mark.parametrize("k,n", [(7168, 2048), (2048, 7168)])
def test_fp8_dgrad_v3_expert_shapes(k, n, impl):
    assert_fp8_dgrad_like_xla(4096, k, n, zipf_sizes(4096, 32, group_alignment(impl)), impl)


@pytest.mark.parametrize(
    "rows_shape,weights_shape",
    [((4096, 7168), (4, 7168, 2048)), ((33, 384), (3, 256, 384))],  # V3's; partial warp steps
)
def test_fp8_quantize_kernels_are_the_fp8_rule(rows_shape, weights_shape):
    check_fp8_quantize_calls(rows_shape, weights_shape)


def test_fp8_layer_on_the_kernels():
    """jax_ep.nn's FP8 layer (dispatch's FP8 rows into the FP8 gate/up kernels) under jit and
    gradients on this machine's GPUs: as its XLA path, and within FP8's error of bf16 rows."""
    from jax_ep import nn

    mesh = make_mesh(len(jax.devices("gpu")), devices=jax.devices("gpu"))
    tokens, hidden = 256, 256
    x = jax.random.normal(jax.random.key(1), (mesh.size * tokens, hidden), jnp.bfloat16)
    results = {}
    for name, fp8, matmul in (
        ("fp8", True, "deepgemm"),
        ("fp8_xla", True, "xla"),
        ("bf16", False, "auto"),
    ):
        cfg = nn.MoEConfig(
            num_experts=8 * mesh.size,
            num_topk=4,
            hidden=hidden,
            ffn_hidden=256,
            expert_alignment=128,
            fp8=fp8,
            fp8_experts=fp8,
            grouped_matmul=matmul,
        )
        layer = nn.MoELayer(cfg, mesh, expert_axis="ep", tokens_per_rank=tokens)
        if name == "fp8":
            assert layer.grouped_matmul_path() == {"gate_up": "deepgemm_fp8", "down": "deepgemm"}
        params = nn.init_params(jax.random.key(0), cfg, jnp.bfloat16, mesh=mesh, expert_axis="ep")
        results[name] = jax.jit(
            jax.value_and_grad(
                lambda p, x: (jnp.sum(layer(p, x)[0].astype(jnp.float32) ** 2), layer(p, x)[0]),
                argnums=(0, 1),
                has_aux=True,
            )
        )(params, x)
    (_, y), (dp, dx) = results["fp8"]
    (_, y_xla), (dp_xla, dx_xla) = results["fp8_xla"]
    (_, y_bf16), _ = results["bf16"]
    assert relative_error(y, y_xla) < TOLERANCE
    assert relative_error(dx, dx_xla) < 2 * TOLERANCE
    assert relative_error(dp["w_gate"], dp_xla["w_gate"]) < 2 * TOLERANCE
    assert relative_error(y, y_bf16) < 0.08

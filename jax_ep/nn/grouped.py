"""Grouped matmuls of the MoE experts: consecutive row groups of `lhs`, group g times rhs[g].

    y = grouped_matmul(lhs, rhs, group_sizes)   # lhs [M, K], rhs [G, K, N], group_sizes [G]

Rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])) of y are lhs's rows times rhs[g]; rows past
sum(group_sizes) are zero (their gradients too), as with jax.lax.ragged_dot. Group sizes live on
the device (no host sync); it works under jit, shard_map, jax.checkpoint and gradients of any
order.

Three products make the matmul and its gradients, each the adjoint of the others:

  gmm    out[i] = lhs[i] @ rhs[g(i)]          [M, K] x [G, K, N] -> [M, N]   (forward)
  gmm_t  out[i] = lhs[i] @ rhs[g(i)]^T        [M, N] x [G, K, N] -> [M, K]   (d lhs)
  tgmm   out[g] = sum_i lhs[i]^T rhs[i]       [M, K] x [M, N]    -> [G, K, N] (d rhs)

Four implementations: "xla" (jax.lax.ragged_dot_general: the reference, and the path on CPU;
XLA:GPU expands it to dense work), "cutlass" (CUTLASS's Hopper grouped GEMMs as custom calls,
nn/cutlass.py: groups of any size, bfloat16), "deepgemm" (the same calls with DeepGEMM's kernels
computing gmm and gmm_t for the groups that start and end on 128-row boundaries, tgmm where every
group has a multiple of 128 rows, CUTLASS's the others: at EP8's V3 shapes 0-13% faster in bf16,
the FP8 forward 8-26%; it needs group_alignment a multiple of 128, so that the groups it cannot
take are the exception) and "mosaic" (Pallas Mosaic GPU kernels for Hopper). impl="auto" takes
the first of AUTO_ORDER that can run here on these operands (`deepgemm_misfits`,
`cutlass_misfits`, `mosaic_misfits`), "xla" otherwise. The Mosaic kernels:

- gmm, gmm_t with group_alignment a multiple of block_m (every group size a multiple of it, as
  a dispatch with that expert_alignment gives): `mosaic.aligned_gmm`, one output tile per row
  block and column block of the rows in groups, each row block in one group;
- otherwise jax's jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, whose grid also holds
  G - 1 tiles for blocks split between groups and the blocks of rows past sum(group_sizes)
  (computed, not stored: at 128 rows per group half its tiles);
- tgmm with group_alignment a multiple of block_k: `mosaic.aligned_tgmm`, each output tile a
  pipeline over its group's row blocks (none straddles two groups), two programs per SM so
  that one's loads overlap the other's products (a tile of a 128-row group is two steps);
  otherwise jax's transposed_ragged_dot_mgpu (each group's row blocks only, the first and
  last masked).

Each program of jax_ep's kernels stores a finished tile through shared memory with a bulk copy
it does not wait for: the copy overlaps the next tile, and the buffer is reused once it is read.

The Mosaic weight gradient multiplies the rows of a group's last block past its end by zero, so
rows past sum(group_sizes) must be finite (a dispatch's padding rows are zeros).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.fp8 import (
    FP8_BLOCK,
    dequantize_fp8,
    quantize_fp8,
    quantize_weights_fp8,
    transpose_weights_fp8,
)
from jax_ep.memory import limits
from jax_ep.nn.grouped_impls import IMPLS
from jax_ep.rank_ops import all_varying, varying_like


class _OnFirstUse:
    """A module imported when one of its names is first read: the GPU kernels' bindings (the
    compiled extension, CUTLASS's and DeepGEMM's calls, Pallas Mosaic GPU, which imports absl)
    load when a GPU program first needs them, never at `import jax_ep.nn`."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


_native = _OnFirstUse("jax_ep._native")
ffi_path = _OnFirstUse("jax_ep.ffi_path")
cutlass = _OnFirstUse("jax_ep.nn.cutlass")
mosaic = _OnFirstUse("jax_ep.nn.mosaic")

# What impl="auto" tries, fastest first (H200 and H100 at EP8's V3 shapes: docs/PERFORMANCE.md).
AUTO_ORDER = ("deepgemm", "cutlass", "mosaic")
PRODUCTS = ("gmm", "gmm_t", "tgmm")
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Blocks(NamedTuple):
    """Tiling of one Mosaic GPU kernel: output tiles of block_m x block_n, block_k deep, with
    max_concurrent_steps loads in flight; grid_block_n output tiles side by side per SM sweep;
    programs_per_sm programs share each SM (jax_ep's kernels only), so that one's loads overlap
    another's products where a tile's pipeline is a few steps long."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int
    programs_per_sm: int = 1

    def jax_kernel_args(self):
        """The keyword arguments of jax's ragged_dot_mgpu kernels (one program per SM)."""
        return {name: value for name, value in self._asdict().items() if name != "programs_per_sm"}


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """The kernels' block sizes, per product: the best of bench/grouped_matmul.py's sweep on an
    H200 at DeepSeek-V3's expert shapes (each record of that benchmark holds its sweep's result as
    "best_blocks")."""

    gmm: Blocks = Blocks(128, 128, 128, 3, 8)
    gmm_t: Blocks = Blocks(128, 128, 128, 3, 8)
    tgmm: Blocks = Blocks(128, 128, 64, 2, 8, 2)


MOSAIC_BLOCKS = MosaicBlocks()


def grouped_matmul(lhs, rhs, group_sizes, *, impl="auto", group_alignment=1, blocks=MOSAIC_BLOCKS):
    """lhs [M, K] rows in groups of group_sizes [G] (int32, sum <= M), rhs [G, K, N] -> [M, N]
    in lhs.dtype (rhs is cast to it). impl: "auto", "xla", "cutlass", "deepgemm" or "mosaic"
    (ValueError when the kernels cannot run here or these shapes do not fit them).
    group_alignment: a number every group size is a multiple of (the caller's promise: wrong
    results otherwise from "mosaic"; "deepgemm" checks it on the device, and computes a group
    that breaks it with CUTLASS's kernel, after its own), e.g. the expert_alignment of the
    dispatch that made the rows."""
    _check_operands("grouped_matmul", ("M", "K"), lhs, rhs, "group_sizes", group_sizes)
    return product(
        "gmm", lhs, rhs, group_sizes, impl=impl, group_alignment=group_alignment, blocks=blocks
    )


def masked_matmul(lhs, rhs, rows_per_group, *, impl="auto", blocks=MOSAIC_BLOCKS):
    """The decode MLP's matmul over the expert_padded layout: lhs [G, C, K] @ rhs[g] ([G, K, N])
    -> [G, C, N] in lhs.dtype, where only group g's first rows_per_group[g] rows hold data
    (a dispatch's x and tokens_per_expert). Rows past them in the result are unspecified.
    "xla": the batched einsum (every row); "cutlass": group g's first rows_per_group[g] rows
    only (clamped to C); "mosaic": the row blocks holding data only (mosaic.masked_gmm, gmm's
    blocks; C a multiple of block_m). Forward only."""
    _check_operands("masked_matmul", ("G", "C", "K"), lhs, rhs, "rows_per_group", rows_per_group)
    if impl == "deepgemm":
        raise ValueError(
            "jax_ep.nn.masked_matmul: impl='deepgemm' cannot run: jax_ep builds only DeepGEMM's "
            "kernels for consecutive groups (use 'cutlass', or 'auto')"
        )
    groups, capacity, k = lhs.shape
    # Each group's rows start a row block: C is "M" of the forward's blocks.
    chosen = resolve_impl(impl, (capacity, k), rhs.shape, lhs.dtype, blocks)
    rhs, rows_per_group = rhs.astype(lhs.dtype), rows_per_group.astype(jnp.int32)
    if chosen == "xla":
        return jnp.einsum("gck,gkn->gcn", lhs, rhs, preferred_element_type=jnp.float32).astype(
            lhs.dtype
        )
    if chosen == "cutlass":
        rows = lhs.reshape(groups * capacity, k)
        out = cutlass.product("gmm", rows, rhs, rows_per_group, group_stride=capacity)
        return varying_like(out, lhs, rhs, rows_per_group).reshape(groups, capacity, -1)
    return mosaic.masked_gmm(lhs, rhs, rows_per_group, blocks.gmm)


def _check_operands(name, lhs_dims, lhs, rhs, sizes_name, sizes):
    """lhs of dimensions lhs_dims (K last; a leading G is rhs's), rhs [G, K, N], sizes [G]."""
    batched = lhs_dims[0] == "G"
    if (
        lhs.ndim != len(lhs_dims)
        or rhs.ndim != 3
        or rhs.shape[1] != lhs.shape[-1]
        or (batched and rhs.shape[0] != lhs.shape[0])
    ):
        raise ValueError(
            f"jax_ep.nn.{name}: lhs must be [{', '.join(lhs_dims)}] and rhs [G, K, N], got "
            f"{lhs.shape} and {rhs.shape}"
        )
    if sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"jax_ep.nn.{name}: {sizes_name} must have shape ({rhs.shape[0]},), got {sizes.shape}"
        )


def product(kind, a, b, group_sizes, *, impl="auto", group_alignment=1, blocks=MOSAIC_BLOCKS):
    """One of the three products alone ("gmm", "gmm_t" or "tgmm", shapes as in the module
    docstring), differentiable like grouped_matmul: for benchmarks and custom layers."""
    if kind not in PRODUCTS:
        raise ValueError(f"jax_ep.nn.grouped: kind must be one of {PRODUCTS}, got {kind!r}")
    (m, first), second = a.shape, b.shape
    lhs_shape, rhs_shape = {
        "gmm": ((m, first), second),
        "gmm_t": ((m, second[1]), second),
        "tgmm": ((m, first), (group_sizes.shape[0], first, second[1])),
    }[kind]
    impl = resolve_impl(impl, lhs_shape, rhs_shape, a.dtype, blocks, group_alignment)
    # The backward's cotangents vary over the axes of all three operands: so must the operands.
    a, b, group_sizes = all_varying(a, b.astype(a.dtype), group_sizes.astype(jnp.int32))
    return _product(kind, _Plan(impl, group_alignment, blocks), a, b, group_sizes)


class _Plan(NamedTuple):
    """How the products run (static): implementation, promised alignment, block sizes."""

    impl: str
    group_alignment: int
    blocks: MosaicBlocks


def resolve_impl(impl, lhs_shape, rhs_shape, dtype, blocks=MOSAIC_BLOCKS, group_alignment=1):
    """The implementation grouped_matmul takes for these operands: "xla", "cutlass",
    "deepgemm" or "mosaic" (for "auto", the first of AUTO_ORDER that can run)."""
    return _resolve(
        "grouped_matmul",
        impl,
        {
            "deepgemm": lambda: deepgemm_misfits(lhs_shape, rhs_shape, dtype, group_alignment),
            "cutlass": lambda: cutlass_misfits(lhs_shape, rhs_shape, dtype),
            "mosaic": lambda: mosaic_misfits(lhs_shape, rhs_shape, dtype, blocks),
        },
    )


def _resolve(name, impl, misfits):
    """impl itself when it can run ("xla" always can), else a ValueError saying why; for
    "auto" the first of AUTO_ORDER that can, else "xla". misfits: impl -> () -> its problems."""
    if impl not in IMPLS:
        raise ValueError(f"jax_ep.nn.{name}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return impl
    if impl != "auto":
        problems = misfits[impl]()
        if problems:
            raise ValueError(f"jax_ep.nn.{name}: impl={impl!r} cannot run: " + "; ".join(problems))
        return impl
    if _platform_misfits():  # no GPU kernel runs here: nothing of theirs is loaded
        return "xla"
    return next((each for each in AUTO_ORDER if not misfits[each]()), "xla")


def cutlass_misfits(lhs_shape, rhs_shape, dtype, fp8=False):
    """Why the CUTLASS kernels cannot compute this grouped matmul and both its gradients (or
    with fp8, its FP8 forward) (empty when they can): K and N multiples of 8 (FP8: 128), any
    group sizes."""
    problems = list(_platform_misfits())
    if not cutlass.built():
        problems.append("this jax_ep was built without CUTLASS's grouped matmuls")
    if not fp8 and jnp.dtype(dtype) not in cutlass.DTYPES:
        problems.append(f"dtype {jnp.dtype(dtype).name} (needs bfloat16)")
    (_, k), (groups, _, n) = lhs_shape, rhs_shape
    return problems + cutlass.shape_misfits(k, n, groups, fp8)


def deepgemm_misfits(lhs_shape, rhs_shape, dtype, group_alignment, fp8=False):
    """Why DeepGEMM's kernels (with CUTLASS's for the groups they cannot take) cannot
    compute this grouped matmul and both its gradients (or with fp8, its FP8 forward) (empty
    when they can): CUTLASS's conditions, a build with DeepGEMM's headers, a GPU of the SMs its
    kernels were built for, K and N multiples of its alignment (FP8: 128, K at most its limit),
    1 to 2^31 - 1 rows (the limits from kernels/limits.h), and group_alignment a multiple of its
    128-row tiles (the handlers check all but the last again)."""
    problems = cutlass_misfits(lhs_shape, rhs_shape, dtype, fp8)
    if not cutlass.deep_gemm_built():
        problems.append("this jax_ep was built without DeepGEMM's kernels")
    bounds = limits()
    rows, sms = bounds["deep_gemm_rows"], bounds["deep_gemm_sms"]
    device = jax.devices()[0]
    if device.platform == "gpu" and getattr(device, "core_count", sms) != sms:
        problems.append(
            f"deepgemm: its kernels are built for {sms} SMs, the GPU has {device.core_count}"
        )
    if group_alignment % rows:
        problems.append(
            f"deepgemm: group_alignment={group_alignment} is not a multiple of {rows} rows"
        )
    (m, k), (groups, _, n) = lhs_shape, rhs_shape
    if not 0 < m <= bounds["deep_gemm_max_rows"]:
        problems.append(
            f"deepgemm: M={m} rows (its kernels take 1 to {bounds['deep_gemm_max_rows']})"
        )
    if groups > bounds["deep_gemm_max_groups"]:
        problems.append(
            f"deepgemm: G={groups} is more than {bounds['deep_gemm_max_groups']} groups"
        )
    if fp8 and k > bounds["deep_gemm_max_fp8_k"]:
        problems.append(f"deepgemm: K={k} is more than {bounds['deep_gemm_max_fp8_k']} (FP8)")
    multiple = FP8_BLOCK if fp8 else bounds["deep_gemm_alignment"]
    return problems + [
        f"deepgemm: {name}={size} is not a positive multiple of {multiple}"
        for name, size in (("K", k), ("N", n))
        if size <= 0 or size % multiple
    ]


def mosaic_misfits(lhs_shape, rhs_shape, dtype, blocks=MOSAIC_BLOCKS):
    """Why the Mosaic GPU kernels cannot compute this grouped matmul and both its gradients
    (empty when they can). Each kernel tiles its output and contraction dimensions by its blocks
    exactly (grid_block_n need not divide); the forward reads lhs in block_m rows."""
    problems = list(_platform_misfits())
    if jnp.dtype(dtype) not in MOSAIC_DTYPES:
        problems.append(f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)")
    (m, k), (_, _, n) = lhs_shape, rhs_shape
    # (product, dimension name, size, multiple it must be of): forward [M,K]x[K,N], d lhs
    # [M,N]x[N,K] (rhs transposed), d rhs [K,M]x[M,N] contracting over the rows.
    needs = [
        ("gmm", "M", m, blocks.gmm.block_m),
        ("gmm", "K", k, blocks.gmm.block_k),
        ("gmm", "N", n, blocks.gmm.block_n),
        ("gmm_t", "M", m, blocks.gmm_t.block_m),
        ("gmm_t", "N", n, blocks.gmm_t.block_k),
        ("gmm_t", "K", k, blocks.gmm_t.block_n),
        ("tgmm", "M", m, blocks.tgmm.block_k),
        ("tgmm", "K", k, blocks.tgmm.block_m),
        ("tgmm", "N", n, blocks.tgmm.block_n),
    ]
    for product, name, size, multiple in needs:
        if size == 0 or size % multiple:
            problems.append(f"{product}: {name}={size} is not a positive multiple of {multiple}")
    return problems


@functools.cache
def _platform_misfits():
    device = jax.devices()[0]
    capability = str(getattr(device, "compute_capability", ""))
    if device.platform != "gpu" or capability.split(".")[0] != "9":
        return (
            f"the default device is {device.device_kind} ({device.platform}), not a CUDA GPU "
            f"of compute capability 9.x",
        )
    try:
        mosaic.jax_kernels()
    except ImportError as e:
        return (f"jax's Mosaic GPU kernels do not import: {e}",)
    return ()


# ---------------------------------------------------------------- the three products


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _product(kind, plan, a, b, group_sizes):
    return _compute(kind, plan, a, b, group_sizes)


def _product_fwd(kind, plan, a, b, group_sizes):
    return _product(kind, plan, a, b, group_sizes), (a, b, group_sizes)


def _product_bwd(kind, plan, residuals, ct):
    a, b, group_sizes = residuals

    def run(kind, x, y):
        return _product(kind, plan, x, y, group_sizes)

    if kind == "gmm":  # out = a @ b_g
        grads = run("gmm_t", ct, b), run("tgmm", a, ct)
    elif kind == "gmm_t":  # out = a @ b_g^T
        grads = run("gmm", ct, b), run("tgmm", ct, a)
    else:  # out_g = a_g^T @ b_g
        grads = run("gmm_t", b, ct), run("gmm", a, ct)
    return grads + (None,)


_product.defvjp(_product_fwd, _product_bwd)

_XLA_DIMENSIONS = {  # ((lhs contracting, rhs contracting), (batch, batch)), ragged, group dims
    "gmm": ((([1], [1]), ([], [])), [0], [0]),
    "gmm_t": ((([1], [2]), ([], [])), [0], [0]),
    "tgmm": ((([0], [0]), ([], [])), [0], []),
}


def _compute(kind, plan, a, b, group_sizes):
    if plan.impl in ("cutlass", "deepgemm"):  # complete: zeros past the groups
        deep_gemm = plan.impl == "deepgemm" and (
            kind != "tgmm" or cutlass.deep_gemm_takes_tgmm(a.shape[1])
        )
        out = cutlass.product(kind, a, b, group_sizes, deep_gemm=deep_gemm)
        return varying_like(out, a, b, group_sizes)
    if plan.impl == "xla":
        dot, ragged, group = _XLA_DIMENSIONS[kind]
        return jax.lax.ragged_dot_general(
            a, b, group_sizes, jax.lax.RaggedDotDimensionNumbers(dot, ragged, group)
        )
    ragged_dot, transposed_ragged_dot = mosaic.jax_kernels()
    tiles = getattr(plan.blocks, kind)
    if kind == "tgmm" and plan.group_alignment % tiles.block_k == 0:
        out = mosaic.aligned_tgmm(a, b, group_sizes, tiles)
    elif kind == "tgmm":  # reads only the groups' rows; an empty group's block is zero
        out = transposed_ragged_dot(a, b, group_sizes=group_sizes, **tiles.jax_kernel_args())
    elif plan.group_alignment % tiles.block_m == 0:
        out = mosaic.aligned_gmm(a, b, group_sizes, tiles, transpose_rhs=kind == "gmm_t")
    else:
        out = ragged_dot(
            a, b, group_sizes=group_sizes, transpose_rhs=kind == "gmm_t", **tiles.jax_kernel_args()
        )
    # A custom call's outputs look replicated to shard_map: they vary like the operands.
    out = varying_like(out, a, b, group_sizes)
    if kind == "tgmm":
        return out
    return _zero_past_groups(out, group_sizes)  # the kernels leave those rows unwritten


def _zero_past_groups(out, group_sizes):
    """out [M, N] with its rows past sum(group_sizes) zero."""
    valid = jnp.arange(out.shape[0]) < group_sizes.sum()
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


# ---------------------------------------------------------------- FP8 (block-scaled) products

FP8_TILES = Blocks(64, 128, FP8_BLOCK, 4, 8)
"""The FP8 kernel's tiling: block_k is the FP8 block (one scale per row and per weight block
each step); 64 rows, as the step's product and the running sum (two float32 tiles) must fit in
one warpgroup's registers."""


def fp8_misfits(lhs_shape, rhs_shape, group_alignment):
    """Why the Mosaic FP8 kernel cannot compute this product (empty when it can): lhs [M, K],
    rhs [G, K, N], every group size a multiple of group_alignment."""
    problems = list(_platform_misfits())
    (m, k), (_, _, n) = lhs_shape, rhs_shape
    bm, bn, bk = FP8_TILES[:3]
    for name, size, multiple in (
        ("M", m, bm),
        ("K", k, bk),
        ("N", n, bn),
        ("group_alignment", group_alignment, bm),
    ):
        if size == 0 or size % multiple:
            problems.append(f"fp8: {name}={size} is not a positive multiple of {multiple}")
    return problems


def resolve_fp8_impl(impl, lhs_shape, rhs_shape, group_alignment):
    """The implementation fp8_grouped_matmul takes for these operands: "xla", "cutlass",
    "deepgemm" or "mosaic"."""
    return _resolve(
        "fp8_grouped_matmul",
        impl,
        {
            "deepgemm": lambda: deepgemm_misfits(
                lhs_shape, rhs_shape, None, group_alignment, fp8=True
            ),
            "cutlass": lambda: cutlass_misfits(lhs_shape, rhs_shape, None, fp8=True),
            "mosaic": lambda: fp8_misfits(lhs_shape, rhs_shape, group_alignment),
        },
    )


def fp8_grouped_matmul(
    lhs,
    lhs_q,
    lhs_scales,
    rhs,
    group_sizes,
    *,
    rhs_fp8=None,
    fp8_dgrad=False,
    impl="auto",
    group_alignment=1,
    blocks=MOSAIC_BLOCKS,
):
    """grouped_matmul(lhs, rhs, group_sizes) with an FP8 forward: lhs_q [M, K] e4m3fn and its
    1 x 128 scales lhs_scales [M, K/128] (what dispatch(fp8=True) delivers; lhs [M, K] their
    value in the compute dtype, e.g. Buffer.dequantize's, which only the backward reads), rhs
    [G, K, N] in 128 x 128 blocks (rhs_fp8: quantize_weights_fp8(rhs) made beforehand, e.g.
    once per optimizer step for several micro-batches; default: quantized here). Each 128 of K
    is one FP8 product, scaled by its row's and its weight block's scales and summed in float32;
    the result is in lhs.dtype. The backward is grouped_matmul's, in lhs.dtype, from lhs and rhs
    (no gradient reaches the FP8 values or their scales); with fp8_dgrad lhs's gradient is an
    FP8 product too (DeepSeek-V3's recipe): the output's gradient quantized in 1 x 128 blocks
    times the forward's FP8 weights transposed (the same 128 x 128 blocks and scales), summed in
    float32; rhs's gradient stays in lhs.dtype. rhs_fp8 may then also hold those weights
    transposed, (q, scales) + transpose_weights_fp8(q, scales), made once with them (else the
    backward transposes them, a pass over the FP8 weights per call). impl: "auto" (the first of
    AUTO_ORDER that fits: "deepgemm" on 132-SM Hopper GPUs for group_alignment a multiple of
    128; "cutlass" on Hopper for K and N multiples of 128, any groups; "mosaic" when the
    shapes fit FP8_TILES and group_alignment is a multiple of its 64 rows), "xla"
    (dequantized, float32 ragged_dot), "cutlass", "deepgemm" (group_alignment a multiple of
    128) or "mosaic"."""
    if (
        lhs_q.dtype != jnp.float8_e4m3fn
        or lhs_q.shape != lhs.shape
        or lhs_scales.shape != (lhs.shape[0], lhs.shape[1] // FP8_BLOCK)
        or lhs.shape[1] % FP8_BLOCK
    ):
        raise ValueError(
            f"jax_ep.nn.fp8_grouped_matmul: lhs_q must be e4m3fn like lhs "
            f"{lhs.shape} (K a multiple of {FP8_BLOCK}) and lhs_scales "
            f"[M, K/{FP8_BLOCK}], got {lhs_q.dtype}{lhs_q.shape} and "
            f"{lhs_scales.shape}"
        )
    fp8_impl = resolve_fp8_impl(impl, lhs.shape, rhs.shape, group_alignment)
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    dgrad_impl = resolve_fp8_impl(impl, (m, n), (g, n, k), group_alignment) if fp8_dgrad else None
    backward = _Plan(
        _backward_impl(impl, lhs.shape, rhs.shape, lhs.dtype, blocks, group_alignment),
        group_alignment,
        blocks,
    )
    lhs, rhs, group_sizes = all_varying(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))
    weights = tuple(quantize_weights(rhs, fp8_dgrad) if rhs_fp8 is None else rhs_fp8)
    if len(weights) not in (2, 4):
        raise ValueError(
            "jax_ep.nn.fp8_grouped_matmul: rhs_fp8 is (q, scales) or (q, scales, q_t, "
            f"scales_t), got {len(weights)} arrays"
        )
    if rhs_fp8 is not None:  # made elsewhere: of this rhs's shape (no gradient would notice)
        want = jax.eval_shape(
            functools.partial(quantize_weights, transposed=len(weights) == 4), rhs
        )
        if [(w.shape, w.dtype) for w in want] != [
            (jnp.shape(a), jnp.result_type(a)) for a in weights
        ]:
            raise ValueError(
                f"jax_ep.nn.fp8_grouped_matmul: rhs_fp8 must be quantize_weights_fp8 (and "
                f"transpose_weights_fp8) of an rhs shaped {rhs.shape}: "
                f"{', '.join(f'{w.dtype}{w.shape}' for w in want)}, got "
                f"{', '.join(f'{jnp.result_type(a)}{jnp.shape(a)}' for a in weights)}"
            )
    if fp8_dgrad and len(weights) == 2:
        weights += transpose_weights_fp8(*weights)
    fp8 = (lhs_q, lhs_scales) + weights[: 4 if fp8_dgrad else 2]
    fp8 = [jax.lax.stop_gradient(a) for a in varying_like(fp8, lhs, rhs)]
    return _fp8_gmm(fp8_impl, backward, dgrad_impl, lhs, rhs, group_sizes, *fp8)


def _backward_impl(impl, lhs_shape, rhs_shape, dtype, blocks, group_alignment):
    """The implementation of an FP8 product's backward, in dtype: impl's own where it takes
    them ("xla", or "cutlass" / "deepgemm" in bfloat16), else the first that can run."""
    args = lhs_shape, rhs_shape, dtype, blocks, group_alignment
    if impl in ("cutlass", "deepgemm"):
        try:
            return resolve_impl(impl, *args)
        except ValueError:
            pass
    return resolve_impl(impl if impl == "xla" else "auto", *args)


def _quantize_kernels_run(x):
    """Whether jax_ep's FP8 quantization kernels take x here: a GPU and jax_ep's CUDA backend,
    float32 or bfloat16 values (the same bytes as jax_ep.fp8's rule, in one pass over x)."""
    return (
        jax.devices()[0].platform == "gpu"
        and _native.has_cuda
        and jnp.dtype(x.dtype) in ffi_path.ROWS_DTYPES
    )


def quantize_weights(rhs, transposed=False):
    """quantize_weights_fp8(rhs), and with transposed (for fp8_dgrad) transpose_weights_fp8 of
    it appended: by jax_ep's kernel where it runs (one pass over rhs), else in XLA."""
    if _quantize_kernels_run(rhs):
        return ffi_path.quantize_weights(rhs, transposed)
    weights = quantize_weights_fp8(rhs)
    return weights + transpose_weights_fp8(*weights) if transposed else weights


def _quantize_rows(x):
    """quantize_fp8(x, False)'s values and scales (no gradient: a backward's cotangent)."""
    if _quantize_kernels_run(x):
        return ffi_path.quantize_rows(x)
    return quantize_fp8(x, False)


def _fp8_product(impl, lhs_q, lhs_scales, rhs_q, rhs_scales, group_sizes, like):
    """gmm of FP8 operands (rhs_q [G, N, K]) in like's dtype, varying like it, rows past the
    groups zero."""
    if impl == "xla":
        b = FP8_BLOCK
        g, n, k = rhs_q.shape
        weights = (
            rhs_q.astype(jnp.float32).reshape(g, n // b, b, k // b, b)
            * rhs_scales[:, :, None, :, None]
        ).reshape(g, n, k)
        out = jax.lax.ragged_dot_general(
            dequantize_fp8(lhs_q, lhs_scales),
            weights,
            group_sizes,
            jax.lax.RaggedDotDimensionNumbers(_XLA_DIMENSIONS["gmm_t"][0], [0], [0]),
            precision=jax.lax.Precision.HIGHEST,
        )
    elif impl in ("cutlass", "deepgemm"):  # complete: zeros past the groups
        out = cutlass.gmm_fp8(
            lhs_q,
            lhs_scales,
            rhs_q,
            rhs_scales,
            group_sizes,
            jnp.bfloat16,
            deep_gemm=impl == "deepgemm",
        )
        return varying_like(out.astype(like.dtype), like)
    else:
        out = varying_like(
            mosaic.aligned_gmm_fp8(
                lhs_q, lhs_scales, rhs_q, rhs_scales, group_sizes, FP8_TILES, like.dtype
            ),
            like,
        )
    return _zero_past_groups(out.astype(like.dtype), group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_gmm(fp8_impl, backward, dgrad_impl, lhs, rhs, group_sizes, *fp8):
    """fp8: lhs_q, lhs_scales, rhs_q, rhs_scales (and with dgrad_impl rhs_q, rhs_scales
    transposed)."""
    return _fp8_product(fp8_impl, *fp8[:4], group_sizes, lhs)


def _fp8_gmm_fwd(fp8_impl, backward, dgrad_impl, lhs, rhs, group_sizes, *fp8):
    out = _fp8_gmm(fp8_impl, backward, dgrad_impl, lhs, rhs, group_sizes, *fp8)
    return out, (lhs, rhs, group_sizes, fp8)


def _fp8_gmm_bwd(fp8_impl, backward, dgrad_impl, residuals, ct):
    lhs, rhs, group_sizes, fp8 = residuals
    if dgrad_impl is None:
        d_lhs, d_rhs, _ = _product_bwd("gmm", backward, (lhs, rhs, group_sizes), ct)
    else:  # the forward's weight blocks, [G, K, N]: N, this product's sum, innermost
        d_lhs = _fp8_dgrad(dgrad_impl, backward, ct, rhs, group_sizes, *fp8[4:])
        d_rhs = _product("tgmm", backward, lhs, ct, group_sizes)
    return (d_lhs, d_rhs, None) + tuple(jnp.zeros_like(a) for a in fp8)


_fp8_gmm.defvjp(_fp8_gmm_fwd, _fp8_gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_dgrad(dgrad_impl, backward, ct, rhs, group_sizes, rhs_q_t, rhs_scales_t):
    """fp8_dgrad's row gradient ct @ rhs_g^T as an FP8 product (ct quantized per row, the
    forward's weight blocks transposed), differentiated as the product it stands for (straight
    through, like the forward), so that a gradient of the gradient reaches ct and rhs."""
    ct_q, ct_scales = _quantize_rows(ct)
    return _fp8_product(dgrad_impl, ct_q, ct_scales, rhs_q_t, rhs_scales_t, group_sizes, ct)


def _fp8_dgrad_fwd(dgrad_impl, backward, ct, rhs, group_sizes, *weights):
    out = _fp8_dgrad(dgrad_impl, backward, ct, rhs, group_sizes, *weights)
    return out, (ct, rhs, group_sizes, weights)


def _fp8_dgrad_bwd(dgrad_impl, backward, residuals, ct_out):
    ct, rhs, group_sizes, weights = residuals
    d_ct, d_rhs, _ = _product_bwd("gmm_t", backward, (ct, rhs, group_sizes), ct_out)
    return (d_ct, d_rhs, None) + tuple(jnp.zeros_like(a) for a in weights)


_fp8_dgrad.defvjp(_fp8_dgrad_fwd, _fp8_dgrad_bwd)

"""The Hopper kernels of jax_ep.nn.grouped, as custom calls (kernels/cuda/grouped_gemm.cu):
CUTLASS's persistent grouped GEMMs over row groups of any size, the sizes read on the device;
with deep_gemm, DeepGEMM's kernels first (kernels/cuda/deep_gemm.h: gmm, gmm_t and FP8 gmm) for
the groups that start and end on 128-row boundaries, decided on the device per group, and
CUTLASS's for the others. grouped.py chooses between these, the Mosaic kernels and XLA, and makes
them differentiable.

They run on compute capability 9.0 in a jax_ep built with its CUDA backend and CUTLASS's
headers (`jax_ep._native.has_grouped_gemm`; DeepGEMM's: `has_deep_gemm`, on GPUs of 132 SMs).
The output is complete: rows past the groups (gmm, gmm_t) and the weight gradients of empty
groups (tgmm) are zeros."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native, ffi_path
from jax_ep.fp8 import FP8_BLOCK
from jax_ep.memory import limits

PRODUCT_IDS = {"gmm": 0, "gmm_t": 1, "tgmm": 2}  # kernels/cuda/grouped_gemm.h GroupedProduct
DTYPES = (jnp.dtype(jnp.bfloat16),)


class Order(NamedTuple):
    """The order in which a kernel's persistent CTAs take the output tiles: "m" (down the rows
    of a column of tiles first: neighbouring CTAs share the weights' tile) or "n" (along a row
    of tiles first), swizzle (1, 2, 4 or 8) tiles side by side across that order."""

    raster: str = "m"
    swizzle: int = 1

    def attributes(self):
        return {"raster": np.int32(self.raster == "n"), "swizzle": np.int32(self.swizzle)}


ORDERS = {  # per product: the best of bench.grouped_matmul's sweep at DeepSeek-V3's shapes
    "gmm": Order(),
    "gmm_t": Order(),
    "tgmm": Order(),
    "gmm_fp8": Order(),
}


def built():
    """Whether this jax_ep has the kernels (its CUDA backend was built with CUTLASS)."""
    return bool(getattr(_native, "has_grouped_gemm", False))


def deep_gemm_built():
    """Whether this jax_ep has DeepGEMM's kernels too (built with its headers)."""
    return bool(getattr(_native, "has_deep_gemm", False))


def deep_gemm_takes_tgmm(k):
    """Whether DeepGEMM's weight gradient takes tgmm's K (kernels/limits.h); where it does not,
    CUTLASS's computes it."""
    return k % limits()["deep_gemm_tgmm_k"] == 0


def product(kind, a, b, group_sizes, group_stride=0, order=None, deep_gemm=False):
    """One of grouped.py's products ("gmm", "gmm_t", "tgmm"; shapes as in its docstring), in
    bfloat16 with a float32 sum. group_stride > 0 (gmm only): group g's rows start at row
    g * group_stride instead of after the group before (the expert_padded layout, at most
    group_stride rows each), and the rows past each group's are left unwritten. order: the
    tiles' Order of CUTLASS's kernel (default ORDERS[kind]). deep_gemm (no group_stride):
    DeepGEMM's kernel computes the groups on 128-row boundaries (tgmm: every group, where each
    has a multiple of 128 rows, and K as deep_gemm_takes_tgmm says)."""
    ffi_path.register_targets()
    if kind == "tgmm":
        shape = (group_sizes.shape[0], a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], b.shape[2] if kind == "gmm" else b.shape[1])
    call = jax.ffi.ffi_call(
        "jax_ep_grouped_gemm", jax.ShapeDtypeStruct(shape, a.dtype), vmap_method="sequential"
    )
    return call(
        a,
        b,
        group_sizes,
        product=np.int32(PRODUCT_IDS[kind]),
        group_stride=np.int64(group_stride),
        deep_gemm=np.bool_(deep_gemm),
        **(order or ORDERS[kind]).attributes(),
    )


def gmm_fp8(
    lhs_q, lhs_scales, rhs_q, rhs_scales, group_sizes, out_dtype, order=None, deep_gemm=False
):
    """gmm from FP8 operands -> [M, N] out_dtype (bfloat16): lhs_q [M, K] e4m3fn with scales
    [M, K/128], rhs_q [G, N, K] with scales [G, N/128, K/128] (jax_ep.fp8's formats). The
    kernels apply each 128 of K's scales to that step's product in float32. They read the
    weights' scales with the N block index fastest: transposed here (a small array). deep_gemm:
    as in product()."""
    ffi_path.register_targets()
    m, n = lhs_q.shape[0], rhs_q.shape[1]
    call = jax.ffi.ffi_call(
        "jax_ep_grouped_gemm_fp8",
        jax.ShapeDtypeStruct((m, n), out_dtype),
        vmap_method="sequential",
    )
    return call(
        lhs_q,
        lhs_scales.astype(jnp.float32),
        rhs_q,
        jnp.swapaxes(rhs_scales.astype(jnp.float32), 1, 2),
        group_sizes,
        deep_gemm=np.bool_(deep_gemm),
        **(order or ORDERS["gmm_fp8"]).attributes(),
    )


def shape_misfits(k, n, groups, fp8):
    """Why the kernels cannot take K, N and this many groups (empty when they can): K and N
    multiples of the TMA's alignment (FP8: of the scale blocks), groups within the limit
    (kernels/limits.h; the handlers check both again)."""
    multiple = FP8_BLOCK if fp8 else limits()["grouped_matmul_alignment"]
    most = limits()["max_grouped_matmul_groups"]
    problems = [
        f"cutlass: {name}={size} is not a positive multiple of {multiple}"
        for name, size in (("K", k), ("N", n))
        if size <= 0 or size % multiple
    ]
    if not 1 <= groups <= most:
        problems.append(f"cutlass: G={groups} is not in [1, {most}]")
    return problems

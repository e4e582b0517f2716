"""The FP8 rule of docs/API.md (FP8) in plain JAX: the statement of kernels/fp8.h, the rule the
CPU and CUDA backends follow, which the tests compare with them bitwise. One float32 scale per
block of 128 values (1 x 128 for a dispatch's rows, 128 x 128 for expert weights); e4m3fn values
rounded to nearest even, once, from the bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.rank_ops import as_stored

FP8_BLOCK = 128  # kFp8Block
FP8_MAX = np.float32(448.0)  # kFp8Max
FP8_MIN_AMAX = np.float32(1e-4)  # kMinAmax


def block_amax(blocks, axis):
    """A block's absolute maximum over `axis` (kept), its NaN values left out (all NaN: 0, then
    clamped to 1e-4), as the kernels' max leaves them out: a NaN stays NaN, its block's other
    values keep their scale."""
    return jnp.max(jnp.where(jnp.isnan(blocks), 0, jnp.abs(blocks)), axis=axis, keepdims=True)


def quantize_blocks(values, amax, round_scale=False):
    """The FP8 rule, one scale per block: values (float32) and amax, their blocks' absolute
    maxima shaped to broadcast against them -> (e4m3fn like values, float32 scales like amax).
    scale = max(amax, 1e-4) / 448 (round_scale: the smallest power of two >= it), q = x * (448 /
    amax) (or x / scale), each rounded once."""
    amax = jnp.maximum(amax, FP8_MIN_AMAX)
    scale = amax * np.float32(1 / 448)
    if round_scale:
        # The smallest power of two >= scale, from its bits.
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
        mantissa, exponent = bits & np.uint32(0x7FFFFF), bits & np.uint32(0xFF800000)
        bits = jnp.where(mantissa != 0, exponent + np.uint32(0x800000), bits)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
        q = values / scale
    else:
        q = values * divide_rounded(jnp.full_like(amax, FP8_MAX), amax)
    return float_to_e4m3(q), scale


def divide_rounded(a, b):
    """a / b correctly rounded (IEEE), for positive normal float32 a, b with a normal quotient.

    The FP8 rule asks for a true division; XLA:GPU divides approximately (within 2 ulp), so the
    quotient is computed here by long division of the significands, on integers.
    """
    ua = jax.lax.bitcast_convert_type(a, jnp.uint32)
    ub = jax.lax.bitcast_convert_type(b, jnp.uint32)
    implicit = np.uint32(1 << 23)
    ma, mb = (ua & np.uint32(0x7FFFFF)) | implicit, (ub & np.uint32(0x7FFFFF)) | implicit
    exponent = ((ua >> 23) & 0xFF).astype(jnp.int32) - ((ub >> 23) & 0xFF).astype(jnp.int32) + 127
    below_one = ma < mb  # quotient significand < 1: shift in one more bit
    rest = jnp.where(below_one, ma << 1, ma)
    exponent = exponent - below_one.astype(jnp.int32)
    quotient = jnp.zeros_like(ma)
    for _ in range(25):  # 24 significand bits and one guard bit
        bit = rest >= mb
        quotient = (quotient << 1) | bit.astype(jnp.uint32)
        rest = jnp.where(bit, rest - mb, rest) << 1
    guard, quotient = quotient & 1, quotient >> 1
    quotient = quotient + (guard & ((rest != 0) | (quotient & 1)).astype(jnp.uint32))  # to even
    carry = quotient >> 24  # rounding overflowed into the next power of two
    quotient, exponent = quotient >> carry, exponent + carry.astype(jnp.int32)
    bits = (exponent.astype(jnp.uint32) << 23) | (quotient & np.uint32(0x7FFFFF))
    exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(jnp.isfinite(a) & jnp.isfinite(b), exact, a / b)


def float_to_e4m3(v):
    """float32 -> float8_e4m3fn, rounded to nearest even once, from the bits (XLA's own convert
    may round through float16 first on some backends). Saturates at 448; NaN stays NaN."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.uint32)
    sign = ((bits >> 24) & 0x80).astype(jnp.uint8)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    # Normal e4m3: keep 3 mantissa bits, ties to even, and re-bias the exponent (127 -> 7).
    kept = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> 20) & 1)) >> 20
    normal = jnp.minimum(kept.astype(jnp.int32) - ((127 - 7) << 3), 0x7E)
    # Below 2^-6: multiples of 2^-9 (jnp.round rounds half to even).
    small = jnp.round(jax.lax.bitcast_convert_type(magnitude, jnp.float32) * 512.0)
    code = jnp.where(magnitude < np.uint32(0x3C800000), small.astype(jnp.int32), normal)
    code = jnp.where(magnitude > np.uint32(0x7F800000), 0x7F, code).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(sign | code, jnp.float8_e4m3fn)


def dequantize_fp8(q, scales):
    """[..., H] e4m3fn and [..., H/128] scales -> [..., H] float32: q * scale."""
    blocks = q.astype(jnp.float32).reshape(scales.shape + (FP8_BLOCK,))
    return (blocks * scales[..., None]).reshape(q.shape)


def quantize_weights_fp8(w):
    """Expert weights [G, K, N] -> (e4m3fn [G, N, K], float32 scales [G, N/128, K/128]): the FP8
    rule (quantize_blocks) on 128 x 128 blocks, DeepSeek-V3's weight recipe; K
    innermost, as Hopper's FP8 tensor-core instructions read both operands. The blocks' maxima
    and the quantization run in w's own layout (reads in order); only the FP8 result, half the
    bytes, is transposed."""
    g, k, n = w.shape
    b = FP8_BLOCK
    if k % b or n % b:
        raise ValueError(
            f"jax_ep.nn.quantize_weights_fp8: weights [G, K, N] need K and N "
            f"multiples of {b}, got {w.shape}"
        )
    blocks = w.astype(jnp.float32).reshape(g, k // b, b, n // b, b)
    q, scales = quantize_blocks(blocks, block_amax(blocks, (2, 4)))  # scales [G,K/b,1,N/b,1]
    return jnp.swapaxes(q.reshape(g, k, n), 1, 2), jnp.swapaxes(scales[:, :, 0, :, 0], 1, 2)


def transpose_weights_fp8(q, scales):
    """quantize_weights_fp8's (q [G, N, K], scales [G, N/128, K/128]) -> the same blocks as
    [G, K, N] and [G, K/128, N/128]: N innermost, as the FP8 product of a row gradient (d lhs,
    a sum over N) reads them."""
    return jnp.swapaxes(q, 1, 2), jnp.swapaxes(scales, 1, 2)


def quantize_fp8(x, round_scale):
    """[T, H] -> (e4m3fn [T, H], float32 scales [T, H/128]): a dispatch's FP8 rows (1 x 128
    blocks), as the backends make them; straight-through for gradients."""
    t, h = x.shape
    blocks = as_stored(x).astype(jnp.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    q, scale = quantize_blocks(blocks, block_amax(blocks, -1), round_scale)
    return _with_gradient_to_x(x.dtype, x, q.reshape(t, h)), jax.lax.stop_gradient(scale[..., 0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_gradient_to_x(dtype, x, q):
    """q, whose cotangent goes to x unchanged (cast to x's dtype)."""
    return q


def _with_gradient_to_x_fwd(dtype, x, q):
    return q, None


def _with_gradient_to_x_bwd(dtype, _, ct_q):
    return ct_q.astype(dtype), None


_with_gradient_to_x.defvjp(_with_gradient_to_x_fwd, _with_gradient_to_x_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dequantize_with_gradient(combine, x, q, scales, handle):
    """q * scales as x.dtype (Buffer.dequantize): x's gradient is combine(the rows' cotangents,
    handle), as if x had been dispatched unquantised."""
    return dequantize_fp8(q, scales).astype(x.dtype)


def _dequantize_with_gradient_fwd(combine, x, q, scales, handle):
    return dequantize_with_gradient(combine, x, q, scales, handle), handle


def _dequantize_with_gradient_bwd(combine, handle, ct):
    # q and scales get zeros that JAX sees as zeros: the dispatch's backward skips them.
    return combine(ct, handle), None, None, None


dequantize_with_gradient.defvjp(_dequantize_with_gradient_fwd, _dequantize_with_gradient_bwd)

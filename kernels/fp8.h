// The FP8 rule (docs/API.md, FP8), shared by the CPU and CUDA backends; jax_ep/fp8.py states it
// in JAX. One float32 scale per 128 channels; e4m3fn values rounded to nearest even.
#pragma once
#include "kernels/layout.h"
#include <cmath>

namespace jax_ep {

constexpr int kFp8Block = 128;
constexpr float kFp8Max = 448.0f;
constexpr float kMinAmax = 1e-4f;

JAX_EP_HD float fp8_amax(float block_max_abs) {
  return block_max_abs > kMinAmax ? block_max_abs : kMinAmax;
}

// scale = amax * float32(1/448); with round_scale the smallest power of two >= that,
// taken from the exponent bits.
JAX_EP_HD float fp8_scale(float amax, bool round_scale) {
  float scale = amax * (1.0f / kFp8Max);
  if (!round_scale) return scale;
  uint32_t u;
  memcpy(&u, &scale, 4);
  if (u & 0x007fffffu) u = (u & 0xff800000u) + 0x00800000u;
  memcpy(&scale, &u, 4);
  return scale;
}

// What a block's values are multiplied by: 448 / amax (a true division), or with round_scale
// 1 / scale, exact for a power of two, so that x * factor is x / scale to the bit.
struct Fp8Block {
  float scale;
  float factor;
  JAX_EP_HD static Fp8Block make(float block_max_abs, bool round_scale) {
    float amax = fp8_amax(block_max_abs);
    float scale = fp8_scale(amax, round_scale);
    return {scale, round_scale ? 1.0f / scale : kFp8Max / amax};
  }
  JAX_EP_HD float scaled(float x) const { return x * factor; }
};

// float -> float8_e4m3fn, round to nearest even, saturating to +-448 (inputs never exceed it).
// The CUDA kernels convert pairs in hardware instead (rows.cuh: the same bytes).
JAX_EP_HD uint8_t float_to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint8_t sign = uint8_t((u >> 24) & 0x80);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  float mag;
  memcpy(&mag, &a, 4);
  if (mag < 0.015625f) {  // below e4m3's smallest normal 2^-6: multiples of 2^-9
    return sign | uint8_t(std::nearbyint(mag * 512.0f));
  }
  uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // keep 3 mantissa bits, RNE
  int32_t code = int32_t(rounded) - ((127 - 7) << 3);
  return sign | uint8_t(code > 0x7e ? 0x7e : code);
}

}  // namespace jax_ep

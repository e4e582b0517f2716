// Element types the backends move and the conversions they share (host and device).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAX_EP_HD __host__ __device__ __forceinline__
#else
#define JAX_EP_HD inline
#endif

namespace jax_ep {

enum class Dtype : int32_t { kF32 = 0, kBF16 = 1, kF8E4M3 = 2 };

JAX_EP_HD int dtype_size(Dtype t) { return t == Dtype::kF32 ? 4 : t == Dtype::kBF16 ? 2 : 1; }

// bfloat16 <-> float32, round to nearest even (as XLA's convert).
JAX_EP_HD float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

JAX_EP_HD uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Element i of a float32 or bfloat16 array, as float32.
JAX_EP_HD float load_float(const void* p, int64_t i, Dtype t) {
  return t == Dtype::kF32 ? static_cast<const float*>(p)[i]
                          : bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}

JAX_EP_HD void store_float(void* p, int64_t i, Dtype t, float v) {
  if (t == Dtype::kF32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

}  // namespace jax_ep

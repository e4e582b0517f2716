// Moving and summing rows, one warp per row: what the dispatch and combine kernels (and the
// probes under bench/) share.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/cuda/warp.cuh"
#include "kernels/dtype.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace jax_ep::cuda {

// f(T(), std::integral_constant<bool, kFp8>()) for a dispatch's row type: the kernels that read
// x rows are templates over both.
template <typename F>
cudaError_t with_row_type(Dtype x_dtype, bool fp8, F&& f) {
  if (x_dtype == Dtype::kBF16)
    return fp8 ? f(__nv_bfloat16(), std::true_type()) : f(__nv_bfloat16(), std::false_type());
  return fp8 ? f(float(), std::true_type()) : f(float(), std::false_type());
}

// How one lane walks a row: per step it loads kLoads 16-byte vectors (kElems elements) and
// writes them, or their e4m3 bytes (16 per lane: 16 bytes), to every destination.
template <typename T, bool kFp8>
struct RowStep {
  static constexpr int kLoads = kFp8 ? int(sizeof(T)) : 1;
  static constexpr int kElems = kLoads * 16 / int(sizeof(T));
  static constexpr int kStep = 32 * kElems;                  // elements per warp step
  static constexpr int kLanesPerBlock = kFp8Block / kElems;  // lanes sharing one scale
  static constexpr int kUnroll = 8 / kLoads;                 // steps with loads in flight
};

// The largest |x| of one lane's 16 elements (bfloat16 pairs compared as pairs: exact).
template <typename T>
__device__ __forceinline__ float abs_max16(const int4* v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(v);
    __nv_bfloat162 m = __habs2(h[0]);
#pragma unroll
    for (int i = 1; i < 8; ++i) m = __hmax2(m, __habs2(h[i]));
    return fmaxf(__low2float(m), __high2float(m));
  } else {
    const float* f = reinterpret_cast<const float*>(v);
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(f[i]));
    return m;
  }
}

// Element i of one lane's 16, as float32: a bfloat16 is the high half of its float32, so one
// shift or mask (the conversion the compiler emits takes two for odd elements).
template <typename T>
__device__ __forceinline__ float element_as_float(const int4* v, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t pair = reinterpret_cast<const uint32_t*>(v)[i / 2];
    return __uint_as_float(i % 2 ? pair & 0xffff0000u : pair << 16);
  } else {
    return reinterpret_cast<const float*>(v)[i];
  }
}

// The e4m3 bytes of one lane's 16 elements, with the scale of their 128-channel block: one
// multiply and half a paired conversion per element.
template <typename T>
__device__ __forceinline__ int4 quantize16(const int4* v, bool round_scale, float* scale) {
  constexpr int kLanesPerBlock = RowStep<T, true>::kLanesPerBlock;
  const float max_abs = group_max<kLanesPerBlock>(abs_max16<T>(v));
  const Fp8Block block = Fp8Block::make(max_abs, round_scale);
  *scale = block.scale;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float f[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) f[j] = block.scaled(element_as_float<T>(v, 4 * i + j));
    const uint32_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(f[0], f[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(f[2], f[3]), __NV_SATFINITE, __NV_E4M3);
    q[i] = lo | hi << 16;
  }
  return make_int4(int(q[0]), int(q[1]), int(q[2]), int(q[3]));
}

// One warp sends steps [first_step, end_step) of a token's row (RowStep elements each) to every
// rank d in `targets`: loads kUnroll steps ahead, quantises when kFp8, and stores from registers
// to x_dst[d] (any memory: a peer's over NVLink); the FP8 scales of those steps go to
// scale_dst[d], staged in `stage` (the row's scales, per warp). Rows whose size is no multiple of
// 16 bytes (never FP8) move element by element.
template <typename T, bool kFp8>
__device__ __forceinline__ void send_row(const uint8_t* row, int hidden, bool round_scale,
                                         uint32_t targets, uint8_t* const* x_dst,
                                         float* const* scale_dst, float* stage, int first_step,
                                         int end_step, bool aligned) {
  using Step = RowStep<T, kFp8>;
  const int lane = threadIdx.x % 32;
  if (!kFp8 && !aligned) {
    const int end = min(hidden, end_step * Step::kStep);
    for (uint32_t m = targets; m; m &= m - 1) {
      T* to = reinterpret_cast<T*>(x_dst[__ffs(m) - 1]);
      for (int i = first_step * Step::kStep + lane; i < end; i += 32)
        to[i] = reinterpret_cast<const T*>(row)[i];
    }
    return;
  }
  for (int s0 = first_step; s0 < end_step; s0 += Step::kUnroll) {
    const int steps = min(Step::kUnroll, end_step - s0);  // the same in every lane
    int4 v[Step::kUnroll][Step::kLoads];
#pragma unroll
    for (int u = 0; u < Step::kUnroll; ++u) {
      const int e = (s0 + u) * Step::kStep + lane * Step::kElems;
#pragma unroll
      for (int l = 0; l < Step::kLoads; ++l)
        v[u][l] = u < steps && e < hidden
                      ? __ldg(reinterpret_cast<const int4*>(row + e * sizeof(T)) + l)
                      : make_int4(0, 0, 0, 0);
    }
    if constexpr (kFp8) {  // v[u][0] becomes the step's e4m3 bytes
#pragma unroll
      for (int u = 0; u < Step::kUnroll; ++u) {
        if (u >= steps) break;
        const int e = (s0 + u) * Step::kStep + lane * Step::kElems;
        float scale;
        v[u][0] = quantize16<T>(v[u], round_scale, &scale);
        if (e < hidden && lane % Step::kLanesPerBlock == 0) stage[e / kFp8Block] = scale;
      }
    }
    for (uint32_t m = targets; m; m &= m - 1) {  // each destination's address read once
      uint8_t* to = x_dst[__ffs(m) - 1];
#pragma unroll
      for (int u = 0; u < Step::kUnroll; ++u) {
        const int e = (s0 + u) * Step::kStep + lane * Step::kElems;
        if (u < steps && e < hidden)
          *reinterpret_cast<int4*>(to + (kFp8 ? e : e * int64_t(sizeof(T)))) = v[u][0];
      }
    }
  }
  if constexpr (kFp8) {
    __syncwarp();
    const int first = first_step * Step::kStep / kFp8Block;
    const int end = min(hidden, end_step * Step::kStep) / kFp8Block;
    for (uint32_t m = targets; m; m &= m - 1) {
      float* to = scale_dst[__ffs(m) - 1];
      for (int i = first + lane; i < end; i += 32) to[i] = stage[i];
    }
  }
}

// One warp copies bytes [begin, end) of src to dst (zeros when src is null): 16-byte vectors,
// eight per lane in flight, when sizes and addresses allow; else byte by byte.
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, int64_t begin, int64_t end) {
  const int lane = threadIdx.x % 32;
  uint8_t* to = static_cast<uint8_t*>(dst);
  const uint8_t* from = static_cast<const uint8_t*>(src);
  if ((begin | end | reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16) {
    for (int64_t i = begin + lane; i < end; i += 32) to[i] = from ? from[i] : 0;
    return;
  }
  constexpr int kInFlight = 8;
  for (int64_t i0 = begin / 16; i0 < end / 16; i0 += 32 * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = i0 + u * 32 + lane;
      v[u] = from && i < end / 16 ? reinterpret_cast<const int4*>(from)[i] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = i0 + u * 32 + lane;
      if (i < end / 16) reinterpret_cast<int4*>(to)[i] = v[u];
    }
  }
}

// Adds the 16-byte vector `v` of t elements into acc[0..16/size).
__device__ __forceinline__ void add_vector(float* acc, int4 v, Dtype t) {
  if (t == Dtype::kF32) {
    const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += f[i];
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += bf16_to_float(h[i]);
  }
}

// n <= 8 consecutive elements at `index`, as float32: one 16-byte load when aligned.
__device__ __forceinline__ void load_run(float* acc, const void* base, int64_t index, int n,
                                         Dtype t) {
  const int size = dtype_size(t);
  if (n * size == 16 && (index * size) % 16 == 0) {
    int4 v = *reinterpret_cast<const int4*>(static_cast<const uint8_t*>(base) + index * size);
    for (int i = 0; i < n; ++i) acc[i] = 0.f;
    add_vector(acc, v, t);
    return;
  }
  for (int i = 0; i < n; ++i) acc[i] = load_float(base, index + i, t);
}

// The rounding to the output type happens here, once.
__device__ __forceinline__ void store_run(void* base, int64_t index, const float* acc, int n,
                                          Dtype t) {
  uint8_t* at = static_cast<uint8_t*>(base) + index * dtype_size(t);
  if (t == Dtype::kBF16 && n == 8 &&
      (index * 2) % 16 == 0) {  // float_to_bf16, in pairs, in hardware
    __nv_bfloat162 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *reinterpret_cast<int4*>(at) = *reinterpret_cast<const int4*>(h);
    return;
  }
  if (t == Dtype::kF32 && n % 4 == 0 && (index * 4) % 16 == 0) {
    for (int i = 0; i < n; i += 4)
      reinterpret_cast<float4*>(at)[i / 4] =
          make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    return;
  }
  for (int i = 0; i < n; ++i) store_float(base, index + i, t, acc[i]);
}

constexpr int kSumUnroll = 4;  // 16-byte vectors per lane and source in flight

// One warp: out[t] = bias[t] + the rows at row_at[d] for the ranks d in `sources`, in rank order
// (the fixed summation order), accumulated in float32 and rounded once; 16-byte vectors
// [first, vectors) of rows of 16-byte multiples. Sources are loaded two at a time, so a peer's
// loads are in flight together with the local ones.
// Asks for `bytes` (a multiple of 16) at p, 16-byte aligned, in L2 (sm_90's bulk prefetch; a
// no-op before it): one instruction brings a whole run of a row.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void sum_rows(const CombineRecv& recv, int t, uint32_t sources,
                                         const int4* const* row_at, int first, int vectors) {
  const int lane = threadIdx.x % 32;
  const int per_vector = 16 / dtype_size(recv.rows_dtype);
  for (int v0 = first; v0 < vectors; v0 += 32 * kSumUnroll) {
    float acc[kSumUnroll][8] = {};
    if (recv.bias) {
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        if (v < vectors)
          load_run(acc[u], recv.bias, int64_t(t) * recv.width + int64_t(v) * per_vector, per_vector,
                   recv.bias_dtype);
      }
    }
    for (uint32_t m = sources; m;) {
      const int4* first_src = row_at[__ffs(m) - 1];
      m &= m - 1;
      const int4* second_src = m ? row_at[__ffs(m) - 1] : nullptr;
      m &= m - 1;
      int4 loaded[2][kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int v = v0 + u * 32 + lane;
        loaded[0][u] = v < vectors ? first_src[v] : make_int4(0, 0, 0, 0);
        loaded[1][u] = second_src && v < vectors ? second_src[v] : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) add_vector(acc[u], loaded[0][u], recv.rows_dtype);
      if (second_src)
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) add_vector(acc[u], loaded[1][u], recv.rows_dtype);
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v < vectors)
        store_run(recv.out, int64_t(t) * recv.width + int64_t(v) * per_vector, acc[u], per_vector,
                  recv.out_dtype);
    }
  }
}

}  // namespace jax_ep::cuda

// What one warp computes together (every lane of it must call, the whole warp active): sums and
// maxima across lanes, and counts of a ballot's bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep::cuda {

// The sum of `value` over the warp's 32 lanes, in every lane.
__device__ __forceinline__ int warp_sum(int value) {
  for (int offset = 16; offset; offset /= 2) value += __shfl_xor_sync(~0u, value, offset);
  return value;
}

// The sum of `value` over this lane and the lanes below it.
__device__ __forceinline__ int warp_inclusive_sum(int value) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_up_sync(~0u, value, offset);
    if (lane >= offset) value += below;
  }
  return value;
}

// The maximum of `value` over each aligned group of kLanes lanes, in every lane of the group.
template <int kLanes>
__device__ __forceinline__ float group_max(float value) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(~0u, value, offset));
  return value;
}

// How many of the bits of `bits` are below bit `bit` (< 32): a lane's index among the lanes of
// a ballot.
__device__ __forceinline__ int count_below(uint32_t bits, int bit) {
  return __popc(bits & ((1u << bit) - 1u));
}

}  // namespace jax_ep::cuda

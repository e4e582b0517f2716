// DeepGEMM's SM90 grouped GEMMs (github.com/deepseek-ai/DeepGEMM; the headers of the
// sgl-deep-gemm wheel) for grouped_gemm.cu's products: 5-30% faster than CUTLASS's at
// DeepSeek-V3's shapes (docs/PERFORMANCE.md), but each 128-row tile of gmm, gmm_t and gmm_fp8
// takes the weights of one group, so they compute only groups that start on a 128-row boundary
// and end on one (or at the last row of all the groups); tgmm takes every group or none (below).
// grouped_gemm.cu runs them first, then CUTLASS's kernel over the groups they cannot take (which
// overwrites what DeepGEMM's tiles wrote there).
// Built where DeepGEMM's headers were found (JAX_EP_WITH_DEEP_GEMM).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/grouped_gemm.h"
#include "kernels/limits.h"

namespace jax_ep::cuda {

// Whether group [offset, offset + rows) is DeepGEMM's: its tiles cover it exactly, with no other
// group's rows in them (`total`: the rows of all groups; rows past it are zeroed afterwards).
__host__ __device__ inline bool deep_gemm_takes_group(int64_t offset, int64_t rows, int64_t total) {
  const int64_t end = offset + rows;
  return offset % kDeepGemmRows == 0 && (end % kDeepGemmRows == 0 || end == total);
}

// tgmm: DeepGEMM's weight gradient sums each group's rows in steps that do not stop at a group's
// end, and places each group after the ones before it: it computes every group or none, and
// only where each has a multiple of 128 rows.
__host__ __device__ inline bool deep_gemm_takes_k_group(int64_t rows) {
  return rows % kDeepGemmRows == 0;
}

#ifdef JAX_EP_WITH_DEEP_GEMM
// "" when DeepGEMM's kernels can compute `a` on `device`, else why not.
std::string deep_gemm_misfit(const GroupedGemmArgs& a, int device);
// Device scratch one call needs (the groups' layout; FP8: the row scales transposed).
size_t deep_gemm_scratch_bytes(const GroupedGemmArgs& a);
// Enqueues DeepGEMM's kernel over the groups it takes. rows, offsets: each group's rows
// (clamped) and first row (on the device, grouped_gemm.cu's setup kernel's). "" once enqueued,
// else the error.
std::string deep_gemm(const GroupedGemmArgs& a, const int32_t* rows, const int64_t* offsets,
                      void* scratch, cudaStream_t stream);
#else  // a build without DeepGEMM's headers: CUTLASS computes every group
inline std::string deep_gemm_misfit(const GroupedGemmArgs&, int) {
  return "this jax_ep was built without DeepGEMM's headers";
}
inline size_t deep_gemm_scratch_bytes(const GroupedGemmArgs&) { return 0; }
inline std::string deep_gemm(const GroupedGemmArgs& a, const int32_t*, const int64_t*, void*,
                             cudaStream_t) {
  return deep_gemm_misfit(a, 0);
}
#endif

}  // namespace jax_ep::cuda

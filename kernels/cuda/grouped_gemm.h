// Grouped matmuls of the MoE experts on Hopper (sm_90a), CUTLASS's kernels: the products of
// jax_ep/nn/grouped.py, with the group sizes on the device. Built only where CUTLASS's headers
// were found and the CUDA architectures include sm_90 (JAX_EP_WITH_GROUPED_GEMM).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_ep::cuda {

// The products (jax_ep/nn/grouped.py's names), all row-major, rows of lhs in consecutive groups:
//   gmm      out[i] = lhs[i] @ rhs[g(i)]        lhs [M, K], rhs [G, K, N]      -> out [M, N]
//   gmm_t    out[i] = lhs[i] @ rhs[g(i)]^T      lhs [M, N], rhs [G, K, N]      -> out [M, K]
//   tgmm     out[g] = lhs[rows of g]^T rhs[...] lhs [M, K], rhs [M, N]         -> out [G, K, N]
//   gmm_fp8  gmm from e4m3 lhs [M, K] (1 x 128 scales) and rhs [G, N, K] (128 x 128 scales)
enum class GroupedProduct : int32_t { kGmm = 0, kGmmT = 1, kTgmm = 2, kGmmFp8 = 3 };

struct GroupedGemmArgs {
  GroupedProduct product;
  int64_t m, k, n;             // as in the shapes above (for gmm_t, out is [M, K])
  int32_t groups;              // G
  int32_t raster;              // output tiles in order down M first (0) or along N first (1),
  int32_t swizzle;             // this many (1, 2, 4, 8) side by side across that order
  bool deep_gemm;              // gmm, gmm_t, gmm_fp8: DeepGEMM's kernels compute the groups they
                               // take (deep_gemm.h; deep_gemm_misfit(...) must be ""),
                               // CUTLASS's the others
  int64_t group_stride;        // gmm: 0, or group g's rows start at row g * group_stride (at
                               // most group_stride rows each; the rows past them unwritten)
  const void* lhs;             // bfloat16 (e4m3 for gmm_fp8)
  const void* rhs;             // bfloat16 (e4m3 for gmm_fp8)
  const int32_t* group_sizes;  // [G] rows per group; clamped to [0, rows left] (never past M)
  const float* lhs_scales;     // gmm_fp8: [M, K/128] (one per row and 128 of K)
  const float* rhs_scales;     // gmm_fp8: [G, K/128, N/128] (the N block fastest)
  void* out;                   // bfloat16; rows past the groups (gmm, gmm_t; group_stride 0)
                               // and the blocks of empty groups (tgmm) are written with zeros
};

// Whether this build has the kernels, and the device can run them (compute capability 9.0).
bool grouped_gemm_available(int device);
// The device's SM count (asked once per device).
int grouped_gemm_sms(int device);
// Device scratch one call needs (its per-group arguments and CUTLASS's workspace).
size_t grouped_gemm_workspace_bytes(const GroupedGemmArgs& args, int device);
// "" once the kernels are enqueued on `stream`, else the error.
std::string grouped_gemm(const GroupedGemmArgs& args, int device, void* workspace,
                         cudaStream_t stream);

}  // namespace jax_ep::cuda

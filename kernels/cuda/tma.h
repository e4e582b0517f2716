// Host-side TMA descriptors (cuTensorMapEncodeTiled) for the kernels that take them as launch
// arguments: DeepGEMM's (kernels/cuda/deep_gemm.cu) and the benchmark programs that launch them.
// The driver's entry point is found through the runtime, so nothing links libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jax_ep::cuda {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, asked once (nullptr where the driver lacks it).
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 2-D map over `inner` x `outer` elements, rows `row_bytes` apart, copied in boxes of
// box_inner x box_outer; swizzle: 0 or 16 (none), 32, 64 or 128 bytes. Reads past the edges
// give zeros, writes past them are dropped. "" on success, else why not.
inline std::string tensor_map(CUtensorMap& map, const void* base, CUtensorMapDataType type,
                              uint64_t inner, uint64_t outer, uint64_t row_bytes,
                              uint32_t box_inner, uint32_t box_outer, int swizzle) {
  const EncodeTiled encode = encode_tiled();
  if (!encode) return "the CUDA driver has no cuTensorMapEncodeTiled";
  const cuuint64_t dims[2] = {inner, outer}, strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer}, element_strides[2] = {1, 1};
  const auto mode = swizzle == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                    : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                    : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                    : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult status =
      encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, mode, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS
             ? ""
             : "cuTensorMapEncodeTiled failed (" + std::to_string(int(status)) + ")";
}

// A map of an operand whose rows are `inner` elements of `elem_bytes`, copied in boxes one
// swizzle atom wide and box_outer rows deep.
inline std::string operand_map(CUtensorMap& map, const void* base, CUtensorMapDataType type,
                               int elem_bytes, uint64_t inner, uint64_t outer, uint32_t box_outer,
                               int swizzle) {
  return tensor_map(map, base, type, inner, outer, inner * elem_bytes, swizzle / elem_bytes,
                    box_outer, swizzle);
}

// The widest TMA swizzle (128, 64 or 32 bytes; 16: none) that divides a row of row_bytes.
constexpr uint32_t swizzle_bytes(uint32_t row_bytes) {
  for (uint32_t mode : {128u, 64u, 32u}) {
    if (row_bytes % mode == 0) return mode;
  }
  return 16;
}

}  // namespace jax_ep::cuda

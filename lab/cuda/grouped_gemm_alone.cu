// The grouped matmuls' CUTLASS kernels timed alone, outside JAX: a standalone program that
// includes a kernel source (KERNEL: kernels/cuda/grouped_gemm.cu, or an edited copy of it, e.g.
// another tile shape), runs one bf16 product of 32768 rows in G groups (default 32: EP8's per-rank
// shape; 256: EP1's) of sizes uniform or Zipf in multiples of 128 rows as bench.grouped_matmul
// makes them, or "random": each row to a random group, as top-k routing fills groups that are
// not aligned), prints a checksum of the output
// (variants must agree to bf16 rounding) and the product's TFLOP/s (median of 7 samples of 20
// calls). Without NDEBUG, CuTe's device asserts are calls that make ptxas serialize the warpgroup
// MMAs (its warning C7510): build as the wheel does.
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a -I. -isystem $CUTLASS/include \
//     -isystem $CUTLASS/tools/util/include --expt-relaxed-constexpr \
//     [-DKERNEL='"copy.cu"'] lab/cuda/grouped_gemm_alone.cu -o gemm
//   ./gemm gmm|gmm_t|tgmm K N uniform|zipf|random [G]
#ifndef KERNEL
#define KERNEL "kernels/cuda/grouped_gemm.cu"
#endif
#include KERNEL

#include <cmath>
#include <string>
#include <vector>

#include "lab/cuda/alone.cuh"

using jax_ep::alone::device_random;
using jax_ep::alone::group_sizes;

int main(int argc, char** argv) {
  using jax_ep::cuda::GroupedProduct;
  if (argc < 5) {
    std::printf("usage: %s gmm|gmm_t|tgmm K N uniform|zipf|random [G]\n", argv[0]);
    return 2;
  }
  const std::string name = argv[1];
  const int64_t rows = 32768, k = std::atoll(argv[2]), n = std::atoll(argv[3]);
  const int groups = argc > 5 ? std::atoi(argv[5]) : 32;
  const std::string distribution = argv[4];
  jax_ep::cuda::GroupedGemmArgs a{};
  a.product = name == "gmm"     ? GroupedProduct::kGmm
              : name == "gmm_t" ? GroupedProduct::kGmmT
                                : GroupedProduct::kTgmm;
  a.m = rows, a.k = k, a.n = n, a.groups = groups, a.raster = 0, a.swizzle = 1;
  // gmm: [M, K] x [G, K, N]; gmm_t: [M, N] x [G, K, N]; tgmm: [M, K] x [M, N] -> [G, K, N].
  const int64_t lhs_cols = a.product == GroupedProduct::kGmmT ? n : k;
  const int64_t rhs_elems = a.product == GroupedProduct::kTgmm ? rows * n : groups * k * n;
  const int64_t out_elems = a.product == GroupedProduct::kTgmm
                                ? groups * k * n
                                : rows * (a.product == GroupedProduct::kGmmT ? k : n);
  a.lhs = device_random<__nv_bfloat16>(rows * lhs_cols, 1);
  a.rhs = device_random<__nv_bfloat16>(rhs_elems, 2, 1.f / 64);
  const auto sizes = group_sizes(distribution, rows, groups);
  int32_t* device_sizes;
  CHECK(cudaMalloc(&device_sizes, sizeof(int32_t) * groups));
  CHECK(cudaMemcpy(device_sizes, sizes.data(), sizeof(int32_t) * groups, cudaMemcpyHostToDevice));
  a.group_sizes = device_sizes;
  __nv_bfloat16* out;
  CHECK(cudaMalloc(&out, out_elems * sizeof(*out)));
  a.out = out;
  void* workspace;
  CHECK(cudaMalloc(&workspace, jax_ep::cuda::grouped_gemm_workspace_bytes(a, 0) + 256));

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  auto call = [&] {
    const std::string error = jax_ep::cuda::grouped_gemm(a, 0, workspace, stream);
    if (!error.empty()) {
      std::printf("%s\n", error.c_str());
      std::exit(1);
    }
  };
  call();
  CHECK(cudaStreamSynchronize(stream));
  std::vector<__nv_bfloat16> host(out_elems);
  CHECK(cudaMemcpy(host.data(), out, out_elems * sizeof(*out), cudaMemcpyDeviceToHost));
  double checksum = 0;
  for (const auto& v : host) checksum += std::abs(double(__bfloat162float(v)));

  constexpr int kCalls = 20, kSamples = 7;
  for (int i = 0; i < 3; ++i) call();
  const auto ms = jax_ep::alone::sorted_sample_ms(stream, kSamples, [&] {
    for (int i = 0; i < kCalls; ++i) call();
  });
  const double tflop_ms = 2.0 * rows * k * n * kCalls / 1e9;  // TFLOP of a sample, times 1000
  std::printf("%s %s K %lld N %lld %s G %d: %.1f TFLOP/s (best %.1f), checksum %.6e\n", KERNEL,
              name.c_str(), (long long)k, (long long)n, argv[4], groups,
              tflop_ms / ms[kSamples / 2], tflop_ms / ms[0], checksum);
}

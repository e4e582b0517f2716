// The expert_padded call's kernels timed alone, outside JAX: a standalone program that includes a
// kernel source (KERNEL: kernels/cuda/expert_layout.cu, or an edited copy of it), prints digests of
// the call's outputs (maps, weights, counts, valid rows: variants must print the same) and times
// jax_ep::cuda::expert_padded as a CUDA graph of 50 calls.
//   nvcc -std=c++17 -O3 -arch=sm_90a -I. --expt-relaxed-constexpr \
//     [-DKERNEL='"copy.cu"'] lab/cuda/expert_padded_alone.cu -o padded
//   ./padded ROWS [CAPACITY]
// Rows of 7168 FP8 bytes and 224 bytes of scales, each naming 8 distinct of 256 local experts.
#ifndef KERNEL
#define KERNEL "kernels/cuda/expert_layout.cu"
#endif
#include KERNEL

#include <algorithm>
#include <random>
#include <vector>

#include "lab/cuda/alone.cuh"

namespace {

using jax_ep::ExpertPaddedArgs;

template <class T>
T* device_zeros(size_t n) {
  T* p;
  CHECK(cudaMalloc(&p, n * sizeof(T)));
  CHECK(cudaMemset(p, 0, n * sizeof(T)));
  return p;
}

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* p = device_zeros<T>(host.size());
  CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

uint64_t digest(const void* device, size_t bytes) {  // FNV-1a
  std::vector<uint8_t> host(bytes);
  CHECK(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost));
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : host) h = (h ^ b) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::printf("usage: %s ROWS [CAPACITY]\n", argv[0]);
    return 2;
  }
  const int rows = std::atoi(argv[1]), topk = 8, experts = 256;
  const int capacity = argc > 2 ? std::atoi(argv[2]) : 128;
  const int64_t x_bytes = 7168, scale_bytes = 224, expert_rows = int64_t(experts) * capacity;
  std::mt19937 rng(7);
  std::vector<int32_t> ids(int64_t(rows) * topk), order(experts);
  std::vector<float> weights(ids.size());
  for (int e = 0; e < experts; ++e) order[e] = e;
  for (int r = 0; r < rows; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < topk; ++k) {
      ids[r * topk + k] = order[k];
      weights[r * topk + k] = float(rng() % 1000) / 1000.f;
    }
  }
  std::vector<uint8_t> x(rows * x_bytes), scales(rows * scale_bytes);
  for (auto& b : x) b = uint8_t(rng());
  for (auto& b : scales) b = uint8_t(rng());

  ExpertPaddedArgs args{};
  args.rows = rows;
  args.num_topk = topk;
  args.experts_per_rank = experts;
  args.capacity = capacity;
  args.x_row_bytes = x_bytes;
  args.scale_row_bytes = scale_bytes;
  args.topk_rows = device_copy(ids);
  args.weight_rows = device_copy(weights);
  args.x_rows = device_copy(x);
  args.scale_rows = device_copy(scales);
  args.x_out = device_zeros<uint8_t>(expert_rows * x_bytes);
  args.scales_out = device_zeros<uint8_t>(expert_rows * scale_bytes);
  args.weights_out = device_zeros<float>(expert_rows);
  args.expert_src = device_zeros<int32_t>(expert_rows);
  args.expert_of_row = device_zeros<int32_t>(expert_rows);
  args.expert_rows = device_zeros<int32_t>(int64_t(rows) * args.max_per_row());
  args.tokens_per_expert = device_zeros<int32_t>(experts);
  args.expert_counts = device_zeros<int32_t>(experts);
  args.chunk_counts = device_zeros<int32_t>(int64_t(args.chunks()) * experts);

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const std::string error = jax_ep::cuda::expert_padded(stream, args);
  if (!error.empty()) {
    std::printf("%s\n", error.c_str());
    return 1;
  }
  CHECK(cudaStreamSynchronize(stream));
  std::vector<int32_t> present(experts);
  CHECK(cudaMemcpy(present.data(), args.tokens_per_expert, sizeof(int32_t) * experts,
                   cudaMemcpyDeviceToHost));
  uint64_t valid_rows = 0;
  for (int e = 0; e < experts; ++e)
    valid_rows = valid_rows * 31 +
                 digest(args.x_out + e * capacity * x_bytes, present[e] * x_bytes) +
                 digest(args.scales_out + e * capacity * scale_bytes, present[e] * scale_bytes);
  std::printf(
      "digest maps %016llx %016llx %016llx w %016llx tpe %016llx cnt %016llx rows %016llx\n",
      (unsigned long long)digest(args.expert_src, 4 * expert_rows),
      (unsigned long long)digest(args.expert_of_row, 4 * expert_rows),
      (unsigned long long)digest(args.expert_rows, 4 * int64_t(rows) * args.max_per_row()),
      (unsigned long long)digest(args.weights_out, 4 * expert_rows),
      (unsigned long long)digest(args.tokens_per_expert, 4 * experts),
      (unsigned long long)digest(args.expert_counts, 4 * experts), (unsigned long long)valid_rows);

  constexpr int kCallsPerGraph = 50, kGraphsPerSample = 10, kSamples = 7;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kCallsPerGraph; ++i) jax_ep::cuda::expert_padded(stream, args);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, stream));
  const auto ms = jax_ep::alone::sorted_sample_ms(stream, kSamples, [&] {
    for (int i = 0; i < kGraphsPerSample; ++i) CHECK(cudaGraphLaunch(exec, stream));
  });
  const double us_per_ms_call = 1000.0 / (kGraphsPerSample * kCallsPerGraph);
  std::printf("%s rows %d C %d: %.2f us per call (min %.2f)\n", KERNEL, rows, capacity,
              ms[kSamples / 2] * us_per_ms_call, ms[0] * us_per_ms_call);
}

// What the standalone timing programs (lab/cuda/*_alone.cu) share: a CUDA error ends the
// program, a piece of work is timed by events around it on its stream, operands are filled with
// hashed values on the device, and groups are sized as bench.grouped_matmul sizes them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace jax_ep::alone {

inline void check(cudaError_t status, int line) {
  if (status == cudaSuccess) return;
  std::printf("CUDA error at line %d: %s\n", line, cudaGetErrorString(status));
  std::exit(1);
}
#define CHECK(expr) ::jax_ep::alone::check(expr, __LINE__)

// Milliseconds of `samples` runs of enqueue() on `stream`, each between two events, sorted:
// the best first, the median at samples / 2.
template <class Enqueue>
std::vector<float> sorted_sample_ms(cudaStream_t stream, int samples, Enqueue enqueue) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(samples);
  for (float& sample : ms) {
    CHECK(cudaEventRecord(start, stream));
    enqueue();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaEventElapsedTime(&sample, start, stop));
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms;
}

__device__ inline uint32_t hash_index(int64_t i, uint32_t seed) {
  uint32_t h = uint32_t(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  return h ^ (h >> 13);
}

// offset + scale * (a value in [-1, 1) from a hash of the index and seed), converted to T.
template <class T>
__global__ void fill_kernel(T* out, int64_t n, uint32_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = T(offset + scale * (float(hash_index(i, seed) & 0xffff) / 32768.f - 1.f));
}

template <class T>
T* device_random(int64_t n, uint32_t seed, float scale = 1.f, float offset = 0.f) {
  T* p;
  CHECK(cudaMalloc(&p, n * sizeof(*p)));
  fill_kernel<<<1024, 256>>>(p, n, seed, scale, offset);
  CHECK(cudaGetLastError());
  return p;
}

// bench.grouped_matmul's group sizes: `groups` multiples of 128 summing to rows; or (random) the
// counts of rows sent each to a group drawn from a fixed-seed generator.
inline std::vector<int32_t> group_sizes(const std::string& distribution, int64_t rows, int groups) {
  std::vector<int32_t> sizes(groups);
  if (distribution == "random") {
    uint64_t state = 88172645463325252ull;  // xorshift64
    for (int64_t r = 0; r < rows; ++r) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      ++sizes[state % groups];
    }
    return sizes;
  }
  const bool zipf = distribution == "zipf";
  const int64_t units = rows / 128;
  std::vector<double> share(groups);
  double total = 0;
  for (int g = 0; g < groups; ++g) total += share[g] = zipf ? 1.0 / (g + 1) : 1.0;
  int64_t used = 0;
  for (int g = 0; g < groups; ++g) used += sizes[g] = int32_t(share[g] / total * units);
  sizes[0] += int32_t(units - used);
  for (auto& s : sizes) s *= 128;
  return sizes;
}

}  // namespace jax_ep::alone

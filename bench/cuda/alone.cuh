// What the standalone timing programs (bench/cuda/*_alone.cu) share: a CUDA error ends the
// program, and a piece of work is timed by events around it on its stream.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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

}  // namespace jax_ep::alone

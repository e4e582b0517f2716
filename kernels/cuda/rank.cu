#include <mutex>
#include <unordered_map>

#include "kernels/cuda/sync.cuh"

namespace jax_ep::cuda {

Peers Rank::peers() const {
  Peers peers{};
  peers.window = window;
  for (int r = 0; r < window.num_ranks; ++r) peers.windows[r] = windows[r];
  peers.rank = rank;
  peers.timeout_ns = uint64_t(timeout_s * 1e9);
  peers.failure = failure_on_device;
  peers.direct_local = direct_local;
  return peers;
}

std::string Rank::failed() const {
  const volatile Failure& f = *failure;
  if (f.written == 0) return {};
  AbortRecord a;
  const volatile uint64_t* from = reinterpret_cast<const volatile uint64_t*>(&f.record);
  uint64_t* to = reinterpret_cast<uint64_t*>(&a);
  for (size_t i = 0; i < sizeof a / 8; ++i) to[i] = from[i];
  return abort_message(a, group, rank, timeout_s) + " [GPU " + std::to_string(device) + "]";
}

cudaError_t static_shared_bytes(const void* kernel, size_t* bytes) {
  static std::mutex mutex;
  static std::unordered_map<const void*, size_t> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(kernel); it != known.end()) return *bytes = it->second, cudaSuccess;
  cudaFuncAttributes attributes;
  if (cudaError_t err = cudaFuncGetAttributes(&attributes, kernel); err != cudaSuccess) return err;
  return *bytes = known[kernel] = attributes.sharedSizeBytes, cudaSuccess;
}

}  // namespace jax_ep::cuda

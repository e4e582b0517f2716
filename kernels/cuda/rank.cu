#include <mutex>
#include <unordered_map>

#include "kernels/cuda/sync.cuh"

namespace jax_ep::cuda {

Peers Rank::peers() const {
  Peers p{};
  p.w = window;
  for (int r = 0; r < window.num_ranks; ++r) p.window[r] = windows[r];
  p.rank = rank;
  p.timeout_ns = uint64_t(timeout_s * 1e9);
  p.failure = failure_on_device;
  p.direct_local = direct_local;
  return p;
}

namespace {
const char* what_failed(int32_t code) {
  switch (code) {
    case kWaitRows: return "waited too long for its rows";
    case kWaitCounts: return "waited too long for its row counts";
    case kWaitRelease: return "waited too long for it to release the window";
    case kWaitLower: return "waited too long for its row counts (rows placed after its)";
    case kKindMismatch: return "found it ran another kind of op (dispatch against combine)";
  }
  return "failed";
}
}  // namespace

std::string Rank::failed() const {
  const volatile Failure& f = *failure;
  if (f.code == 0) return {};
  const bool timed_out = f.code != kKindMismatch;
  return "jax_ep: rank " + std::to_string(f.rank) + " of EP group " + std::to_string(group) +
         " (GPU " + std::to_string(device) + ") " + what_failed(f.code) + " from rank " +
         std::to_string(f.peer) + " at op " + std::to_string(uint64_t(f.op)) +
         (timed_out ? " (timeout_s=" + std::to_string(timeout_s) + ")" : std::string()) +
         ": every rank must run the same jax_ep ops" + (timed_out ? "; did a process stop?" : "") +
         " The op's results were not usable; this Buffer stopped (create a new one)";
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

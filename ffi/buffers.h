// The native side of a jax_ep.Buffer: its ranks on this process's devices, found by the Buffer's
// key when XLA instantiates an executable that uses it. The key is the same on every process
// (jax_ep/bootstrap.py), so the compiled programs are too. A handler's state holds its rank, so
// a Buffer's memory lives until close() and the last executable using it are both gone.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

class NativeBuffer {
 public:
  virtual ~NativeBuffer() = default;
  // The error that stopped one of this process's ranks (or an abort a peer wrote into its
  // window), or "": read without synchronising with the device.
  virtual std::string status() const = 0;
  // This Buffer's rank on `device` (a local device ordinal), or null.
  void* rank_on(int device) const {
    auto it = ranks.find(device);
    return it == ranks.end() ? nullptr : it->second.get();
  }
  std::map<int, std::shared_ptr<void>> ranks;  // by device ordinal: cpu::Rank or cuda::Rank
};

void register_buffer(int64_t key, std::shared_ptr<NativeBuffer> buffer);
void forget_buffer(int64_t key);
void forget_all_buffers();  // at interpreter exit
std::shared_ptr<NativeBuffer> find_buffer(int64_t key);

// What a custom call's instantiate stage decodes once: its Buffer and its static configuration.
// (XLA:CPU instantiates without a device, so the rank is looked up when the call runs.)
struct CallConfig {
  bool fp8, round_scale, low_latency;
  int32_t rows_dtype;  // the Dtype combine rows travel in
};

template <class RankT>
struct CallState {
  static xla::ffi::TypeId id;
  std::shared_ptr<NativeBuffer> buffer;
  CallConfig config;
  RankT* rank_on(int device) const { return static_cast<RankT*>(buffer->rank_on(device)); }
};
template <class RankT>
xla::ffi::TypeId CallState<RankT>::id = {};

template <class RankT>
xla::ffi::ErrorOr<std::unique_ptr<CallState<RankT>>> instantiate(int64_t buffer,
                                                                 const CallConfig& config) {
  auto native = find_buffer(buffer);
  if (!native)
    return xla::ffi::Unexpected(xla::ffi::Error(
        xla::ffi::ErrorCode::kFailedPrecondition,
        "jax_ep: this program uses a Buffer that was closed before it was compiled (or was "
        "never created in this process)"));
  return std::unique_ptr<CallState<RankT>>(new CallState<RankT>{std::move(native), config});
}

}  // namespace jax_ep

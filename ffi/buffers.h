// The native side of a jax_ep.Buffer: its ranks on this process's devices, found by the Buffer's
// key when XLA instantiates an executable that uses it. The key is the same on every process
// (jax_ep/bootstrap.py), so the compiled programs are too. A handler's state holds its rank, so
// a Buffer's memory lives until close() and the last executable using it are both gone.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/dtype.h"
#include "kernels/signature.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// Made by C++ (std::make_shared, module.cc): a shared_ptr that XLA's call states and the registry
// hold then keeps no Python object alive (nanobind finds it through shared_from_this), so the
// Python side goes with its Buffer and the native side with its last user.
class NativeBuffer : public std::enable_shared_from_this<NativeBuffer> {
 public:
  virtual ~NativeBuffer() = default;
  // The error that stopped one of this process's ranks (or an abort a peer wrote into its
  // window), or "": read without synchronising with the device.
  virtual std::string status() const = 0;
  // The process holding rank `rank` of EP group `group` has ended (ffi/ended.h): this process's
  // ranks of the group stop waiting for it.
  virtual void peer_ended(int group, int rank) = 0;
  // Nodes of a tuple axis ran different ops (jax_ep/node_check.py; `record` says which): every
  // rank here stops with it, so that status() names both ops and the next op raises.
  virtual void stop(const AbortRecord& record) = 0;
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

// A custom call's static configuration, decoded once when XLA instantiates it (ffi/decode.h).
struct CallConfig {
  bool fp8, round_scale, low_latency;
  Dtype rows_dtype;   // what combine rows travel in
  int64_t call_site;  // where the program calls the op (jax_ep/ffi_path.py, call_site)
};

// What a custom call's instantiate stage keeps: its Buffer and its configuration. (XLA:CPU
// instantiates without a device, so the rank is looked up when the call runs.)
template <class RankT>
struct CallState {
  static xla::ffi::TypeId id;
  std::shared_ptr<NativeBuffer> buffer;
  CallConfig config;
  RankT* rank_on(int device) const { return static_cast<RankT*>(buffer->rank_on(device)); }
};
template <class RankT>
xla::ffi::TypeId CallState<RankT>::id = {};

}  // namespace jax_ep

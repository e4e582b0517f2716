#include "ffi/buffers.h"

#include <mutex>

namespace jax_ep {
namespace {

std::mutex mu;
std::map<int64_t, std::shared_ptr<NativeBuffer>>& buffers() {
  static auto* live = new std::map<int64_t, std::shared_ptr<NativeBuffer>>();
  return *live;
}

}  // namespace

void register_buffer(int64_t key, std::shared_ptr<NativeBuffer> buffer) {
  std::lock_guard<std::mutex> lock(mu);
  buffers()[key] = std::move(buffer);
}

void forget_buffer(int64_t key) {
  std::shared_ptr<NativeBuffer> dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(mu);
  auto it = buffers().find(key);
  if (it == buffers().end()) return;
  dropped = std::move(it->second);
  buffers().erase(it);
}

void forget_all_buffers() {
  std::map<int64_t, std::shared_ptr<NativeBuffer>> dropped;
  std::lock_guard<std::mutex> lock(mu);
  dropped.swap(buffers());
}

std::shared_ptr<NativeBuffer> find_buffer(int64_t key) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = buffers().find(key);
  return it == buffers().end() ? nullptr : it->second;
}

}  // namespace jax_ep

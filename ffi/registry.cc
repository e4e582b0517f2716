#include "ffi/registry.h"

#include <mutex>

namespace jax_ep {
namespace {
std::mutex registry_mu;
std::unordered_map<int64_t, std::shared_ptr<BufferState>>& registry() {
  static auto* buffers = new std::unordered_map<int64_t, std::shared_ptr<BufferState>>();
  return *buffers;
}
int64_t next_id = 1;
}  // namespace

int64_t register_buffer(std::shared_ptr<BufferState> state) {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry()[next_id] = std::move(state);
  return next_id++;
}

void unregister_buffer(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry().erase(id);
}

std::shared_ptr<BufferState> find_buffer(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

std::string locate(int64_t id, int device, std::shared_ptr<BufferState>* state, Place* place) {
  *state = find_buffer(id);
  if (!*state) return "jax_ep: Buffer " + std::to_string(id) + " does not exist (closed?)";
  auto it = (*state)->places.find(device);
  if (it == (*state)->places.end())
    return "jax_ep: device " + std::to_string(device) + " is not in the mesh of Buffer " +
           std::to_string(id);
  *place = it->second;
  return {};
}

}  // namespace jax_ep

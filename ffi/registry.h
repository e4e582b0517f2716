// The native side of jax_ep.Buffer: which device is which rank of which EP group, and the
// communication memory of each backend. Handlers find it by the buffer id attribute and their
// device ordinal.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/exchange.h"

namespace jax_ep {

struct Place {
  int group, rank;
};

struct BufferState {
  int num_ranks, num_experts;
  std::unordered_map<int, Place> places;           // by device ordinal
  std::vector<std::unique_ptr<cpu::Group>> cpu_groups;
  std::shared_ptr<void> cuda;                      // the CUDA backend's per-device state
};

int64_t register_buffer(std::shared_ptr<BufferState> state);
void unregister_buffer(int64_t id);
std::shared_ptr<BufferState> find_buffer(int64_t id);

// The place of `device` in buffer `id`, or an error message.
std::string locate(int64_t id, int device, std::shared_ptr<BufferState>* state, Place* place);

}  // namespace jax_ep

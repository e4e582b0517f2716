// The custom-call targets each backend exports, by op name.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ffi/registry.h"
#include "xla/ffi/api/c_api.h"

namespace jax_ep {

using Targets = std::map<std::string, XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)>;

Targets cpu_targets();

#ifdef JAX_EP_WITH_CUDA
Targets cuda_targets();
// Allocates each device's communication memory and connects the peers of every group.
std::shared_ptr<void> cuda_connect(const std::vector<std::vector<int>>& groups,
                                   int experts_per_rank, int hidden, int num_topk,
                                   int low_latency_tokens, int num_sms, double timeout_s);
// How many times the cross-rank CUDA handlers ran (tests: command-buffer replays skip them).
int64_t cuda_handler_calls();
// Peer bandwidth of a transfer mechanism, GB/s per direction (kernels/cuda/backend.h).
double cuda_peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters,
                      bool both_ways, uintptr_t dst_buffer);
#endif

}  // namespace jax_ep

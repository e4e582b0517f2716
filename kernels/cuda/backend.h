// Host interface of the CUDA backend (one process driving all local GPUs).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace jax_ep::cuda {

struct Knobs {
  int num_sms;          // blocks of the bandwidth kernels (one per SM)
  double timeout_s;     // every device-side wait for a peer
};

// The communication memory of one Buffer on every device of its groups, peers connected.
class Comm;
std::shared_ptr<Comm> connect(const std::vector<std::vector<int>>& groups, int experts_per_rank,
                              Knobs knobs);

// Each returns an empty string once the kernels are enqueued on `stream`, else the error.
std::string dispatch(Comm& comm, int device, cudaStream_t stream, const DispatchArgs& a);
std::string combine(Comm& comm, int device, cudaStream_t stream, const CombineArgs& a);
std::string expert_layout(cudaStream_t stream, const ExpertLayoutArgs& a);

// Bandwidth (GB/s per direction) of moving bytes from device src to device dst, and at the same
// time from dst to src when both_ways: the ceilings the benchmark reports. mode -1: the copy
// engine; from `blocks` SMs: 0 bulk-copy (TMA) stores, 1 plain stores, 2 bulk-copy loads,
// 3 plain loads.
double peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters, bool both_ways);

}  // namespace jax_ep::cuda

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "kernels/cuda/comm.cuh"

namespace jax_ep::cuda {

std::string enable_peer_access(int device, int peer) {
  int can = 0;
  JAX_EP_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can)
    return "jax_ep: GPU " + std::to_string(device) + " cannot access GPU " +
           std::to_string(peer) + " directly (no NVLink/PCIe peer access)";
  JAX_EP_CUDA_TRY(cudaSetDevice(device));
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) return cudaGetLastError(), std::string();
  JAX_EP_CUDA_TRY(err);
  return {};
}

namespace {

const char* wait_name(int what) {
  switch (what) {
    case kWaitCounts: return "its row counts";
    case kWaitMailbox: return "its buffer addresses";
    case kWaitArrived: return "its rows to arrive";
    case kWaitReleased: return "it to finish reading";
  }
  return "it";
}

std::string connect_into(Comm& comm, const std::vector<std::vector<int>>& groups,
                         const Shape& shape) {
  const int experts_per_rank = shape.experts_per_rank;
  for (const auto& group : groups) {
    const int num_ranks = int(group.size());
    if (num_ranks > kMaxRanks) return "jax_ep: at most 32 ranks per EP group";
    std::vector<DeviceState*> states(num_ranks);
    for (int r = 0; r < num_ranks; ++r) {
      for (int peer : group)
        if (peer != group[r])
          if (auto err = enable_peer_access(group[r], peer); !err.empty()) return err;
      JAX_EP_CUDA_TRY(cudaSetDevice(group[r]));
      DeviceState initial{};
      const size_t tally = sizeof(int32_t) * num_ranks * experts_per_rank;
      JAX_EP_CUDA_TRY(cudaMalloc(&initial.expert_tally, tally));
      JAX_EP_CUDA_TRY(cudaMalloc(&initial.expert_inbox, 2 * tally));
      JAX_EP_CUDA_TRY(cudaMalloc(&states[r], sizeof(DeviceState)));
      JAX_EP_CUDA_TRY(cudaMemcpy(states[r], &initial, sizeof(DeviceState), cudaMemcpyHostToDevice));
      Failure* failure = nullptr;
      JAX_EP_CUDA_TRY(cudaHostAlloc(&failure, sizeof(Failure), cudaHostAllocMapped |
                                                                  cudaHostAllocPortable));
      *failure = Failure{};
      Comm::Rank rank{failure, nullptr, nullptr, nullptr, {}};
      LowLatencyLink& ll = rank.link.low_latency;
      ll.tokens = shape.low_latency_tokens;
      ll.hidden = shape.hidden;
      ll.num_topk = shape.num_topk;
      if (ll.tokens > 0) {  // both kinds' regions and the expert rows, zeroed: no flag raised yet
        const int64_t per_kind[2] = {2 * int64_t(num_ranks) * ll.tokens * ll.row_bytes(kLowLatencyDispatch),
                                     2 * int64_t(num_ranks) * ll.tokens * ll.row_bytes(kLowLatencyCombine)};
        const int64_t expert_rows = sizeof(uint64_t) * 2 * num_ranks * experts_per_rank;
        const int64_t bytes = per_kind[0] + per_kind[1] + expert_rows;
        JAX_EP_CUDA_TRY(cudaMalloc(&rank.regions, bytes));
        ll.region[kLowLatencyDispatch][r] = rank.regions;
        ll.region[kLowLatencyCombine][r] = rank.regions + per_kind[0];
        ll.expert_rows[r] = reinterpret_cast<uint64_t*>(rank.regions + per_kind[0] + per_kind[1]);
        JAX_EP_CUDA_TRY(cudaMemset(rank.regions, 0, bytes));
      }
      rank.link.self = states[r];
      JAX_EP_CUDA_TRY(cudaHostGetDevicePointer(&rank.link.failure, failure, 0));
      rank.link.num_ranks = num_ranks;
      rank.link.rank = r;
      rank.link.experts_per_rank = experts_per_rank;
      rank.tally = initial.expert_tally;
      rank.inbox = initial.expert_inbox;
      rank.link.timeout_ns = uint64_t(comm.knobs.timeout_s * 1e9);
      comm.ranks[group[r]] = rank;
    }
    for (int r = 0; r < num_ranks; ++r)
      for (int p = 0; p < num_ranks; ++p) {
        Link& link = comm.ranks[group[r]].link;
        const Link& peer = comm.ranks[group[p]].link;
        link.peers[p] = states[p];
        for (int kind : {kLowLatencyDispatch, kLowLatencyCombine})
          link.low_latency.region[kind][p] = peer.low_latency.region[kind][p];
        link.low_latency.expert_rows[p] = peer.low_latency.expert_rows[p];
      }
  }
  return {};
}

}  // namespace

std::shared_ptr<Comm> connect(const std::vector<std::vector<int>>& groups, const Shape& shape,
                              Knobs knobs) {
  auto comm = std::make_shared<Comm>();
  comm->knobs = knobs;
  int previous = 0;
  cudaGetDevice(&previous);
  std::string err = connect_into(*comm, groups, shape);
  cudaSetDevice(previous);
  if (!err.empty()) throw std::runtime_error(err);
  return comm;
}

Comm::~Comm() {
  int previous = 0;
  cudaGetDevice(&previous);
  for (auto& [device, rank] : ranks) {  // kernels may still use the memory: wait for them
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    cudaFree(rank.link.self);
    cudaFree(rank.tally);
    cudaFree(rank.inbox);
    cudaFree(rank.regions);
    cudaFreeHost(rank.failure);
  }
  cudaSetDevice(previous);
}

std::string Comm::rank_on(int device, Rank** out) {
  auto it = ranks.find(device);
  if (it == ranks.end()) return "jax_ep: GPU " + std::to_string(device) + " is not in this Buffer";
  const volatile Failure& f = *it->second.failure;  // written by kernels that timed out
  if (f.code != 0)
    return "jax_ep: rank " + std::to_string(f.rank) + " (GPU " + std::to_string(device) +
           ") waited more than " + std::to_string(knobs.timeout_s) + " s at op " +
           std::to_string(uint64_t(f.seq)) + " for rank " + std::to_string(f.peer) + " (" +
           wait_name(f.what) + ") and stopped; the CUDA context is lost, restart the process";
  *out = &it->second;
  return {};
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

int bandwidth_blocks(const Knobs& knobs, int device) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return knobs.num_sms < sms ? knobs.num_sms : sms;
}

}  // namespace jax_ep::cuda

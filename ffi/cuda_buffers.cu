// The CUDA sides of a Buffer: the windows of an engine (transport/nccl.h or cuda_ipc.h) and a
// cuda::Rank on each of them (kernels/cuda/rank.h).
#include "ffi/backends.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"
#include "kernels/cuda/rank.h"

namespace jax_ep {
namespace {

// The first error of one of this process's ranks, or "".
std::string ranks_status(const std::map<int, std::shared_ptr<void>>& ranks) {
  for (const auto& [device, rank] : ranks)
    if (auto err = static_cast<const cuda::Rank*>(rank.get())->failed(); !err.empty()) return err;
  return {};
}

void ranks_peer_ended(const std::map<int, std::shared_ptr<void>>& ranks, int group, int rank) {
  for (const auto& [device, r] : ranks)
    if (auto* mine = static_cast<const cuda::Rank*>(r.get()); mine->group == group)
      mine->peer_ended(rank);
}

void ranks_stop(const std::map<int, std::shared_ptr<void>>& ranks, const AbortRecord& record) {
  for (const auto& [device, r] : ranks) static_cast<const cuda::Rank*>(r.get())->stop(record);
}

size_t window_allocation(const Window& window) {
  return size_t(align_bytes(window.total_bytes(), 4096));
}

}  // namespace

CudaBuffer::CudaBuffer(const Window& window, const std::string& nccl_library, double timeout_s,
                       int num_sms, std::vector<LocalRank> local,
                       const std::map<int, std::string>& unique_ids, bool direct_local,
                       uint64_t first_op, const std::function<bool()>& interrupted) {
  const cuda::RankConfig config{window, num_sms, timeout_s, direct_local, first_op};
  int previous = 0;
  cudaGetDevice(&previous);
  std::map<int, std::vector<std::pair<int, int>>> by_group;  // in group order on every process
  for (const LocalRank& l : local) by_group[l.group].push_back({l.device, l.rank});
  for (const auto& [group, members] : by_group) {
    auto comms =
        std::make_shared<nccl::Group>(nccl_library, unique_ids.at(group), window.num_ranks, members,
                                      window_allocation(window), timeout_s, interrupted);
    for (const nccl::Group::Member& m : comms->members)
      ranks[m.device] = cuda::make_rank(config, group, m.rank, m.device, m.peers, comms);
  }
  cudaSetDevice(previous);
}

CudaBuffer::~CudaBuffer() { ranks.clear(); }

std::string CudaBuffer::status() const { return ranks_status(ranks); }

void CudaBuffer::peer_ended(int group, int rank) { ranks_peer_ended(ranks, group, rank); }

void CudaBuffer::stop(const AbortRecord& record) { ranks_stop(ranks, record); }

CudaIpcBuffer::CudaIpcBuffer(const Window& window, const std::string& socket_name,
                             const std::string& secret, const std::vector<int>& pids,
                             double timeout_s, int num_sms, std::vector<LocalRank> local,
                             bool direct_local, uint64_t first_op)
    : config_(std::make_shared<cuda::RankConfig>(
          cuda::RankConfig{window, num_sms, timeout_s, direct_local, first_op})) {
  engine_ = std::make_shared<cuda_ipc::Engine>(socket_name, secret, pids, window.num_ranks, local,
                                               window_allocation(window));
}

std::string CudaIpcBuffer::socket() const { return engine_->socket(); }

std::vector<std::string> CudaIpcBuffer::notes() const { return engine_->notes(); }

std::vector<std::pair<int, int>> CudaIpcBuffer::connect(const std::vector<EnginePeer>& peers,
                                                        double slice_s) {
  if (!ranks.empty()) return {};
  auto missing = engine_->connect(peers, slice_s);
  if (!missing.empty()) return missing;
  int previous = 0;
  cudaGetDevice(&previous);
  for (const cuda_ipc::Engine::Member& m : engine_->members)
    ranks[m.device] = cuda::make_rank(*config_, m.group, m.rank, m.device, m.peers, engine_);
  cudaSetDevice(previous);
  return {};
}

void CudaIpcBuffer::stop_serving() { engine_->stop(); }

CudaIpcBuffer::~CudaIpcBuffer() { ranks.clear(); }

std::string CudaIpcBuffer::status() const { return ranks_status(ranks); }

void CudaIpcBuffer::peer_ended(int group, int rank) { ranks_peer_ended(ranks, group, rank); }

void CudaIpcBuffer::stop(const AbortRecord& record) { ranks_stop(ranks, record); }

}  // namespace jax_ep

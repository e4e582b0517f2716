// The CPU side of a Buffer: the shared-memory engine's windows (transport/shm.h) and a
// cpu::Rank on each of them.
#include "ffi/backends.h"
#include "transport/shm.h"
#include "kernels/cpu/rank.h"

namespace jax_ep {

CpuBuffer::CpuBuffer(const Window& window, const std::string& socket_name,
                     const std::string& secret, const std::vector<int>& pids, double timeout_s,
                     const std::vector<LocalRank>& local, uint64_t first_op)
    : window_(window), timeout_s_(timeout_s), first_op_(first_op) {
  engine_ = std::make_shared<shm::Engine>(window.num_ranks, local, size_t(window.total_bytes()));
  for (const shm::Engine::Member& m : engine_->members)  // before any peer maps them
    initial_words(window, first_op, [mine = m.window](int64_t at, uint64_t value) {
      *reinterpret_cast<uint64_t*>(mine + at) = value;
    });
  engine_->serve(socket_name, secret, pids);
}

CpuBuffer::~CpuBuffer() { ranks.clear(); }

std::string CpuBuffer::status() const {
  for (const auto& [device, rank] : ranks)
    if (auto err = static_cast<const cpu::Rank*>(rank.get())->status(); !err.empty()) return err;
  return {};
}

void CpuBuffer::peer_ended(int group, int rank) {
  for (const auto& [device, r] : ranks)
    if (auto* mine = static_cast<cpu::Rank*>(r.get()); mine->group == group) mine->peer_ended(rank);
}

void CpuBuffer::stop(const AbortRecord& record) {
  for (auto& [device, r] : ranks) static_cast<cpu::Rank*>(r.get())->publish(record);
}

std::string CpuBuffer::socket() const { return engine_->socket(); }

std::vector<std::string> CpuBuffer::notes() const { return engine_->notes(); }

std::vector<std::pair<int, int>> CpuBuffer::connect(const std::vector<EnginePeer>& peers,
                                                    double slice_s) {
  if (!ranks.empty()) return {};
  auto missing = engine_->connect(peers, slice_s);
  if (!missing.empty()) return missing;
  for (const shm::Engine::Member& m : engine_->members)
    ranks[m.device] = std::make_shared<cpu::Rank>(window_, m.group, m.rank, m.peers, engine_,
                                                  timeout_s_, first_op_);
  return {};
}

void CpuBuffer::stop_serving() { engine_->stop_serving(); }

}  // namespace jax_ep

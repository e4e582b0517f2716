// The CPU side of a Buffer: the shared-memory engine's windows (kernels/comm/shm.h) and a
// cpu::Rank on each of them.
#include "ffi/backends.h"
#include "kernels/comm/shm.h"
#include "kernels/cpu/rank.h"

namespace jax_ep {

CpuBuffer::CpuBuffer(const Window& window, std::string prefix, double timeout_s,
                     std::vector<LocalRank> local, uint64_t first_op)
    : window_(window),
      prefix_(std::move(prefix)),
      timeout_s_(timeout_s),
      local_(std::move(local)),
      first_op_(first_op) {}

CpuBuffer::~CpuBuffer() { ranks.clear(); }

std::string CpuBuffer::status() const {
  for (const auto& [device, rank] : ranks)
    if (auto err = static_cast<const cpu::Rank*>(rank.get())->status(); !err.empty()) return err;
  return {};
}

void CpuBuffer::create() {
  std::vector<shm::Engine::Member> members;
  for (const LocalRank& l : local_) members.push_back({l.device, l.group, l.rank, nullptr, {}});
  engine_ = std::make_shared<shm::Engine>(prefix_, window_.num_ranks, members,
                                          size_t(window_.total_bytes()));
  for (const shm::Engine::Member& m : engine_->members)  // before any peer maps them
    initial_words(window_, first_op_, [mine = m.window](int64_t at, uint64_t value) {
      *reinterpret_cast<uint64_t*>(mine + at) = value;
    });
}

void CpuBuffer::connect() {
  engine_->connect();
  for (const shm::Engine::Member& m : engine_->members)
    ranks[m.device] = std::make_shared<cpu::Rank>(window_, m.group, m.rank, m.peers, engine_,
                                                  timeout_s_, first_op_);
}

void CpuBuffer::unlink() { engine_->unlink(); }

}  // namespace jax_ep

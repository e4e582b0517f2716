#include "kernels/cpu/rank.h"

#include <chrono>

namespace jax_ep::cpu {

uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

Rank::Rank(const Window& window, int group, int rank, std::vector<uint8_t*> windows,
           std::shared_ptr<void> keep, double timeout_s)
    : window(window), group(group), rank(rank), windows_(std::move(windows)),
      keep_(std::move(keep)), timeout_s_(timeout_s) {
  worker_ = std::thread([this] { work(); });
  completer_ = std::thread([this] { complete(); });
}

Rank::~Rank() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  completer_.join();
}

void Rank::run(std::function<std::string()> job, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.emplace_back(std::move(job), std::move(done));
  }
  cv_.notify_all();
}

void Rank::work() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    auto [job, done] = std::move(jobs_.front());
    jobs_.pop_front();
    std::string error = broken_;
    if (error.empty()) {
      lock.unlock();
      error = job();
      lock.lock();
      if (!error.empty())
        broken_ = error + " (this Buffer stopped here: its ranks no longer agree on the ops "
                          "in flight; create a new Buffer)";
    }
    completions_.emplace_back(std::move(done), std::move(error));
    cv_.notify_all();
  }
}

void Rank::complete() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return !completions_.empty() || (stop_ && jobs_.empty()); });
    if (completions_.empty()) return;
    auto [done, error] = std::move(completions_.front());
    completions_.pop_front();
    lock.unlock();
    done(error);
    lock.lock();
  }
}

uint64_t Rank::op_of_ticket(int32_t ticket) const {
  // The newest op sent whose low 32 bits are the ticket: recv halves follow their sends closely.
  return sent_ - uint32_t(uint32_t(sent_) - uint32_t(ticket));
}

template <typename Ready>
std::string Rank::wait(int64_t offset, Ready ready, uint64_t op, int peer, const char* what) const {
  const uint64_t* w = word(rank, offset);
  if (ready(load_acquire(w))) return {};
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s_));
  // Peers are other threads or processes, often on fewer cores than ranks: back off to sleeps.
  for (int i = 0; !ready(load_acquire(w)); ++i) {
    if (i < 64) continue;
    if (Clock::now() > deadline)
      return "jax_ep: rank " + std::to_string(rank) + " of EP group " + std::to_string(group) +
             " waited more than " + std::to_string(timeout_s_) + " s for rank " +
             std::to_string(peer) + " (" + what + ", op " + std::to_string(op) +
             "): every rank of the group must run the same jax_ep ops; did a process stop?";
    std::this_thread::sleep_for(std::chrono::microseconds(i < 128 ? 1 : i < 256 ? 20 : 200));
  }
  return {};
}

std::string Rank::wait_tag(int64_t offset, uint64_t op, int peer, const char* what) const {
  return wait(offset, [op](uint64_t v) { return tag_op(v) >= op; }, op, peer, what);
}

std::string Rank::wait_value(int64_t offset, uint64_t at_least, int peer, const char* what) const {
  return wait(offset, [at_least](uint64_t v) { return v >= at_least; }, at_least, peer, what);
}

}  // namespace jax_ep::cpu

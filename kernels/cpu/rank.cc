#include "kernels/cpu/rank.h"

#include <chrono>

namespace jax_ep::cpu {

Rank::Rank(const Window& window, int group, int rank, std::vector<uint8_t*> windows,
           std::shared_ptr<void> keep, double timeout_s)
    : window(window), group(group), rank(rank), windows_(std::move(windows)),
      keep_(std::move(keep)), timeout_s_(timeout_s), queues_(std::make_shared<Queues>()) {
  worker_ = std::thread(work, queues_);
  completer_ = std::thread(complete, queues_);
}

Rank::~Rank() {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    queues_->stop = true;
  }
  queues_->cv.notify_all();
  for (std::thread* t : {&worker_, &completer_}) {
    if (t->get_id() == std::this_thread::get_id())
      t->detach();
    else
      t->join();
  }
}

void Rank::run(std::function<std::string()> job, Done done) {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    queues_->jobs.emplace_back(std::move(job), std::move(done));
  }
  queues_->cv.notify_all();
}

void Rank::work(std::shared_ptr<Queues> q) {
  std::unique_lock<std::mutex> lock(q->mu);
  while (true) {
    q->cv.wait(lock, [&] { return q->stop || !q->jobs.empty(); });
    if (q->jobs.empty()) return;
    auto [job, done] = std::move(q->jobs.front());
    q->jobs.pop_front();
    ++q->running;
    std::string error = q->broken;
    if (error.empty()) {
      lock.unlock();
      error = job();
      lock.lock();
      if (!error.empty())
        q->broken = error + " (this Buffer stopped here: its ranks no longer agree on the ops "
                            "in flight; create a new Buffer)";
    }
    q->completions.emplace_back(std::move(done), std::move(error));
    --q->running;
    q->cv.notify_all();
  }
}

void Rank::complete(std::shared_ptr<Queues> q) {
  std::unique_lock<std::mutex> lock(q->mu);
  while (true) {
    q->cv.wait(lock, [&] {
      return !q->completions.empty() || (q->stop && q->jobs.empty() && q->running == 0);
    });
    if (q->completions.empty()) return;
    auto [done, error] = std::move(q->completions.front());
    q->completions.pop_front();
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

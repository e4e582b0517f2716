#include "kernels/cpu/rank.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <pmmintrin.h>
#include <xmmintrin.h>
#endif
#if defined(__linux__)
#include <sys/prctl.h>
#endif

namespace jax_ep::cpu {
namespace {

constexpr int kReadySoonUs = 30;  // how long a handler waits for its peers before the hand-off

// XLA:CPU runs its computations with denormals flushed to zero, as inputs and as results. So do
// a rank's threads: they sum a combine's rows, and completing an op runs the device's next XLA
// work on them; without it both kept denormals that the reference path and the rest of the
// program flush.
void flush_denormals() {
#if defined(__x86_64__) || defined(__i386__)
  _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
  _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
#elif defined(__aarch64__)
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  asm volatile("msr fpcr, %0" ::"r"(fpcr | (uint64_t(1) << 24)));  // FZ
#endif
}

// Linux lets a sleeping thread oversleep by its timer slack, 50 us by default: the backoff of a
// wait for a peer (wait_op) and the hand-offs between a rank's threads would each cost that
// much, which at small sizes is most of an op.
void precise_sleeps() {
#if defined(__linux__)
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
#endif
}

uint64_t float_mode() {
#if defined(__x86_64__) || defined(__i386__)
  return _mm_getcsr();
#elif defined(__aarch64__)
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  return fpcr;
#else
  return 0;
#endif
}

void set_float_mode(uint64_t mode) {
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(static_cast<unsigned>(mode));
#elif defined(__aarch64__)
  asm volatile("msr fpcr, %0" ::"r"(mode));
#else
  (void)mode;
#endif
}

}  // namespace

FlushDenormals::FlushDenormals() : saved_(float_mode()) { flush_denormals(); }
FlushDenormals::~FlushDenormals() { set_float_mode(saved_); }

Rank::Rank(const Window& window, int group, int rank, std::vector<uint8_t*> windows,
           std::shared_ptr<void> keep, double timeout_s, uint64_t first_op)
    : window(window),
      group(group),
      rank(rank),
      windows_(std::move(windows)),
      keep_(std::move(keep)),
      timeout_s_(timeout_s),
      ended_(std::make_unique<std::atomic<bool>[]>(window.num_ranks)),
      sent_(first_op),
      queues_(std::make_shared<Queues>()) {
  worker_ = std::thread(work, queues_, this);
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

void Rank::run(uint64_t op, std::function<std::string()> job, std::function<void()> poison,
               Done done) {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    queues_->jobs.push_back({op, std::move(job), std::move(poison), std::move(done)});
  }
  queues_->cv.notify_all();
}

bool Rank::ready_to_send(uint64_t op) const { return idle() && slot_free(op); }

bool Rank::ready_soon(uint64_t op) const {
  if (!idle()) return false;  // nothing else of the rank can start meanwhile: checked once
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::microseconds(kReadySoonUs);
  while (!counts_in(op)) {
    if (Clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

bool Rank::counts_in(uint64_t op) const {
  for (int s = 0; s < window.num_ranks; ++s)
    if (load_acquire(word(rank, window.counts_at(int(op % kSlots), s))) < op) return false;
  return true;
}

bool Rank::slot_free(uint64_t op) const {
  if (op <= kSlots) return true;
  for (int d = 0; d < window.num_ranks; ++d)
    if (load_acquire(word(rank, window.released_at(int(op % kSlots), d))) < op - kSlots)
      return false;
  return true;
}

bool Rank::idle() const {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    if (!queues_->jobs.empty() || queues_->running || !queues_->broken.empty()) return false;
  }
  return load_acquire(word(rank, window.aborted_at())) == kNoAbort;
}

void Rank::broken(uint64_t op, const std::string& error) {
  std::lock_guard<std::mutex> lock(queues_->mu);
  if (!queues_->broken.empty()) return;
  queues_->broken = error;
  queues_->broken_op = op;
}

// Jobs run while the rank lives: the calls in flight hold it (see cpu_handlers.cc).
void Rank::work(std::shared_ptr<Queues> q, const Rank* rank) {
  flush_denormals();
  precise_sleeps();
  std::unique_lock<std::mutex> lock(q->mu);
  while (true) {
    q->cv.wait(lock, [&] { return q->stop || !q->jobs.empty(); });
    if (q->jobs.empty()) return;
    Queues::Job job = std::move(q->jobs.front());
    q->jobs.pop_front();
    ++q->running;
    if (q->broken.empty()) {
      lock.unlock();
      uint64_t failed_op = job.op;
      std::string error;
      if (!rank->aborted(&failed_op, &error)) error = job.run();  // else a peer gave up first
      lock.lock();
      if (!error.empty()) {
        q->broken = error;
        q->broken_op = failed_op;
      }
    }
    // The failed op's parts leave NaN and succeed; any other op fails with the error.
    std::string error;
    if (!q->broken.empty()) {
      lock.unlock();
      if (job.poison) job.poison();
      lock.lock();
      if (job.op != q->broken_op) error = q->broken;
    }
    q->completions.emplace_back(std::move(job.done), std::move(error));
    --q->running;
    q->cv.notify_all();
  }
}

void Rank::complete(std::shared_ptr<Queues> q) {
  flush_denormals();
  precise_sleeps();
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

std::string Rank::status() const {
  {
    std::lock_guard<std::mutex> lock(queues_->mu);
    if (!queues_->broken.empty()) return queues_->broken;
  }
  uint64_t op = 0;
  std::string error;
  aborted(&op, &error);
  return error;
}

uint64_t Rank::op_of_ticket(int32_t ticket) const {
  // The newest op sent whose low 32 bits are the ticket: recv halves follow their sends closely.
  return sent_ - uint32_t(uint32_t(sent_) - uint32_t(ticket));
}

bool Rank::aborted(uint64_t* op, std::string* error) const {
  const Window& w = window;
  if (load_acquire(word(rank, w.aborted_at())) != kAbortWritten) return false;
  AbortRecord a;
  std::memcpy(&a, windows_[rank] + w.abort_record_at(), sizeof a);
  *op = a.op;
  *error = abort_message(a, group, rank, timeout_s_);
  return true;
}

void Rank::publish(const AbortRecord& a) const {
  const Window& w = window;
  // Its own window first: the record it reports is the first of its window.
  for (int i = 0; i < w.num_ranks; ++i) {
    const int r = (rank + i) % w.num_ranks;
    uint64_t expected = kNoAbort;
    if (!__atomic_compare_exchange_n(word(r, w.aborted_at()), &expected, uint64_t(kAbortClaimed),
                                     false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      continue;  // another rank's abort came first
    std::memcpy(windows_[r] + w.abort_record_at(), &a, sizeof a);
    store_release(word(r, w.aborted_at()), kAbortWritten);
  }
}

std::string Rank::give_up(Wait code, int peer, uint64_t op, const uint64_t* mine,
                          const uint64_t* theirs) const {
  AbortRecord a{};
  a.code = uint64_t(code);
  a.giver = uint64_t(rank);
  a.peer = uint64_t(peer);
  a.op = op;
  if (mine && theirs) {
    std::memcpy(a.mine, mine, sizeof a.mine);
    std::memcpy(a.theirs, theirs, sizeof a.theirs);
  }
  publish(a);
  // The first abort of this window, once its writer has published it (a moment; if it never
  // does, this rank's own).
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + std::chrono::seconds(1);
  uint64_t first_op = 0;
  std::string error;
  while (!aborted(&first_op, &error) && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  return error.empty() ? abort_message(a, group, rank, timeout_s_) : error;
}

std::string Rank::wait_op(int64_t offset, uint64_t op, int peer, Wait what) const {
  const uint64_t* w = word(rank, offset);
  if (load_acquire(w) >= op) return {};
  const uint64_t* abort_state = word(rank, window.aborted_at());
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s_));
  // Peers are other threads or processes, often on fewer cores than ranks: spin a moment, then
  // yield the core (a peer that is runnable here runs at once), then back off to sleeps.
  for (int i = 0; load_acquire(w) < op; ++i) {
    if (load_acquire(abort_state) == kAbortWritten) {  // another rank gave up: stop at once
      uint64_t first_op = 0;
      std::string error;
      aborted(&first_op, &error);
      return error;
    }
    if (i < 64) continue;
    // A dead peer never writes the word: its stores were all visible before its end was seen.
    if (ended_[peer].load(std::memory_order_relaxed) && load_acquire(w) < op)
      return give_up(kPeerEnded, peer, op);
    if (Clock::now() > deadline) return give_up(what, peer, op);
    if (i < 1024)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(i < 2048 ? 2 : i < 4096 ? 20 : 200));
  }
  return {};
}

// ---- what a failed op leaves

namespace {
void fill_nan(void* p, int64_t n, Dtype t) {
  for (int64_t i = 0; i < n; ++i) store_float(p, i, t, std::numeric_limits<float>::quiet_NaN());
}
}  // namespace

void poison(const DispatchSend& a, int num_ranks) {
  if (!a.fresh()) return;  // a cached dispatch's routes are its input
  std::fill(a.send_pos, a.send_pos + int64_t(a.num_tokens) * num_ranks, -1);
  *a.num_invalid = 0;
}

void poison(const DispatchRecv& a, int num_ranks, int experts_per_rank) {
  if (!a.x_out) return;  // not a recv part
  const int64_t elems = int64_t(a.out_rows) * a.hidden;
  if (a.fp8)
    std::memset(a.x_out, 0x7f, elems);  // e4m3fn NaN
  else
    fill_nan(a.x_out, elems, a.x_dtype);
  if (a.fp8) fill_nan(a.scales_out, int64_t(a.out_rows) * (a.hidden / kFp8Block), Dtype::kF32);
  if (!a.fresh()) return;
  const int64_t slots = int64_t(a.out_rows) * a.num_topk;
  std::fill(a.topk_out, a.topk_out + slots, -1);
  fill_nan(a.weights_out, slots, Dtype::kF32);
  std::fill(a.recv_counts, a.recv_counts + num_ranks, 0);
  std::fill(a.tokens_per_expert, a.tokens_per_expert + experts_per_rank, 0);
  *a.num_recv = 0;
  *a.num_dropped = 0;
  *a.group_invalid = 0;
}

void poison(const CombineRecv& a) {
  if (!a.out) return;
  fill_nan(a.out, int64_t(a.num_tokens) * a.width, a.out_dtype);
  if (a.extra_out) fill_nan(a.extra_out, int64_t(a.num_tokens) * a.extra_cols, Dtype::kF32);
}

}  // namespace jax_ep::cpu

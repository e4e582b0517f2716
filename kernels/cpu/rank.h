// The CPU backend: one Rank per CPU device of an EP group, its window and its peers' windows
// mapped in this process (kernels/comm/shm.h), the same protocol as on GPUs (kernels/window.h).
//
// XLA:CPU calls each device's handlers on its own threads and may run independent work of one
// device in any order, also between processes. So no handler ever blocks: it queues its op on
// the rank's worker, which runs the rank's ops in order (waiting for peers there, with a
// timeout), and returns a future. The call completes on another thread of the rank: completing
// it runs the device's next work, which may block in XLA's own collectives and must not hold up
// the worker.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ops.h"
#include "kernels/window.h"

namespace jax_ep::cpu {

using Done = std::function<void(const std::string& error)>;

class Rank {
 public:
  // windows[r]: rank r's window as mapped here; `keep` keeps the mappings alive.
  Rank(const Window& window, int group, int rank, std::vector<uint8_t*> windows,
       std::shared_ptr<void> keep, double timeout_s);
  ~Rank();

  const Window window;
  const int group, rank;

  // Runs job() on the worker after every job queued before; then done(its error) on the
  // completion thread. After an error the rank is broken: later jobs fail at once.
  void run(std::function<std::string()> job, Done done);

  // The number of the next op this rank sends (ops are numbered in the order their send halves
  // are called, the same on every rank), and the op a recv half's ticket (its low 32 bits) names.
  uint64_t next_op() { return ++sent_; }
  uint64_t op_of_ticket(int32_t ticket) const;

  uint8_t* window_of(int r) const { return windows_[r]; }
  uint64_t* word(int r, int64_t offset) const {
    return reinterpret_cast<uint64_t*>(windows_[r] + offset);
  }

  // Waits until the word at `offset` of this rank's window reaches op `op` (its tag, or the
  // word itself for released ops); "" or the timeout's error naming `peer`.
  std::string wait_tag(int64_t offset, uint64_t op, int peer, const char* what) const;
  std::string wait_value(int64_t offset, uint64_t at_least, int peer, const char* what) const;

 private:
  template <typename Ready>
  std::string wait(int64_t offset, Ready ready, uint64_t op, int peer, const char* what) const;

  // The threads' state, theirs as much as the rank's: the last reference to a rank may drop on
  // one of them (a completed call ends a program, which may free it), which then lets the
  // threads finish on their own instead of joining itself.
  struct Queues {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::pair<std::function<std::string()>, Done>> jobs;
    std::deque<std::pair<Done, std::string>> completions;
    std::string broken;
    int running = 0;  // jobs taken whose completion is not queued yet
    bool stop = false;
  };
  static void work(std::shared_ptr<Queues> q);
  static void complete(std::shared_ptr<Queues> q);

  std::vector<uint8_t*> windows_;
  std::shared_ptr<void> keep_;
  const double timeout_s_;
  uint64_t sent_ = 0;
  std::shared_ptr<Queues> queues_;
  std::thread worker_, completer_;
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The protocol steps both kinds of op share: before sending op `op`, that every destination has
// read what this rank sent it in the op of the same slot; the rows each source sent this rank in
// op `op` (first[s]: the first row of source s in (source, j) order, first[R]: all), once every
// count word of the op has come; and telling every source this rank has read them.
std::string wait_slot_free(Rank& r, uint64_t op);
std::string received_rows(Rank& r, uint64_t op, OpKind kind, std::vector<int>* first);
void release(Rank& r, uint64_t op);

// The stages of kernels/ops.h on one rank, for op `op`; each returns "" or the error.
std::string dispatch_send(Rank& r, uint64_t op, const DispatchSend& a);
std::string dispatch_recv(Rank& r, uint64_t op, const DispatchRecv& a);
std::string combine_send(Rank& r, uint64_t op, const CombineSend& a);
std::string combine_recv(Rank& r, uint64_t op, const CombineRecv& a);
void expert_layout(const ExpertLayoutArgs& a);

}  // namespace jax_ep::cpu

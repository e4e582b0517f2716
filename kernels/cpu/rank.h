// The CPU backend: one Rank per CPU device of an EP group, its window and its peers' windows
// mapped in this process (transport/shm.h), the same protocol as on GPUs (kernels/window.h).
//
// XLA:CPU calls each device's handlers on its own threads and may run independent work of one
// device in any order, also between processes. So no handler ever blocks: it queues its op on
// the rank's worker, which runs the rank's ops in order (waiting for peers there, with a
// timeout), and returns a future. The call completes on another thread of the rank: completing
// it runs the device's next work, which may block in XLA's own collectives and must not hold up
// the worker. An op that fails (a wait timed out, a peer aborted, the ranks ran different ops)
// completes without an error but with NaN in its float outputs and -1 / 0 in its integers, so
// that its own step sees it; every later op of the rank then fails at once with the error.
#pragma once
#include <atomic>
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

// While it lives, the calling thread computes with denormals flushed to zero, as XLA:CPU's
// computations and the rank's own threads do; the thread's mode is restored after. For a stage
// of an op run on a thread of XLA's (which need not flush at that moment).
class FlushDenormals {
 public:
  FlushDenormals();
  ~FlushDenormals();
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  uint64_t saved_;
};

class Rank {
 public:
  // windows[r]: rank r's window as mapped here; `keep` keeps the mappings alive.
  Rank(const Window& window, int group, int rank, std::vector<uint8_t*> windows,
       std::shared_ptr<void> keep, double timeout_s, uint64_t first_op);
  ~Rank();

  const Window window;
  const int group, rank;

  // Runs job() (a part of op `op`) on the worker after every job queued before; then done(its
  // error) on the completion thread. A job that fails leaves poison() in its outputs and is
  // done without an error; the rank is then broken: a later job of the same op is poisoned too,
  // any other fails at once with the error. A job that finds an abort in the rank's window
  // before it starts is the same as a failed one (poisoned if it is of the abort's op).
  void run(uint64_t op, std::function<std::string()> job, std::function<void()> poison, Done done);

  // Whether a send (or recv) stage of op `op` runs without waiting: nothing of the rank is
  // queued, running, broken or aborted, and every word the stage waits for is written already
  // (send: the slot is free; recv: every count record of the op has come, or comes within a few
  // microseconds, bounded so that the caller's thread is never held up for long). Such a stage
  // may run on the caller's thread (no hand-off to the worker and back); a stage that fails
  // there is reported with broken().
  bool ready_to_send(uint64_t op) const;
  bool ready_soon(uint64_t op) const;
  // Op `op` failed with `error` outside the worker: the rank is broken, as when a job fails.
  void broken(uint64_t op, const std::string& error);

  // The error that stopped the rank (or an abort a peer wrote into its window), or "".
  std::string status() const;

  // The number of the next op this rank sends (ops are numbered in the order their send halves
  // are called, the same on every rank), and the op a recv half's ticket (its low 32 bits) names.
  uint64_t next_op() { return ++sent_; }
  uint64_t op_of_ticket(int32_t ticket) const;

  uint8_t* window_of(int r) const { return windows_[r]; }
  uint64_t* word(int r, int64_t offset) const {
    return reinterpret_cast<uint64_t*>(windows_[r] + offset);
  }

  // Waits until the word at `offset` of this rank's window (an op number) is at least `op`;
  // "" or the error: the timeout's naming `peer` (then this rank gave up), or the abort another
  // rank wrote into this window meanwhile.
  std::string wait_op(int64_t offset, uint64_t op, int peer, Wait what) const;

  // Gives up op `op`: writes the abort record into every window of the group (each window's
  // first abort stays) and returns the error.
  std::string give_up(Wait code, int peer, uint64_t op, const uint64_t* mine = nullptr,
                      const uint64_t* theirs = nullptr) const;

  // Writes `a` into every window of the group whose record is still free (each window's first
  // abort stays): every wait of their ranks stops with it.
  void publish(const AbortRecord& a) const;

  // The abort record of this rank's window if one was written: its op and error.
  bool aborted(uint64_t* op, std::string* error) const;

  // Rank r's process has ended (ffi/ended.h): a wait for a word that r writes gives up at once
  // instead of after the timeout.
  void peer_ended(int r) { ended_[r].store(true, std::memory_order_relaxed); }

 private:
  // The threads' state, theirs as much as the rank's: the last reference to a rank may drop on
  // one of them (a completed call ends a program, which may free it), which then lets the
  // threads finish on their own instead of joining itself.
  struct Queues {
    std::mutex mu;
    std::condition_variable cv;
    struct Job {
      uint64_t op;
      std::function<std::string()> run;
      std::function<void()> poison;
      Done done;
    };
    std::deque<Job> jobs;
    std::deque<std::pair<Done, std::string>> completions;
    std::string broken;
    uint64_t broken_op = 0;  // the op that failed here (its other parts are poisoned, not failed)
    int running = 0;         // jobs taken whose completion is not queued yet
    bool stop = false;
  };
  bool idle() const;
  bool slot_free(uint64_t op) const;  // the waits of wait_slot_free, done
  bool counts_in(uint64_t op) const;  // the waits of received_rows, done
  static void work(std::shared_ptr<Queues> q, const Rank* rank);
  static void complete(std::shared_ptr<Queues> q);

  std::vector<uint8_t*> windows_;
  std::shared_ptr<void> keep_;
  const double timeout_s_;
  std::unique_ptr<std::atomic<bool>[]> ended_;  // by rank: its process has ended
  uint64_t sent_;
  std::shared_ptr<Queues> queues_;
  std::thread worker_, completer_;
};

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

// The protocol steps both kinds of op share: before sending op `op`, that every destination has
// read what this rank sent it in the op of the same slot; the count record for destination d
// (after the rows: its op word, stored last with release semantics, is their flag); the rows
// each source sent this rank in op `op` (first[s]: the first row of source s in (source, j)
// order, first[R]: all), once every count record of the op has come and every source's
// signature is this rank's own (else the error naming both ops); and telling every source this
// rank has read them.
std::string wait_slot_free(Rank& r, uint64_t op);
// count: count_word(rows, invalid ids) (kernels/window.h).
void send_count(Rank& r, int dest, uint64_t op, uint64_t count, const Signature& sig);
// group_invalid (or null): += the sources' invalid expert ids.
std::string received_rows(Rank& r, uint64_t op, std::vector<int>* first,
                          int* group_invalid = nullptr);
void release(Rank& r, uint64_t op);

// NaN in the float outputs, -1 in the ids, 0 in the counts: what a failed op leaves.
void poison(const DispatchSend& a, int num_ranks);
void poison(const DispatchRecv& a, int num_ranks, int experts_per_rank);
void poison(const CombineRecv& a);

// The stages of kernels/ops.h on one rank, for op `op`; each returns "" or the error.
std::string dispatch_send(Rank& r, uint64_t op, const DispatchSend& a);
std::string dispatch_recv(Rank& r, uint64_t op, const DispatchRecv& a);
std::string combine_send(Rank& r, uint64_t op, const CombineSend& a);
std::string combine_recv(Rank& r, uint64_t op, const CombineRecv& a);
void expert_layout(const ExpertLayoutArgs& a);
std::string expert_padded(const ExpertPaddedArgs& a);
std::string place_rows(const PlaceRowsArgs& a);
void quantize_rows(const QuantizeRowsArgs& a);
void quantize_weights(const QuantizeWeightsArgs& a);
// One row of `hidden` elements of `dtype` in e4m3 bytes q and one scale per 128 (the FP8 rule).
void quantize_row(const void* x, int hidden, Dtype dtype, bool round_scale, uint8_t* q,
                  float* scales);

}  // namespace jax_ep::cpu

// CPU backend: the devices of an EP group are threads of one process. XLA:CPU runs independent
// ops in any order, and in a different one on each device, so calls are matched across ranks by
// the op's key (a trace-time id, the same on every rank) and its occurrence, and no handler ever
// blocks: each rank joins its op with its arguments (the addresses of its XLA buffers: the
// group's communication memory is this table) and returns; the rank that completes an op moves
// the rows of every rank and completes every rank's call, each on that rank's own completion
// thread (completing a call runs the rest of that device's program, which may block in an XLA
// collective). A watchdog ends ops whose ranks never all arrive with an error.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/ops.h"

namespace jax_ep::cpu {

// Completes one rank's call: empty on success, else the error to report.
using Done = std::function<void(const std::string& error)>;

struct Call {
  enum Kind { kDispatch, kCombine } kind;
  DispatchArgs dispatch;
  CombineArgs combine;
  Done done;
};

class Group {
 public:
  Group(int num_ranks, double timeout_s);
  ~Group();
  // Rank `rank`'s next run of op `key`; `call.done` runs once the op has run (on some thread).
  void join(int rank, int64_t key, Call call);

 private:
  struct Pending {
    std::vector<std::optional<Call>> calls;
    int arrived = 0;
    std::chrono::steady_clock::time_point deadline;
  };
  void watch();
  void complete(int rank, Done done, std::string error);  // on rank's completion thread
  void serve(int rank);                                    // a completion thread
  void fail_pending(const std::string& error);             // with mu_ held

  const int num_ranks_;
  const double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  using OpId = std::pair<int64_t, uint64_t>;          // key, occurrence
  std::vector<std::map<int64_t, uint64_t>> runs_;    // per rank: runs of each key so far
  std::map<OpId, Pending> pending_;                  // ops some but not all ranks joined
  std::string broken_;
  bool stop_ = false;
  std::vector<std::vector<std::function<void()>>> completions_;  // per rank, queued
  std::vector<std::thread> completers_;
  std::thread watchdog_;
};

// Every rank's call of one op, in rank order; each returns the error of every rank.
std::vector<std::string> dispatch(std::vector<DispatchArgs>& ranks);
std::vector<std::string> combine(const std::vector<CombineArgs>& ranks);
void expert_layout(const ExpertLayoutArgs& a);

}  // namespace jax_ep::cpu

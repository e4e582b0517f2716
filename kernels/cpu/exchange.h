// CPU backend: the devices of an EP group are threads of one process. Each rank publishes its
// counts and buffer addresses in its mailbox (the group's communication memory), meets the
// others at a barrier, then writes rows straight into its peers' output buffers (dispatch) or
// reads its peers' rows (combine), and meets them again before returning.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace jax_ep::cpu {

struct Mailbox {
  std::vector<int32_t> counts;   // rows this rank sends to each rank
  void* x_out = nullptr;         // where peers write dispatched rows
  float* scales_out = nullptr;
  int32_t* topk_out = nullptr;
  float* weights_out = nullptr;
  const void* rows = nullptr;    // what peers read in combine
};

class Group {
 public:
  explicit Group(int num_ranks);
  Mailbox& mailbox(int rank) { return boxes_[rank]; }
  // Waits for every rank of the group; an error after `timeout_s`, and every later call fails.
  std::string barrier(int rank, const char* op, double timeout_s);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int num_ranks_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string broken_;
  std::vector<Mailbox> boxes_;
};

// Each returns an empty string on success, else the error to report.
std::string dispatch(Group& group, const DispatchArgs& a, double timeout_s);
std::string combine(Group& group, const CombineArgs& a, double timeout_s);
void expert_layout(const ExpertLayoutArgs& a);

}  // namespace jax_ep::cpu

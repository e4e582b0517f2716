// Host interface of the CUDA backend (one process driving all local GPUs).
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace jax_ep::cuda {

struct Knobs {
  int num_sms;          // blocks of the bandwidth kernels (one per SM)
  double timeout_s;     // every device-side wait for a peer
};

// What the Buffer was built for: sizes the communication memory.
struct Shape {
  int experts_per_rank, hidden, num_topk;
  int low_latency_tokens;  // rows per source of the low-latency regions (0: none)
};

// The communication memory of one Buffer on every device of its groups, peers connected.
class Comm;
std::shared_ptr<Comm> connect(const std::vector<std::vector<int>>& groups, const Shape& shape,
                              Knobs knobs);

// Each returns an empty string once the kernels are enqueued on `stream`, else the error.
std::string dispatch(Comm& comm, int device, cudaStream_t stream, const DispatchArgs& a);
std::string combine(Comm& comm, int device, cudaStream_t stream, const CombineArgs& a);
std::string expert_layout(cudaStream_t stream, const ExpertLayoutArgs& a);

// The low-latency ops (low_latency.cu), whole or in halves: send returns once the rows are on
// their way and writes the op's number to ticket_out; recv takes it back as ticket_in.
enum Half : int { kSend = 1, kRecv = 2, kBoth = 3 };
struct LowLatencyDispatchArgs {
  DispatchArgs a;                  // send_pos: output when fresh, input when cached
  const int32_t* recv_counts_in;   // cached: the handle's recv_counts
  const int32_t* ticket_in;        // recv half
  int32_t* ticket_out;             // send half
  int half;
};
struct LowLatencyCombineArgs {
  CombineArgs a;
  const int32_t* recv_counts;      // rows each source sent here at dispatch
  const int32_t* num_rows;         // rows present (the rest were dropped)
  const int32_t* ticket_in;
  int32_t* ticket_out;
  int half;
};
std::string low_latency_dispatch(Comm& comm, int device, cudaStream_t stream,
                                 const LowLatencyDispatchArgs& a);
std::string low_latency_combine(Comm& comm, int device, cudaStream_t stream,
                                const LowLatencyCombineArgs& a);

// Bandwidth (GB/s per direction) of moving bytes from device src to device dst, and at the same
// time from dst to src when both_ways: the ceilings the benchmark reports. mode -1: the copy
// engine; from `blocks` SMs: 0 bulk-copy (TMA) stores, 1 plain stores, 2 bulk-copy loads,
// 3 plain loads, 4 plain stores amid local traffic like a dispatch's, 5 plain stores of whole
// 7168-byte rows, a warp per row, 6 the dispatch's row path (BF16 rows quantised to FP8 by
// send_row) to a local and the peer's row, 7 the same to the peer's row only, 8 and 9 the same
// into local staging in 4 or 8 chunks, each moved to the peer by the copy engine meanwhile,
// 10 the combine's row path (sum_rows: a peer's BF16 row and a local one into a local row),
// 11 mode 6 into local rows only, 12 and 13 a row path specialised to V3 rows (the FP8 rows of
// modes 11 and 7 with the loads of half a row in flight, no per-row generality). The pushes of
// modes -1, 0, 1, 4, 5, one way, may write into dst_buffer, which must hold `bytes` on dst.
// -1: an unknown mode, dst_buffer with another mode or both ways, a CUDA error.
double peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters, bool both_ways,
                 void* dst_buffer);

}  // namespace jax_ep::cuda

// The CUDA backend's rank: one GPU of an EP group, the windows of its group as this GPU reaches
// them (transport/nccl.h), and what its kernels need to find their peers and give up on them.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/limits.h"
#include "kernels/ops.h"
#include "kernels/window.h"

namespace jax_ep::cuda {

// Why this rank's kernels stopped: the abort record of its window (its own or a peer's, see
// kernels/signature.h), copied into host-mapped memory by the first kernel thread that saw it,
// so the host reads it without a sync.
// The host writes `ended` there: the ranks whose process has ended (ffi/ended.h), which a wait
// for such a rank gives up on at once instead of after the timeout.
struct Failure {
  AbortRecord record;
  uint64_t written;  // set last: 0 while nothing stopped
  uint64_t ended;    // bit r: rank r's process has ended (host-written)
};

// What every kernel of an op takes (by value): the window layout and where every rank's is.
struct Peers {
  Window window;                   // the layout every rank's window has
  uint8_t* windows[kMaxGpuRanks];  // windows[r]: rank r's window as this GPU reaches it
  int rank;
  uint64_t timeout_ns;
  Failure* failure;   // device view of the host-mapped record
  bool direct_local;  // whole ops write a rank's own rows in place

  __device__ uint64_t* word(int r, int64_t offset) const {
    return reinterpret_cast<uint64_t*>(windows[r] + offset);
  }
  __device__ uint8_t* row(int on, int slot, int source, int j) const {
    return windows[on] + window.row_at(slot, source, j);
  }
};

// What each kernel of an op takes (by value): the group, the op's halves (a split op's kernels
// get one, the other empty), the part they run, and where the op's number comes from and goes.
template <typename Send, typename Recv>
struct OpParams {
  Peers peers;
  Send send;
  Recv recv;
  Part part;
  const int32_t* ticket;  // recv halves: the device word holding the op's number
  int32_t* token_out;     // gets the op's number
  // A whole op whose rows to this rank are written in place.
  __host__ __device__ bool in_place() const { return part == Part::kWhole && peers.direct_local; }
};

struct Rank {
  Window window;
  int group, rank, device;
  int blocks;  // of every kernel that begins an op (they number the ops)
  double timeout_s;
  bool direct_local;
  std::vector<uint8_t*> windows;         // device pointers, by rank
  Failure* failure = nullptr;            // host-mapped
  Failure* failure_on_device = nullptr;  // the same record as kernels address it
  std::shared_ptr<void> keep;            // the group's communicators and memory

  Peers peers() const;
  // "" while no kernel of this rank gave up, else what happened (the Buffer is then unusable).
  std::string failed() const;
  // Rank r's process has ended: the kernels' waits for it give up (they poll `failure->ended`).
  void peer_ended(int r) const;
  // Stops the rank with `record` unless a kernel stopped it first: failed() returns its error,
  // and every later op fails at once (ffi/buffers.h, NativeBuffer::stop).
  void stop(const AbortRecord& record) const;
};

// What every rank of a Buffer is made with.
struct RankConfig {
  Window window;
  int num_sms;  // the most blocks a kernel that begins an op takes
  double timeout_s;
  bool direct_local;
  uint64_t first_op;  // ops are numbered from first_op + 1
};

// A rank of either engine (transport/nccl.h, cuda_ipc.h): `peers` are the group's windows as
// `device` reaches them, `engine` holds what they live in; its window gets its owner's words.
// Throws on a CUDA error.
std::shared_ptr<Rank> make_rank(const RankConfig& config, int group, int rank, int device,
                                std::vector<uint8_t*> peers, std::shared_ptr<void> engine);

// Each returns "" once its kernels are enqueued on `stream`, else the error. `ticket` (recv
// halves) is the device word holding the op's number; `token_out` gets it.
std::string dispatch(const Rank& r, cudaStream_t stream, Part part, const DispatchSend* send,
                     const DispatchRecv* recv, bool low_latency, const int32_t* ticket,
                     int32_t* token_out);
std::string combine(const Rank& r, cudaStream_t stream, Part part, const CombineSend* send,
                    const CombineRecv* recv, const int32_t* ticket, int32_t* token_out);
std::string expert_layout(cudaStream_t stream, const ExpertLayoutArgs& args);
std::string expert_padded(cudaStream_t stream, const ExpertPaddedArgs& args);
std::string place_rows(cudaStream_t stream, const PlaceRowsArgs& args);
std::string quantize_rows(cudaStream_t stream, const QuantizeRowsArgs& args);
std::string quantize_weights(cudaStream_t stream, const QuantizeWeightsArgs& args);

}  // namespace jax_ep::cuda

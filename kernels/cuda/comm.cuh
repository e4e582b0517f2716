// The memory protocol between the GPUs of an EP group (see docs/ARCHITECTURE.md).
//
// Each rank owns one DeviceState in its own device memory; peers reach it over NVLink. Data never
// passes through it: ranks publish the addresses of their XLA buffers in their mailbox and peers
// write (dispatch) or read (combine) those buffers directly. Ops are numbered on device: every
// kernel of an op works on op `seq + 1`, and the op's last kernel, once every peer is done with
// this rank's buffers, commits `seq`. Flags carry the number of the op they belong to, so
// nothing on the host counts ops and CUDA-graph replays stay in step. Mailboxes and inboxes have
// two slots, by op parity: a rank can be one op ahead of a peer, never two.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/layout.h"

namespace jax_ep::cuda {

constexpr int kMailboxPointers = 4;
constexpr size_t kDefaultSharedBytes = 48 * 1024;  // static + dynamic, without opting in

// The low-latency ops (low_latency.cu) send through regions the Buffer owns, so they need no
// address exchange: each rank receives into its own region, [2 slots by op parity][R sources]
// [tokens] rows, one region per kind of op. Rows move in parts of kPartElems elements, each part
// with a flag the sender raises to the op's number; nothing waits for a whole grid. Ops of each
// kind are numbered on device; a sender reuses a slot once its receivers released the op two
// before in that slot. A receiver releases an op at the start of its next kernel of that kind,
// when the kernel boundary has ordered every read of it: a plain store, off the critical path.
// Both this and the op numbers need a kind's kernels to run in order on one stream; recv halves
// may run in either order.
enum LowLatencyKind : int { kLowLatencyDispatch = 0, kLowLatencyCombine = 1 };
constexpr int kPartElems = 1024;  // elements of a row under one flag

struct LowLatencyState {
  uint64_t started[2];              // [kind]: blocks of send halves started, gridDim.x per op
  // Per slot, as recv halves may finish out of send order (at most two ops await theirs).
  uint64_t received[2][2];             // [kind][slot]: the last op of the slot received here
  uint64_t released[2][2][kMaxRanks];  // [kind][slot][dst]: the last op of it dst finished reading
  uint64_t counts[2][kMaxRanks];    // [slot][src]: op << 24 | rows src sent here (fresh dispatch)
};

// Dispatch routing runs one block per chunk of kRouteTokens tokens (dispatch.cu).
constexpr int kRouteTokens = 1024;
constexpr int kMaxRouteChunks = 1024;

struct DeviceState {
  uint64_t seq;                                   // ops this rank has completed
  uint32_t ticket;                                // blocks of the running kernel that finished
  int32_t route_invalid;                          // invalid expert ids the route blocks saw
  int32_t chunk_rows[kMaxRouteChunks][kMaxRanks]; // rows earlier chunks of tokens send to rank d
  int32_t* expert_tally;                          // [R][E_l]: rows this rank sends, per expert
  int32_t* expert_inbox;                          // [2][R][E_l]: the tallies peers sent here
  // Mailbox: written by this rank, read by peers.
  uint64_t published[2];                          // = seq once `pointers` hold that op's buffers
  void* pointers[2][kMailboxPointers];
  // Inbox: written by peers.
  uint64_t counts_seq[2][kMaxRanks];              // = seq once counts[.][src] holds that op's row
  int32_t counts[2][kMaxRanks][kMaxRanks];        // rows src sends to each rank
  uint64_t arrived[kMaxRanks];                    // src finished writing into my buffers
  uint64_t released[kMaxRanks];                   // src finished reading my buffers
  LowLatencyState low_latency;
};

// Why a kernel gave up; kept in host-mapped memory so the host can read it without a sync.
struct Failure {
  int32_t code;        // 0: none, 1: timeout
  int32_t peer;
  int32_t what;        // which wait (see kWait*)
  int32_t rank;
  uint64_t seq;
};

enum Wait : int32_t { kWaitCounts = 1, kWaitMailbox = 2, kWaitArrived = 3, kWaitReleased = 4 };

// Where the low-latency regions are and how their rows are laid out.
struct LowLatencyLink {
  uint8_t* region[2][kMaxRanks];   // [kind][rank]: that rank's receive region
  int tokens, hidden, num_topk;    // rows per (slot, source); the Buffer's H and K
  // Room for a float32 row of width H, 16-byte aligned.
  __host__ __device__ int64_t widest_row() const { return (4 * int64_t(hidden) + 15) / 16 * 16; }
  // Flags a row has room for: combine rows may be 2H bfloat16 wide.
  __host__ __device__ int max_parts() const { return (2 * hidden + kPartElems - 1) / kPartElems; }
  // Dispatch rows: x, FP8 scales, K local expert ids and K weights, a flag per part.
  __host__ __device__ int64_t scales_at() const { return widest_row(); }
  __host__ __device__ int64_t meta_at() const { return scales_at() + (hidden / 32 + 15) / 16 * 16; }
  // Combine rows: one row of expert output (float32 at most), a flag per part.
  __host__ __device__ int64_t flags_at(int kind) const {
    return kind == kLowLatencyDispatch ? meta_at() + (8 * num_topk + 15) / 16 * 16 : widest_row();
  }
  __host__ __device__ int64_t row_bytes(int kind) const {
    return flags_at(kind) + (8 * int64_t(max_parts()) + 15) / 16 * 16;
  }
  // Row j from `src` in slot `slot` of the region of `kind` on rank `on`.
  __host__ __device__ uint8_t* row(int kind, int on, int slot, int src, int j, int num_ranks) const {
    return region[kind][on] + ((int64_t(slot) * num_ranks + src) * tokens + j) * row_bytes(kind);
  }
  __host__ __device__ uint64_t* flags(int kind, uint8_t* row) const {
    return reinterpret_cast<uint64_t*>(row + flags_at(kind));
  }
  // Rank `on`'s [2 slots][R sources][E_l] words op << 16 | rows, per local expert, that each
  // source's dispatch sends there (fresh dispatch): the receiver's tally costs no pass over rows.
  uint64_t* expert_rows[kMaxRanks];
  __host__ __device__ uint64_t* expert_rows_from(int on, int slot, int src, int num_ranks,
                                                 int experts_per_rank) const {
    return expert_rows[on] + (int64_t(slot) * num_ranks + src) * experts_per_rank;
  }
};

// What every kernel of an op needs to reach its peers.
struct Link {
  DeviceState* self;
  DeviceState* peers[kMaxRanks];   // peers[rank] == self
  Failure* failure;
  int num_ranks, rank, experts_per_rank;
  uint64_t timeout_ns;
  LowLatencyLink low_latency;
};

// ---- PTX helpers (sm_90) ----

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Orders this thread's earlier writes (and those it observed) before its later ones, for every
// observer in the system: with a relaxed flag store after it, a release.
__device__ __forceinline__ void fence_release_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag >= seq; past the timeout records why in host memory and traps (the CUDA
// error then surfaces in XLA and the next jax_ep call reports the recorded failure).
__device__ __forceinline__ void wait_for(const Link& link, const uint64_t* flag, uint64_t seq,
                                         Wait what, int peer) {
  if (load_acquire(flag) >= seq) return;
  uint64_t start = global_time_ns();
  while (load_acquire(flag) < seq) {
    if (global_time_ns() - start > link.timeout_ns) {
      Failure* f = link.failure;
      f->peer = peer;
      f->what = what;
      f->rank = link.rank;
      f->seq = seq;
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(&f->code) = 1;
      __threadfence_system();
      __trap();
    }
  }
}

// The number of the op a kernel belongs to: one past the last op this rank completed.
__device__ __forceinline__ uint64_t this_op(const DeviceState* self) {
  return *reinterpret_cast<const volatile uint64_t*>(&self->seq) + 1;
}

// Publishes this rank's buffers for op `seq` (one thread).
__device__ __forceinline__ void publish(DeviceState* self, uint64_t seq, void* const* ptrs) {
  for (int i = 0; i < kMailboxPointers; ++i) self->pointers[seq & 1][i] = ptrs[i];
  __threadfence_system();
  store_release(&self->published[seq & 1], seq);
}

// A peer's published buffers for op `seq` (one thread).
__device__ __forceinline__ void read_mailbox(const Link& link, int peer, uint64_t seq,
                                             void** ptrs) {
  DeviceState* st = link.peers[peer];
  wait_for(link, &st->published[seq & 1], seq, kWaitMailbox, peer);
  for (int i = 0; i < kMailboxPointers; ++i)
    ptrs[i] = *reinterpret_cast<void* volatile*>(&st->pointers[seq & 1][i]);
}

// True in exactly one block: the last of the grid to finish. Each block's writes, ordered by its
// barrier, are released by one system fence before it counts itself on `ticket`; the last block
// fences again before acting on them, and resets the ticket for the next kernel.
__device__ __forceinline__ bool last_block_done(uint32_t* ticket) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence_system();
      *ticket = 0;
    }
  }
  __syncthreads();
  return last;
}

// The end of an op, in its last kernel's last block: tell every peer this rank is done with its
// buffers (flag: arrived or released), wait until every peer is done with this rank's, commit.
__device__ __forceinline__ void finish_op(const Link& link, uint64_t seq, Wait what) {
  const int peer = threadIdx.x;
  if (peer < link.num_ranks) {
    uint64_t* theirs = what == kWaitArrived ? link.peers[peer]->arrived : link.peers[peer]->released;
    store_release(&theirs[link.rank], seq);
    const uint64_t* mine = what == kWaitArrived ? link.self->arrived : link.self->released;
    wait_for(link, &mine[peer], seq, what, peer);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    link.self->seq = seq;
  }
}

}  // namespace jax_ep::cuda

// ---- host side ----
#include <string>
#include <unordered_map>

#include "kernels/cuda/backend.h"

namespace jax_ep::cuda {

#define JAX_EP_CUDA_TRY(expr)                                                          \
  do {                                                                                 \
    cudaError_t err_ = (expr);                                                         \
    if (err_ != cudaSuccess)                                                           \
      return std::string("jax_ep: ") + #expr + ": " + cudaGetErrorString(err_);        \
  } while (0)

class Comm {
 public:
  struct Rank {
    Failure* failure;   // host-mapped
    int32_t *tally, *inbox;  // device arrays DeviceState points to
    uint8_t* regions;        // the low-latency regions of both kinds, or null
    Link link;          // self, peers, rank, timeout
  };
  Knobs knobs;
  std::unordered_map<int, Rank> ranks;  // by device ordinal

  ~Comm();
  // The rank on `device`, or why it cannot run (unknown device, an earlier timeout).
  std::string rank_on(int device, Rank** rank);
};

// Lets `device` read and write `peer`'s memory (idempotent); an error message if it cannot.
std::string enable_peer_access(int device, int peer);

// A kernel's static shared memory, looked up once per kernel (handlers run on several threads).
cudaError_t static_shared_bytes(const void* kernel, size_t* bytes);

// kernel<<<blocks, threads, smem, stream>>>(args...), opting in to more dynamic shared memory
// only when the kernel's static and dynamic shared memory exceed the default (driver calls).
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, int threads, size_t smem,
                   cudaStream_t stream, Args... args) {
  size_t static_smem = 0;
  if (cudaError_t err = static_shared_bytes(reinterpret_cast<const void*>(kernel), &static_smem);
      err != cudaSuccess)
    return err;
  if (static_smem + smem > kDefaultSharedBytes)
    if (cudaError_t err = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)); err != cudaSuccess)
      return err;
  kernel<<<blocks, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

// Grid size of the bandwidth kernels: the knob, at most one block per SM.
int bandwidth_blocks(const Knobs& knobs, int device);

}  // namespace jax_ep::cuda

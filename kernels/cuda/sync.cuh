// The protocol of kernels/window.h on GPUs: flags, waits that give up, op numbers, slot release.
// docs/ARCHITECTURE.md says who writes which word when.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/rank.h"

namespace jax_ep::cuda {

constexpr size_t kDefaultSharedBytes = 48 * 1024;  // static + dynamic, without opting in

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t load_volatile(const uint64_t* word) {
  return *reinterpret_cast<const volatile uint64_t*>(word);
}

__device__ __forceinline__ void store_release(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

__device__ __forceinline__ void store_relaxed(uint64_t* word, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

// Orders this thread's earlier writes (and those it observed) before its later ones, for every
// observer in the system: with a relaxed flag store after it, a release.
__device__ __forceinline__ void fence_release_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Whether some rank of the group gave up: its abort record is in this rank's window (or being
// written there).
__device__ __forceinline__ bool aborted(const Peers& peers) {
  return load_volatile(peers.word(peers.rank, peers.window.aborted_at())) != kNoAbort;
}

// The abort record of this rank's window into the host-mapped Failure, by the first thread of
// the rank's kernels to get here (the host reads it at the next call, or in Buffer.status()).
// Inlined like every function handed the kernel's parameters by reference: an out-of-line call
// makes every thread copy them to local memory at entry (+50% kernel time at 128 tokens).
static __device__ __forceinline__ void record_failure(const Peers& peers) {
  auto* claim =
      reinterpret_cast<unsigned int*>(peers.windows[peers.rank] + peers.window.failure_claim_at());
  if (atomicCAS(claim, 0u, 1u) != 0u) return;
  const uint64_t* state = peers.word(peers.rank, peers.window.aborted_at());
  const uint64_t start = global_time_ns();  // the writer publishes it at once (unless it died)
  while (load_acquire(state) != kAbortWritten && global_time_ns() - start < peers.timeout_ns) {
  }
  volatile Failure* f = peers.failure;
  const uint64_t* record = peers.word(peers.rank, peers.window.abort_record_at());
  volatile uint64_t* to = reinterpret_cast<volatile uint64_t*>(&f->record);
  for (int i = 0; i < int(sizeof(AbortRecord) / 8); ++i) to[i] = load_volatile(record + i);
  __threadfence_system();
  f->written = 1;
  __threadfence_system();
}

// Gives up op `op`: the abort record goes into every window of the group whose record is still
// free (this rank's first, so that it names this rank's reason), which stops every wait of
// every rank at once; then into this rank's host record. The kernels end; their results are
// NaN (the kernels' ends poison them) and the next call raises.
static __device__ __forceinline__ void give_up(const Peers& peers, Wait what, int peer, uint64_t op,
                                               const uint64_t* mine = nullptr,
                                               const uint64_t* theirs = nullptr) {
  const Window& window = peers.window;
  for (int i = 0; i < window.num_ranks; ++i) {
    const int r = (peers.rank + i) % window.num_ranks;
    auto* state = reinterpret_cast<unsigned long long*>(peers.word(r, window.aborted_at()));
    if (atomicCAS_system(state, 0ull, (unsigned long long)kAbortClaimed) != 0ull) continue;
    uint64_t* record = peers.word(r, window.abort_record_at());  // an AbortRecord's words
    store_relaxed(record, uint64_t(what));
    store_relaxed(record + 1, uint64_t(peers.rank));
    store_relaxed(record + 2, uint64_t(peer));
    store_relaxed(record + 3, op);
    for (int k = 0; k < kSignatureWords; ++k) {
      store_relaxed(record + 4 + k, mine ? mine[k] : 0);
      store_relaxed(record + 4 + kSignatureWords + k, theirs ? theirs[k] : 0);
    }
    store_release(reinterpret_cast<uint64_t*>(state), kAbortWritten);
  }
  record_failure(peers);
}

// How often a wait reads the host-mapped word saying which peers' processes have ended (a read
// over PCIe: not at every spin).
constexpr uint64_t kEndedPollNs = 1000000;

// Spins until ready(*flag); false if this rank gives up meanwhile (timeout_ns without it, or the
// host found that `peer`'s process has ended) or finds that another rank did.
template <typename Ready>
__device__ __forceinline__ bool wait_until(const Peers& peers, const uint64_t* flag, Ready ready,
                                           Wait what, int peer, uint64_t op) {
  if (ready(load_acquire(flag))) return true;
  const uint64_t start = global_time_ns();
  uint64_t next_poll = start + kEndedPollNs;
  while (!ready(load_acquire(flag))) {
    if (aborted(peers)) {
      record_failure(peers);
      return false;
    }
    const uint64_t now = global_time_ns();
    if (now - start > peers.timeout_ns) {
      give_up(peers, what, peer, op);
      return false;
    }
    if (now > next_poll) {
      next_poll = now + kEndedPollNs;
      const uint64_t ended = load_volatile(&peers.failure->ended);
      if ((ended >> peer & 1) && !ready(load_acquire(flag))) {
        give_up(peers, kPeerEnded, peer, op);
        return false;
      }
    }
  }
  return true;
}

// A word holding an op number (count records, rows per expert, flags of rows, released ops) is
// at least `op`. Op numbers are whole 64-bit words: they never wrap.
__device__ __forceinline__ bool wait_op(const Peers& peers, const uint64_t* word, uint64_t op,
                                        Wait what, int peer) {
  return wait_until(peers, word, [op](uint64_t v) { return v >= op; }, what, peer, op);
}

// The count record for destination d of op `op` (one thread): count_word(rows, invalid ids) and
// the op's signature, then its op number with release semantics (the flag of the record).
__device__ __forceinline__ void send_count(const Peers& peers, int d, uint64_t op, uint64_t count,
                                           const Signature& sig) {
  uint64_t* record = peers.word(d, peers.window.counts_at(int(op % kSlots), peers.rank));
  store_relaxed(record + kCountRows / 8, count);
  uint64_t words[kSignatureWords];
  signature_words(sig, words);
  for (int k = 0; k < kSignatureWords; ++k)
    store_relaxed(record + kCountSignature / 8 + k, words[k]);
  store_release(record, op);
}

// Source s's count record of op `op` in this rank's window has come (else false: stopped); its
// rows, and (if asked) the source's invalid expert ids.
__device__ __forceinline__ bool wait_count(const Peers& peers, uint64_t op, int s, Wait what,
                                           int* rows, int* invalid = nullptr) {
  const uint64_t* record = peers.word(peers.rank, peers.window.counts_at(int(op % kSlots), s));
  if (!wait_op(peers, record, op, what, s)) return false;
  const uint64_t count = load_volatile(record + kCountRows / 8);
  *rows = rows_of(count, peers.window.rows_per_source);
  if (invalid) *invalid = invalid_of(count);
  return true;
}

// After every source's record of op `op` came (the caller's barrier): thread s < R compares
// source s's signature with this rank's own record (what it sent itself) and gives up naming
// both ops if they differ.
__device__ __forceinline__ void check_signatures(const Peers& peers, uint64_t op) {
  const int s = threadIdx.x;
  if (s >= peers.window.num_ranks) return;
  const int slot = int(op % kSlots);
  const uint64_t* mine =
      peers.word(peers.rank, peers.window.counts_at(slot, peers.rank)) + kCountSignature / 8;
  const uint64_t* theirs =
      peers.word(peers.rank, peers.window.counts_at(slot, s)) + kCountSignature / 8;
  if (load_volatile(mine - kCountSignature / 8) < op ||
      load_volatile(theirs - kCountSignature / 8) < op)
    return;  // a record that never came: its wait gave up
  uint64_t a[kSignatureWords], b[kSignatureWords];
  bool same = true;
  for (int k = 0; k < kSignatureWords; ++k) {
    a[k] = load_volatile(mine + k);
    b[k] = load_volatile(theirs + k);
    same &= a[k] == b[k];
  }
  if (!same) give_up(peers, kMismatch, s, op, a, b);
}

// The op this kernel serves, into `op` (shared memory) once the caller's next barrier passed.
// The first kernel of an op counts its blocks on `started`: every such kernel has the same
// grid, so the count names the op (no host counter: command-buffer replays stay in step). A
// later kernel of the op reads it; a recv half takes it from its ticket (its low 32 bits).
// Block 0 first releases, to every source, the last op of each slot received here: the kernel
// boundary has ordered every read of it before (a plain store, off the critical path).
enum class Begin { kCount, kFollow, kTicket };
__device__ __forceinline__ void begin_op(const Peers& peers, Begin how, const int32_t* ticket,
                                         uint64_t* op) {
  const Window& window = peers.window;
  if (blockIdx.x == 0 && threadIdx.x < window.num_ranks)
    for (int slot = 0; slot < kSlots; ++slot)
      store_relaxed(peers.word(threadIdx.x, window.released_at(slot, peers.rank)),
                    load_volatile(peers.word(peers.rank, window.received_at(slot))));
  if (threadIdx.x == 0) {
    auto* started =
        reinterpret_cast<unsigned long long*>(peers.word(peers.rank, window.started_at()));
    if (how == Begin::kCount) {
      *op = atomicAdd(started, 1ull) / gridDim.x + 1;
    } else {
      const uint64_t last = load_volatile(reinterpret_cast<uint64_t*>(started)) / gridDim.x;
      *op = how == Begin::kFollow ? last : last - uint32_t(uint32_t(last) - uint32_t(*ticket));
    }
  }
}

// Before writing into slot `op % 2` of every destination: each has finished reading op - 2
// there. Warp 1 waits (warp 0 is free for other work meanwhile); the caller's barrier follows.
__device__ __forceinline__ void wait_slot_free(const Peers& peers, uint64_t op) {
  const int d = int(threadIdx.x) - 32;
  if (d >= 0 && d < peers.window.num_ranks && op > kSlots)
    wait_op(peers, peers.word(peers.rank, peers.window.released_at(int(op % kSlots), d)),
            op - kSlots, kWaitRelease, d);
}

// The source of row `row` in (source, j) order, first[s] being the first row of source s.
__device__ __forceinline__ int source_of(const int32_t* first, int row) {
  int s = 0;
  while (first[s + 1] <= row) ++s;
  return s;
}

// Float outputs of a failed op: NaN (float32, bfloat16 or e4m3 bytes), each thread of the block
// from `begin` in steps of the block.
__device__ __forceinline__ void fill_nan(void* out, int64_t n, int elem_bytes) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (elem_bytes == 4)
      static_cast<uint32_t*>(out)[i] = 0x7fc00000u;
    else if (elem_bytes == 2)
      static_cast<uint16_t*>(out)[i] = 0x7fc0u;
    else
      static_cast<uint8_t*>(out)[i] = 0x7fu;
  }
}

template <typename T>
__device__ __forceinline__ void fill(T* out, int64_t n, T value) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}

// Whether this rank stopped (the whole block agrees): a failed op's kernels then leave NaN in
// its outputs, every block all of them (blocks that finished before the abort wrote theirs
// earlier, so the last writes are NaN).
__device__ __forceinline__ bool block_sees_abort(const Peers& peers) {
  __shared__ bool seen;
  __syncthreads();
  if (threadIdx.x == 0) seen = aborted(peers);
  __syncthreads();
  return seen;
}

// How a grid's warps split rows into pieces of whole parts (each under its own flags), so that
// few rows still use many warps.
struct Pieces {
  int parts, per_piece, pieces;  // per row
  __device__ Pieces(int warps_per_block, int rows, int width) {
    parts = (width + kPartElems - 1) / kPartElems;
    const int warps = gridDim.x * warps_per_block;
    const int want = max(1, min(parts, warps / max(rows, 1)));
    per_piece = (parts + want - 1) / want;
    pieces = (parts + per_piece - 1) / per_piece;
  }
  __device__ int first(int piece) const { return piece * per_piece; }
  __device__ int end(int piece) const { return min(parts, (piece + 1) * per_piece); }
};

// The raised flags of parts [p0, p1) of `row` (the warp's stores of them are fenced).
__device__ __forceinline__ void raise_flags(const Window& window, uint8_t* row, int p0, int p1,
                                            uint64_t op) {
  uint64_t* flags = reinterpret_cast<uint64_t*>(row + window.flags_at());
  for (int part = p0 + threadIdx.x % 32; part < p1; part += 32) store_relaxed(flags + part, op);
}

// The end of a recv part, in every block: the next kernel of this rank releases the op.
__device__ __forceinline__ void finish_recv(const Peers& peers, uint64_t op) {
  if (threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(
        peers.word(peers.rank, peers.window.received_at(int(op % kSlots)))) = op;
}

// True in exactly one block: the last of the grid to finish. Each block's writes, ordered by
// its barrier, are released by one system fence before it counts itself on the ticket; the
// last block fences again before acting on them, and resets the ticket for the next kernel.
__device__ __forceinline__ bool last_block_done(const Peers& peers) {
  __shared__ bool last;
  auto* ticket =
      reinterpret_cast<unsigned int*>(peers.windows[peers.rank] + peers.window.ticket_at());
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

// kernel<<<blocks, threads, smem, stream>>>(args...), opting in to more dynamic shared memory
// only when the kernel's static and dynamic shared memory pass the default.
cudaError_t static_shared_bytes(const void* kernel, size_t* bytes);

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, int threads, size_t smem,
                   cudaStream_t stream, Args... args) {
  size_t static_smem = 0;
  if (cudaError_t err = static_shared_bytes(reinterpret_cast<const void*>(kernel), &static_smem);
      err != cudaSuccess)
    return err;
  if (static_smem + smem > kDefaultSharedBytes)
    if (cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        err != cudaSuccess)
      return err;
  kernel<<<blocks, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

#define JAX_EP_CUDA_TRY(expr)                                                   \
  do {                                                                          \
    cudaError_t err_ = (expr);                                                  \
    if (err_ != cudaSuccess)                                                    \
      return std::string("jax_ep: ") + #expr + ": " + cudaGetErrorString(err_); \
  } while (0)

}  // namespace jax_ep::cuda

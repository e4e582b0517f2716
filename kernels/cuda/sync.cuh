// The protocol of kernels/window.h on GPUs: flags, waits that give up, op numbers, slot release.
// docs/ARCHITECTURE.md says who writes which word when.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/rank.h"

namespace jax_ep::cuda {

constexpr size_t kDefaultSharedBytes = 48 * 1024;  // static + dynamic, without opting in

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t load_volatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Orders this thread's earlier writes (and those it observed) before its later ones, for every
// observer in the system: with a relaxed flag store after it, a release.
__device__ __forceinline__ void fence_release_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool aborted(const Peers& p) {
  return load_volatile(p.word(p.rank, p.w.aborted_at())) != 0;
}

// Gives up: the first wait of this rank to do so records why (the host reads it at the next
// call); every other wait of its kernels then returns at once, so the kernels end (their
// results are not to be used) and the CUDA context stays usable.
__device__ __forceinline__ void give_up(const Peers& p, Wait what, int peer, uint64_t op) {
  auto* flag = reinterpret_cast<unsigned long long*>(p.word(p.rank, p.w.aborted_at()));
  if (atomicCAS(flag, 0ull, 1ull) != 0ull) return;
  volatile Failure* f = p.failure;
  f->peer = peer;
  f->rank = p.rank;
  f->op = op;
  __threadfence_system();
  f->code = int32_t(what);
  __threadfence_system();
}

// Spins until ready(*flag); false if this rank gives up meanwhile (timeout_ns without it).
template <typename Ready>
__device__ __forceinline__ bool wait_until(const Peers& p, const uint64_t* flag, Ready ready,
                                           Wait what, int peer, uint64_t op) {
  if (ready(load_acquire(flag))) return true;
  const uint64_t start = global_time_ns();
  while (!ready(load_acquire(flag))) {
    if (aborted(p)) return false;
    if (global_time_ns() - start > p.timeout_ns) {
      give_up(p, what, peer, op);
      return false;
    }
  }
  return true;
}

// A word peers tag with the op number (counts, rows per expert, flags) has reached op `op`.
__device__ __forceinline__ bool wait_tag(const Peers& p, const uint64_t* word, uint64_t op,
                                         Wait what, int peer) {
  return wait_until(p, word, [op](uint64_t v) { return tag_op(v) >= op; }, what, peer, op);
}

// A word holding an op number (flags of rows, released ops) is at least `op`.
__device__ __forceinline__ bool wait_op(const Peers& p, const uint64_t* word, uint64_t op,
                                        Wait what, int peer) {
  return wait_until(p, word, [op](uint64_t v) { return v >= op; }, what, peer, op);
}

// The op this kernel serves, into `op` (shared memory) once the caller's next barrier passed.
// The first kernel of an op counts its blocks on `started`: every such kernel has the same
// grid, so the count names the op (no host counter: command-buffer replays stay in step). A
// later kernel of the op reads it; a recv half takes it from its ticket (its low 32 bits).
// Block 0 first releases, to every source, the last op of each slot received here: the kernel
// boundary has ordered every read of it before (a plain store, off the critical path).
enum class Begin { kCount, kFollow, kTicket };
__device__ __forceinline__ void begin_op(const Peers& p, Begin how, const int32_t* ticket,
                                         uint64_t* op) {
  const Window& w = p.w;
  if (blockIdx.x == 0 && threadIdx.x < w.num_ranks)
    for (int slot = 0; slot < kSlots; ++slot)
      store_relaxed(p.word(threadIdx.x, w.released_at(slot, p.rank)),
                    load_volatile(p.word(p.rank, w.received_at(slot))));
  if (threadIdx.x == 0) {
    auto* started = reinterpret_cast<unsigned long long*>(p.word(p.rank, w.started_at()));
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
__device__ __forceinline__ void wait_slot_free(const Peers& p, uint64_t op) {
  const int d = int(threadIdx.x) - 32;
  if (d >= 0 && d < p.w.num_ranks && op > kSlots)
    wait_op(p, p.word(p.rank, p.w.released_at(int(op % kSlots), d)), op - kSlots, kWaitRelease, d);
}

// The source of row `row` in (source, j) order, first[s] being the first row of source s.
__device__ __forceinline__ int source_of(const int32_t* first, int row) {
  int s = 0;
  while (first[s + 1] <= row) ++s;
  return s;
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

// The end of a recv part, in every block: the next kernel of this rank releases the op.
__device__ __forceinline__ void finish_recv(const Peers& p, uint64_t op) {
  if (threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(p.word(p.rank, p.w.received_at(int(op % kSlots)))) = op;
}

// True in exactly one block: the last of the grid to finish. Each block's writes, ordered by
// its barrier, are released by one system fence before it counts itself on the ticket; the
// last block fences again before acting on them, and resets the ticket for the next kernel.
__device__ __forceinline__ bool last_block_done(const Peers& p) {
  __shared__ bool last;
  auto* ticket = reinterpret_cast<unsigned int*>(p.window[p.rank] + p.w.ticket_at());
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
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               int(smem));
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

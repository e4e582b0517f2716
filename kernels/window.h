// The communication window of a Buffer: every rank of an EP group owns one, with the same layout,
// and its peers reach it (NVLink pointers on GPUs, POSIX shared memory on CPUs). This is the only
// place that computes an offset into one. See docs/ARCHITECTURE.md for who writes what, when.
//
//   control   words the owner keeps (op counter, received ops, scratch, the abort record any
//             rank may write) and words peers write into it (released ops: op numbers; count
//             records and rows per expert: with their 64-bit op number)
//   rows      [2 slots][R sources][N rows] of row_bytes: what source s sends this rank in op n
//             lands in slot n % 2, block s, at row j = the token's index among those s sends here
//
// A row: payload (x, its e4m3 bytes or a combine row), FP8 scales, the token's local expert ids
// and weights (in a combine: extra float32 columns), one flag per part of kPartElems payload
// elements (GPUs: raised to the op number once the part is written).
#pragma once
#include "kernels/fp8.h"
#include "kernels/limits.h"
#include "kernels/signature.h"

namespace jax_ep {

constexpr int kSlots = 2;         // ops a rank can have sent and not yet received: slot = op % 2
constexpr int kPartElems = 1024;  // payload elements under one flag

// Words peers write hold whole 64-bit op numbers (they never wrap). A count record (what source s
// sends this rank in op n) is five words: the op number, written last with release semantics
// (its flag), the rows (low 32 bits) with the source's invalid expert ids (high 32 bits: a fresh
// dispatch's, so that every rank learns the group's total), and the op's signature
// (kernels/signature.h, three words); a rows-per-expert entry is two: the op number, written after
// the value, and the value.
constexpr int64_t kCountRecordBytes = 16 + 8 * kSignatureWords;
constexpr int64_t kCountRows = 8, kCountSignature = 16;  // offsets in a count record
JAX_EP_HD uint64_t count_word(int rows, int invalid) {
  return uint64_t(uint32_t(rows)) | uint64_t(uint32_t(invalid)) << 32;
}
JAX_EP_HD int rows_of(uint64_t count, int rows_per_source) {  // clamped: a peer's word
  return int(uint32_t(count) < uint32_t(rows_per_source) ? uint32_t(count) : rows_per_source);
}
JAX_EP_HD int invalid_of(uint64_t count) { return int(uint32_t(count >> 32) & 0x7fffffff); }
constexpr int64_t kExpertRowsBytes = 16;
constexpr int64_t kExpertRowsValue = 8;  // offset in an entry

JAX_EP_HD int64_t align_bytes(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Window {
  int num_ranks, experts_per_rank, hidden, num_topk;
  int rows_per_source;  // N: max tokens per rank
  int element_bytes;    // the widest payload element (4: float32, 2: bfloat16)

  // ---- a row
  JAX_EP_HD int64_t payload_bytes() const {
    return align_bytes(int64_t(hidden) * element_bytes, 16);
  }
  JAX_EP_HD int num_scales() const { return hidden / kFp8Block; }
  JAX_EP_HD int64_t scales_at() const { return payload_bytes(); }
  JAX_EP_HD int64_t meta_at() const { return scales_at() + align_bytes(4 * num_scales(), 16); }
  JAX_EP_HD int64_t meta_bytes() const { return align_bytes(8 * int64_t(num_topk), 16); }
  JAX_EP_HD int num_parts() const { return (hidden + kPartElems - 1) / kPartElems; }
  JAX_EP_HD int64_t flags_at() const { return meta_at() + meta_bytes(); }
  JAX_EP_HD int64_t row_bytes() const {
    return flags_at() + align_bytes(8 * int64_t(num_parts()), 16);
  }

  // ---- control: kept by the owner
  JAX_EP_HD int64_t started_at() const { return 0; }  // u64: kernels that began an op
  JAX_EP_HD int64_t received_at(int slot) const { return 8 + 8 * slot; }  // u64: last op received
  JAX_EP_HD int64_t ticket_at() const { return 24; }         // u32: blocks of a grid done
  JAX_EP_HD int64_t invalid_tally_at() const { return 28; }  // u32: a route's invalid ids
  JAX_EP_HD int64_t failure_claim_at() const {
    return 32;
  }  // u32: GPUs: who writes the host record
  // The abort record (kernels/signature.h): its state word, then an AbortRecord. Written by
  // whichever rank of the group gives up first.
  JAX_EP_HD int64_t aborted_at() const { return 64; }
  static constexpr int64_t kAbortRecordAt = 72, kRouteScratchAt = 192;
  static_assert(kAbortRecordAt + int64_t(sizeof(AbortRecord)) <= kRouteScratchAt,
                "the abort record overlaps the route scratch");
  JAX_EP_HD int64_t abort_record_at() const { return kAbortRecordAt; }
  // Route scratch (large dispatches on GPUs): rows earlier chunks of kChunkTokens send to rank d,
  // and rows per global expert.
  static constexpr int kChunkTokens = 1024;
  JAX_EP_HD int max_chunks() const { return (rows_per_source + kChunkTokens - 1) / kChunkTokens; }
  JAX_EP_HD int64_t chunk_rows_at(int chunk, int rank) const {
    return kRouteScratchAt + 4 * (int64_t(chunk) * num_ranks + rank);
  }
  JAX_EP_HD int64_t expert_tally_at(int expert) const {
    return align_bytes(chunk_rows_at(max_chunks(), 0), 8) + 4 * int64_t(expert);
  }
  // Each token's index among its chunk's tokens sent to rank d (then the send adds the chunk's).
  JAX_EP_HD int64_t chunk_slot_at(int token, int rank) const {
    return align_bytes(expert_tally_at(num_ranks * experts_per_rank), 8) +
           4 * (int64_t(token) * num_ranks + rank);
  }
  JAX_EP_HD int64_t local_end() const {
    return align_bytes(chunk_slot_at(rows_per_source, 0), 128);
  }

  // ---- control: written by peers
  // released[slot][d]: the last op of `slot` rank d finished reading from this rank.
  JAX_EP_HD int64_t released_at(int slot, int peer) const {
    return local_end() + 8 * (int64_t(slot) * num_ranks + peer);
  }
  // counts[slot][s]: the count record of what source s sends this rank (kCountRecordBytes).
  JAX_EP_HD int64_t counts_at(int slot, int source) const {
    return released_at(kSlots, 0) + kCountRecordBytes * (int64_t(slot) * num_ranks + source);
  }
  // expert_rows[slot][s][e]: (op, rows for local expert e) a fresh dispatch from s brings.
  JAX_EP_HD int64_t expert_rows_at(int slot, int source, int expert) const {
    return counts_at(kSlots, 0) +
           kExpertRowsBytes * ((int64_t(slot) * num_ranks + source) * experts_per_rank + expert);
  }

  // ---- rows
  JAX_EP_HD int64_t rows_at() const { return align_bytes(expert_rows_at(kSlots, 0, 0), 256); }
  JAX_EP_HD int64_t row_at(int slot, int source, int j) const {
    return rows_at() + ((int64_t(slot) * num_ranks + source) * rows_per_source + j) * row_bytes();
  }
  JAX_EP_HD int64_t total_bytes() const { return row_at(kSlots, 0, 0); }
};

// The owner's words of a fresh window whose Buffer numbers its ops from first + 1 (first is 0,
// or for tests a number near 2^32): every slot received and released up to `first`.
template <typename Set>
void initial_words(const Window& w, uint64_t first, Set set) {
  for (int slot = 0; slot < kSlots; ++slot) {
    set(w.received_at(slot), first);
    for (int r = 0; r < w.num_ranks; ++r) set(w.released_at(slot, r), first);
  }
}

}  // namespace jax_ep

// The communication window of a Buffer: every rank of an EP group owns one, with the same layout,
// and its peers reach it (NVLink pointers on GPUs, POSIX shared memory on CPUs). This is the only
// place that computes an offset into one. See docs/ARCHITECTURE.md for who writes what, when.
//
//   control   words the owner keeps (op counter, received ops, scratch) and words peers write
//             into it (released ops: op numbers; row counts and rows per expert: tagged with
//             their op)
//   rows      [2 slots][R sources][N rows] of row_bytes: what source s sends this rank in op n
//             lands in slot n % 2, block s, at row j = the token's index among those s sends here
//
// A row: payload (x, its e4m3 bytes or a combine row), FP8 scales, the token's local expert ids
// and weights (in a combine: extra float32 columns), one flag per part of kPartElems payload
// elements (GPUs: raised to the op number once the part is written).
#pragma once
#include "kernels/fp8.h"
#include "kernels/limits.h"

namespace jax_ep {

constexpr int kSlots = 2;          // ops a rank can have sent and not yet received: slot = op % 2
constexpr int kPartElems = 1024;   // payload elements under one flag

enum class OpKind : uint32_t { kDispatch = 1, kCombine = 2 };

// Words peers write: the op number in the high 32 bits, a value in the low 32.
JAX_EP_HD uint64_t tagged(uint64_t op, uint32_t value) { return op << 32 | value; }
JAX_EP_HD uint64_t tag_op(uint64_t word) { return word >> 32; }
JAX_EP_HD uint32_t tag_value(uint64_t word) { return uint32_t(word); }
// A row count word: which kind of op sent it and how many rows (< 2^28).
JAX_EP_HD uint32_t count_value(OpKind kind, int rows) { return uint32_t(kind) << 28 | uint32_t(rows); }
JAX_EP_HD OpKind count_kind(uint64_t word) { return OpKind(tag_value(word) >> 28); }
JAX_EP_HD int count_rows(uint64_t word) { return int(tag_value(word) & ((1u << 28) - 1)); }

JAX_EP_HD int64_t align_bytes(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Window {
  int num_ranks, experts_per_rank, hidden, num_topk;
  int rows_per_source;   // N: max tokens per rank
  int element_bytes;     // the widest payload element (4: float32, 2: bfloat16)

  // ---- a row
  JAX_EP_HD int64_t payload_bytes() const { return align_bytes(int64_t(hidden) * element_bytes, 16); }
  JAX_EP_HD int num_scales() const { return hidden / kFp8Block; }
  JAX_EP_HD int64_t scales_at() const { return payload_bytes(); }
  JAX_EP_HD int64_t meta_at() const { return scales_at() + align_bytes(4 * num_scales(), 16); }
  JAX_EP_HD int64_t meta_bytes() const { return align_bytes(8 * int64_t(num_topk), 16); }
  JAX_EP_HD int num_parts() const { return (hidden + kPartElems - 1) / kPartElems; }
  JAX_EP_HD int64_t flags_at() const { return meta_at() + meta_bytes(); }
  JAX_EP_HD int64_t row_bytes() const { return flags_at() + align_bytes(8 * int64_t(num_parts()), 16); }

  // ---- control: kept by the owner
  JAX_EP_HD int64_t started_at() const { return 0; }            // u64: kernels that began an op
  JAX_EP_HD int64_t received_at(int slot) const { return 8 + 8 * slot; }  // u64: last op received
  JAX_EP_HD int64_t ticket_at() const { return 24; }            // u32: blocks of a grid done
  JAX_EP_HD int64_t aborted_at() const { return 32; }           // u64: a wait timed out
  JAX_EP_HD int64_t invalid_tally_at() const { return 40; }     // u32: a route's invalid ids
  // Route scratch (large dispatches on GPUs): rows earlier chunks of kChunkTokens send to rank d,
  // and rows per global expert.
  static constexpr int kChunkTokens = 1024;
  JAX_EP_HD int max_chunks() const { return (rows_per_source + kChunkTokens - 1) / kChunkTokens; }
  JAX_EP_HD int64_t chunk_rows_at(int chunk, int rank) const {
    return 64 + 4 * (int64_t(chunk) * num_ranks + rank);
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
  // counts[slot][s]: tagged(op, count_value(kind, rows)) source s sends this rank.
  JAX_EP_HD int64_t counts_at(int slot, int source) const {
    return released_at(kSlots, 0) + 8 * (int64_t(slot) * num_ranks + source);
  }
  // expert_rows[slot][s][e]: tagged(op, rows for local expert e) a fresh dispatch from s brings.
  JAX_EP_HD int64_t expert_rows_at(int slot, int source, int expert) const {
    return counts_at(kSlots, 0) + 8 * ((int64_t(slot) * num_ranks + source) * experts_per_rank + expert);
  }

  // ---- rows
  JAX_EP_HD int64_t rows_at() const { return align_bytes(expert_rows_at(kSlots, 0, 0), 256); }
  JAX_EP_HD int64_t row_at(int slot, int source, int j) const {
    return rows_at() + ((int64_t(slot) * num_ranks + source) * rows_per_source + j) * row_bytes();
  }
  JAX_EP_HD int64_t total_bytes() const { return row_at(kSlots, 0, 0); }
};

}  // namespace jax_ep

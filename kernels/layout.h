// Layout arithmetic shared by the CPU and CUDA backends (host and device).
// The plain-JAX statement of the same rules is jax_ep/layout.py; tests compare the two.
#pragma once
#include "kernels/dtype.h"

namespace jax_ep {

JAX_EP_HD bool is_routed(int32_t expert, int num_experts) {
  return expert >= 0 && expert < num_experts;
}

// -1 marks an unused slot; anything else outside [0, E) is invalid input.
JAX_EP_HD bool is_invalid(int32_t expert, int num_experts) {
  return expert < -1 || expert >= num_experts;
}

// Whether slot k is the first of the token's slots naming a routed expert on `rank`: the token
// goes to each such rank once.
JAX_EP_HD bool first_slot_on_rank(const int32_t* topk, int k, int num_experts,
                                  int experts_per_rank) {
  if (!is_routed(topk[k], num_experts)) return false;
  const int rank = topk[k] / experts_per_rank;
  for (int p = 0; p < k; ++p)
    if (is_routed(topk[p], num_experts) && topk[p] / experts_per_rank == rank) return false;
  return true;
}

// The ranks holding at least one of this token's experts, as a mask (GPUs: at most 32 ranks).
JAX_EP_HD uint32_t dest_rank_mask(const int32_t* topk, int num_topk, int num_experts,
                                  int experts_per_rank) {
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k)
    if (is_routed(topk[k], num_experts)) mask |= 1u << (topk[k] / experts_per_rank);
  return mask;
}

JAX_EP_HD int count_invalid(const int32_t* topk, int num_topk, int num_experts) {
  int n = 0;
  for (int k = 0; k < num_topk; ++k) n += is_invalid(topk[k], num_experts);
  return n;
}

// Slot k of a token as seen by rank `rank`: its local expert id there, or -1.
JAX_EP_HD int32_t local_expert_on(int32_t expert, int rank, int num_experts, int experts_per_rank) {
  return is_routed(expert, num_experts) && expert / experts_per_rank == rank
             ? expert - rank * experts_per_rank
             : -1;
}

// Does a received row (local expert ids or -1) hold local expert e? Duplicated slots count once.
JAX_EP_HD bool row_has_expert(const int32_t* local_topk, int num_topk, int32_t e) {
  for (int k = 0; k < num_topk; ++k)
    if (local_topk[k] == e) return true;
  return false;
}

// Among a row's distinct local experts, how many are below e: the column of e in expert_rows.
JAX_EP_HD int distinct_experts_below(const int32_t* local_topk, int num_topk, int32_t e) {
  int n = 0;
  for (int k = 0; k < num_topk; ++k) {
    int32_t v = local_topk[k];
    n += v >= 0 && v < e && !row_has_expert(local_topk, k, v);
  }
  return n;
}

// Expert-layout rows one received row can expand to.
JAX_EP_HD int max_experts_per_row(int num_topk, int experts_per_rank) {
  return num_topk < experts_per_rank ? num_topk : experts_per_rank;
}

JAX_EP_HD int align_up(int value, int alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Where expert e's rows start and how many fit (see jax_ep/layout.py expert_layout): padded
// blocks of block_rows rows each, or packed blocks aligned to `alignment` up to the capacity.
JAX_EP_HD void expert_block(const int32_t* counts, int e, int alignment, int block_rows,
                            int capacity, int* start, int* room) {
  if (block_rows > 0) {
    *start = e * block_rows;
    *room = block_rows;
    return;
  }
  int s = 0;
  for (int p = 0; p < e; ++p) s += align_up(counts[p], alignment);
  *start = s;
  *room = capacity - s > 0 ? capacity - s : 0;
}

}  // namespace jax_ep

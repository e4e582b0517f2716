#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/cpu/rank.h"
#include "kernels/layout.h"

namespace jax_ep::cpu {

// Expert e's block starts where expert_block says; within the block rows keep rank-layout order;
// whatever does not fit the block is dropped (and counted).
void expert_layout(const ExpertLayoutArgs& a) {
  const int El = a.experts_per_rank, K = a.num_topk, M = a.max_per_row();
  int32_t* count = a.expert_counts;
  std::fill(count, count + El, 0);
  for (int r = 0; r < a.rows; ++r)
    for (int e = 0; e < El; ++e) count[e] += row_has_expert(a.topk_rows + int64_t(r) * K, K, e);

  std::vector<int> start(El), room(El);
  for (int e = 0; e < El; ++e)
    expert_block(count, e, a.alignment, a.block_rows, a.capacity, &start[e], &room[e]);
  std::fill(a.expert_src, a.expert_src + a.capacity, -1);
  std::fill(a.expert_of_row, a.expert_of_row + a.capacity, -1);
  std::fill(a.expert_rows, a.expert_rows + int64_t(a.rows) * M, -1);
  std::fill(a.tokens_per_expert, a.tokens_per_expert + El, 0);
  int32_t dropped = 0;
  for (int r = 0; r < a.rows; ++r) {
    const int32_t* topk = a.topk_rows + int64_t(r) * K;
    for (int e = 0; e < El; ++e) {
      if (!row_has_expert(topk, K, e)) continue;
      if (a.tokens_per_expert[e] == room[e]) {
        ++dropped;
        continue;
      }
      const int32_t pos = start[e] + a.tokens_per_expert[e]++;
      a.expert_src[pos] = r;
      a.expert_of_row[pos] = e;
      a.expert_rows[int64_t(r) * M + distinct_experts_below(topk, K, e)] = pos;
    }
  }
  *a.num_dropped = dropped;
}

// The packed layout's maps with a block of C rows per expert, then the rows placed and weighed.
std::string expert_padded(const ExpertPaddedArgs& a) {
  const int El = a.experts_per_rank, K = a.num_topk;
  const int64_t out_rows = int64_t(El) * a.capacity;
  int32_t dropped;
  ExpertLayoutArgs layout{};
  layout.rows = a.rows;
  layout.num_topk = K;
  layout.experts_per_rank = El;
  layout.alignment = 1;
  layout.capacity = int(out_rows);
  layout.block_rows = a.capacity;
  layout.topk_rows = a.topk_rows;
  layout.expert_src = a.expert_src;
  layout.expert_rows = a.expert_rows;
  layout.expert_of_row = a.expert_of_row;
  layout.tokens_per_expert = a.tokens_per_expert;
  layout.num_dropped = &dropped;
  layout.expert_counts = a.expert_counts;
  expert_layout(layout);
  for (int64_t pos = 0; pos < out_rows; ++pos) {
    const int32_t r = a.expert_src[pos], e = a.expert_of_row[pos];
    float weight = 0.f;
    for (int k = 0; r >= 0 && k < K; ++k)
      if (a.topk_rows[int64_t(r) * K + k] == e) weight += a.weight_rows[int64_t(r) * K + k];
    a.weights_out[pos] = weight;
  }
  const int M = a.max_per_row();
  for (auto [src, out, bytes] : {std::tuple{a.x_rows, a.x_out, a.x_row_bytes},
                                 std::tuple{a.scale_rows, a.scales_out, a.scale_row_bytes}}) {
    if (bytes == 0) continue;
    if (auto err = place_rows({a.rows, M, bytes, out_rows, src, a.expert_rows, out}); !err.empty())
      return err;
  }
  return {};
}

std::string place_rows(const PlaceRowsArgs& a) {
  for (int r = 0; r < a.rows; ++r)
    for (int m = 0; m < a.per_row; ++m) {
      const int32_t pos = a.expert_rows[int64_t(r) * a.per_row + m];
      if (pos < 0) continue;
      if (pos >= a.out_rows) return "place rows: an expert row lies past the output";
      std::memcpy(a.out + pos * a.row_bytes, a.src + r * a.row_bytes, a.row_bytes);
    }
  return {};
}

}  // namespace jax_ep::cpu

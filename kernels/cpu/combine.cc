// Combine on CPU devices: the send half writes each rank-level row this rank kept back into
// row j of its source's block there, then the count word (rows kept); the recv half waits for
// every rank's count word and sums each token's rows in rank order onto the bias, in float32.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/rank.h"

namespace jax_ep::cpu {

std::string combine_send(Rank& r, uint64_t op, const CombineSend& a) {
  const Window& w = r.window;
  const int R = w.num_ranks, me = r.rank, slot = int(op % kSlots);
  if (auto err = wait_slot_free(r, op); !err.empty()) return err;
  const int64_t row_bytes = int64_t(a.width) * dtype_size(a.rows_dtype);
  // The handle's counts are only trusted within the window and the rows: a stale or corrupted
  // handle cannot write past a block or read past row_data.
  std::vector<int> counts(R);
  int64_t total = 0;
  for (int s = 0; s < R; ++s) {
    counts[s] = std::clamp(a.recv_counts[s], 0, w.rows_per_source);
    total += counts[s];
  }
  const int present = int(std::clamp<int64_t>(*a.num_rows, 0, std::min<int64_t>(total, a.rows)));
  const Signature sig = signature(a, w.num_ranks * w.experts_per_rank);
  for (int s = 0, first = 0; s < R; first += counts[s], ++s) {
    const int kept = std::clamp(present - first, 0, counts[s]);
    for (int j = 0; j < kept; ++j) {
      uint8_t* row = r.window_of(s) + w.row_at(slot, me, j);
      std::memcpy(row, static_cast<const uint8_t*>(a.row_data) + (first + j) * row_bytes,
                  row_bytes);
      if (a.extra)
        std::memcpy(row + w.meta_at(), a.extra + int64_t(first + j) * a.extra_cols,
                    4 * a.extra_cols);
    }
    send_count(r, s, op, count_word(kept, 0), sig);
  }
  return {};
}

std::string combine_recv(Rank& r, uint64_t op, const CombineRecv& a) {
  const Window& w = r.window;
  const int R = w.num_ranks, slot = int(op % kSlots);
  std::vector<int> first;
  if (auto err = received_rows(r, op, &first); !err.empty()) return err;
  std::vector<float> acc(a.width), extra(a.extra_cols);
  for (int t = 0; t < a.num_tokens; ++t) {
    for (int c = 0; c < a.width; ++c)
      acc[c] = a.bias ? load_float(a.bias, int64_t(t) * a.width + c, a.bias_dtype) : 0.f;
    std::fill(extra.begin(), extra.end(), 0.f);
    for (int d = 0; d < R; ++d) {  // rank order: the fixed summation order
      const int32_t j = a.send_pos[int64_t(t) * R + d];
      if (j < 0 || j >= first[d + 1] - first[d]) continue;  // not sent, or dropped there
      const uint8_t* row = r.window_of(r.rank) + w.row_at(slot, d, j);
      for (int c = 0; c < a.width; ++c) acc[c] += load_float(row, c, a.rows_dtype);
      const float* cols = reinterpret_cast<const float*>(row + w.meta_at());
      for (int c = 0; c < a.extra_cols; ++c) extra[c] += cols[c];
    }
    for (int c = 0; c < a.width; ++c)
      store_float(a.out, int64_t(t) * a.width + c, a.out_dtype, acc[c]);
    if (a.extra_out) std::copy(extra.begin(), extra.end(), a.extra_out + int64_t(t) * a.extra_cols);
  }
  release(r, op);
  return {};
}

}  // namespace jax_ep::cpu

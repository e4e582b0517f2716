// Dispatch on CPU devices: the send half writes each token's row into its block of every
// destination's window and then the count word (a release store: the word is the rows' flag
// here); the recv half waits for every source's count word and copies the rows out in
// (source, j) order.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/rank.h"
#include "kernels/fp8.h"

namespace jax_ep::cpu {
namespace {

// The row as it goes on the wire: x's bytes, or its e4m3 bytes and one scale per 128 channels.
void encode_row(const DispatchSend& a, int t, uint8_t* payload, float* scales) {
  const int64_t in_row = int64_t(a.hidden) * dtype_size(a.x_dtype);
  const uint8_t* src = static_cast<const uint8_t*>(a.x) + t * in_row;
  if (!a.fp8) {
    std::memcpy(payload, src, in_row);
    return;
  }
  quantize_row(src, a.hidden, a.x_dtype, a.round_scale, payload, scales);
}

}  // namespace

std::string dispatch_send(Rank& r, uint64_t op, const DispatchSend& a) {
  const Window& w = r.window;
  const int R = w.num_ranks, me = r.rank, slot = int(op % kSlots), K = a.num_topk;
  const int El = w.experts_per_rank;
  if (auto err = wait_slot_free(r, op); !err.empty()) return err;

  std::vector<int32_t> rows(R, 0);
  int invalid = 0;
  if (a.fresh()) {
    std::fill(a.send_pos, a.send_pos + int64_t(a.num_tokens) * R, -1);
    for (int t = 0; t < a.num_tokens; ++t) {
      const int32_t* topk = a.topk_idx + int64_t(t) * K;
      invalid += count_invalid(topk, K, a.num_experts);
      for (int k = 0; k < K; ++k)
        if (first_slot_on_rank(topk, k, a.num_experts, El))
          a.send_pos[int64_t(t) * R + topk[k] / El] = rows[topk[k] / El]++;
    }
    *a.num_invalid = invalid;
  } else {  // a handle's routes: rows beyond a block (a corrupted handle) are not sent
    for (int64_t i = 0; i < int64_t(a.num_tokens) * R; ++i)
      if (a.send_pos[i] >= 0 && a.send_pos[i] < w.rows_per_source) ++rows[i % R];
  }

  std::vector<uint8_t> payload(a.wire_row_bytes());
  std::vector<float> scales(w.num_scales());
  for (int t = 0; t < a.num_tokens; ++t) {
    bool encoded = false;
    for (int d = 0; d < R; ++d) {
      const int32_t j = a.send_pos[int64_t(t) * R + d];
      if (j < 0 || j >= w.rows_per_source) continue;
      if (!encoded) encode_row(a, t, payload.data(), scales.data()), encoded = true;
      uint8_t* row = r.window_of(d) + w.row_at(slot, me, j);
      std::memcpy(row, payload.data(), payload.size());
      if (a.fp8) std::memcpy(row + w.scales_at(), scales.data(), 4 * scales.size());
      if (!a.fresh()) continue;
      int32_t* ids = reinterpret_cast<int32_t*>(row + w.meta_at());
      float* weights = reinterpret_cast<float*>(ids + K);
      for (int k = 0; k < K; ++k) {
        const int64_t at = int64_t(t) * K + k;
        ids[k] = local_expert_on(a.topk_idx[at], d, a.num_experts, El);
        weights[k] = ids[k] >= 0 ? a.topk_weights[at] : 0.f;
      }
    }
  }
  const Signature sig = signature(a);
  for (int d = 0; d < R; ++d) send_count(r, d, op, count_word(rows[d], invalid), sig);
  return {};
}

std::string wait_slot_free(Rank& r, uint64_t op) {
  const Window& w = r.window;
  if (op <= kSlots) return {};
  for (int d = 0; d < w.num_ranks; ++d)  // d has read what this rank sent it kSlots ops ago
    if (auto err = r.wait_op(w.released_at(int(op % kSlots), d), op - kSlots, d, kWaitRelease);
        !err.empty())
      return err;
  return {};
}

void send_count(Rank& r, int dest, uint64_t op, uint64_t count, const Signature& sig) {
  const int64_t at = r.window.counts_at(int(op % kSlots), r.rank);
  uint8_t* record = r.window_of(dest) + at;
  *reinterpret_cast<uint64_t*>(record + kCountRows) = count;
  signature_words(sig, reinterpret_cast<uint64_t*>(record + kCountSignature));
  store_release(r.word(dest, at), op);  // the rows' and the record's flag
}

std::string received_rows(Rank& r, uint64_t op, std::vector<int>* first, int* group_invalid) {
  const Window& w = r.window;
  const int slot = int(op % kSlots), R = w.num_ranks;
  first->assign(R + 1, 0);
  auto record = [&](int s) { return r.window_of(r.rank) + w.counts_at(slot, s); };
  auto sig = [&](int s) { return reinterpret_cast<const uint64_t*>(record(s) + kCountSignature); };
  for (int s = 0; s < R; ++s)
    if (auto err = r.wait_op(w.counts_at(slot, s), op, s, kWaitCounts); !err.empty()) return err;
  const auto mine = sig(r.rank);  // the record this rank sent itself
  for (int s = 0; s < R; ++s) {
    if (std::memcmp(sig(s), mine, 8 * kSignatureWords) != 0)
      return r.give_up(kMismatch, s, op, mine, sig(s));
    const uint64_t count = *reinterpret_cast<const uint64_t*>(record(s) + kCountRows);
    (*first)[s + 1] = (*first)[s] + rows_of(count, w.rows_per_source);
    if (group_invalid) *group_invalid += invalid_of(count);
  }
  return {};
}

void release(Rank& r, uint64_t op) {
  const Window& w = r.window;
  const int slot = int(op % kSlots);
  *r.word(r.rank, w.received_at(slot)) = op;
  for (int s = 0; s < w.num_ranks; ++s) store_release(r.word(s, w.released_at(slot, r.rank)), op);
}

std::string dispatch_recv(Rank& r, uint64_t op, const DispatchRecv& a) {
  const Window& w = r.window;
  const int R = w.num_ranks, slot = int(op % kSlots), K = a.num_topk;
  std::vector<int> first;
  int group_invalid = 0;
  if (auto err = received_rows(r, op, &first, a.fresh() ? &group_invalid : nullptr); !err.empty())
    return err;
  const int present = std::min(first[R], a.out_rows);
  const int64_t row_bytes = a.wire_row_bytes(), num_scales = a.fp8 ? w.num_scales() : 0;
  uint8_t* x_out = static_cast<uint8_t*>(a.x_out);
  for (int s = 0, i = 0; s < R; ++s)
    for (int j = 0; j < first[s + 1] - first[s] && i < present; ++j, ++i) {
      const uint8_t* row = r.window_of(r.rank) + w.row_at(slot, s, j);
      std::memcpy(x_out + i * row_bytes, row, row_bytes);
      if (num_scales)
        std::memcpy(a.scales_out + i * num_scales, row + w.scales_at(), 4 * num_scales);
      if (!a.fresh()) continue;
      std::memcpy(a.topk_out + int64_t(i) * K, row + w.meta_at(), 4 * int64_t(K));
      std::memcpy(a.weights_out + int64_t(i) * K, row + w.meta_at() + 4 * K, 4 * int64_t(K));
    }
  // Padding rows: zeros, expert -1, weight 0.
  std::memset(x_out + present * row_bytes, 0, (a.out_rows - present) * row_bytes);
  if (num_scales)
    std::fill(a.scales_out + present * num_scales, a.scales_out + a.out_rows * num_scales, 0.f);
  if (a.fresh()) {
    std::fill(a.topk_out + int64_t(present) * K, a.topk_out + int64_t(a.out_rows) * K, -1);
    std::fill(a.weights_out + int64_t(present) * K, a.weights_out + int64_t(a.out_rows) * K, 0.f);
    const int El = int(w.experts_per_rank);
    std::fill(a.tokens_per_expert, a.tokens_per_expert + El, 0);
    for (int i = 0; i < present; ++i)
      for (int e = 0; e < El; ++e)
        a.tokens_per_expert[e] += row_has_expert(a.topk_out + int64_t(i) * K, K, e);
    for (int s = 0; s < R; ++s) a.recv_counts[s] = first[s + 1] - first[s];
    *a.num_recv = present;
    *a.num_dropped = first[R] - present;
    *a.group_invalid = group_invalid;
  }
  release(r, op);
  return {};
}

}  // namespace jax_ep::cpu

#include "kernels/cpu/exchange.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fp8.h"
#include "kernels/layout.h"

namespace jax_ep::cpu {

Group::Group(int num_ranks, double timeout_s)
    : num_ranks_(num_ranks), timeout_s_(timeout_s), runs_(num_ranks), completions_(num_ranks) {
  for (int r = 0; r < num_ranks; ++r) completers_.emplace_back([this, r] { serve(r); });
  watchdog_ = std::thread([this] { watch(); });
}

Group::~Group() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    fail_pending("jax_ep: the Buffer was closed while an op waited for its peers");
  }
  cv_.notify_all();
  watchdog_.join();
  for (auto& t : completers_) t.join();
}

void Group::complete(int rank, Done done, std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    completions_[rank].push_back([done = std::move(done), error = std::move(error)] { done(error); });
  }
  cv_.notify_all();
}

void Group::serve(int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !completions_[rank].empty(); });
    if (completions_[rank].empty()) return;  // stopping, nothing left to complete
    auto work = std::move(completions_[rank]);
    completions_[rank].clear();
    lock.unlock();
    for (auto& w : work) w();
    lock.lock();
  }
}

void Group::join(int rank, int64_t key, Call call) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) {
    completions_[rank].push_back([done = std::move(call.done), error = broken_] { done(error); });
    lock.unlock();
    cv_.notify_all();
    return;
  }
  const OpId id{key, runs_[rank][key]++};
  Pending& op = pending_[id];
  if (op.calls.empty()) {
    op.calls.resize(num_ranks_);
    op.deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(timeout_s_));
    cv_.notify_all();
  }
  op.calls[rank] = std::move(call);
  if (++op.arrived < num_ranks_) return;
  std::vector<Call> calls;
  for (auto& c : op.calls) calls.push_back(std::move(*c));
  pending_.erase(id);
  lock.unlock();

  std::vector<std::string> errors(num_ranks_);
  const bool same = std::all_of(calls.begin(), calls.end(),
                                [&](const Call& c) { return c.kind == calls[0].kind; });
  if (!same) {
    errors.assign(num_ranks_, "jax_ep: the ranks of an EP group ran different ops (dispatch on "
                              "some, combine on others); every device must run the same sequence");
  } else if (calls[0].kind == Call::kDispatch) {
    std::vector<DispatchArgs> args;
    for (auto& c : calls) args.push_back(c.dispatch);
    errors = dispatch(args);
  } else {
    std::vector<CombineArgs> args;
    for (auto& c : calls) args.push_back(c.combine);
    errors = combine(args);
  }
  for (int r = 0; r < num_ranks_; ++r) complete(r, std::move(calls[r].done), errors[r]);
}

void Group::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (pending_.empty()) {
      cv_.wait(lock);
      continue;
    }
    auto first = std::chrono::steady_clock::time_point::max();
    for (auto& [id, op] : pending_) first = std::min(first, op.deadline);
    if (first > std::chrono::steady_clock::now()) {
      cv_.wait_until(lock, first);
      continue;
    }
    auto expired = std::min_element(pending_.begin(), pending_.end(), [](auto& a, auto& b) {
      return a.second.deadline < b.second.deadline;
    });
    std::string missing;
    for (int r = 0; r < num_ranks_; ++r)
      if (!expired->second.calls[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    broken_ = "jax_ep: rank(s) " + missing + " of an EP group never arrived at an op the other "
              "ranks ran, within " + std::to_string(timeout_s_) + " s (every device of the "
              "group must run the same jax_ep ops); this Buffer is unusable from now on";
    fail_pending(broken_);
    cv_.notify_all();
  }
}

void Group::fail_pending(const std::string& error) {
  for (auto& [id, op] : pending_)
    for (int r = 0; r < num_ranks_; ++r)
      if (op.calls[r])
        completions_[r].push_back([done = std::move(op.calls[r]->done), error] { done(error); });
  pending_.clear();
}

namespace {

// One token's row as it goes on the wire: x, or its e4m3 bytes and scales.
struct WireRow {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
};

void encode_row(const DispatchArgs& a, int t, WireRow& row) {
  const int64_t in_row = int64_t(a.hidden) * dtype_size(a.x_dtype);
  const uint8_t* src = static_cast<const uint8_t*>(a.x) + t * in_row;
  if (!a.fp8) {
    row.bytes.assign(src, src + in_row);
    return;
  }
  row.bytes.resize(a.hidden);
  row.scales.resize(a.scales_per_row());
  for (int g = 0; g < a.scales_per_row(); ++g) {
    float max_abs = 0.f;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      max_abs = std::max(max_abs, std::fabs(load_float(src, c, a.x_dtype)));
    Fp8Block block = Fp8Block::make(max_abs, a.round_scale);
    row.scales[g] = block.scale;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      row.bytes[c] = float_to_e4m3(block.scaled(load_float(src, c, a.x_dtype)));
  }
}

// Token t of `from` lands in row `pos` of rank `dest_rank`, whose outputs `to` describes.
void write_row(const DispatchArgs& from, const WireRow& row, const DispatchArgs& to,
               int dest_rank, int t, int64_t pos) {
  const int64_t row_bytes = to.x_out_row_bytes();
  memcpy(static_cast<uint8_t*>(to.x_out) + pos * row_bytes, row.bytes.data(), row_bytes);
  if (to.fp8)
    memcpy(to.scales_out + pos * to.scales_per_row(), row.scales.data(),
           sizeof(float) * to.scales_per_row());
  if (to.cached) return;
  for (int k = 0; k < from.num_topk; ++k) {
    int32_t e = from.topk_idx[int64_t(t) * from.num_topk + k];
    int32_t local = local_expert_on(e, dest_rank, from.num_experts, from.experts_per_rank());
    to.topk_out[pos * to.num_topk + k] = local;
    to.weights_out[pos * to.num_topk + k] =
        local >= 0 ? from.topk_weights[int64_t(t) * from.num_topk + k] : 0.f;
  }
}

// Padding rows: zeros, expert -1, weight 0.
void clear_rows(const DispatchArgs& a, int64_t from) {
  const int64_t n = a.out_rows - from;
  if (n <= 0) return;
  memset(static_cast<uint8_t*>(a.x_out) + from * a.x_out_row_bytes(), 0, n * a.x_out_row_bytes());
  if (a.fp8) memset(a.scales_out + from * a.scales_per_row(), 0, n * a.scales_per_row() * 4);
  if (a.cached) return;
  std::fill(a.topk_out + from * a.num_topk, a.topk_out + a.out_rows * int64_t(a.num_topk), -1);
  std::fill(a.weights_out + from * a.num_topk, a.weights_out + a.out_rows * int64_t(a.num_topk),
            0.f);
}

}  // namespace

std::vector<std::string> dispatch(std::vector<DispatchArgs>& ranks) {
  const int R = int(ranks.size());
  // Route: the slot of each token among those its rank sends to d, in token order.
  std::vector<std::vector<int32_t>> counts(R, std::vector<int32_t>(R, 0));
  std::vector<std::vector<int32_t>> slot(R);
  std::vector<int> invalid(R, 0);
  for (int s = 0; s < R; ++s) {
    const DispatchArgs& a = ranks[s];
    if (a.cached) continue;
    slot[s].assign(int64_t(a.num_tokens) * R, -1);
    for (int t = 0; t < a.num_tokens; ++t) {
      const int32_t* topk = a.topk_idx + int64_t(t) * a.num_topk;
      invalid[s] += count_invalid(topk, a.num_topk, a.num_experts);
      uint32_t mask = dest_rank_mask(topk, a.num_topk, a.num_experts, a.experts_per_rank());
      for (int d = 0; d < R; ++d)
        if (mask >> d & 1u) slot[s][int64_t(t) * R + d] = counts[s][d]++;
    }
  }
  // Rows from lower ranks come first at every destination; past the capacity they drop.
  std::vector<int64_t> received(R, 0), present(R);
  for (int d = 0; d < R; ++d) {
    for (int s = 0; s < R; ++s) received[d] += counts[s][d];
    present[d] = ranks[d].cached ? *ranks[d].cached_num_recv
                                 : std::min<int64_t>(received[d], ranks[d].out_rows);
    clear_rows(ranks[d], present[d]);
  }
  WireRow row;
  for (int s = 0; s < R; ++s) {
    const DispatchArgs& a = ranks[s];
    std::vector<int64_t> first_row(R, 0);
    for (int d = 0; d < R; ++d)
      for (int p = 0; p < s; ++p) first_row[d] += counts[p][d];
    for (int t = 0; t < a.num_tokens; ++t) {
      bool encoded = false;
      for (int d = 0; d < R; ++d) {
        int32_t& pos = a.send_pos[int64_t(t) * R + d];
        if (!a.cached) {
          int32_t k = slot[s][int64_t(t) * R + d];
          pos = k >= 0 && first_row[d] + k < ranks[d].out_rows ? int32_t(first_row[d] + k) : -1;
        }
        if (pos < 0) continue;
        if (!encoded) encode_row(a, t, row), encoded = true;
        write_row(a, row, ranks[d], d, t, pos);
      }
    }
  }
  std::vector<std::string> errors(R);
  for (int d = 0; d < R; ++d) {
    const DispatchArgs& a = ranks[d];
    if (a.cached) continue;
    const int El = a.experts_per_rank();
    std::fill(a.tokens_per_expert, a.tokens_per_expert + El, 0);
    for (int64_t p = 0; p < present[d]; ++p)
      for (int e = 0; e < El; ++e)
        a.tokens_per_expert[e] += row_has_expert(a.topk_out + p * a.num_topk, a.num_topk, e);
    for (int s = 0; s < R; ++s) a.recv_counts[s] = counts[s][d];
    *a.num_recv = int32_t(present[d]);
    *a.num_dropped = int32_t(received[d] - present[d]);
    *a.num_invalid = invalid[d];
    if (invalid[d] > 0)
      errors[d] = "jax_ep dispatch: topk_idx holds " + std::to_string(invalid[d]) +
                  " expert id(s) outside [-1, num_experts=" + std::to_string(a.num_experts) +
                  ") on rank " + std::to_string(d) + "; they were excluded";
  }
  return errors;
}

std::vector<std::string> combine(const std::vector<CombineArgs>& ranks) {
  const int R = int(ranks.size());
  for (const CombineArgs& a : ranks) {
    std::vector<float> acc(a.width);
    for (int t = 0; t < a.num_tokens; ++t) {
      for (int c = 0; c < a.width; ++c)
        acc[c] = a.has_bias ? load_float(a.bias, int64_t(t) * a.width + c, a.bias_dtype) : 0.f;
      for (int d = 0; d < R; ++d) {  // rank order: the fixed summation order
        int32_t pos = a.send_pos[int64_t(t) * R + d];
        if (pos < 0) continue;
        for (int c = 0; c < a.width; ++c)
          acc[c] += load_float(ranks[d].row_data, int64_t(pos) * a.width + c, ranks[d].rows_dtype);
      }
      for (int c = 0; c < a.width; ++c)
        store_float(a.out, int64_t(t) * a.width + c, a.out_dtype, acc[c]);
    }
  }
  return std::vector<std::string>(R);
}

}  // namespace jax_ep::cpu

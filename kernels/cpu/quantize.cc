// FP8 quantization on CPU devices (the rule of kernels/fp8.h): rows in 1 x 128 blocks, expert
// weights in 128 x 128 blocks.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/rank.h"
#include "kernels/fp8.h"

namespace jax_ep::cpu {

void quantize_row(const void* x, int hidden, Dtype dtype, bool round_scale, uint8_t* q,
                  float* scales) {
  for (int g = 0; g < hidden / kFp8Block; ++g) {
    float max_abs = 0.f;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      max_abs = std::max(max_abs, std::fabs(load_float(x, c, dtype)));
    const Fp8Block block = Fp8Block::make(max_abs, round_scale);
    scales[g] = block.scale;
    for (int c = g * kFp8Block; c < (g + 1) * kFp8Block; ++c)
      q[c] = float_to_e4m3(block.scaled(load_float(x, c, dtype)));
  }
}

void quantize_rows(const QuantizeRowsArgs& a) {
  const int64_t row_bytes = int64_t(a.hidden) * dtype_size(a.dtype);
  for (int64_t r = 0; r < a.rows; ++r)
    quantize_row(static_cast<const uint8_t*>(a.x) + r * row_bytes, a.hidden, a.dtype, a.round_scale,
                 a.q + r * a.hidden, a.scales + r * (a.hidden / kFp8Block));
}

void quantize_weights(const QuantizeWeightsArgs& a) {
  const int K = a.k, N = a.n, kb = K / kFp8Block, nb = N / kFp8Block;
  for (int g = 0; g < a.groups; ++g) {
    const int64_t w0 = int64_t(g) * K * N;  // the group's first element, in w, q and q_t
    for (int bk = 0; bk < kb; ++bk)
      for (int bn = 0; bn < nb; ++bn) {
        float max_abs = 0.f;
        for (int i = bk * kFp8Block; i < (bk + 1) * kFp8Block; ++i)
          for (int j = bn * kFp8Block; j < (bn + 1) * kFp8Block; ++j)
            max_abs =
                std::max(max_abs, std::fabs(load_float(a.w, w0 + int64_t(i) * N + j, a.dtype)));
        const Fp8Block block = Fp8Block::make(max_abs, false);
        a.scales[(int64_t(g) * nb + bn) * kb + bk] = block.scale;
        if (a.scales_t) a.scales_t[(int64_t(g) * kb + bk) * nb + bn] = block.scale;
        for (int i = bk * kFp8Block; i < (bk + 1) * kFp8Block; ++i)
          for (int j = bn * kFp8Block; j < (bn + 1) * kFp8Block; ++j) {
            const uint8_t v =
                float_to_e4m3(block.scaled(load_float(a.w, w0 + int64_t(i) * N + j, a.dtype)));
            a.q[w0 + int64_t(j) * K + i] = v;
            if (a.q_t) a.q_t[w0 + int64_t(i) * N + j] = v;
          }
      }
  }
}

}  // namespace jax_ep::cpu

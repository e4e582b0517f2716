// The limits of the backends, in one place: the kernels size their arrays by them and the Python
// side reads them (jax_ep._native.limits()) to reject what they cannot take at trace time.
#pragma once

namespace jax_ep {

// Ranks of one EP group. On GPUs a rank's routing is a 32-bit mask (a lane per destination);
// the CPU backend keeps destinations in lists.
constexpr int kMaxGpuRanks = 32;
constexpr int kMaxCpuRanks = 1024;

// Tokens per rank whose routing a dispatch kernel scans in shared memory (the single-kernel
// low-latency path); larger batches are routed by a kernel of their own first.
constexpr int kMaxInBlockTokens = 1024;

// Rows of one op's arrays on a rank: what it receives (R * max_tokens_per_rank) and what a
// dispatch's layout holds (the expert layout's capacity, expert_padded's E_l * capacity). The
// kernels count and index rows, and count records and signatures carry them, as 32-bit ints.
constexpr int kMaxRankRows = 2147483647;

// A Buffer's timeout_s: the waits count nanoseconds in 64 bits (2^63 ns is 292 years).
constexpr double kMaxTimeoutSeconds = 1e9;

// Rank-level rows per block of the GPUs' expert_padded placement: a row's place among its
// expert's rows is counted within its chunk, plus the counts of the chunks before it.
constexpr int kExpertChunkRows = 1024;

// FP8 scales of one row staged in shared memory by the CUDA dispatch: hidden <= 131072.
constexpr int kMaxScalesPerRow = 1024;

// The grouped matmuls (kernels/cuda/grouped_gemm.cu): groups of one call (a grid dimension of
// its per-call kernels), and the multiple K and N must be of (16 bytes of bfloat16: TMA's
// alignment of each group's rows).
constexpr int kMaxGroupedMatmulGroups = 65535;
constexpr int kGroupedMatmulAlignment = 8;

// DeepGEMM's kernels beside them (kernels/cuda/deep_gemm.h): rows of their tiles (a group they
// compute starts at a multiple of it), the multiple bfloat16 K and N must be of (FP8: the scale
// block), and the SMs of the GPUs they run on (their persistent grid, fixed at compile time).
constexpr int kDeepGemmRows = 128;
constexpr int kDeepGemmAlignment = 64;
constexpr int kDeepGemmSms = 132;
// Its FP8 kernels keep the weights' scales of a tile's K steps in shared memory: K up to this.
constexpr int kDeepGemmMaxFp8K = 16384;
// Its kernels walk the groups, a compile-time count: at most this many groups (instances for a
// few counts up to it). Rows of a call: its kernels take shapes and each group's end rounded up
// to 128 rows as 32-bit numbers.
constexpr int kDeepGemmMaxGroups = 256;
constexpr int kDeepGemmMaxRows = (1u << 31) - kDeepGemmRows;
// Its weight gradient (tgmm): K a multiple of its tiles' 256 rows.
constexpr int kDeepGemmTgmmK = 256;

}  // namespace jax_ep

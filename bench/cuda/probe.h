// bench._probe: peer bandwidth of the ways a kernel can move bytes between two GPUs.
#pragma once
#include <cstdint>

namespace jax_ep::probe {

// Bandwidth (GB/s per direction) of moving bytes from device src to device dst, and at the same
// time from dst to src when both_ways: the ceilings the benchmark reports. mode -1: the copy
// engine; from `blocks` SMs: 0 bulk-copy (TMA) stores, 1 plain stores, 2 bulk-copy loads,
// 3 plain loads, 4 plain stores amid local traffic like a dispatch's, 5 plain stores of whole
// 7168-byte rows, a warp per row, 6 the dispatch's row path (BF16 rows quantised to FP8 by
// send_row) to a local and the peer's row, 7 the same to the peer's row only, 8 and 9 the same
// into local staging in 4 or 8 chunks, each moved to the peer by the copy engine meanwhile,
// 10 the combine's row path (sum_rows: a peer's BF16 row and a local one into a local row),
// 11 mode 6 into local rows only, 12 and 13 a row path specialised to V3 rows (the FP8 rows of
// modes 11 and 7 with the loads of half a row in flight, no per-row generality). The pushes of
// modes -1, 0, 1, 4, 5, one way, may write into dst_buffer, which must hold `bytes` on dst.
// -1: an unknown mode, dst_buffer with another mode or both ways, no peer access, a CUDA error.
double peer_gbps(int src, int dst, int64_t bytes, int blocks, int mode, int iters, bool both_ways,
                 void* dst_buffer);

}  // namespace jax_ep::probe

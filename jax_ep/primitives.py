"""The four primitives a backend provides; Buffer builds dispatch and combine from them.

Rank level (crosses ranks):
  dispatch(x, topk_idx, topk_weights)   -> RankRows, Routing   one row per (source rank, token)
  dispatch_cached(x, send_pos, ...)     -> x rows, scales      the same routes, new x
  combine(rows, send_pos, ..., bias)    -> [T, W]              bias + sum over ranks, float32
Receiver-local:
  expert_layout(topk_rows)              -> layout.ExpertMaps   rank-level rows -> expert rows

Two backends: reference.Reference (jax.lax.all_to_all) and ffi_path.Ffi (custom calls).
"""
from __future__ import annotations

from typing import Any, NamedTuple

Array = Any


class RankRows(NamedTuple):
    x: Array            # [S, H] x dtype, or e4m3fn when fp8
    scales: Array | None  # [S, H / 128] float32 when fp8
    topk_idx: Array     # [S, K] local expert ids or -1
    topk_weights: Array  # [S, K] float32, 0 where -1


class Routing(NamedTuple):
    send_pos: Array           # [T, R]
    recv_counts: Array        # [R]
    tokens_per_expert: Array  # [E_l]
    num_recv: Array           # []
    num_dropped: Array        # []
    num_invalid: Array        # []

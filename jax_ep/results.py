"""The pytrees dispatch returns: DispatchResult and the Handle that combine and cached dispatch
use."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Handle:
    """Where every token went, so combine (and a cached dispatch) can follow the same routes.

    Rank-level rows are one per (source rank, token): the rank layout's output rows, or for the
    expert layout the rows it is expanded from.
    """

    send_pos: Array  # [T, R] int32: where token t went on rank d, -1 if not sent (the
    # custom calls: its row in this rank's block there; the reference
    # path: its rank-level row there, -1 also if dropped); on a tuple
    # axis a hierarchical.NodeRoutes
    recv_counts: Array  # [R] int32: rows each source rank sent here, before capacity
    num_rows: Array  # [] int32: rank-level rows present here
    expert_src: Array | None  # [C] int32 (expert layout): rank-level row of each expert row, -1
    expert_rows: Array | None  # [S, M] int32 (expert layout): expert rows of each rank-level row
    result: tuple  # the routing fields of the DispatchResult, returned again by a cached dispatch
    layout: str = dataclasses.field(metadata=dict(static=True))
    rows: int = dataclasses.field(metadata=dict(static=True))  # S: rank-level rows
    capacity: int = dataclasses.field(metadata=dict(static=True))  # C: rows of the output
    buffer: int = dataclasses.field(metadata=dict(static=True))  # the Buffer's serial

    @property
    def num_tokens(self):
        """T: the tokens the dispatch routed (the rows of combine's result)."""
        return jax.tree.leaves(self.send_pos)[0].shape[0]


class DispatchResult(NamedTuple):
    """What dispatch returns (docs/API.md, "The result, per layout"). Padding rows hold expert -1
    and weight 0, and zeros in x and scales, except expert_padded's rows of x and scales past
    tokens_per_expert[e]: those are unspecified."""

    x: Array  # [C, H]; expert_padded: [E_l, C, H]
    scales: Array | None  # x's shape with H / 128 float32 columns when fp8
    topk_idx: Array  # rank: [C, K] local expert or -1; expert: [C]; expert_padded: [E_l, C]
    topk_weights: Array | None  # topk_idx's shape, float32; None when dispatch got none
    tokens_per_expert: Array  # [E_l] int32
    group_sizes: Array  # [E_l] int32: tokens_per_expert rounded up to expert_alignment
    num_recv: Array  # [] int32
    num_dropped: Array  # [] int32
    num_invalid: Array  # [] int32
    handle: Handle

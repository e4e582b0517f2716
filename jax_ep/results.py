"""The pytrees dispatch returns: DispatchResult and the Handle that combine and cached dispatch
use."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jax_ep import _jax

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


class Receipt:
    """Whether a send's recv half was traced already: one per send, kept by identity through
    every copy of its Pending (jit boundaries, run_between), so a second recv is refused; the
    send's custom calls carry its mark, so that a program without the recv is refused when it is
    lowered (_jax.sending). Receipt.open() counts the sends whose recv is still to come."""

    _open = weakref.WeakSet()
    _lock = threading.Lock()  # programs may be traced on several threads

    def __init__(self):
        self.mark = _jax.SendMark()  # what the send's custom calls carry
        with Receipt._lock:
            Receipt._open.add(self)

    @property
    def received(self):
        return self.mark.received

    def receive(self):
        self.mark.received = True
        with Receipt._lock:
            Receipt._open.discard(self)

    @staticmethod
    def open():
        """How many sends traced so far (and still referenced) have no recv yet, but for those
        of programs refused when lowered for lacking it (they never run)."""
        if Receipt._open:
            gc.collect()  # a finished trace's Pendings may sit in reference cycles
        with Receipt._lock:
            return sum(not r.mark.refused for r in Receipt._open)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """An op whose data is on its way (dispatch_send / combine_send): pass it to the matching
    *_recv, which waits for the peers and returns the result. Other work can run in between."""

    arrays: tuple
    finish: Callable = dataclasses.field(metadata=dict(static=True))
    kind: str = dataclasses.field(metadata=dict(static=True))  # "dispatch" | "combine"
    buffer: int = dataclasses.field(metadata=dict(static=True))  # the Buffer's serial
    receipt: Receipt = dataclasses.field(metadata=dict(static=True))

    def run_between(self, work, *args):
        """(pending, work(*args)) with XLA made to run the work after this send and before its
        recv: XLA orders only what data orders, and could run independent work before the send
        or after the recv. (Whether the work runs beside the send is up to XLA: see
        Buffer.dispatch_send.)"""
        arrays, args = jax.lax.optimization_barrier((self.arrays, args))
        arrays, out = jax.lax.optimization_barrier((arrays, work(*args)))
        return dataclasses.replace(self, arrays=arrays), out

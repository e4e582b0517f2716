"""The two halves of a split op (dispatch_send / dispatch_recv, combine_send / combine_recv):
the Pending a send returns, and the one recv that may take it."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from collections.abc import Callable

import jax

from jax_ep import _jax
from jax_ep.memory import fail


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


def send(kind, buffer, start):
    """The Pending of the send half that start() traces, for Buffer `buffer` (its serial)."""
    receipt = Receipt()
    with _jax.sending(receipt.mark):
        started = start()
    return Pending(*started, kind=kind, buffer=buffer, receipt=receipt)


def receive(pending, kind, buffer):
    """The recv half of `pending`: its op's result, once its peers' rows are here."""
    if not isinstance(pending, Pending) or pending.kind != kind:
        fail(f"{kind}_recv needs the result of {kind}_send, got {type(pending).__name__}")
    if pending.buffer != buffer:
        fail(
            f"{kind}_recv: pending is another Buffer's op (Buffer {pending.buffer}, this "
            f"is Buffer {buffer})"
        )
    if pending.receipt.received:
        fail(f"{kind}_recv: pending was received already (each send has one recv)")
    pending.receipt.receive()
    return pending.finish(pending.arrays)

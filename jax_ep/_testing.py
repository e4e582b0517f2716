"""Knobs for jax_ep's own tests, no part of its API: the Buffers created inside
`with _testing.buffers(...)` take them (every process of a mesh must give the same).

first_op=n: the Buffers number their ops from n + 1 instead of 1, e.g. just below 2^32 to show
that op numbers do not wrap (they are 64-bit everywhere).
direct_local=False: on GPUs, whole ops send a rank's rows to itself through its window like a
peer's, instead of straight to their place (so that tests run the kernels' window path on every
row).
cuda_handler_calls(): how many times the cross-rank CUDA handlers ran in this process (replayed
command buffers run their kernels without them).
"""

from __future__ import annotations

import contextlib
import dataclasses


@dataclasses.dataclass(frozen=True)
class Knobs:
    first_op: int = 0
    direct_local: bool = True


knobs = Knobs()  # what a Buffer created now takes


@contextlib.contextmanager
def buffers(**changes):
    """The Buffers created inside the block take these knobs (Knobs' fields)."""
    global knobs
    before, knobs = knobs, dataclasses.replace(knobs, **changes)
    try:
        yield
    finally:
        knobs = before


def cuda_handler_calls():
    from jax_ep import _native

    return _native.cuda_handler_calls()

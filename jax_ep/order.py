"""The ordering token of a Buffer's custom calls.

XLA orders operations only by their data, and under command buffers with concurrent scheduling
runs independent ones at once. Every custom call of a Buffer takes the token the Buffer's last
call returned and returns the next one, so that XLA must run them one after the other, on every
device in the same order, forward and backward alike.

The chain is kept per traced function (JAX's trace). A nested function (a loop body, a cond
branch, jax.checkpoint) that calls the Buffer starts from the token of the function around it,
which JAX then passes in, so its calls follow the ones before it. A backward rule starts from
its forward call's token instead (see Chain.take). A call of
the enclosing function after the nested one is ordered after it by their data only (the nested
function's results it uses): the token of a finished trace cannot leave it.
"""
from __future__ import annotations

import threading

import jax.numpy as jnp

TOKEN_SHAPE = (1,)


def _trace_stack():
    """The current trace and the traces around it, innermost first."""
    from jax._src import core

    stack, trace = [], core.trace_ctx.trace
    while trace is not None:
        stack.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return stack


class Chain:
    def __init__(self):
        # Per thread (JAX traces per thread), trace -> the token its last call returned. Only the
        # traces of the current stack are kept: a finished trace's tokens are of no more use.
        self._local = threading.local()

    def _last(self, stack):
        last = getattr(self._local, "last", None)
        if last is None:
            last = self._local.last = {}
        ids = {id(t) for t in stack}
        for key in [k for k in last if k not in ids]:
            del last[key]
        return last

    def take(self, *after):
        """The token the next call takes: the last of this trace, joined with `after` (tokens
        it must also follow: the forward call's token in a backward rule). A call without
        `after` that is this trace's first starts from the nearest enclosing trace's token; a
        backward rule does not, since JAX cannot transpose a loop or jit whose body captured a
        value of the trace around it, and its forward token already orders it after the calls
        that came before its forward call."""
        stack = _trace_stack()
        last = self._last(stack)
        searched = stack[:1] if after else stack
        token = next((last[id(t)][1] for t in searched if id(t) in last), None)
        for other in after:
            token = other if token is None else jnp.maximum(token, other)
        return jnp.zeros(TOKEN_SHAPE, jnp.int32) if token is None else token

    def put(self, token):
        """Records the token a call returned as this trace's last."""
        stack = _trace_stack()
        self._last(stack)[id(stack[0])] = (stack[0], token)

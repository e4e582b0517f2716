"""A Buffer's runtime tokens, and the launch of the programs that use a Buffer.

Between program executions JAX passes each ordered effect's token from one execution to the
next, keeping these runtime tokens per host thread. A Buffer's are kept per process instead, and
the programs that use a Buffer are launched one at a time (one lock for all Buffers), so programs
launched from several threads reach every device in one order, each after the one before
(`_token_input`, `_token_result`, `_execute`). A program that fails leaves its error in its
output token, which PjRt hands on to every later program that takes the token; an op that raised
on purpose (check_invalid) must leave its Buffer usable, so a Buffer's token is dropped once it
holds an error (`_token_input`); a Buffer stopped by a timeout raises on its next call by
itself. JAX also raises every failed token again at the interpreter's exit: closing a Buffer
whose last program failed lets go of that program's tokens (`release_tokens`).

Mends (`MENDS`, applied by jax_ep._jax.install): dispatch.RuntimeTokenSet.get_token_input and
set_token_result, pxla.ExecuteReplicated.__call__; each hands JAX every effect and program that
is not a Buffer's unchanged. Checked on jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

import threading
from typing import Any

from jax_ep._jax.order import BufferOrder
from jax_ep._jax.require import require

dispatch = require(
    __name__,
    "jax._src.dispatch",
    "RuntimeTokenSet.get_token_input",
    "RuntimeTokenSet.set_token_result",
    "runtime_tokens",
)
pxla = require(__name__, "jax._src.interpreters.pxla", "ExecuteReplicated.__call__")


def _failed(token) -> bool:
    """Whether a runtime token is ready and holds an error (never waits for one in flight)."""
    buf = getattr(token, "_buf", None)
    if buf is None or not buf.is_ready():
        return False
    try:
        buf.block_until_ready()
    except Exception:  # noqa: BLE001 - any error of the program that made it
        return True
    return False


# JAX keeps runtime tokens per host thread. A Buffer's are kept per process instead, and the
# programs that use a Buffer are launched one at a time: then every device gets them in one
# order, and each waits for the one before, whichever thread launched it.
_buffer_tokens: dict[BufferOrder, Any] = {}
_launch = threading.RLock()
_jax_token_input = dispatch.RuntimeTokenSet.get_token_input
_jax_token_result = dispatch.RuntimeTokenSet.set_token_result
_jax_execute = pxla.ExecuteReplicated.__call__


def _on_devices(token, devices) -> bool:
    """Whether a token's buffer has one shard on each of `devices`, in their order: what the
    program takes as its input token there."""
    sharding = getattr(getattr(token, "_buf", None), "sharding", None)
    return getattr(sharding, "_device_assignment", None) == tuple(devices)


def _token_input(self, effect, devices):
    if isinstance(effect, BufferOrder):
        token = _buffer_tokens.get(effect)
        if token is None or _failed(token):
            self.current_tokens.pop(effect, None)
        else:
            self.current_tokens[effect] = token
            # Already on the program's devices: handed on as it is, so that the device orders
            # the programs. JAX's own path would wait on the host until the last program is
            # over, then put a new token on the devices (array.py's _token_shard_arg): each
            # launch would wait for the one before to finish.
            if _on_devices(token, devices):
                return token
    return _jax_token_input(self, effect, devices)


def _token_result(self, effect, token):
    if isinstance(effect, BufferOrder):
        _buffer_tokens[effect] = token
    _jax_token_result(self, effect, token)


def release_tokens(order: BufferOrder):
    """For a Buffer being closed: lets go of what JAX keeps of its last program if that program
    failed (its token, and the runtime tokens it left on its devices, in the token sets of the
    thread that launched it; JAX would raise the error again at the interpreter's exit, where
    it waits for every token). A program still in flight keeps its tokens, so that the exit
    still waits for it."""
    with _launch:
        ordering, runtime, left = _last_launch.pop(order, ({}, {}, {}))
        token = _buffer_tokens.get(order)
        if token is None or not _failed(token):
            return
        del _buffer_tokens[order]
        if ordering.get(order) is token:
            del ordering[order]
        for device, runtime_token in left.items():
            if runtime.get(device) is not runtime_token:
                continue  # a later program's
            try:
                runtime_token.block_until_ready()  # its program is over: this does not wait
            except Exception:  # noqa: BLE001 - the failed program's error
                del runtime[device]


# Where a Buffer's last program left its tokens: the launching thread's dicts of ordering and of
# runtime tokens (JAX keeps both per thread, and waits for the main thread's at exit) and the
# runtime token it left on each device. Only release_tokens reads them.
_last_launch: dict[BufferOrder, tuple[dict, dict, dict]] = {}


def _execute(self, *args):
    orders = [e for e in self.ordered_effects if isinstance(e, BufferOrder)]
    if not orders:
        return _jax_execute(self, *args)
    with _launch:
        out = _jax_execute(self, *args)
        # Read defensively: a launch must not fail for what only close() uses.
        tokens = dispatch.runtime_tokens
        runtime = getattr(tokens, "output_runtime_tokens", {})
        left = {d: runtime[d] for d in getattr(self, "_local_devices", ()) if d in runtime}
        for order in orders:
            _last_launch[order] = (tokens.current_tokens, runtime, left)
        return out


MENDS = (
    (dispatch.RuntimeTokenSet, "get_token_input", _token_input),
    (dispatch.RuntimeTokenSet, "set_token_result", _token_result),
    (pxla.ExecuteReplicated, "__call__", _execute),
)

"""Running jax_ep's custom calls on a stream of XLA's other than its compute stream, so that
compute overlaps them."""
from __future__ import annotations

import contextvars
import inspect

import jax

_placement = contextvars.ContextVar("jax_ep_placement", default=None)


def on_collective_stream(fn, stream="collective"):
    """fn (e.g. lambda: buf.dispatch_send(...)) with its jax_ep custom calls placed on XLA stream
    `stream` (compute_on "gpu_stream:<stream>", jax >= 0.11.1 on GPU; other backends ignore it).
    Only the custom calls move: XLA cannot assign a stream to calls nested in the placed one, and
    jax.numpy makes such calls. Use it inside shard_map, and for every half of a kind of op alike:
    the low-latency kernels of one kind must run in order on one stream (their op numbers and slot
    releases count on it); a numbered stream ("1") is one stream, "collective" may be any of
    XLA's extra compute streams."""
    from jax.experimental import compute_on as compute_on_module

    form = compute_on_module.compute_on
    if "out_memory_spaces" not in inspect.signature(form).parameters:  # jax < 0.11: compute_on2
        form = getattr(compute_on_module, "compute_on2", None)
    if form is None:
        raise NotImplementedError(f"jax {jax.__version__} cannot place a call on another stream "
                                  "(needs jax.experimental.compute_on with out_memory_spaces)")
    place = form(compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)

    def placed_fn(*args, **kwargs):
        token = _placement.set(place)
        try:
            return fn(*args, **kwargs)
        finally:
            _placement.reset(token)

    return placed_fn


def placed(call):
    """A custom call's function, on the stream on_collective_stream chose around it, if any."""
    place = _placement.get()
    return call if place is None else place(call)

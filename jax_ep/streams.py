"""Asking XLA to run jax_ep's custom calls on one of its streams other than the compute stream,
so that compute could overlap them."""
from __future__ import annotations

import contextvars
import inspect

import jax

_stream = contextvars.ContextVar("jax_ep_stream", default=None)


def on_stream(fn, stream="1"):
    """fn (e.g. lambda: buf.dispatch_send(...)) with the jax_ep custom calls it makes annotated
    for XLA stream `stream` (compute_on "gpu_stream:<stream>", jax >= 0.11.1; only GPUs read it).
    The Buffer methods called inside fn record the stream, so their gradients' calls carry it too;
    fn's own jax.numpy work stays where it was (XLA assigns no stream to calls nested in an
    annotated one). Call the Buffer methods inside fn itself: a jitted function traced outside
    on_stream keeps that trace. The low-latency kernels of one kind must run in order on one
    stream: give every half of a kind the same numbered stream ("collective" is accepted, but
    XLA may spread such calls over several streams). Measured with jax 0.11.2: XLA accepts the
    annotation and runs the calls correctly, on its one compute stream."""
    _placement(stream)  # fails here on a jax without stream placement

    def on(*args, **kwargs):
        token = _stream.set(stream)
        try:
            return fn(*args, **kwargs)
        finally:
            _stream.reset(token)

    return on


def current():
    """The stream on_stream asked for around this call, or None."""
    return _stream.get()


def placed(call, stream):
    """`call` (a function of arrays) annotated for XLA stream `stream`, or as it is for None."""
    return call if stream is None else _placement(stream)(call)


def _placement(stream):
    from jax.experimental import compute_on as compute_on_module

    form = compute_on_module.compute_on
    if "out_memory_spaces" not in inspect.signature(form).parameters:  # jax < 0.11: compute_on2
        form = getattr(compute_on_module, "compute_on2", None)
    if form is None:
        raise NotImplementedError(f"jax {jax.__version__} cannot place a call on another stream "
                                  "(needs jax.experimental.compute_on with out_memory_spaces)")
    return form(compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)

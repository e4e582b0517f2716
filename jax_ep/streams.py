"""Running jax_ep's halves on XLA's collective stream, so that compute overlaps them."""
from __future__ import annotations

import inspect

import jax


def on_collective_stream(fn):
    """fn (e.g. lambda: buf.dispatch_send(...)) as a call XLA runs on its collective stream
    (compute_on "gpu_stream:collective", jax >= 0.11.1 on GPU). Use it inside shard_map, and
    for every half of a kind of op alike: the low-latency kernels of one kind must run in order
    on one stream (their op numbers and slot releases count on it)."""
    from jax.experimental import compute_on as compute_on_module

    form = compute_on_module.compute_on
    if "out_memory_spaces" not in inspect.signature(form).parameters:  # jax < 0.11: compute_on2
        form = getattr(compute_on_module, "compute_on2", None)
    if form is None:
        raise NotImplementedError(f"jax {jax.__version__} cannot place a call on the collective "
                                  "stream (needs jax.experimental.compute_on with out_memory_spaces)")
    return form(compute_type="gpu_stream:collective",
                out_memory_spaces=jax.memory.Space.Device)(fn)

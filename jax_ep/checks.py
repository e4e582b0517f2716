"""The checks of a Buffer's ops at trace time: each wrong argument is a ValueError naming it
(docs/API.md, "Errors"), and check_invalid's raise at run time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _jax
from jax_ep.fp8 import FP8_BLOCK
from jax_ep.halves import Receipt
from jax_ep.memory import FLOAT_ROWS, check_row_width, fail, limits
from jax_ep.results import Handle

_MODES = ("auto", "normal", "low_latency")


def check_flag(value, name):
    """A static flag: True or False (numpy's, or a concrete boolean array of no dimensions), not
    a string, a number or a traced value."""
    concrete = isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer)
    if not (
        isinstance(value, (bool, np.bool_))
        or (concrete and value.shape == () and value.dtype == np.bool_)
    ):
        fail(f"{name} must be True or False, got {value!r}")


def check_array(array, name, shape, dtypes, why=""):
    """Shape and dtype of an argument; None in `shape` matches any size; `why` ends a wrong
    shape's message."""
    if (
        not hasattr(array, "shape")
        or len(array.shape) != len(shape)
        or any(want is not None and got != want for got, want in zip(array.shape, shape))
    ):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        fail(
            f"{name} must have shape ({want}), got "
            f"{getattr(array, 'shape', type(array).__name__)}{why}"
        )
    if jnp.dtype(array.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        fail(
            f"{name} must have dtype {' or '.join(jnp.dtype(d).name for d in dtypes)}, "
            f"got {jnp.dtype(array.dtype).name}"
        )


def require_shard_map(config):
    """The op is traced inside a shard_map over the Buffer's axis, as its backend needs."""
    try:
        size = jax.lax.axis_size(config.axis_name)
    except NameError:
        size = None
    if size is None:
        fail(
            f"dispatch and combine must be called inside jax.shard_map(..., mesh=mesh) "
            f"over the axis {config.axis_name!r}"
        )
    if size != config.num_ranks:
        fail(
            f"axis {config.axis_name!r} has size {size} here but the Buffer was built for "
            f"{config.num_ranks} ranks"
        )
    if config.impl == "ffi" and _jax.in_eager_shard_map():
        fail(
            "the custom calls run under jax.jit: wrap the shard_map that calls them in "
            "jax.jit (JAX cannot run them op by op inside shard_map), or use "
            "impl='reference'"
        )
    # XLA's partitioner cannot place an ordered custom call among automatic axes.
    automatic = set(config.mesh.axis_names) - set(
        getattr(jax.sharding.get_abstract_mesh(), "manual_axes", config.mesh.axis_names)
    )
    if config.impl == "ffi" and automatic:
        fail(
            f"the custom calls run in a shard_map manual over every axis of the Buffer's "
            f"mesh; axes {sorted(automatic)} are automatic here (leave shard_map's "
            f"axis_names out, or use impl='reference')"
        )


def check_x(config, platform, x, fp8, round_scale):
    """A dispatch's x and FP8 flags (`platform`: the custom calls', None on the reference path)
    -> its tokens."""
    check_flag(fp8, "fp8")
    check_flag(round_scale, "round_scale")
    check_array(x, "x", (None, config.hidden), FLOAT_ROWS)
    if not fp8:
        check_row_width(x.dtype, config.max_row_dtype, "x")
    tokens = x.shape[0]
    if tokens > config.max_tokens_per_rank:
        fail(
            f"x has {tokens} tokens per rank, more than max_tokens_per_rank="
            f"{config.max_tokens_per_rank}"
        )
    if fp8 and config.hidden % FP8_BLOCK:
        fail(f"fp8 needs hidden % 128 == 0, got hidden={config.hidden}")
    if fp8 and platform == "cuda":
        widest = limits()["max_scales_per_row"] * FP8_BLOCK  # the dispatch stages the scales
        if config.hidden > widest:
            fail(f"fp8 rows on GPUs take hidden up to {widest}, got hidden={config.hidden}")
    if round_scale and not fp8:
        fail("round_scale=True needs fp8=True")
    return tokens


def low_latency(config, low_latency_tokens, mode, tokens):
    """Whether a dispatch of `tokens` per rank in `mode` takes the single-kernel path, which
    routes up to low_latency_tokens (None: the backend has none)."""
    if mode not in _MODES:
        fail(f"mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
    if low_latency_tokens is None:  # no single-kernel path: every mode is the same
        return False
    fast_tokens = config.fast_tokens(tokens)  # what the fast leg's kernels route
    if mode == "low_latency" and fast_tokens > low_latency_tokens:
        nodes = f" ({config.num_nodes} nodes x {tokens})" if config.num_nodes > 1 else ""
        fail(
            f"mode='low_latency' takes at most low_latency_tokens="
            f"{low_latency_tokens} tokens per rank, x has {fast_tokens}{nodes}"
        )
    return mode != "normal" and fast_tokens <= low_latency_tokens


def check_handle(config, buffer, handle, op):
    """`handle` is one that a dispatch of Buffer `buffer` (its serial) returned, as it did."""
    if not isinstance(handle, Handle):
        fail(
            f"handle must be the handle of an earlier dispatch ({op}), got {type(handle).__name__}"
        )
    if handle.buffer != buffer:
        fail(
            f"handle belongs to another Buffer (Buffer {handle.buffer}, this is Buffer "
            f"{buffer}): {op} follows the routes of this Buffer's dispatches only"
        )
    if config.num_nodes > 1:  # a tuple axis's routes are hierarchical.NodeRoutes
        return
    ranks = config.num_ranks
    for name, want in (
        ("send_pos", (None, ranks)),
        ("recv_counts", (ranks,)),
        ("num_rows", ()),
        ("expert_src", (None,)),
        ("expert_rows", (handle.rows, None)),
    ):
        if getattr(handle, name) is not None or not name.startswith("expert"):
            check_array(
                getattr(handle, name),
                f"handle.{name}",
                want,
                (jnp.int32,),
                f": {op} takes a handle as its dispatch returned it, inside the same "
                "shard_map (not one made under jax.vmap)",
            )


def raising_on_invalid(config, tokens, rows, routing):
    """check_invalid=True: a fresh dispatch's (rows, routing), after which every rank raises at
    run time when the group's topk_idx held invalid ids."""
    if not config.check_invalid or tokens == 0:  # no tokens, no invalid ids
        return rows, routing
    if Receipt.open():
        fail(
            "check_invalid=True: this dispatch would raise while another op's halves are "
            "open (a *_send whose *_recv has not been traced yet); the raise would stop the "
            "program before that recv and strand its op. Call it before the send or after "
            "the recv, or use check_invalid=False and read num_invalid"
        )
    # Every rank raises (a rank left running would wait for the rest): each learns its EP
    # group's invalid ids with the op's counts, and the other groups of the mesh sum theirs.
    # After the op's own collectives (the reference path's), so that no rank stops while the
    # others are still in one of them.
    rows, routing = jax.lax.optimization_barrier((rows, routing))
    everywhere = routing.group_invalid
    others = tuple(a for a in _bound_axes(config.mesh) if a not in config.axes)
    if others:
        everywhere = jax.lax.psum(everywhere, others)
    jax.debug.callback(_raise_if_invalid, routing.num_invalid, everywhere, config.num_experts)
    return rows, routing


def _raise_if_invalid(here, everywhere, num_experts):
    if int(everywhere):
        raise ValueError(
            f"jax_ep: topk_idx holds {int(everywhere)} expert id(s) outside "
            f"[-1, {num_experts}) ({int(here)} on this rank); they were excluded "
            f"from the dispatch"
        )


def _bound_axes(mesh):
    """The mesh axes the enclosing shard_map maps over."""
    bound = []
    for name in mesh.axis_names:
        try:
            jax.lax.axis_size(name)
            bound.append(name)
        except NameError:
            pass
    return tuple(bound)

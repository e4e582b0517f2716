"""The order of a Buffer's calls: a JAX ordered effect per Buffer (`BufferOrder`), and the
primitive that makes a custom call carry it (`ordered_ffi_call`).

A Buffer's custom calls must run in program order on every rank, whatever XLA's scheduling
(command buffers with CONCURRENT scheduling run independent calls at once). JAX threads one XLA
token per ordered effect through the whole program, in program order: through jit and nested
jit, shard_map, scan / while / cond, jax.checkpoint and custom_vjp, forward and backward.
`ordered_ffi_call` makes an XLA FFI custom call whose first operand and first result are that
token, so XLA cannot reorder or overlap two calls of one Buffer. A send half's calls carry its
`SendMark` (bound under `sending`): a program that lacks the send's recv is refused when it is
lowered.

JAX internals used: the effect sets of jax._src.effects, jax._src.core's Primitive and the mesh
of the current trace, the lowering rule context and token sets of jax._src.interpreters.mlir,
vmap's and JVP's rule tables (jax._src.interpreters.batching, .ad), dispatch.simple_impl, and
jax.ffi.build_ffi_lowering_function. Checked on jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import numpy as np
from jax.extend.mlir.dialects import stablehlo

from jax_ep._jax.require import require

_EFFECT_SETS = (
    "ordered_effects",
    "shardable_ordered_effects",
    "lowerable_effects",
    "control_flow_allowed_effects",
    "custom_derivatives_allowed_effects",
    "remat_allowed_effects",
)
effects = require(__name__, "jax._src.effects", "Effect", *_EFFECT_SETS)
core = require(
    __name__,
    "jax._src.core",
    "Primitive",
    "ShapedArray",
    "abstract_token",
    "get_cur_mesh_sharding",
)
dispatch = require(__name__, "jax._src.dispatch", "simple_impl")
mlir = require(
    __name__,
    "jax._src.interpreters.mlir",
    "TokenSet",
    "LoweringRuleContext",
    "register_lowering",
)
batching = require(__name__, "jax._src.interpreters.batching", "moveaxis", "primitive_batchers")
ad = require(__name__, "jax._src.interpreters.ad", "primitive_jvps")
require(__name__, "jax.ffi", "build_ffi_lowering_function")


class BufferOrder(effects.Effect):
    """The order of one Buffer's calls: an ordered effect of its own, so that two Buffers'
    calls do not wait for each other. mesh: the mesh the Buffer numbers its ranks by (not part
    of the effect's identity), which the shard_map around each call must be."""

    def __init__(self, key: int, mesh=None):
        self.key, self.mesh = key, mesh

    def __eq__(self, other):
        return isinstance(other, BufferOrder) and other.key == self.key

    def __hash__(self):
        return hash((BufferOrder, self.key))

    def __repr__(self):
        return f"jax_ep.Buffer[{self.key}]"


for _name in _EFFECT_SETS:
    getattr(effects, _name).add_type(BufferOrder)


def orders_in(effect_set) -> bool:
    """Whether a set of JAX effects holds a Buffer's order."""
    return any(isinstance(e, BufferOrder) for e in effect_set)


call_p = core.Primitive("jax_ep_call")
call_p.multiple_results = True
dispatch.simple_impl(call_p)


class SendMark:
    """What a send half's custom calls carry of their op (as a parameter, which JAX may keep in
    its caches: it holds nothing else alive): whether its recv half was traced, and whether its
    program was refused for lacking it (then the send is not open: that program never runs)."""

    __slots__ = ("received", "refused")

    def __init__(self):
        self.received = self.refused = False


_sending = threading.local()  # .mark: the op whose send half is being traced (`sending`)


@contextlib.contextmanager
def sending(mark: SendMark):
    """The halves bound inside are the send of `mark`'s op: a program in which that op's recv
    half was not traced is refused when it is compiled (`_lowering`). Such a send would leave its
    slot taken after the program ends, and the Buffer's later ops took its rows, silently."""
    _sending.mark = mark
    try:
        yield
    finally:
        _sending.mark = None


def ordered_ffi_call(
    target: str,
    result_shapes,
    *operands,
    order: BufferOrder,
    halves: bool,
    attributes: dict[str, Any],
):
    """The results of custom call `target` on `operands`, in `order` with the Buffer's other
    calls. Whole ops may be batched by vmap (one call per element, in order); halves cannot
    (a batch's sends would all come before its recvs)."""
    result_avals = tuple(core.ShapedArray(s.shape, s.dtype) for s in result_shapes)
    return call_p.bind(
        *operands,
        target=target,
        result_avals=result_avals,
        order=order,
        halves=halves,
        sent=getattr(_sending, "mark", None) if halves else None,
        attributes=tuple(sorted(attributes.items())),
    )


def _abstract_eval(*avals_in, result_avals, order, **_):
    sharding = core.get_cur_mesh_sharding()
    return tuple(a.update(sharding=sharding) for a in result_avals), {order}


def _lowering(ctx, *operands, target, result_avals, order, halves, sent, attributes):
    del result_avals
    _check_mesh(ctx, order)
    if sent is not None and not sent.received:  # the whole program is traced by now
        sent.refused = True
        kind = "dispatch" if "dispatch" in target else "combine"
        raise ValueError(
            f"jax_ep: a {kind}_send has no {kind}_recv in its program: receive every send in "
            "the program (jit) that sends it (left open, its op would keep its slot, and the "
            "Buffer's later ops would take its rows)"
        )
    token = ctx.tokens_in.get(order)
    inner = ctx.replace(
        avals_in=[core.abstract_token, *ctx.avals_in],
        avals_out=[core.abstract_token, *ctx.avals_out],
    )
    call = jax.ffi.build_ffi_lowering_function(target, has_side_effect=halves)
    op = call(inner, token, *_barrier(operands), **dict(attributes))
    ctx.set_tokens_out(mlir.TokenSet({order: op.results[0]}))
    return _barrier(op.results[1:])


def _check_mesh(ctx, order):
    """A Buffer numbers its ranks by its own mesh's devices; a shard_map over the same axes and
    devices in another order would hand each device another rank's rows, without an error. The
    mesh is known here, where the call is lowered inside the shard_map (trace time knows only
    the axes' names and sizes)."""
    used = getattr(ctx.module_context.axis_context, "mesh", None)
    if order.mesh is None or used is None or not hasattr(type(used), "device_ids"):
        return
    try:
        used_ids = used.device_ids
    except ValueError:  # an AbstractMesh: axis names and sizes, no devices
        raise ValueError(
            "jax_ep: a Buffer's ops run inside a shard_map over the Buffer's own mesh "
            "(jax.shard_map(..., mesh=mesh)), not an abstract one: the devices' order numbers "
            "the ranks, and an abstract mesh does not say it"
        ) from None
    own = order.mesh
    if used.axis_names != own.axis_names or not np.array_equal(used_ids, own.device_ids):
        raise ValueError(
            f"jax_ep: a Buffer's ops run inside a shard_map over the Buffer's own mesh, the same "
            f"devices in the same order (it numbers its ranks by that order); this shard_map's "
            f"mesh is {used.axis_names} over devices {used_ids.tolist()}, the Buffer's "
            f"{own.axis_names} over {own.device_ids.tolist()}"
        )


def _barrier(values):
    """values through an optimization barrier. XLA's GPU dynamic-slice fusion would otherwise
    pull a dynamic-slice that feeds the call, or a dynamic-update-slice of its result (a loop's
    stacked residuals under a gradient), into one fusion with the call, and abort compiling on
    the call's token ("Check failed: shape.IsArray() || shape.IsTuple()"). A barrier copies
    nothing; XLA fuses nothing into a custom call either way."""
    return list(stablehlo.OptimizationBarrierOp(values).results) if values else []


def _batch(args, dims, *, target, result_avals, order, halves, sent, attributes):
    """vmap: a whole op once per batch element, in order (jax.lax.map)."""
    if halves:
        raise ValueError(
            f"jax_ep: the halves of an op cannot be batched by vmap ({target}); vmap the whole ops"
        )
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else batching.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    batched = [d is not None for d in dims]

    def one(elements):
        it = iter(elements)
        ins = [next(it) if b else a for a, b in zip(moved, batched)]
        return call_p.bind(
            *ins,
            target=target,
            result_avals=result_avals,
            order=order,
            halves=halves,
            sent=sent,
            attributes=attributes,
        )

    outs = jax.lax.map(one, [a for a, b in zip(moved, batched) if b])
    assert all(o.shape[0] == size for o in outs)
    return outs, [0] * len(outs)


def _not_differentiable(primals, tangents, *, target, **_):
    raise ValueError(
        f"jax_ep: {target} is not differentiable by itself (the halves of an op "
        "are not differentiable: use the whole ops under jax.grad)"
    )


call_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(call_p, _lowering)
batching.primitive_batchers[call_p] = _batch
ad.primitive_jvps[call_p] = _not_differentiable

"""Everything jax_ep takes from JAX's private modules (`jax._src`), in one place.

A Buffer's custom calls must run in program order on every rank, whatever XLA's scheduling
(command buffers with CONCURRENT scheduling run independent calls at once). jax_ep gets that
from JAX's own ordered effects: every Buffer has one (`BufferOrder`), every cross-rank call of
the Buffer carries it, and JAX threads one XLA token per effect through the whole program, in
program order: through jit and nested jit, shard_map, scan / while / cond, jax.checkpoint and
custom_vjp, forward and backward. `ordered_ffi_call` makes such a call: an XLA FFI custom call
whose first operand and first result are that token, so XLA cannot reorder or overlap two calls
of one Buffer. Between programs JAX passes the token from one execution to the next.

Three JAX behaviours are mended here. JAX keeps those runtime tokens per host thread: a
Buffer's are kept per process, and the programs that use a Buffer are launched one at a time,
so programs launched from several threads reach every device in one order, each after the one
before (`_token_input`, `_token_result`, `_execute`). An ahead-of-time compiled program's second
call passes no token (`_create_cpp_call`). A program that fails leaves its error in its output
token, which PjRt hands on to every later program that takes the token; an op that raised on
purpose (check_invalid) must leave its Buffer usable, so a Buffer's token is dropped once it
holds an error (`_token_input`); a Buffer stopped by a timeout raises on its next call by
itself. JAX also raises every failed token again at the interpreter's exit: closing a Buffer
whose last program failed lets go of that program's tokens (`release_tokens`).

And a fourth, a JAX bug that jax_ep's FP8 rows meet (docs/API.md has the report for JAX):
jax.checkpoint rounds every saved float residual with reduce_precision(exponent_bits,
mantissa_bits) of its dtype, and XLA's reduce_precision has IEEE semantics, where the top
exponent means inf or NaN. float8_e4m3fn (jax_ep's FP8 rows) has no inf and uses that exponent
for 256..448: a saved FP8 row came back NaN in every such element. In a checkpoint around a
Buffer's calls, float types without inf keep one more exponent bit (`_remat_residual_rounding`),
which leaves their values as they are; other checkpoints are JAX's own.

Also here: jax.distributed's key-value store (`distributed_client`, where the processes of a
mesh meet to bring a Buffer up) and its coordinator's address (`coordinator_address`), and the
mesh axes a value varies over inside shard_map (`varying_axes`), whose attribute changed name
between jax versions, and whether ops run one by one in shard_map (`in_eager_shard_map`).

The four mends replace JAX functions, so they are applied only once a process makes its first
Buffer (`install`, from Buffer's constructor): `import jax_ep` alone changes nothing in JAX.

None of this is public JAX API, so it fails loudly here, naming the jax version, rather than as
wrong results later.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
import numpy as np
from jax.extend.mlir.dialects import stablehlo

try:
    from jax._src import ad_checkpoint, core, dispatch, distributed, dtypes, effects
    from jax._src.interpreters import ad, batching, mlir, pxla
    from jax._src.lax.lax import reduce_precision_p
except ImportError as e:  # pragma: no cover - only on a jax that moved its internals
    raise ImportError(
        f"jax_ep needs JAX's effect system (jax._src), which jax "
        f"{jax.__version__} does not provide as expected: {e}"
    ) from e

_EFFECT_SETS = (
    "ordered_effects",
    "shardable_ordered_effects",
    "lowerable_effects",
    "control_flow_allowed_effects",
    "custom_derivatives_allowed_effects",
    "remat_allowed_effects",
)
_missing = [f"effects.{name}" for name in _EFFECT_SETS if not hasattr(effects, name)]
_missing += [
    f"mlir.{name}" for name in ("TokenSet", "LoweringRuleContext") if not hasattr(mlir, name)
]
_missing += (
    []
    if hasattr(jax.ffi, "build_ffi_lowering_function")
    else ["jax.ffi.build_ffi_lowering_function"]
)
_missing += [
    f"{owner.__name__}.{name}"
    for owner, name in (
        (dispatch.RuntimeTokenSet, "get_token_input"),
        (pxla.MeshExecutable, "create_cpp_call"),
        (ad_checkpoint, "_insert_reduce_precision"),
    )
    if not hasattr(owner, name)
]
if _missing:
    raise ImportError(
        f"jax_ep: jax {jax.__version__} lacks what jax_ep orders its calls with: "
        f"{', '.join(_missing)}"
    )


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


# An ahead-of-time compiled program (jit(f).lower(...).compile()) runs its second call through
# JAX's C++ fast path, which passes no runtime tokens: XLA then refuses the call ("Execution
# supplied N arguments but compiled program expected N + 1"). Programs that use a Buffer keep
# JAX's Python path, which passes them (as jit's own calls do for ordered effects).
_jax_create_cpp_call = pxla.MeshExecutable.create_cpp_call


def _create_cpp_call(self, params):
    if any(isinstance(e, BufferOrder) for e in getattr(self.unsafe_call, "ordered_effects", ())):
        return None
    return _jax_create_cpp_call(self, params)


# jax.checkpoint's rounding of saved residuals, for float types without inf (float8_e4m3fn and
# the other "fn" types): one more exponent bit, so that their top exponent stays finite (a
# no-op on their values; the mantissa is still rounded to theirs).
_jax_insert_reduce_precision = ad_checkpoint._insert_reduce_precision


def _has_inf(dtype) -> bool:
    return bool(np.isinf(np.asarray(np.inf, np.float32).astype(dtype)))


def _remat_residual_rounding(jaxpr, num_res):
    uses_buffer = any(isinstance(e, BufferOrder) for e in jaxpr.effects)
    jaxpr = _jax_insert_reduce_precision(jaxpr, num_res)
    if not uses_buffer:  # only checkpoints around a Buffer's calls: other programs get JAX's
        return jaxpr
    eqns = list(jaxpr.eqns)
    for i, eqn in enumerate(eqns):
        dtype = eqn.outvars[0].aval.dtype if eqn.primitive is reduce_precision_p else None
        if dtype is None or not dtypes.issubdtype(dtype, np.floating) or _has_inf(dtype):
            continue
        if eqn.params["exponent_bits"] == dtypes.finfo(dtype).nexp:
            eqns[i] = eqn.replace(
                params=dict(eqn.params, exponent_bits=eqn.params["exponent_bits"] + 1)
            )
    return jaxpr.replace(eqns=eqns)


# The mends, as (owner, name, jax_ep's function): applied by install(), not at import.
_MENDS = (
    (dispatch.RuntimeTokenSet, "get_token_input", _token_input),
    (dispatch.RuntimeTokenSet, "set_token_result", _token_result),
    (pxla.ExecuteReplicated, "__call__", _execute),
    (pxla.MeshExecutable, "create_cpp_call", _create_cpp_call),
    (ad_checkpoint, "_insert_reduce_precision", _remat_residual_rounding),
)
_install = threading.Lock()


def install():
    """Applies the mends above, once per process, when its first Buffer is made: importing
    jax_ep changes nothing in JAX, and a process that makes no Buffer runs JAX's own code. Each
    mend hands JAX every effect and program that is not a Buffer's unchanged (the float8
    rounding too, which changes only checkpoints around a Buffer's calls)."""
    with _install:
        for owner, name, mend in _MENDS:
            if getattr(owner, name) is not mend:
                setattr(owner, name, mend)


def installed() -> bool:
    """Whether install() has mended JAX in this process."""
    return all(getattr(owner, name) is mend for owner, name, mend in _MENDS)


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
    sharding = core.get_cur_mesh_sharding() if hasattr(core, "get_cur_mesh_sharding") else None
    outs = tuple(a if sharding is None else a.update(sharding=sharding) for a in result_avals)
    return outs, {order}


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


def distributed_client():
    """jax.distributed's key-value client, or a ValueError when it is not initialized."""
    client = distributed.global_state.client
    if client is None:
        raise ValueError(
            "jax_ep: the mesh spans several processes but jax.distributed is not "
            "initialized (call jax.distributed.initialize() first)"
        )
    return client


def coordinator_address() -> str | None:
    """jax.distributed's coordinator ("host:port"), or None when it is not initialized."""
    return distributed.global_state.coordinator_address


def in_eager_shard_map() -> bool:
    """Whether this runs op by op inside shard_map (no jit around it): JAX cannot run a
    custom_vjp with symbolic zeros there, which every op of the custom calls is."""
    trace = core.trace_ctx.trace
    while trace is not None:
        name = type(trace).__name__
        if name == "ShardMapTrace":
            return True
        if name == "DynamicJaxprTrace":
            return False
        trace = getattr(trace, "parent_trace", None)
    return False


def varying_axes(value) -> frozenset:
    """The mesh axes `value` varies over inside shard_map (jax >= 0.10: the aval's
    manual_axis_type; earlier: its vma)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    raise TypeError(
        f"jax_ep: jax {jax.__version__}: an abstract value without manual_axis_type or vma "
        f"({type(aval).__name__}); jax_ep cannot tell which mesh axes it varies over"
    )

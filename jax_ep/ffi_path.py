"""The custom-call path: the rank-level operations as jax.ffi calls into the native backends
(kernels/cpu, kernels/cuda), one target per operation and half, every call carrying the Buffer's
ordered effect (jax_ep/_jax/order.py: JAX threads one XLA token through them in program
order), made differentiable with custom_vjp: the backward of dispatch is one combine of the
rows' and the weights' cotangents, the backward of combine is a cached dispatch. Also the local
calls: the expert layouts of received rows, and the FP8 quantization of jax_ep.nn's matmul
operands."""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_ep import _native, layout
from jax_ep._jax import BufferOrder, ordered_ffi_call
from jax_ep.fp8 import FP8_BLOCK
from jax_ep.rank_ops import RankRows, Routing, all_varying, varying_like

_TICKET = jax.ShapeDtypeStruct((1,), jnp.int32)  # an op's number (low 32 bits)
ROWS_DTYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1}  # kernels/dtype.h Dtype


@functools.cache
def register_targets():
    """Registers the custom-call targets, and the type of their state, of every backend built.
    The backends start first (jax.devices()): jaxlib registers what comes after a backend's
    start in order, but replays what came before it with the targets ahead of their types,
    which fails the CPU backend's start (a call traced before any device was asked for, e.g.
    under jax.eval_shape)."""
    jax.devices()
    backends = [("cpu", _native.cpu_targets(), _native.cpu_state_type())]
    if _native.has_cuda:
        backends.append(("CUDA", _native.cuda_targets(), _native.cuda_state_type()))
    for platform, targets, state in backends:
        jax.ffi.register_ffi_type("jax_ep_call_state", state, platform=platform)
        for name, handler in targets.items():
            jax.ffi.register_ffi_target(f"jax_ep_{name}", handler, platform=platform)


def quantize_rows(x, round_scale=False):
    """jax_ep.fp8's rule on rows [T, H] (float32 or bfloat16, H a multiple of 128) in one pass
    of the backend's kernel: (e4m3 [T, H], float32 scales [T, H/128]), the bytes of
    quantize_fp8's. No gradient flows through them (stop_gradient)."""
    register_targets()
    x = jax.lax.stop_gradient(x)
    t, h = x.shape
    shapes = (
        jax.ShapeDtypeStruct((t, h), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((t, h // FP8_BLOCK), jnp.float32),
    )
    call = jax.ffi.ffi_call("jax_ep_quantize_rows", shapes, vmap_method="sequential")
    return tuple(varying_like(call(x, round_scale=bool(round_scale)), x))


def quantize_weights(w, transposed=False):
    """jax_ep.fp8's rule on expert weights [G, K, N] (float32 or bfloat16, K and N multiples of
    128) in one pass of the backend's kernel: quantize_weights_fp8's (q [G, N, K], scales
    [G, N/128, K/128]), and with transposed also transpose_weights_fp8's of them. No gradient
    flows through them (stop_gradient)."""
    register_targets()
    w = jax.lax.stop_gradient(w)
    g, k, n = w.shape
    b = FP8_BLOCK
    t = 1 if transposed else 0  # no elements: not asked for
    shapes = (
        jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((g, n // b, k // b), jnp.float32),
        jax.ShapeDtypeStruct((g * t, k, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((g * t, k // b, n // b), jnp.float32),
    )
    call = jax.ffi.ffi_call("jax_ep_quantize_weights", shapes, vmap_method="sequential")
    out = tuple(varying_like(call(w), w))
    return out if transposed else out[:2]


# Where libraries live: jax_ep, JAX, the standard library and installed packages. A frame of a
# file under none of them is the program's.
_JAX_DIRS = tuple(
    os.path.join(os.path.realpath(os.path.dirname(m.__file__)), "") for m in (jax, jaxlib)
)
_LIBRARY_DIRS = _JAX_DIRS + tuple(
    os.path.join(os.path.realpath(d), "")
    for d in {
        os.path.dirname(__file__),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
        *site.getsitepackages(),
        site.getusersitepackages(),
    }
)
_MAX_SITE_FRAMES = 16


@functools.cache
def _is_library(filename, dirs=_LIBRARY_DIRS):
    if filename.startswith("<frozen"):
        return True
    return os.path.join(os.path.realpath(filename), "").startswith(dirs)


def _site_of(places):
    return zlib.crc32(";".join(places).encode()) if places else 0


def call_site():
    """Where the program calls an op, as a 32-bit number: a crc32 of the program's innermost
    frames (function name, its first line, the line running; no file names: a notebook's cells
    are files named by their process), from the first frame outside every library out to the next
    library frame. Every rank of a Buffer runs the same program, so its ranks' ops at one op
    number come from one place; a rank that skipped an op (a lax.cond on the rank, a process that
    left out a step) pairs its next op with an op of another place, and the signatures
    (kernels/signature.h) differ. The walk never passes a frame of JAX's (the jit, shard_map or
    loop tracing the op): what a process called before or around the jit does not count. An op
    that a library calls (a model installed as a package) takes the place where the program calls
    into that library; one that a library calls under its own jit with no program frame in
    between (jax_ep.nn's layer) takes the library's frames."""
    frame = sys._getframe(1)
    library = []
    while frame is not None and _is_library(frame.f_code.co_filename):
        if _is_library(frame.f_code.co_filename, _JAX_DIRS):
            return _site_of(library)
        library.append(_place(frame))
        frame = frame.f_back
    places = []
    while (
        frame is not None
        and len(places) < _MAX_SITE_FRAMES
        and not _is_library(frame.f_code.co_filename)
    ):
        places.append(_place(frame))
        frame = frame.f_back
    return _site_of(places)


def _place(frame):
    code = frame.f_code
    return f"{code.co_name}:{code.co_firstlineno}:{frame.f_lineno}"


class _Config(NamedTuple):
    """A Buffer's calls: what they share, and one call's static configuration."""

    buffer: int  # the Buffer's key (its native side, found at instantiation)
    order: BufferOrder
    num_ranks: int
    experts_per_rank: int
    fp8: bool = False
    round_scale: bool = False
    low_latency: bool = False  # a fresh dispatch's kernels (CUDA)
    x_dtype: str = "float32"  # a dispatch's x
    rows_dtype: str = "float32"  # a combine's rows
    out_dtype: str = "float32"  # a combine's result
    bias_dtype: str | None = None  # a combine's bias, if any
    max_row_dtype: str = "float32"  # the widest rows the Buffer's window takes (not decoded)
    call_site: int = 0  # where the program calls the op (call_site(); a backward op: its forward's)

    def attributes(self):
        """What the instantiate stage decodes (the same for every target)."""
        return dict(
            buffer=np.int64(self.buffer),
            fp8=bool(self.fp8),
            round_scale=bool(self.round_scale),
            low_latency=bool(self.low_latency),
            rows_dtype=np.int32(ROWS_DTYPES[jnp.dtype(self.rows_dtype)]),
            call_site=np.int64(self.call_site),
        )


def _call(cfg: _Config, target, shapes, *operands, halves=False):
    """(the op's ticket, results) of custom call `target`, in the Buffer's order. Every call
    carries the Buffer's effect, so none is dropped or reordered; an op that jax.checkpoint
    recomputes (the expert layout's: dispatch's and combine's residuals are kept) is a new op,
    on every rank alike. Halves are also side effects for XLA: a recv half whose results go
    unused must still run (it releases its send's slot)."""
    operands = [o for o in operands if o is not None]
    out = ordered_ffi_call(
        f"jax_ep_{target}",
        (_TICKET, *shapes),
        *operands,
        order=cfg.order,
        halves=halves,
        attributes=cfg.attributes(),
    )
    out = varying_like(out, *operands)
    return out[0], out[1:]


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _rows_shapes(cfg: _Config, rows, hidden):
    x = jax.ShapeDtypeStruct((rows, hidden), jnp.float8_e4m3fn if cfg.fp8 else cfg.x_dtype)
    scales = jax.ShapeDtypeStruct((rows, hidden // FP8_BLOCK) if cfg.fp8 else (0,), jnp.float32)
    return x, scales


def _sent_shapes(cfg: _Config, tokens):
    """What the send half of a fresh dispatch returns: the handle's send_pos and num_invalid."""
    return _i32(tokens, cfg.num_ranks), _i32()


def _received_shapes(cfg: _Config, rows, hidden, k):
    """What the recv half of a fresh dispatch returns (ffi/decode.h FreshReceived)."""
    return (
        *_rows_shapes(cfg, rows, hidden),
        _i32(rows, k),
        jax.ShapeDtypeStruct((rows, k), jnp.float32),
        _i32(cfg.num_ranks),
        _i32(cfg.experts_per_rank),
        _i32(),
        _i32(),
        _i32(),
    )


def _received(cfg: _Config, received, send_pos, num_invalid):
    x_rows, scales, topk_rows, weight_rows, *counts = received
    recv_counts, per_expert, num_recv, dropped, group_invalid = counts
    return (
        RankRows(x_rows, _scales(cfg, scales), topk_rows, weight_rows),
        Routing(send_pos, recv_counts, per_expert, num_recv, dropped, num_invalid, group_invalid),
    )


def _scales(cfg: _Config, scales):
    return scales if cfg.fp8 else None


# ---------------------------------------------------------------- differentiable whole ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch(cfg, rows, x, topk_idx, topk_weights):
    """A fresh dispatch: (RankRows, Routing). It returns what its send half does, then what its
    recv half does."""
    t, k = topk_idx.shape
    shapes = (*_sent_shapes(cfg, t), *_received_shapes(cfg, rows, x.shape[1], k))
    _, (send_pos, num_invalid, *received) = _call(
        cfg, "dispatch", shapes, x, topk_idx, topk_weights
    )
    return _received(cfg, received, send_pos, num_invalid)


# The forward rules call the differentiable ops themselves, so that a gradient's own forward
# pass can be differentiated again (second order).
def _dispatch_fwd(cfg, rows, *args):
    moved, routing = _dispatch(cfg, rows, *custom_vjp_primal_tree_values(args))
    return (moved, routing), (
        routing.send_pos,
        routing.recv_counts,
        routing.num_recv,
        moved.topk_idx,
    )


def _dispatch_bwd(cfg, rows, res, ct):
    """One combine brings the rows' and the weights' cotangents back to the tokens; a cotangent
    JAX knows to be zero costs nothing (the float8 rows' when they are only used through
    Buffer.dequantize, the weights' when nothing uses them)."""
    send_pos, recv_counts, num_rows, topk_rows = res
    ct_rows = ct[0]
    has_x = not isinstance(ct_rows.x, SymbolicZero)
    has_w = not isinstance(ct_rows.topk_weights, SymbolicZero)
    handle = (send_pos, recv_counts, num_rows)
    grad_x = grad_w = None
    if has_w:  # each (token, slot) weight lives in exactly one rank's row; elsewhere it is -1
        ct_w = jnp.where(topk_rows >= 0, ct_rows.topk_weights, 0.0)
    travel = layout.travel_dtype(cfg.x_dtype, cfg.max_row_dtype)
    if has_x and has_w and travel == jnp.dtype(cfg.x_dtype):
        grad_x, grad_w = _adjoint(cfg, ct_rows.x.astype(travel), ct_w, *handle)
        grad_x = grad_x.astype(ct_rows.x.dtype).astype(cfg.x_dtype)  # as x_from_rows rounds
    else:
        if has_x:
            grad_x = _x_from_rows(cfg, ct_rows.x, handle)
        if has_w:
            grad_w = _combine(
                cfg._replace(rows_dtype="float32", out_dtype="float32"), ct_w, *handle, None
            )
    return grad_x, None, grad_w


def _x_from_rows(cfg, ct_rows, handle):
    """layout.x_from_rows by one combine along the handle's routes."""

    def combine(rows, out_dtype):
        config = cfg._replace(rows_dtype=rows.dtype.name, out_dtype=jnp.dtype(out_dtype).name)
        return _combine(config, rows, *handle, None)

    return layout.x_from_rows(combine, ct_rows, cfg.x_dtype, cfg.max_row_dtype)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _adjoint(cfg, ct_x, ct_w, send_pos, recv_counts, num_rows):
    """The adjoint of a dispatch: (d x, d topk_weights), both moved by one combine."""
    t = send_pos.shape[0]
    _, (grad_x, grad_w) = _call(
        cfg,
        "dispatch_adjoint",
        (
            jax.ShapeDtypeStruct((t, ct_x.shape[1]), ct_x.dtype),
            jax.ShapeDtypeStruct((t, ct_w.shape[1]), jnp.float32),
        ),
        ct_x,
        ct_w,
        send_pos,
        recv_counts,
        num_rows,
    )
    return grad_x, grad_w


def _adjoint_fwd(cfg, *args):
    ct_x, ct_w, send_pos, recv_counts, num_rows = custom_vjp_primal_tree_values(args)
    out = _adjoint(cfg, ct_x, ct_w, send_pos, recv_counts, num_rows)
    return out, (ct_x.shape[0], send_pos, recv_counts, num_rows)


def _adjoint_bwd(cfg, res, ct):
    """Its own adjoint (second order): the cotangents go out again along the same routes."""
    rows, *handle = res
    grads = []
    for value, dtype in zip(ct, (cfg.x_dtype, "float32")):
        grads.append(
            None
            if isinstance(value, SymbolicZero)
            else _dispatch_cached(cfg._replace(fp8=False, x_dtype=dtype), rows, value, *handle)[0]
        )
    return (*grads, None, None, None)


_adjoint.defvjp(_adjoint_fwd, _adjoint_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_cached(cfg, rows, x, send_pos, recv_counts, num_rows):
    """x along a handle's routes: (x rows, scales)."""
    _, (x_rows, scales) = _call(
        cfg, "dispatch_cached", _rows_shapes(cfg, rows, x.shape[1]), x, send_pos
    )
    return x_rows, _scales(cfg, scales)


def _dispatch_cached_fwd(cfg, rows, x, send_pos, recv_counts, num_rows):
    out = _dispatch_cached(cfg, rows, x, send_pos, recv_counts, num_rows)
    return out, (send_pos, recv_counts, num_rows)


def _dispatch_cached_bwd(cfg, rows, handle, ct):
    return _x_from_rows(cfg, ct[0], handle), None, None, None


_dispatch_cached.defvjp(_dispatch_cached_fwd, _dispatch_cached_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(cfg, row_data, send_pos, recv_counts, num_rows, bias):
    """bias + the rows of each token summed in rank order."""
    shape = jax.ShapeDtypeStruct((send_pos.shape[0], row_data.shape[1]), cfg.out_dtype)
    _, (out,) = _call(cfg, "combine", (shape,), row_data, send_pos, recv_counts, num_rows, bias)
    return out


def _combine_fwd(cfg, row_data, send_pos, recv_counts, num_rows, bias):
    out = _combine(cfg, row_data, send_pos, recv_counts, num_rows, bias)
    return out, (row_data.shape[0], send_pos, recv_counts, num_rows)


def _combine_bwd(cfg, res, ct_out):
    """A cached dispatch of y's cotangent, in the rows' dtype where that is narrower (float32 y
    from bf16 rows: rounding commutes with moving, and the Buffer may not take float32 rows)."""
    rows, send_pos, recv_counts, num_rows = res
    moved = ct_out.astype(layout.travel_dtype(ct_out.dtype, cfg.rows_dtype))
    ct_rows, _ = _dispatch_cached(
        cfg._replace(fp8=False, x_dtype=moved.dtype.name),
        rows,
        moved,
        send_pos,
        recv_counts,
        num_rows,
    )
    # The bias is added to y in float32 and never travels: its cotangent is y's, unrounded.
    ct_bias = None if cfg.bias_dtype is None else ct_out.astype(cfg.bias_dtype)
    return ct_rows.astype(cfg.rows_dtype), None, None, None, ct_bias


_combine.defvjp(_combine_fwd, _combine_bwd)


# ---------------------------------------------------------------- the rank-level operations


def _send(cfg: _Config, target, shapes, *operands):
    """A send half: its ticket (naming its op) and results."""
    ticket, out = _call(cfg, target, shapes, *operands, halves=True)
    return (ticket, *out)


def _recv(cfg: _Config, target, shapes, ticket, *operands):
    """A recv half of the op `ticket` names (in the Buffer's order too: work between the
    halves may have called the Buffer)."""
    return _call(cfg, target, shapes, ticket, *operands, halves=True)[1]


class Ffi:
    """Custom-call implementations of the rank-level operations (see rank_ops.py), on one Buffer."""

    def __init__(self, buffer_key, num_ranks, num_experts, mesh=None, max_row_dtype="float32"):
        self._cfg = _Config(
            buffer_key,
            BufferOrder(buffer_key, mesh),
            num_ranks,
            num_experts // num_ranks,
            max_row_dtype=jnp.dtype(max_row_dtype).name,
        )

    @property
    def key(self):
        """The Buffer's key (its native side)."""
        return self._cfg.buffer

    def _dispatch_config(self, x, fp8=False, round_scale=False, low_latency=False):
        return self._cfg._replace(
            fp8=bool(fp8),
            round_scale=bool(round_scale),
            low_latency=bool(low_latency),
            x_dtype=x.dtype.name,
            call_site=call_site(),
        )

    def _combine_config(self, row_data, out_dtype, bias=None):
        return self._cfg._replace(
            rows_dtype=row_data.dtype.name,
            out_dtype=jnp.dtype(out_dtype).name,
            bias_dtype=None if bias is None else bias.dtype.name,
            call_site=call_site(),
        )

    def dispatch(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False):
        return _dispatch(
            self._dispatch_config(x, fp8, round_scale, low_latency),
            rows,
            *all_varying(x, topk_idx, topk_weights),
        )

    def dispatch_cached(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        return _dispatch_cached(
            self._dispatch_config(x, fp8, round_scale),
            rows,
            *all_varying(x, send_pos, recv_counts, num_rows),
        )

    def combine(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        return _combine(
            self._combine_config(row_data, out_dtype, bias),
            *all_varying(row_data, send_pos, recv_counts, num_rows, bias),
        )

    # Halves: not differentiable (under grad use the whole ops). The send half returns its
    # ticket with its results; finish(them) runs the recv half.

    def dispatch_send(
        self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False
    ):
        cfg = self._dispatch_config(x, fp8, round_scale, low_latency)
        t, k = topk_idx.shape
        sent = _send(
            cfg,
            "dispatch_send",
            _sent_shapes(cfg, t),
            *all_varying(x, topk_idx, topk_weights),
        )

        def finish(sent):
            ticket, send_pos, num_invalid = sent
            received = _recv(
                cfg, "dispatch_recv", _received_shapes(cfg, rows, x.shape[1], k), ticket
            )
            return _received(cfg, received, send_pos, num_invalid)

        return sent, finish

    def dispatch_cached_send(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        cfg = self._dispatch_config(x, fp8, round_scale)
        sent = _send(cfg, "dispatch_cached_send", (), *all_varying(x, send_pos))

        def finish(sent):
            x_rows, scales = _recv(
                cfg, "dispatch_cached_recv", _rows_shapes(cfg, rows, x.shape[1]), sent[0]
            )
            return x_rows, _scales(cfg, scales)

        return sent, finish

    def combine_send(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        cfg = self._combine_config(row_data, out_dtype, bias)
        row_data, send_pos, recv_counts, num_rows = all_varying(
            row_data, send_pos, recv_counts, num_rows
        )
        sent = _send(cfg, "combine_send", (), row_data, recv_counts, num_rows)
        shape = jax.ShapeDtypeStruct((send_pos.shape[0], row_data.shape[1]), cfg.out_dtype)

        def finish(sent):
            (out,) = _recv(
                cfg, "combine_recv", (shape,), sent[0], send_pos, *(() if bias is None else (bias,))
            )
            return out

        return sent, finish

    def expert_layout(self, topk_rows, *, experts_per_rank, alignment, capacity):
        rows, k = topk_rows.shape
        i32 = jnp.int32
        shapes = (
            jax.ShapeDtypeStruct((capacity,), i32),
            jax.ShapeDtypeStruct((rows, layout.max_experts_per_row(k, experts_per_rank)), i32),
            jax.ShapeDtypeStruct((capacity,), i32),
            jax.ShapeDtypeStruct((experts_per_rank,), i32),
            jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((experts_per_rank,), i32),
        )  # counts before capacity
        topk_rows = jax.lax.stop_gradient(topk_rows)  # integers: nothing to differentiate
        call = jax.ffi.ffi_call("jax_ep_expert_layout", shapes, vmap_method="sequential")
        out = varying_like(
            call(topk_rows, alignment=np.int32(alignment)),
            topk_rows,
        )
        return layout.ExpertMaps(*out[:5])

    def expert_padded(self, topk_rows, weight_rows, rows, *, experts_per_rank, capacity):
        x_rows, scale_rows = rows
        num_rows, k = topk_rows.shape
        out_rows = experts_per_rank * capacity
        if scale_rows is None:  # an empty array in its place: one call signature
            scale_rows = varying_like(jnp.zeros((num_rows, 0), jnp.float32), x_rows)
        i32 = jnp.int32
        chunks = -(-num_rows // _native.limits()["expert_chunk_rows"])
        shapes = (
            jax.ShapeDtypeStruct((out_rows,) + x_rows.shape[1:], x_rows.dtype),
            jax.ShapeDtypeStruct((out_rows,) + scale_rows.shape[1:], scale_rows.dtype),
            jax.ShapeDtypeStruct((out_rows,), jnp.float32),
            jax.ShapeDtypeStruct((out_rows,), i32),
            jax.ShapeDtypeStruct((num_rows, layout.max_experts_per_row(k, experts_per_rank)), i32),
            jax.ShapeDtypeStruct((out_rows,), i32),
            jax.ShapeDtypeStruct((experts_per_rank,), i32),
            jax.ShapeDtypeStruct((experts_per_rank,), i32),  # before the capacity
            jax.ShapeDtypeStruct((chunks, experts_per_rank), i32),  # scratch
        )
        call = jax.ffi.ffi_call("jax_ep_expert_padded", shapes, vmap_method="sequential")
        x, scales, weights, src, expert_rows, expert_of_row, present, counts, _ = varying_like(
            call(topk_rows, weight_rows, x_rows, scale_rows), topk_rows, weight_rows, x_rows
        )
        maps = layout.ExpertMaps(
            src, expert_rows, expert_of_row, present, (counts - present).sum(dtype=i32)
        )
        return maps, weights, (x, None if rows[1] is None else scales)

    def place_rows(self, rank_rows, expert_rows, capacity):
        shape = jax.ShapeDtypeStruct((capacity,) + rank_rows.shape[1:], rank_rows.dtype)
        call = jax.ffi.ffi_call("jax_ep_place_rows", shape, vmap_method="sequential")
        return varying_like(call(rank_rows, expert_rows), rank_rows, expert_rows)

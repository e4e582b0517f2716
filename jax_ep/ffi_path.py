"""The custom-call path: the rank-level primitives as jax.ffi calls into the native backends
(kernels/cpu, kernels/cuda), made differentiable with custom_vjp: the backward of dispatch is a
combine, the backward of combine is a cached dispatch."""
from __future__ import annotations

import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_ep import _native, layout, streams
from jax_ep.primitives import RankRows, Routing, Unsplit, all_varying, varying_like



def register_targets():
    """Registers the custom-call targets of every backend this build has."""
    for name, capsule in _native.cpu_targets().items():
        jax.ffi.register_ffi_target(f"jax_ep_{name}", capsule, platform="cpu")
    if _native.has_cuda:
        for name, capsule in _native.cuda_targets().items():
            jax.ffi.register_ffi_target(f"jax_ep_{name}", capsule, platform="CUDA")


def _custom_call(target, shapes, *args, stream, has_side_effect=False, **attributes):
    """Custom call `target` on args, annotated for XLA stream `stream` (streams.on_stream).

    A whole op has no side effect for XLA: every rank runs the same program, so whatever XLA
    merges, drops or recomputes (jax.checkpoint), it does on all ranks alike, and the ops are
    numbered on the device as they run. Split halves are marked as side-effecting: merging two
    sends, or dropping one, would break the pairing of sends and recvs."""
    call = jax.ffi.ffi_call(target, shapes, has_side_effect=has_side_effect)
    return streams.placed(lambda *operands: call(*operands, **attributes), stream)(*args)


class _Move(NamedTuple):  # static configuration of a dispatch
    buffer_id: int
    num_ranks: int
    experts_per_rank: int
    rows: int
    fp8: bool
    round_scale: bool
    x_dtype: str
    low_latency: bool
    stream: str | None  # the XLA stream its calls are annotated for (streams.on_stream)


class _Sum(NamedTuple):  # static configuration of a combine
    buffer_id: int
    num_ranks: int
    rows_dtype: str
    out_dtype: str
    bias_dtype: str | None
    low_latency: bool
    stream: str | None


_op_keys = itertools.count(1)


def _op_key():
    """A fresh id per traced custom call: the same on every device running the compiled program,
    so the CPU backend can match the ranks' calls whatever order each device runs them in."""
    return np.int64(next(_op_keys))


def _attrs(cfg: _Move):
    return dict(buffer_id=np.int64(cfg.buffer_id), op_key=_op_key(), out_rows=np.int32(cfg.rows),
                fp8=bool(cfg.fp8), round_scale=bool(cfg.round_scale))


def _x_rows_shapes(cfg: _Move, hidden):
    x = jax.ShapeDtypeStruct((cfg.rows, hidden), jnp.float8_e4m3fn if cfg.fp8 else cfg.x_dtype)
    scales = jax.ShapeDtypeStruct((cfg.rows, hidden // layout.FP8_BLOCK) if cfg.fp8 else (0,),
                                  jnp.float32)
    return x, scales


def _dispatch_call(cfg: _Move, x, topk_idx, topk_weights):
    if cfg.low_latency:
        return _ll_dispatch_recv(cfg, _ll_dispatch_send(cfg, BOTH, x, topk_idx, topk_weights))
    (t, hidden), k = x.shape, topk_idx.shape[1]
    i32 = jnp.int32
    shapes = (*_x_rows_shapes(cfg, hidden),
              jax.ShapeDtypeStruct((cfg.rows, k), i32),
              jax.ShapeDtypeStruct((cfg.rows, k), jnp.float32),
              jax.ShapeDtypeStruct((t, cfg.num_ranks), i32),
              jax.ShapeDtypeStruct((cfg.num_ranks,), i32),
              jax.ShapeDtypeStruct((cfg.experts_per_rank,), i32),
              jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((), i32),
              jax.ShapeDtypeStruct((), i32))
    out = varying_like(_custom_call("jax_ep_dispatch", shapes, x, topk_idx, topk_weights,
                                    stream=cfg.stream, **_attrs(cfg)), x, topk_idx, topk_weights)
    x_rows, scales = out[0], out[1] if cfg.fp8 else None
    return RankRows(x_rows, scales, out[2], out[3]), Routing(*out[4:])


def _dispatch_cached_call(cfg: _Move, x, send_pos, num_rows, recv_counts):
    if cfg.low_latency:
        return _ll_cached_recv(cfg, _ll_cached_send(cfg, BOTH, x, send_pos, num_rows, recv_counts))
    x_rows, scales = varying_like(
        _custom_call("jax_ep_dispatch_cached", _x_rows_shapes(cfg, x.shape[1]), x, send_pos,
                     num_rows, stream=cfg.stream, **_attrs(cfg)),
        x, send_pos, num_rows)
    return x_rows, scales if cfg.fp8 else None


def _combine_call(cfg: _Sum, row_data, send_pos, num_rows, recv_counts, bias):
    if cfg.low_latency:
        return _ll_combine_recv(cfg, _ll_combine_send(cfg, BOTH, row_data, send_pos, num_rows,
                                                      recv_counts, bias))
    shape = jax.ShapeDtypeStruct((send_pos.shape[0], row_data.shape[1]), cfg.out_dtype)
    bias = _no_bias() if bias is None else bias
    return varying_like(_custom_call(
        "jax_ep_combine", shape, row_data, send_pos, bias, stream=cfg.stream,
        buffer_id=np.int64(cfg.buffer_id), op_key=_op_key(), has_bias=cfg.bias_dtype is not None),
        row_data, send_pos, bias)


def _no_bias():
    return jnp.zeros((0,), jnp.float32)


# ---------------------------------------------------------------- low-latency calls (CUDA)
# One custom call per op, or split in two (send: returns once the data is on its way, with a
# ticket naming the op on device; recv: waits for the peers, lays the rows out). The same call
# target serves every phase; outputs a phase does not produce are empty.

SEND, RECV, BOTH = 1, 2, 3
_TICKET = jax.ShapeDtypeStruct((1,), jnp.int32)


def _empty(*shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


class _LLSent(NamedTuple):  # what a low-latency send half leaves for its recv half
    inputs: tuple    # the call's operands (the recv half passes them again, with the ticket)
    ticket: Any      # [1] int32 op number, or None when both halves run in one call
    outputs: tuple   # the send half's other outputs (send_pos, num_invalid)


def _ll_dispatch_ffi(cfg: _Move, phase, inputs, ticket, cached):
    (tokens, hidden), k = inputs[0].shape, inputs[1].shape[1]  # x, topk_idx (empty when cached)
    send, recv = phase & SEND, phase & RECV
    rows = cfg.rows if recv else 0
    x_dtype = jnp.float8_e4m3fn if cfg.fp8 else cfg.x_dtype
    fresh_rows = rows if not cached else 0
    shapes = (_TICKET if phase == SEND else _empty(0),
              _empty(tokens if send and not cached else 0, cfg.num_ranks),   # send_pos
              _empty(),                                                      # num_invalid
              _empty(rows, hidden, dtype=x_dtype),
              _empty(rows if cfg.fp8 else 0, hidden // layout.FP8_BLOCK, dtype=jnp.float32),
              _empty(fresh_rows, k), _empty(fresh_rows, k, dtype=jnp.float32),
              _empty(cfg.num_ranks if recv and not cached else 0),          # recv_counts
              _empty(cfg.experts_per_rank if recv and not cached else 0),   # tokens_per_expert
              _empty(), _empty())                                           # num_recv, dropped
    ticket = jnp.zeros((0,), jnp.int32) if ticket is None else ticket
    out = _custom_call(
        "jax_ep_ll_dispatch", shapes, *inputs, ticket, stream=cfg.stream,
        has_side_effect=phase != BOTH, buffer_id=np.int64(cfg.buffer_id), half=np.int32(phase),
        cached=bool(cached), out_rows=np.int32(cfg.rows), fp8=bool(cfg.fp8),
        round_scale=bool(cfg.round_scale))
    return varying_like(out, *inputs)


def _ll_dispatch_send(cfg: _Move, phase, x, topk_idx, topk_weights):
    none = jnp.zeros((0, cfg.num_ranks), jnp.int32), jnp.zeros((0,), jnp.int32)
    inputs = (x, topk_idx, topk_weights, *none)
    out = _ll_dispatch_ffi(cfg, phase, inputs, None, False)
    sent = _LLSent(inputs, out[0] if phase == SEND else None, (out[1], out[2]))
    return sent, out if phase == BOTH else None


def _ll_dispatch_recv(cfg: _Move, sent_and_out):
    sent, out = sent_and_out
    if out is None:
        out = _ll_dispatch_ffi(cfg, RECV, sent.inputs, sent.ticket, False)
    send_pos, num_invalid = sent.outputs
    rows = RankRows(out[3], out[4] if cfg.fp8 else None, out[5], out[6])
    return rows, Routing(send_pos, out[7], out[8], out[9], out[10], num_invalid)


def _ll_cached_send(cfg: _Move, phase, x, send_pos, num_rows, recv_counts):
    no_topk = jnp.zeros((0, 0), jnp.int32), jnp.zeros((0, 0), jnp.float32)
    inputs = (x, *no_topk, send_pos, recv_counts)
    out = _ll_dispatch_ffi(cfg, phase, inputs, None, True)
    return _LLSent(inputs, out[0] if phase == SEND else None, ()), (
        out if phase == BOTH else None)


def _ll_cached_recv(cfg: _Move, sent_and_out):
    sent, out = sent_and_out
    if out is None:
        out = _ll_dispatch_ffi(cfg, RECV, sent.inputs, sent.ticket, True)
    return out[3], out[4] if cfg.fp8 else None


def _ll_combine_ffi(cfg: _Sum, phase, inputs, ticket):
    row_data, send_pos = inputs[0], inputs[1]
    tokens = send_pos.shape[0] if phase & RECV else 0
    shapes = (_empty(tokens, row_data.shape[1], dtype=cfg.out_dtype),
              _TICKET if phase == SEND else _empty(0))
    ticket = jnp.zeros((0,), jnp.int32) if ticket is None else ticket
    out = _custom_call(
        "jax_ep_ll_combine", shapes, *inputs, ticket, stream=cfg.stream,
        has_side_effect=phase != BOTH, buffer_id=np.int64(cfg.buffer_id), half=np.int32(phase),
        has_bias=cfg.bias_dtype is not None)
    return varying_like(out, *inputs)


def _ll_combine_send(cfg: _Sum, phase, row_data, send_pos, num_rows, recv_counts, bias):
    inputs = (row_data, send_pos, recv_counts, num_rows, _no_bias() if bias is None else bias)
    out = _ll_combine_ffi(cfg, phase, inputs, None)
    return _LLSent(inputs, out[1] if phase == SEND else None, ()), (
        out[0] if phase == BOTH else None)


def _ll_combine_recv(cfg: _Sum, sent_and_out):
    sent, out = sent_and_out
    return _ll_combine_ffi(cfg, RECV, sent.inputs, sent.ticket)[0] if out is None else out


# ---------------------------------------------------------------- differentiation

def _back_to_tokens(cfg: _Move, ct_rows, send_pos, num_rows, recv_counts, dtype):
    """The adjoint of moving rows: every token gets the sum of its rows' cotangents."""
    cfg_sum = _Sum(cfg.buffer_id, cfg.num_ranks, dtype, dtype, None, cfg.low_latency, cfg.stream)
    return _combine(cfg_sum, ct_rows.astype(dtype), send_pos, num_rows, recv_counts, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(cfg, x, topk_idx, topk_weights):
    return _dispatch_call(cfg, x, topk_idx, topk_weights)


# The forward rules call the differentiable ops themselves, so that a gradient's own forward
# pass can be differentiated again (second order).
def _dispatch_fwd(cfg, *args):
    rows, routing = _dispatch(cfg, *custom_vjp_primal_tree_values(args))
    return (rows, routing), (routing.send_pos, routing.num_recv, routing.recv_counts,
                             rows.topk_idx)


def _dispatch_bwd(cfg, res, ct):
    """A cotangent JAX knows to be zero costs no combine: that of an FP8 dispatch's rows when
    they are only used through Buffer.dequantize, that of the weights when nothing uses them."""
    send_pos, num_rows, recv_counts, topk_rows = res
    ct_rows = ct[0]
    grad_x = grad_w = None
    if not isinstance(ct_rows.x, SymbolicZero):
        grad_x = _back_to_tokens(cfg, ct_rows.x, send_pos, num_rows, recv_counts, cfg.x_dtype)
    if not isinstance(ct_rows.topk_weights, SymbolicZero):
        # Each (token, slot) weight lives in exactly one rank's row; elsewhere the slot is -1.
        ct_w = jnp.where(topk_rows >= 0, ct_rows.topk_weights, 0.0)
        k = ct_w.shape[1]
        padded = jnp.pad(ct_w, ((0, 0), (0, layout.align_up(k, 4) - k)))  # 16-byte rows
        grad_w = _back_to_tokens(cfg, padded, send_pos, num_rows, recv_counts, "float32")[:, :k]
    return grad_x, None, grad_w


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_cached(cfg, x, send_pos, num_rows, recv_counts):
    return _dispatch_cached_call(cfg, x, send_pos, num_rows, recv_counts)


def _dispatch_cached_fwd(cfg, x, send_pos, num_rows, recv_counts):
    return (_dispatch_cached(cfg, x, send_pos, num_rows, recv_counts),
            (send_pos, num_rows, recv_counts))


def _dispatch_cached_bwd(cfg, res, ct):
    send_pos, num_rows, recv_counts = res
    grad_x = _back_to_tokens(cfg, ct[0], send_pos, num_rows, recv_counts, cfg.x_dtype)
    return grad_x, None, None, None


_dispatch_cached.defvjp(_dispatch_cached_fwd, _dispatch_cached_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(cfg, row_data, send_pos, num_rows, recv_counts, bias):
    return _combine_call(cfg, row_data, send_pos, num_rows, recv_counts, bias)


def _combine_fwd(cfg, row_data, send_pos, num_rows, recv_counts, bias):
    return (_combine(cfg, row_data, send_pos, num_rows, recv_counts, bias),
            (send_pos, num_rows, recv_counts, row_data.shape[0]))


def _combine_bwd(cfg, res, ct):
    send_pos, num_rows, recv_counts, rows = res
    move = _Move(cfg.buffer_id, cfg.num_ranks, 0, rows, False, False, cfg.out_dtype,
                 cfg.low_latency, cfg.stream)
    ct_rows, _ = _dispatch_cached(move, ct, send_pos, num_rows, recv_counts)
    ct_bias = None if cfg.bias_dtype is None else ct.astype(cfg.bias_dtype)
    return ct_rows.astype(cfg.rows_dtype), None, None, None, ct_bias


_combine.defvjp(_combine_fwd, _combine_bwd)


class Ffi(Unsplit):
    """Custom-call implementations of the primitives (see primitives.py). The low-latency
    kernels split for real; the others do the whole op in the send half."""

    def __init__(self, buffer_id, num_ranks, num_experts):
        self.buffer_id = buffer_id
        self.num_ranks = num_ranks
        self.experts_per_rank = num_experts // num_ranks

    def _move(self, x, rows, fp8, round_scale, low_latency):
        return _Move(self.buffer_id, self.num_ranks, self.experts_per_rank, rows, bool(fp8),
                     bool(round_scale), x.dtype.name, bool(low_latency), streams.current())

    def _sum(self, row_data, bias, out_dtype, low_latency):
        return _Sum(self.buffer_id, self.num_ranks, row_data.dtype.name,
                    jnp.dtype(out_dtype).name, None if bias is None else bias.dtype.name,
                    bool(low_latency), streams.current())

    def dispatch(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False):
        return _dispatch(self._move(x, rows, fp8, round_scale, low_latency),
                         *all_varying(x, topk_idx, topk_weights))

    def dispatch_send(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False):
        if not low_latency:
            return super().dispatch_send(x, topk_idx, topk_weights, rows=rows, fp8=fp8,
                                         round_scale=round_scale, low_latency=False)
        cfg = self._move(x, rows, fp8, round_scale, True)
        return (_ll_dispatch_send(cfg, SEND, x, topk_idx, topk_weights),
                functools.partial(_ll_dispatch_recv, cfg))

    def dispatch_cached(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale,
                        low_latency=False):
        return _dispatch_cached(self._move(x, rows, fp8, round_scale, low_latency),
                                *all_varying(x, send_pos, num_rows, recv_counts))

    def dispatch_cached_send(self, x, send_pos, num_rows, recv_counts, *, rows, fp8,
                             round_scale, low_latency):
        if not low_latency:
            return super().dispatch_cached_send(x, send_pos, num_rows, recv_counts, rows=rows,
                                                fp8=fp8, round_scale=round_scale,
                                                low_latency=False)
        cfg = self._move(x, rows, fp8, round_scale, True)
        return (_ll_cached_send(cfg, SEND, x, send_pos, num_rows, recv_counts),
                functools.partial(_ll_cached_recv, cfg))

    def combine(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype,
                low_latency=False):
        return _combine(self._sum(row_data, bias, out_dtype, low_latency),
                        *all_varying(row_data, send_pos, num_rows, recv_counts, bias))

    def combine_send(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype,
                     low_latency):
        if not low_latency:
            return super().combine_send(row_data, send_pos, num_rows, recv_counts, bias,
                                        out_dtype=out_dtype, low_latency=False)
        cfg = self._sum(row_data, bias, out_dtype, True)
        return (_ll_combine_send(cfg, SEND, row_data, send_pos, num_rows, recv_counts, bias),
                functools.partial(_ll_combine_recv, cfg))

    def expert_layout(self, topk_rows, *, experts_per_rank, alignment, capacity, block_rows=0):
        rows, k = topk_rows.shape
        i32 = jnp.int32
        shapes = (jax.ShapeDtypeStruct((capacity,), i32),
                  jax.ShapeDtypeStruct((rows, layout.max_experts_per_row(k, experts_per_rank)), i32),
                  jax.ShapeDtypeStruct((capacity,), i32),
                  jax.ShapeDtypeStruct((experts_per_rank,), i32),
                  jax.ShapeDtypeStruct((), i32),
                  jax.ShapeDtypeStruct((experts_per_rank,), i32))  # counts before capacity
        topk_rows = jax.lax.stop_gradient(topk_rows)  # integers: nothing to differentiate
        out = varying_like(_custom_call(
            "jax_ep_expert_layout", shapes, topk_rows, stream=streams.current(),
            alignment=np.int32(alignment), block_rows=np.int32(block_rows)),
            topk_rows)
        return layout.ExpertMaps(*out[:5])

"""The custom-call path: the rank-level primitives as jax.ffi calls into the native backends
(kernels/cpu, kernels/cuda), made differentiable with custom_vjp: the backward of dispatch is a
combine, the backward of combine is a cached dispatch."""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native, layout
from jax_ep.primitives import RankRows, Routing



def register_targets():
    """Registers the custom-call targets of every backend this build has."""
    for name, capsule in _native.cpu_targets().items():
        jax.ffi.register_ffi_target(f"jax_ep_{name}", capsule, platform="cpu")
    if _native.has_cuda:
        for name, capsule in _native.cuda_targets().items():
            jax.ffi.register_ffi_target(f"jax_ep_{name}", capsule, platform="CUDA")


class _Move(NamedTuple):  # static configuration of a dispatch
    buffer_id: int
    num_ranks: int
    experts_per_rank: int
    rows: int
    fp8: bool
    round_scale: bool
    x_dtype: str


class _Sum(NamedTuple):  # static configuration of a combine
    buffer_id: int
    num_ranks: int
    rows_dtype: str
    out_dtype: str
    bias_dtype: str | None


def _varying_axes(value):
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older: aval.vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying_like(outputs, *inputs):
    """Custom calls return values JAX sees as the same on every rank; they vary like their inputs
    (shard_map's check_vma needs to know)."""
    axes = frozenset().union(*map(_varying_axes, inputs))

    def vary(out):
        missing = tuple(sorted(axes - _varying_axes(out)))
        return jax.lax.pcast(out, missing, to="varying") if missing else out

    return jax.tree.map(vary, outputs)


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
    out = _varying_like(jax.ffi.ffi_call("jax_ep_dispatch", shapes, has_side_effect=True)(
        x, topk_idx, topk_weights, **_attrs(cfg)), x, topk_idx, topk_weights)
    x_rows, scales = out[0], out[1] if cfg.fp8 else None
    return RankRows(x_rows, scales, out[2], out[3]), Routing(*out[4:])


def _dispatch_cached_call(cfg: _Move, x, send_pos, num_rows):
    x_rows, scales = _varying_like(
        jax.ffi.ffi_call("jax_ep_dispatch_cached", _x_rows_shapes(cfg, x.shape[1]),
                         has_side_effect=True)(x, send_pos, num_rows, **_attrs(cfg)),
        x, send_pos, num_rows)
    return x_rows, scales if cfg.fp8 else None


def _combine_call(cfg: _Sum, row_data, send_pos, bias):
    shape = jax.ShapeDtypeStruct((send_pos.shape[0], row_data.shape[1]), cfg.out_dtype)
    no_bias = jnp.zeros((0,), jnp.float32)
    bias = no_bias if bias is None else bias
    return _varying_like(jax.ffi.ffi_call("jax_ep_combine", shape, has_side_effect=True)(
        row_data, send_pos, bias, buffer_id=np.int64(cfg.buffer_id), op_key=_op_key(),
        has_bias=cfg.bias_dtype is not None), row_data, send_pos, bias)


# ---------------------------------------------------------------- differentiation

def _back_to_tokens(cfg: _Move, ct_rows, send_pos, num_rows, dtype):
    """The adjoint of moving rows: every token gets the sum of its rows' cotangents."""
    cfg_sum = _Sum(cfg.buffer_id, cfg.num_ranks, dtype, dtype, None)
    return _combine(cfg_sum, ct_rows.astype(dtype), send_pos, num_rows, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(cfg, x, topk_idx, topk_weights):
    return _dispatch_call(cfg, x, topk_idx, topk_weights)


def _dispatch_fwd(cfg, x, topk_idx, topk_weights):
    rows, routing = _dispatch_call(cfg, x, topk_idx, topk_weights)
    return (rows, routing), (routing.send_pos, routing.num_recv, rows.topk_idx)


def _dispatch_bwd(cfg, res, ct):
    send_pos, num_rows, topk_rows = res
    ct_rows = ct[0]
    grad_x = _back_to_tokens(cfg, ct_rows.x, send_pos, num_rows, cfg.x_dtype)
    # Each (token, slot) weight lives in exactly one rank's row; elsewhere the slot is -1.
    ct_w = jnp.where(topk_rows >= 0, ct_rows.topk_weights, 0.0)
    k = ct_w.shape[1]
    padded = jnp.pad(ct_w, ((0, 0), (0, layout.align_up(k, 4) - k)))  # 16-byte rows
    grad_w = _back_to_tokens(cfg, padded, send_pos, num_rows, "float32")[:, :k]
    return grad_x, None, grad_w


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_cached(cfg, x, send_pos, num_rows):
    return _dispatch_cached_call(cfg, x, send_pos, num_rows)


def _dispatch_cached_fwd(cfg, x, send_pos, num_rows):
    return _dispatch_cached_call(cfg, x, send_pos, num_rows), (send_pos, num_rows)


def _dispatch_cached_bwd(cfg, res, ct):
    send_pos, num_rows = res
    return _back_to_tokens(cfg, ct[0], send_pos, num_rows, cfg.x_dtype), None, None


_dispatch_cached.defvjp(_dispatch_cached_fwd, _dispatch_cached_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(cfg, row_data, send_pos, num_rows, bias):
    return _combine_call(cfg, row_data, send_pos, bias)


def _combine_fwd(cfg, row_data, send_pos, num_rows, bias):
    return _combine_call(cfg, row_data, send_pos, bias), (send_pos, num_rows, row_data.shape[0])


def _combine_bwd(cfg, res, ct):
    send_pos, num_rows, rows = res
    move = _Move(cfg.buffer_id, cfg.num_ranks, 0, rows, False, False, cfg.out_dtype)
    ct_rows, _ = _dispatch_cached(move, ct, send_pos, num_rows)
    ct_bias = None if cfg.bias_dtype is None else ct.astype(cfg.bias_dtype)
    return ct_rows.astype(cfg.rows_dtype), None, None, ct_bias


_combine.defvjp(_combine_fwd, _combine_bwd)


class Ffi:
    """Custom-call implementations of the primitives (see primitives.py)."""

    def __init__(self, buffer_id, num_ranks, num_experts):
        self.buffer_id = buffer_id
        self.num_ranks = num_ranks
        self.experts_per_rank = num_experts // num_ranks

    def _move(self, x, rows, fp8, round_scale):
        return _Move(self.buffer_id, self.num_ranks, self.experts_per_rank, rows, bool(fp8),
                     bool(round_scale), x.dtype.name)

    def dispatch(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale):
        return _dispatch(self._move(x, rows, fp8, round_scale), x, topk_idx, topk_weights)

    def dispatch_cached(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        return _dispatch_cached(self._move(x, rows, fp8, round_scale), x, send_pos, num_rows)

    def combine(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        cfg = _Sum(self.buffer_id, self.num_ranks, row_data.dtype.name, jnp.dtype(out_dtype).name,
                   None if bias is None else bias.dtype.name)
        return _combine(cfg, row_data, send_pos, num_rows, bias)

    def expert_layout(self, topk_rows, *, experts_per_rank, alignment, capacity):
        rows, k = topk_rows.shape
        i32 = jnp.int32
        shapes = (jax.ShapeDtypeStruct((capacity,), i32),
                  jax.ShapeDtypeStruct((rows, layout.max_experts_per_row(k, experts_per_rank)), i32),
                  jax.ShapeDtypeStruct((capacity,), i32),
                  jax.ShapeDtypeStruct((experts_per_rank,), i32),
                  jax.ShapeDtypeStruct((), i32),
                  jax.ShapeDtypeStruct((experts_per_rank,), i32))  # counts before capacity
        topk_rows = jax.lax.stop_gradient(topk_rows)  # integers: nothing to differentiate
        out = _varying_like(jax.ffi.ffi_call("jax_ep_expert_layout", shapes)(
            topk_rows, alignment=np.int32(alignment)), topk_rows)
        return layout.ExpertMaps(*out[:5])

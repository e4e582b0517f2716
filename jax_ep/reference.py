"""The reference path: rank-level dispatch and combine with jax.lax.all_to_all (capacity-padded,
one [R, T] block per peer). It is the readable statement of the row order, the capacity drops
and the combine order. JAX differentiates it natively, except that x's rows go back as docs/API.md
says, by a combine (float32 sums, rounded once)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep import layout
from jax_ep.fp8 import quantize_fp8
from jax_ep.rank_ops import RankRows, Routing, Unsplit, all_varying


def _kept_slot(send_pos):
    """[T, R]: the token's index among those this rank delivers to d, -1 if none."""
    kept = send_pos >= 0
    return jnp.where(kept, layout.exclusive_cumsum(kept, axis=0), -1)


def _pack(values, slot, fill):
    """[T, ...] -> [T, ...] with the token of slot j in row j (rows past the last slot: fill)."""
    t = values.shape[0]
    out = jnp.full(values.shape, fill, values.dtype)
    return out.at[jnp.where(slot >= 0, slot, t)].set(values, mode="drop")


def _send(axis, per_rank_values, send_pos, fill):
    """all_to_all of one [T, ...] block per destination; returns [R (source), T, ...]."""
    slot = _kept_slot(send_pos)
    blocks = [_pack(per_rank_values(d), slot[:, d], fill) for d in range(send_pos.shape[1])]
    return jax.lax.all_to_all(jnp.stack(blocks), axis, 0, 0)


def _place(received, recv_counts, rows, fill):
    """[R, T, ...] blocks from each source -> [rows, ...] in (source rank, token) order."""
    num_ranks, t = received.shape[:2]
    pos = layout.exclusive_cumsum(recv_counts)[:, None] + jnp.arange(t)
    ok = (jnp.arange(t) < recv_counts[:, None]) & (pos < rows)
    target = jnp.where(ok, pos, rows).reshape(-1)
    out = jnp.full((rows,) + received.shape[2:], fill, received.dtype)
    return out.at[target].set(received.reshape((num_ranks * t,) + received.shape[2:]), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _move_rows(ref, x, send_pos, recv_counts, rows):
    """x's row for every (token, destination rank) in send_pos, placed at each destination."""
    return _place(_send(ref.axis, lambda d: x, send_pos, 0), recv_counts, rows, 0)


def _move_rows_fwd(ref, x, send_pos, recv_counts, rows):
    return _move_rows(ref, x, send_pos, recv_counts, rows), (send_pos, recv_counts)


def _move_rows_bwd(ref, rows, res, ct):
    send_pos, recv_counts = res
    return ref.combine(ct, send_pos, None, recv_counts, None, out_dtype=ct.dtype), None, None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


class Reference(Unsplit):
    """jax.lax implementations of the rank-level operations (see rank_ops.py); one set of
    kernels, so low_latency changes nothing."""

    def __init__(self, axis_name, num_ranks, num_experts):
        self.axis = axis_name
        self.num_ranks = num_ranks
        self.num_experts = num_experts

    def dispatch(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False):
        num_ranks, axis = self.num_ranks, self.axis
        goes = layout.dest_ranks(topk_idx, num_ranks, self.num_experts)  # [T, R]
        counts = jax.lax.all_gather(goes.sum(axis=0, dtype=jnp.int32), axis)  # [src, dst]
        me = jax.lax.axis_index(axis)
        first_row = layout.exclusive_cumsum(counts, axis=0)[me]  # [R] at each dst
        pos = first_row[None, :] + layout.exclusive_cumsum(goes, axis=0)
        send_pos = jnp.where(goes & (pos < rows), pos, -1).astype(jnp.int32)
        recv_counts = counts[:, me]
        x_rows, scales = self._move_x(x, send_pos, recv_counts, rows, fp8, round_scale)

        local = [
            layout.local_topk(topk_idx, topk_weights, d, num_ranks, self.num_experts)
            for d in range(num_ranks)
        ]
        topk_rows = _place(_send(axis, lambda d: local[d][0], send_pos, -1), recv_counts, rows, -1)
        weight_rows = _place(
            _send(axis, lambda d: local[d][1], send_pos, 0.0), recv_counts, rows, 0.0
        )
        num_invalid = layout.num_invalid(topk_idx, self.num_experts)
        received = recv_counts.sum(dtype=jnp.int32)  # int32 under jax_enable_x64 too
        num_recv = jnp.minimum(received, rows)
        routing = Routing(
            send_pos=send_pos,
            recv_counts=recv_counts,
            tokens_per_expert=layout.tokens_per_expert(topk_rows, self.num_experts // num_ranks),
            num_recv=num_recv,
            num_dropped=received - num_recv,
            num_invalid=num_invalid,
            group_invalid=jax.lax.psum(num_invalid, axis),
        )
        return RankRows(x_rows, scales, topk_rows, weight_rows), routing

    def dispatch_cached(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        return self._move_x(x, send_pos, recv_counts, rows, fp8, round_scale)

    def _move_x(self, x, send_pos, recv_counts, rows, fp8, round_scale):
        if fp8:
            q, scales = quantize_fp8(x, round_scale)
            # Through _move_rows, so that the float8 rows' own cotangent (dequantize_fp8 of d.x)
            # is summed in float32 and rounded once, as the custom calls' combine does (JAX's
            # own transpose would add float8 values, rounding at each add).
            return (
                _move_rows(self, *all_varying(q, send_pos, recv_counts), rows),
                _place(_send(self.axis, lambda d: scales, send_pos, 0.0), recv_counts, rows, 0.0),
            )
        return _move_rows(self, *all_varying(x, send_pos, recv_counts), rows), None

    def combine(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        rows, t = row_data.shape[0], send_pos.shape[0]
        # Back to each source: the rows it sent here, in its slot order.
        pos = layout.exclusive_cumsum(recv_counts)[:, None] + jnp.arange(t)
        ok = (jnp.arange(t) < recv_counts[:, None]) & (pos < rows)
        back = jnp.where(ok[..., None], row_data[jnp.where(ok, pos, 0)], 0)
        got = jax.lax.all_to_all(back, self.axis, 0, 0)  # [dst, T, W]
        slot = _kept_slot(send_pos)
        acc = (
            jnp.zeros((t, row_data.shape[1]), jnp.float32)
            if bias is None
            else bias.astype(jnp.float32)
        )
        for d in range(self.num_ranks):  # fixed order: rank 0 first
            sent = slot[:, d] >= 0
            value = got[d][jnp.maximum(slot[:, d], 0)].astype(jnp.float32)
            acc = jnp.where(sent[:, None], acc + value, acc)
        return acc.astype(out_dtype)

    def expert_layout(self, topk_rows, *, experts_per_rank, alignment, capacity):
        return layout.expert_layout(topk_rows, experts_per_rank, alignment, capacity)

    def expert_padded(self, topk_rows, weight_rows, rows, *, experts_per_rank, capacity):
        return layout.expert_padded(topk_rows, weight_rows, rows, experts_per_rank, capacity)

    def place_rows(self, rank_rows, expert_rows, capacity):
        return layout.place_rows(rank_rows, expert_rows, capacity)

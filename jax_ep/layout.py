"""The layout rules of docs/API.md (routing, row order, the expert layouts) in plain JAX: the
single statement every backend follows (the FP8 rule is jax_ep/fp8.py).

The CUDA and CPU kernels implement the same rules in kernels/; the tests compare them bitwise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.rank_ops import varying_like

# Rows of one op's arrays on a rank (what it receives, R * N; a layout's rows): indexed by
# int32 here and in the kernels (kernels/limits.h kMaxRankRows, the same number).
MAX_RANK_ROWS = int(np.iinfo(np.int32).max)


def travel_dtype(dtype, max_row_dtype):
    """The dtype rows of `dtype` cross ranks in on a Buffer of max_row_dtype rows: their own, or
    the Buffer's where that is narrower (a dispatch's cotangents, float32 x sent in FP8 on a
    bf16-row Buffer)."""
    dtype, widest = jnp.dtype(dtype), jnp.dtype(max_row_dtype)
    return dtype if dtype.itemsize <= widest.itemsize else widest


def failed_dispatch(topk_rows, weight_rows):
    """[] bool: whether a fresh dispatch failed, from its rank-level rows. A failed op leaves -1
    ids with NaN weights; one that ran gives a -1 slot the weight 0."""
    if topk_rows.size == 0:
        return jnp.zeros((), bool)
    return (topk_rows[0, 0] < 0) & jnp.isnan(weight_rows[0, 0])


def x_from_rows(combine, ct_rows, x_dtype, max_row_dtype):
    """x's gradient from its rows' cotangents by combine(rows, out_dtype): the rows travel in
    x's dtype or the Buffer's where that is narrower, are summed in float32 and rounded once to
    the rows' dtype (float8 rows' own cotangent, dequantize_fp8 of d.x, rounds to float8), then
    cast to x's. The rule of every backend's dispatch backward."""
    travel = ct_rows.astype(travel_dtype(x_dtype, max_row_dtype))
    rounded = ct_rows.dtype if travel.dtype == ct_rows.dtype else jnp.dtype(jnp.float32)
    return combine(travel, rounded).astype(ct_rows.dtype).astype(x_dtype)


def align_up(value, alignment):
    return (value + alignment - 1) // alignment * alignment


def exclusive_cumsum(values, axis=0):
    return jnp.cumsum(values, axis=axis, dtype=jnp.int32) - values.astype(jnp.int32)


def max_experts_per_row(num_topk, experts_per_rank):
    return min(num_topk, experts_per_rank)


# ---------------------------------------------------------------- routing (sender side)


def routed(topk_idx, num_experts):
    return (topk_idx >= 0) & (topk_idx < num_experts)


def num_invalid(topk_idx, num_experts):
    """Expert ids outside [-1, E): excluded from routing and reported."""
    return ((topk_idx < -1) | (topk_idx >= num_experts)).sum(dtype=jnp.int32)


def dest_ranks(topk_idx, num_ranks, num_experts):
    """[T, R] bool: the token goes to rank d (once, however many of its experts live there)."""
    experts_per_rank = num_experts // num_ranks
    owner = jnp.where(routed(topk_idx, num_experts), topk_idx // experts_per_rank, -1)
    return (owner[:, :, None] == jnp.arange(num_ranks)).any(axis=1)


def local_topk(topk_idx, topk_weights, rank, num_ranks, num_experts):
    """The token's slots as rank `rank` sees them: local expert id or -1, weight or 0."""
    experts_per_rank = num_experts // num_ranks
    mine = routed(topk_idx, num_experts) & (topk_idx // experts_per_rank == rank)
    return (
        jnp.where(mine, topk_idx - rank * experts_per_rank, -1),
        jnp.where(mine, topk_weights, 0.0).astype(jnp.float32),
    )


def tokens_per_expert(topk_rows, experts_per_rank):
    """Distinct (row, local expert) pairs among rank-layout rows."""
    return has_expert(topk_rows, experts_per_rank).sum(axis=0, dtype=jnp.int32)


def has_expert(topk_rows, experts_per_rank):
    """[rows, E_l] bool: the row holds local expert e (duplicated slots count once)."""
    return (topk_rows[:, :, None] == jnp.arange(experts_per_rank)).any(axis=1)


# ---------------------------------------------------------------- expert layout (receiver side)


class ExpertMaps(NamedTuple):
    expert_src: jax.Array  # [C] rank-level row of each expert row, -1 on padding
    expert_rows: jax.Array  # [S, M] expert rows of each rank-level row, by expert, -1
    expert_of_row: jax.Array  # [C] local expert of each expert row, -1 on padding
    tokens_per_expert: jax.Array  # [E_l] rows present per expert
    num_dropped: jax.Array  # [] (row, expert) items beyond the capacity


def expert_layout(topk_rows, experts_per_rank, alignment, capacity, block_rows=0):
    """Expert layout of rank-level rows: by local expert, then rank-level row order.

    Packed (block_rows == 0): each expert's block starts at a multiple of `alignment` right after
    the previous one; items at or past `capacity` drop. Padded (block_rows > 0, the
    expert_padded layout): expert e's block is rows [e * block_rows, (e + 1) * block_rows);
    items past its end drop.
    """
    rows, num_topk = topk_rows.shape
    per_row = max_experts_per_row(num_topk, experts_per_rank)
    has = has_expert(topk_rows, experts_per_rank)  # [S, E_l]
    count = has.sum(axis=0, dtype=jnp.int32)
    within = exclusive_cumsum(has, axis=0)  # [S, E_l]
    if block_rows:
        start = jnp.arange(experts_per_rank, dtype=jnp.int32) * block_rows
        kept = has & (within < block_rows)
    else:
        start = exclusive_cumsum(align_up(count, alignment))
        kept = has & (start[None, :] + within < capacity)
    pos = start[None, :] + within
    target = jnp.where(kept, pos, capacity)  # capacity = dropped
    row_id = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], has.shape)
    expert_id = jnp.broadcast_to(jnp.arange(experts_per_rank, dtype=jnp.int32), has.shape)
    column = jnp.where(kept, exclusive_cumsum(has, axis=1), per_row)  # m-th expert of the row
    return ExpertMaps(
        expert_src=jnp.full(capacity, -1, jnp.int32).at[target].set(row_id, mode="drop"),
        expert_rows=jnp.full((rows, per_row), -1, jnp.int32)
        .at[row_id, column]
        .set(pos.astype(jnp.int32), mode="drop"),
        expert_of_row=jnp.full(capacity, -1, jnp.int32).at[target].set(expert_id, mode="drop"),
        tokens_per_expert=kept.sum(axis=0, dtype=jnp.int32),
        num_dropped=(has & ~kept).sum(dtype=jnp.int32),
    )


def expert_padded(topk_rows, weight_rows, rows, experts_per_rank, capacity):
    """A fresh dispatch's rank-level rows in the expert_padded layout, as one backend call does
    it: the maps (expert_layout with a block of `capacity` rows per expert), each expert row's
    weight [E_l * C], and each array of `rows` ([S, ...], or None) placed ([E_l * C, ...])."""
    out_rows = experts_per_rank * capacity
    maps = expert_layout(topk_rows, experts_per_rank, 1, out_rows, block_rows=capacity)
    weights = expert_weights(weight_rows, topk_rows, maps.expert_src, maps.expert_of_row)
    placed = tuple(None if r is None else place_rows(r, maps.expert_rows, out_rows) for r in rows)
    return maps, weights, placed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def padded_rows(make, experts_per_rank, capacity, topk_rows, weight_rows, rows):
    """A backend's expert_padded(topk_rows, weight_rows, rows, experts_per_rank=, capacity=),
    differentiable: each placed row's gradient goes back to its rank-level row (the sum over its
    expert rows), each weight's to the slots that named its expert."""
    return make(topk_rows, weight_rows, rows, experts_per_rank=experts_per_rank, capacity=capacity)


def _padded_rows_fwd(make, experts_per_rank, capacity, *args):
    topk_rows, weight_rows, rows = jax.custom_derivatives.custom_vjp_primal_tree_values(args)
    # Through padded_rows itself, so that a gradient of this gradient differentiates it too.
    maps, weights, placed = padded_rows(
        make, experts_per_rank, capacity, topk_rows, weight_rows, rows
    )
    res = (topk_rows, weight_rows, maps.expert_src, maps.expert_rows, maps.expert_of_row)
    return (maps, weights, placed), res


def _padded_rows_bwd(make, experts_per_rank, capacity, res, ct):
    topk_rows, weight_rows, expert_src, expert_rows, expert_of_row = res
    _, ct_weights, ct_placed = ct
    zero = jax.custom_derivatives.SymbolicZero
    ct_weight_rows = None
    if not isinstance(ct_weights, zero):
        (ct_weight_rows,) = jax.linear_transpose(
            lambda w: expert_weights(w, topk_rows, expert_src, expert_of_row), weight_rows
        )(ct_weights)
    ct_rows = tuple(
        None
        if c is None or isinstance(c, zero)
        else reduce_expert_rows(c, None, expert_src, expert_rows).astype(c.dtype)
        for c in ct_placed
    )
    return None, ct_weight_rows, ct_rows


padded_rows.defvjp(_padded_rows_fwd, _padded_rows_bwd, symbolic_zeros=True)


def expert_weights(weight_rows, topk_rows, expert_src, expert_of_row):
    """[C]: weight of each expert row, the sum over the slots of its token naming that expert,
    added in slot order (as the kernels add them; XLA's own sum picks its order by shape)."""
    match = (take(topk_rows, expert_src) == expert_of_row[:, None]) & (expert_src >= 0)[:, None]
    named = jnp.where(match, take(weight_rows, expert_src), 0.0)
    weight = jnp.zeros(named.shape[0], named.dtype)
    for k in range(named.shape[1]):
        weight = weight + named[:, k]
    return weight


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_rows(make, rank_rows, expert_src, expert_rows):
    """make(rank_rows, expert_src, expert_rows): [S, W] rank-level rows -> [C, W] expert rows,
    differentiable: a row's gradient sums the cotangents of its expert rows (those rows only)."""
    return make(rank_rows, expert_src, expert_rows)


def _expert_rows_fwd(make, *args):
    rank_rows, expert_src, expert_rows = jax.custom_derivatives.custom_vjp_primal_tree_values(args)
    # Through _expert_rows itself, so that a gradient of this gradient differentiates it too.
    return _expert_rows(make, rank_rows, expert_src, expert_rows), (expert_src, expert_rows)


def _expert_rows_bwd(make, res, ct):
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):  # stays a zero JAX sees
        return None, None, None
    return reduce_expert_rows(ct, None, *res).astype(ct.dtype), None, None


_expert_rows.defvjp(_expert_rows_fwd, _expert_rows_bwd, symbolic_zeros=True)


def expand_rows(rank_rows, expert_src, expert_rows):
    """[S, W] rank-level rows -> [C, W] expert rows (zeros on padding)."""
    return _expert_rows(_gather, rank_rows, expert_src, expert_rows)


def placed_rows(place, rank_rows, expert_src, expert_rows):
    """The same rows by a backend's place_rows(rank_rows, expert_rows, C) (the expert_padded
    layout: only the rows expert_rows names are written)."""
    return _expert_rows(_Placed(place), rank_rows, expert_src, expert_rows)


def _gather(rank_rows, expert_src, expert_rows):
    return take_rows(rank_rows, expert_src)


class _Placed(NamedTuple):
    """place_rows with _expert_rows' arguments (a NamedTuple: equal for an equal place)."""

    place: object

    def __call__(self, rank_rows, expert_src, expert_rows):
        return self.place(rank_rows, expert_rows, expert_src.shape[0])


def take(rows, index, fill=0):
    """rows[index], `fill` where index is -1 (and everywhere when there are no rows)."""
    if rows.shape[0] == 0:
        return varying_like(jnp.full(index.shape + rows.shape[1:], fill, rows.dtype), rows, index)
    picked = rows[jnp.maximum(index, 0)]
    keep = (index >= 0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(keep, picked, jnp.asarray(fill, rows.dtype))


def take_rows(rows, index):
    """take(rows, index) of [S, W] rows, moved as 4-byte words where a row of a narrower type
    (bf16, FP8) is whole words: XLA's GPU gather pays per element (the expert layout's 470 MB of
    bf16 rows: 300 us, as words 225 us; one H200, 2026-12-04)."""
    size = jnp.dtype(rows.dtype).itemsize
    if rows.ndim != 2 or size >= 4 or (rows.shape[1] * size) % 4:
        return take(rows, index)
    per_word = 4 // size
    words = rows.reshape(rows.shape[0], rows.shape[1] // per_word, per_word)
    words = jax.lax.bitcast_convert_type(words, jnp.uint32)
    picked = jax.lax.bitcast_convert_type(take(words, index), rows.dtype)
    return picked.reshape(index.shape[0], rows.shape[1])


def place_rows(rank_rows, expert_rows, capacity):
    """[S, W] rank-level rows -> [C, W] expert rows of the expert_padded layout: only the rows
    that expert_rows names hold data, the others are unspecified (this statement writes zeros
    there; the ffi path leaves them as it found them, so that a padded tensor of E_l * C rows
    costs only the rows received)."""
    out = jnp.zeros((capacity,) + rank_rows.shape[1:], rank_rows.dtype)
    source = jnp.broadcast_to(jnp.arange(expert_rows.shape[0])[:, None], expert_rows.shape)
    target = jnp.where(expert_rows >= 0, expert_rows, capacity)  # capacity = nowhere
    return varying_like(out.at[target].set(rank_rows[source], mode="drop"), rank_rows, expert_rows)


@jax.custom_vjp
def reduce_expert_rows(expert_out, weights, expert_src, expert_rows):
    """[C, W] expert rows -> [S, W] float32: each rank-level row's expert rows, weighted
    (weights [C] or None = 1) and summed in expert order. The adjoint of expand_rows.
    expert_src is only used by the gradient."""
    acc = jnp.zeros((expert_rows.shape[0], expert_out.shape[1]), jnp.float32)
    # On CPUs each product is rounded before its sum (a barrier): XLA:CPU (jax 0.12.1) may fuse
    # the two into one multiply-add, rounding once, in one program and not in another, and the
    # paths agree bit for bit there. GPUs compare within a tolerance; the barrier would cost a
    # pass over the rows per slot.
    rounded = jax.default_backend() == "cpu"
    for m in range(expert_rows.shape[1]):
        index = expert_rows[:, m]
        value = take(expert_out, index).astype(jnp.float32)
        if weights is not None:
            value = value * take(weights, index)[:, None]
            value = jax.lax.optimization_barrier(value) if rounded else value
        acc = jnp.where((index >= 0)[:, None], acc + value, acc)
    return acc


def _reduce_fwd(expert_out, weights, expert_src, expert_rows):
    return (
        reduce_expert_rows(expert_out, weights, expert_src, expert_rows),
        (expert_out, weights, expert_src),
    )


def _reduce_bwd(res, ct):
    """The padding rows of expert_out and their weights are unspecified (NaN, inf, anything):
    every product here is of valid rows only, selected (never multiplied by a mask: 0 * NaN is
    NaN), and so is each factor, so that neither these cotangents nor their own (a gradient of
    this gradient) read a padding row."""
    expert_out, weights, expert_src = res
    valid = expert_src >= 0
    ct_rows = take(ct, expert_src)  # [C, W] float32, 0 on padding
    ct_out, ct_weights = ct_rows, None
    if weights is not None:
        w = jnp.where(valid, weights, 0)
        out = jnp.where(valid[:, None], expert_out.astype(jnp.float32), 0)
        ct_out = jnp.where(valid[:, None], ct_rows * w[:, None], 0)
        ct_weights = jnp.where(valid, (ct_rows * out).sum(axis=1), 0).astype(weights.dtype)
    return ct_out.astype(expert_out.dtype), ct_weights, None, None


reduce_expert_rows.defvjp(_reduce_fwd, _reduce_bwd)

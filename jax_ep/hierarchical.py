"""The rank-level operations (rank_ops.py) of a Buffer over a tuple of mesh axes, outer first,
e.g. ("node", "ep"): M nodes of L ranks, R = M * L, rank = node * L + local.

Built from two legs, each the existing machinery of one kind:
- the node leg crosses the outer axes with XLA's `lax.all_to_all` (NCCL between GPU nodes, gloo
  between CPU processes): each rank sends each token to every node that holds one of its experts,
  once, to the rank of the same local index, with its top-k restricted to that node; one block of
  T rows per node (all_to_all needs equal blocks; XLA:CPU has no ragged_all_to_all);
- the fast leg is an `inner` backend (ffi_path.Ffi over the last axis, or reference.Reference)
  with E / M experts and M * T tokens per rank: the tokens the node leg brought, in (source node,
  token) order, forwarded to the local ranks that hold their experts.

The fast leg delivers rows by (local source, source node, token); they are put in the contract's
order, (source rank, token), by one gather (`inner_row`), and capacity applies there, so the
rows, drops and counts are those of a flat Buffer of R ranks, bit for bit. Combine is the
mirror: the fast leg sums each token's rows per node (float32, local rank 0 first), the node leg
brings one float32 partial per node back, and the partials are added onto the bias in node order
(node 0 first) in float32 and rounded once.

FP8 crosses both legs as FP8: the sender quantizes, and the e4m3 bytes with their scales travel
as opaque 32-bit words (the fast leg moves them as float32 rows of width 33 H / 128, bit for
bit), unpacked after the gather.

Every op first checks that every node runs it (jax_ep/node_check.py): where nodes differ, no rank
runs its node-leg collectives, its results are NaN and the Buffer stops, naming both ops.

dispatch, dispatch_cached and combine are custom_vjp functions whose backward passes are each
other (as in ffi_path): x's gradient is one hierarchical combine (float32 sums, node order,
rounded once), the weights' another.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_ep import layout, node_check
from jax_ep.fp8 import FP8_BLOCK, quantize_fp8
from jax_ep.rank_ops import RankRows, Routing, all_varying, start

Array = Any
_F32 = jnp.dtype(jnp.float32)


class NodeRoutes(NamedTuple):
    """A hierarchical dispatch's routes (the Handle's send_pos on a tuple axis)."""

    node_goes: Array  # [T, M] bool: token t went to node m
    send_pos: Array  # [M * T, L]: the fast leg's routes of the tokens the node leg brought here
    recv_counts: Array  # [L]: the fast leg's rows from each local source
    num_rows: Array  # []: the fast leg's rows here
    inner_row: Array  # [rows] int32: the fast-leg row of each rank-level row here, -1 if none


def _pack_fp8(x, round_scale):
    """[T, H] -> [T, 33 H / 128] uint32: the e4m3 bytes, then the float32 scales' bytes."""
    q, scales = quantize_fp8(jax.lax.stop_gradient(x), round_scale)
    t, h = x.shape  # sizes spelled out: t may be 0
    as_bytes = jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(q, jnp.uint8),
            jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(t, h // FP8_BLOCK * 4),
        ],
        axis=1,
    )
    return jax.lax.bitcast_convert_type(as_bytes.reshape(t, as_bytes.shape[1] // 4, 4), jnp.uint32)


def _unpack_fp8(words, hidden):
    """The inverse of _pack_fp8: (e4m3 [rows, H], float32 scales [rows, H / 128])."""
    rows = words.shape[0]
    as_bytes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(rows, words.shape[1] * 4)
    q = jax.lax.bitcast_convert_type(as_bytes[:, :hidden], jnp.float8_e4m3fn)
    scales = as_bytes[:, hidden:].reshape(rows, hidden // FP8_BLOCK, 4)
    return q, jax.lax.bitcast_convert_type(scales, jnp.float32)


def _varying(*trees):
    """The trees' leaves varying like the most varying of them (rank_ops.all_varying)."""
    leaves, tree = jax.tree.flatten(trees)
    return jax.tree.unflatten(tree, all_varying(*leaves))


def _zeros(x):
    return jnp.zeros(x.shape, x.dtype)


class Hierarchical:
    """The rank-level operations over (outer axes..., fast axis), from an `inner` backend over
    the fast axis (see the module's docstring)."""

    def __init__(
        self, inner, outer_axes, num_nodes, fast_axis, ranks_per_node, num_experts, max_row_dtype
    ):
        self.inner = inner
        self.max_row_dtype = jnp.dtype(max_row_dtype)  # the widest rows a cotangent travels in
        self.group_axes = (*outer_axes, fast_axis)  # every axis of the EP group
        self.outer = outer_axes[0] if len(outer_axes) == 1 else tuple(outer_axes)
        self.fast_axis = fast_axis
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.num_experts = num_experts
        self.node_experts = num_experts // num_nodes
        self.experts_per_rank = num_experts // (num_nodes * ranks_per_node)
        self.key = getattr(inner, "key", None)  # the custom calls' Buffer (no check without)

    def _agree(self, kind, dtype, width, tokens, after, **kwargs):
        """Whether every node runs this op: a node_check.Check (jax_ep/node_check.py)."""
        if self.key is None:  # the reference path: no signatures, no status to name them in
            return None
        words = node_check.signature(kind, dtype, width, tokens, self.num_experts, **kwargs)
        return node_check.agree(self.outer, words, after)

    def _across_nodes(self, blocks):
        """[M, T, ...] with block m for node m -> [M, T, ...] with block m from node m."""
        return jax.lax.all_to_all(blocks, self.outer, 0, 0)

    def _payload(self, x, fp8, round_scale):
        """What the node leg carries of x, and what the fast leg moves: x, or FP8 as words."""
        return _pack_fp8(x, round_scale) if fp8 else x

    def _to_nodes(self, payload, check):
        """The node leg of x's payload -> the fast leg's input [M * T, W] (float32 for FP8)."""
        m = self.num_nodes
        arrived = node_check.where_agree(
            check, self._across_nodes, jnp.broadcast_to(payload, (m,) + payload.shape)
        )
        arrived = arrived.reshape((-1,) + payload.shape[1:])
        if arrived.dtype == jnp.uint32:
            return jax.lax.bitcast_convert_type(arrived, jnp.float32)
        return arrived

    def _rows_out(self, fast_rows, inner_row, fp8, hidden):
        """The fast leg's x rows in rank-level order: (x rows, scales or None)."""
        if not fp8:
            return layout.take_rows(fast_rows, inner_row), None
        words = jax.lax.bitcast_convert_type(fast_rows, jnp.uint32)
        return _unpack_fp8(layout.take(words, inner_row), hidden)

    def _row_order(self, counts, rows):
        """counts [L, M]: rows each local source forwarded here of node m's tokens. -> the
        fast-leg row of each of `rows` rank-level rows (-1 past the last) and the rows each
        rank sent here [R], before capacity."""
        by_rank = counts.T.reshape(-1)  # (node, local): the rank-level order
        start = layout.exclusive_cumsum(by_rank)
        fast_start = layout.exclusive_cumsum(counts.reshape(-1)).reshape(counts.shape).T
        row = jnp.arange(rows, dtype=jnp.int32)
        block = jnp.searchsorted(start, row, side="right") - 1
        inner_row = fast_start.reshape(-1)[block] + row - start[block]
        return jnp.where(row < by_rank.sum(), inner_row, -1).astype(jnp.int32), by_rank

    # ------------------------------------------------------------ dispatch

    def _dispatch_start(self, split, x, topk_idx, topk_weights, rows, fp8, round_scale, ll):
        m, el = self.num_nodes, self.experts_per_rank
        t, k = topk_idx.shape
        check = self._agree(
            node_check.DISPATCH, x.dtype, x.shape[1], t, x, columns=k, fp8=fp8,
            round_scale=round_scale,
        )  # fmt: skip
        node_goes = layout.dest_ranks(topk_idx, m, self.num_experts)  # [T, M]
        per_node = [
            layout.local_topk(topk_idx, topk_weights, n, m, self.num_experts) for n in range(m)
        ]
        fast_idx, fast_w = node_check.where_agree(
            check,
            lambda i, w: (self._across_nodes(i), self._across_nodes(w)),
            jnp.stack([p[0] for p in per_node]),
            jnp.stack([p[1] for p in per_node]),
        )
        fast_idx, fast_w = fast_idx.reshape(m * t, k), fast_w.reshape(m * t, k)
        # Rows each local rank gets of each source node's tokens, gathered by the receiver:
        # the rank-level order is by source node first, the fast leg's by local source.
        goes = layout.dest_ranks(fast_idx, self.ranks_per_node, self.node_experts)
        per_local = goes.reshape(m, t, self.ranks_per_node).sum(axis=1, dtype=jnp.int32)  # [M, L]
        counts = jax.lax.all_to_all(per_local.T, self.fast_axis, 0, 0)  # [L source, M]
        inner = self.inner
        fast_rows = self.ranks_per_node * m * t
        arrays, moved = start(
            split,
            inner.dispatch,
            inner.dispatch_send,
            self._to_nodes(self._payload(x, fp8, round_scale), check),
            fast_idx,
            fast_w,
            rows=fast_rows,
            fp8=False,
            round_scale=False,
            low_latency=ll,
        )
        num_invalid = layout.num_invalid(topk_idx, self.num_experts)
        # The fast leg sees the ids cut to a node (invalid ones gone): sum the group's.
        group_invalid = node_check.where_agree(
            check, lambda n: jax.lax.psum(n, self.group_axes), num_invalid, fill=_zeros
        )

        def finish(arrays):
            fast, node_goes, counts, num_invalid, group_invalid, check = arrays
            got, routing = moved(fast)
            inner_row, recv_counts = self._row_order(counts, rows)
            x_rows, scales = self._rows_out(got.x, inner_row, fp8, x.shape[1])
            topk_rows = layout.take(got.topk_idx, inner_row, -1)
            received = recv_counts.sum()
            num_recv = jnp.minimum(received, rows)
            routes = NodeRoutes(
                node_goes, routing.send_pos, routing.recv_counts, routing.num_recv, inner_row
            )
            moved_rows = RankRows(
                x_rows, scales, topk_rows, layout.take(got.topk_weights, inner_row)
            )
            counted = Routing(
                send_pos=routes,
                recv_counts=recv_counts,
                tokens_per_expert=layout.tokens_per_expert(topk_rows, el),
                num_recv=num_recv,
                num_dropped=received - num_recv,
                num_invalid=num_invalid,
                group_invalid=group_invalid,
            )
            counts_of = ("recv_counts", "tokens_per_expert", "num_recv", "num_dropped")
            routing = counted._replace(
                send_pos=routes._replace(node_goes=node_check.mask(check, routes.node_goes)),
                **{
                    name: node_check.mask(check, getattr(counted, name), _zeros)
                    for name in counts_of
                },
            )
            return node_check.finish(self.key, check, (node_check.mask(check, moved_rows), routing))

        return (arrays, node_goes, counts, num_invalid, group_invalid, check), finish

    def dispatch(self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False):
        return _dispatch(
            (self, rows, bool(fp8), bool(round_scale), bool(low_latency), x.dtype),
            *_varying(x, topk_idx, topk_weights),
        )

    def dispatch_send(
        self, x, topk_idx, topk_weights, *, rows, fp8, round_scale, low_latency=False
    ):
        return self._dispatch_start(
            True, *_varying(x, topk_idx, topk_weights), rows, fp8, round_scale, low_latency
        )

    def _cached_start(self, split, x, routes, fp8, round_scale):
        check = self._agree(
            node_check.CACHED, x.dtype, x.shape[1], x.shape[0], x, fp8=fp8, round_scale=round_scale
        )
        inner = self.inner
        arrays, moved = start(
            split,
            inner.dispatch_cached,
            inner.dispatch_cached_send,
            self._to_nodes(self._payload(x, fp8, round_scale), check),
            routes.send_pos,
            routes.num_rows,
            routes.recv_counts,
            rows=routes.send_pos.shape[0] * self.ranks_per_node,
            fp8=False,
            round_scale=False,
        )

        def finish(arrays):
            fast, inner_row, check = arrays
            rows = self._rows_out(moved(fast)[0], inner_row, fp8, x.shape[1])
            return node_check.finish(self.key, check, node_check.mask(check, rows))

        return (arrays, routes.inner_row, check), finish

    def dispatch_cached(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        return _dispatch_cached(
            (self, bool(fp8), bool(round_scale), x.dtype), *_varying(x, send_pos)
        )

    def dispatch_cached_send(self, x, send_pos, num_rows, recv_counts, *, rows, fp8, round_scale):
        return self._cached_start(True, *_varying(x, send_pos), fp8, round_scale)

    # ------------------------------------------------------------ combine

    def _combine_start(self, split, row_data, routes, bias, out_dtype):
        m = self.num_nodes
        check = self._agree(
            node_check.COMBINE, row_data.dtype, row_data.shape[1], row_data.shape[0], row_data
        )
        fast_rows = routes.send_pos.shape[0] * self.ranks_per_node
        target = jnp.where(routes.inner_row >= 0, routes.inner_row, fast_rows)
        fast_data = (
            jnp.zeros((fast_rows, row_data.shape[1]), row_data.dtype)
            .at[target]
            .set(row_data, mode="drop")
        )
        inner = self.inner
        arrays, summed = start(
            split,
            inner.combine,
            inner.combine_send,
            fast_data,
            routes.send_pos,
            routes.num_rows,
            routes.recv_counts,
            None,
            out_dtype=jnp.float32,
        )

        def finish(arrays):
            fast, node_goes, bias, check = arrays
            partial = summed(fast)  # [M * T, W] float32: this node's sum for each token it got
            back = node_check.where_agree(
                check,
                self._across_nodes,
                partial.reshape((m, len(partial) // m) + partial.shape[1:]),
            )
            acc = jnp.zeros(back.shape[1:], jnp.float32) if bias is None else bias
            acc = acc.astype(jnp.float32)
            for n in range(m):  # fixed order: node 0 first
                acc = jnp.where(node_goes[:, n, None], acc + back[n], acc)
            y = node_check.mask(check, acc.astype(out_dtype))
            return node_check.finish(self.key, check, y)

        return (arrays, routes.node_goes, bias, check), finish

    def combine(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        cfg = (self, jnp.dtype(out_dtype), row_data.dtype, None if bias is None else bias.dtype)
        return _combine(cfg, *_varying(row_data, send_pos, bias))

    def combine_send(self, row_data, send_pos, num_rows, recv_counts, bias, *, out_dtype):
        return self._combine_start(True, *_varying(row_data, send_pos, bias), out_dtype)

    def expert_layout(self, topk_rows, **kwargs):
        return self.inner.expert_layout(topk_rows, **kwargs)

    def expert_padded(self, topk_rows, weight_rows, rows, **kwargs):
        return self.inner.expert_padded(topk_rows, weight_rows, rows, **kwargs)

    def place_rows(self, rank_rows, expert_rows, capacity):
        return self.inner.place_rows(rank_rows, expert_rows, capacity)


# ---------------------------------------------------------------- differentiable whole ops
# Static configurations come first: (Hierarchical, ..., dtypes) tuples. The forward rules call the
# differentiable ops themselves, so that gradients can be differentiated again.


def _whole(started):
    arrays, finish = started
    return finish(arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(cfg, x, topk_idx, topk_weights):
    hier, rows, fp8, round_scale, low_latency, _ = cfg
    return _whole(
        hier._dispatch_start(False, x, topk_idx, topk_weights, rows, fp8, round_scale, low_latency)
    )


def _dispatch_fwd(cfg, *args):
    x, topk_idx, topk_weights = custom_vjp_primal_tree_values(args)
    moved, routing = _dispatch(cfg, x, topk_idx, topk_weights)
    return (moved, routing), (routing.send_pos, moved.topk_idx)


def _dispatch_bwd(cfg, res, ct):
    """x's cotangent: a combine of the rows' (float32 sums, rounded once); the weights': a
    combine of theirs where their slot was sent (each slot lives in one rank's row)."""
    hier, x_dtype = cfg[0], cfg[-1]
    routes, topk_rows = res
    ct_rows = ct[0]
    grad_x = grad_w = None
    if not isinstance(ct_rows.x, SymbolicZero):
        grad_x = _x_from_rows(hier, x_dtype, ct_rows.x, routes)
    if not isinstance(ct_rows.topk_weights, SymbolicZero):
        ct_w = jnp.where(topk_rows >= 0, ct_rows.topk_weights, 0.0)
        grad_w = _combine((hier, _F32, _F32, None), ct_w, routes, None)
    return grad_x, None, grad_w


def _x_from_rows(hier, x_dtype, ct_rows, routes):
    """layout.x_from_rows by one hierarchical combine."""

    def combine(rows, out_dtype):
        return _combine((hier, jnp.dtype(out_dtype), rows.dtype, None), rows, routes, None)

    return layout.x_from_rows(combine, ct_rows, x_dtype, hier.max_row_dtype)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_cached(cfg, x, routes):
    hier, fp8, round_scale, _ = cfg
    return _whole(hier._cached_start(False, x, routes, fp8, round_scale))


def _dispatch_cached_fwd(cfg, x, routes):
    return _dispatch_cached(cfg, x, routes), routes


def _dispatch_cached_bwd(cfg, routes, ct):
    hier, x_dtype = cfg[0], cfg[-1]
    return _x_from_rows(hier, x_dtype, ct[0], routes), None


_dispatch_cached.defvjp(_dispatch_cached_fwd, _dispatch_cached_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(cfg, row_data, routes, bias):
    hier, out_dtype, _, _ = cfg
    return _whole(hier._combine_start(False, row_data, routes, bias, out_dtype))


def _combine_fwd(cfg, row_data, routes, bias):
    return _combine(cfg, row_data, routes, bias), routes


def _combine_bwd(cfg, routes, ct):
    """A cached dispatch of y's cotangent (no FP8), in the rows' dtype where that is narrower."""
    hier, _, rows_dtype, bias_dtype = cfg
    ct_out = ct.astype(layout.travel_dtype(ct.dtype, rows_dtype))
    ct_rows, _ = _dispatch_cached((hier, False, False, ct_out.dtype), ct_out, routes)
    return (
        ct_rows.astype(rows_dtype),
        None,
        None if bias_dtype is None else ct.astype(bias_dtype),
    )


_combine.defvjp(_combine_fwd, _combine_bwd)

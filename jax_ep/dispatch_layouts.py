"""The three layouts of a dispatch's rows (docs/API.md, "The result, per layout"): how each
lays out the rank-level rows that the exchange delivers, and how combine reads them back.

rank: the rank-level rows themselves, one per (source rank, token). expert: a row per (token,
local expert), by expert, each expert's block aligned. expert_padded: [E_l, capacity] rows, a
block of `capacity` rows per expert. The row movement in plain JAX is jax_ep/layout.py's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import layout, memory
from jax_ep.checks import check_array
from jax_ep.memory import check_row_width, fail


@dataclasses.dataclass(frozen=True)
class DispatchSpec:
    """A fresh dispatch's checked arguments, as Buffer._dispatch_start built them."""

    x: jax.Array  # [T, H] the tokens
    topk_idx: jax.Array  # [T, K] int32 expert ids
    topk_weights: jax.Array  # [T, K] float32 (zeros when the caller gave none)
    has_weights: bool  # the caller gave topk_weights (the result carries them)
    layout: Layout
    alignment: int  # expert_alignment
    capacity: int  # output rows (expert_padded: rows per expert)
    fp8: bool
    round_scale: bool
    low_latency: bool  # the backend's single-kernel path
    split: bool  # dispatch_send/dispatch_recv halves, or the whole op up front


class Layout:
    """What the layouts share: a result of `capacity` rows, as combine takes them back."""

    def output_rows(self, config, capacity):
        """The rows of the result (Handle.capacity)."""
        return capacity

    def rows_shape(self, config, capacity):
        """The leading dimensions of expert_out."""
        return (capacity,)


class RankLayout(Layout):
    name = "rank"

    def staging_rows(self, config, spec):
        """The rank-level rows the exchange delivers."""
        return spec.capacity

    def lay_out(self, config, ops, spec, rows, routing):
        """A fresh dispatch's (x, scales, routing fields of the result, expert_src,
        expert_rows) from the rank-level `rows`."""
        result = (
            rows.topk_idx,
            rows.topk_weights if spec.has_weights else None,
            routing.tokens_per_expert,
            layout.align_up(routing.tokens_per_expert, spec.alignment),
            routing.num_recv,
            routing.num_dropped,
            routing.num_invalid,
        )
        return rows.x, rows.scales, result, None, None

    def expand(self, config, ops, x_rows, scales, expert_src, expert_rows):
        """A cached dispatch's rank-level rows in this layout."""
        return x_rows, scales

    def combine_rows(self, config, expert_out, handle, topk_weights, partial_dtype):
        """The rank-level rows that combine sends back."""
        if topk_weights is not None:
            fail(
                "combine in the rank layout is unweighted (the caller mixes its local "
                "experts): topk_weights must be None"
            )
        if partial_dtype is not None:
            fail(
                "partial_dtype applies to the expert layouts (the rank layout sends "
                "expert_out as it is)"
            )
        check_row_width(expert_out.dtype, config.max_row_dtype, "expert_out")
        return expert_out


class ExpertLayout(Layout):
    name = "expert"

    def staging_rows(self, config, spec):
        # On the wire a token goes once per rank; the receiver expands it to its experts' rows.
        return config.num_ranks * spec.x.shape[0]

    def lay_out(self, config, ops, spec, rows, routing):
        maps, weights, placed = self._maps(config, ops, spec, rows)
        # A failed op's rank-level rows are NaN, but it leaves no rows to expand: its weights
        # say so (NaN) in the same step, and the expert layout's rows (the gather that makes
        # them takes the select; expert_padded's are all unspecified with no rows).
        failed = layout.failed_dispatch(rows.topk_idx, rows.topk_weights)
        weights = jnp.where(failed, jnp.nan, weights) if spec.has_weights else None
        group_sizes = layout.align_up(maps.tokens_per_expert, spec.alignment)
        result = (
            self.blocks(config, maps.expert_of_row),
            self.blocks(config, weights),
            maps.tokens_per_expert,
            group_sizes,
            group_sizes.sum(dtype=jnp.int32),
            routing.num_dropped + maps.num_dropped,
            routing.num_invalid,
        )
        if placed is None:
            placed = (
                None if a is None else jnp.where(failed, jnp.nan, a)
                for a in self.expand(
                    config, ops, rows.x, rows.scales, maps.expert_src, maps.expert_rows
                )
            )
        return *placed, result, maps.expert_src, maps.expert_rows

    def _maps(self, config, ops, spec, rows):
        """(the expert maps, each expert row's weight, the rows placed where this layout places
        them as it maps them, else None)."""
        maps = ops.expert_layout(
            rows.topk_idx,
            experts_per_rank=config.num_local_experts,
            alignment=spec.alignment,
            capacity=spec.capacity,
        )
        weights = layout.expert_weights(
            rows.topk_weights, rows.topk_idx, maps.expert_src, maps.expert_of_row
        )
        return maps, weights, None

    def blocks(self, config, rows):
        """Expert rows as the result holds them."""
        return rows

    def _expand(self, ops):
        return layout.expand_rows  # padding rows are zeros

    def expand(self, config, ops, x_rows, scales, expert_src, expert_rows):
        expand = self._expand(ops)
        if scales is not None:
            scales = expand(scales, expert_src, expert_rows)
        x = expand(x_rows, expert_src, expert_rows)
        return self.blocks(config, x), self.blocks(config, scales)

    def combine_rows(self, config, expert_out, handle, topk_weights, partial_dtype):
        if topk_weights is not None:
            rows_shape = self.rows_shape(config, handle.capacity)
            check_array(topk_weights, "topk_weights", rows_shape, (jnp.float32,))
            topk_weights = topk_weights.reshape(-1)
        if partial_dtype is None:
            partial_dtype = config.max_row_dtype
        memory.row_dtype(partial_dtype, "partial_dtype")
        row_data = layout.reduce_expert_rows(
            expert_out.reshape(-1, config.hidden),
            topk_weights,
            handle.expert_src,
            handle.expert_rows,
        )
        row_data = row_data.astype(partial_dtype)
        check_row_width(row_data.dtype, config.max_row_dtype, "partial_dtype")
        return row_data


class ExpertPaddedLayout(ExpertLayout):
    name = "expert_padded"

    def output_rows(self, config, capacity):
        return capacity * config.num_local_experts

    def _maps(self, config, ops, spec, rows):
        # One call: the maps, the weights and the rows in their places.
        maps, weights, (x, scales) = layout.padded_rows(
            ops.expert_padded,
            config.num_local_experts,
            spec.capacity,
            rows.topk_idx,
            rows.topk_weights,
            (rows.x, rows.scales),
        )
        return maps, weights, (self.blocks(config, x), self.blocks(config, scales))

    def blocks(self, config, rows):
        """[E_l * B, ...] expert rows -> [E_l, B, ...]."""
        if rows is None:
            return rows
        return rows.reshape((config.num_local_experts, -1) + rows.shape[1:])

    def _expand(self, ops):
        # Only the valid rows are written (E_l * C rows could be many).
        return functools.partial(layout.placed_rows, ops.place_rows)

    def rows_shape(self, config, capacity):
        return (config.num_local_experts, capacity // config.num_local_experts)


BY_NAME = {lay.name: lay for lay in (RankLayout(), ExpertLayout(), ExpertPaddedLayout())}

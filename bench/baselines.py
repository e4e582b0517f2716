"""The JAX-native ways to do the same routing, end to end, for the benchmark:

- AllToAll: a capacity-padded exchange in the manner of MaxText's capacity path, but routed
  once per destination rank (MaxText pads per expert, which sends more). Every rank sends a
  fixed [T, H] block to every peer (capacity = T, so nothing drops), jax.lax.all_to_all,
  combine sends the blocks back.
- RaggedAllToAll: MaxText's dropless path. Rows packed by destination rank,
  jax.lax.ragged_all_to_all with offsets from an all_gather of the counts, and back.

Both move FP8 rows plus scales when fp8=True (the same bytes as jax_ep) and route every token
once per destination rank, like jax_ep. Call inside shard_map over `axis`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_ep


def exclusive_cumsum(values, axis=0):
    """int32 sums of the values before each one along axis."""
    return jnp.cumsum(values, axis=axis, dtype=jnp.int32) - values.astype(jnp.int32)


def _route(topk_idx, num_ranks, num_experts):
    """[T, R] bool: the token goes to rank d (once, however many of its experts live there; a
    slot outside [0, num_experts) goes nowhere), and the token's row among those rank d gets."""
    routed = (topk_idx >= 0) & (topk_idx < num_experts)
    owner = jnp.where(routed, topk_idx // (num_experts // num_ranks), -1)
    goes = (owner[:, :, None] == jnp.arange(num_ranks)).any(axis=1)
    return goes, exclusive_cumsum(goes, axis=0)


def _payload(x, fp8):
    if not fp8:
        return [x]
    q, scales = jax_ep.quantize_fp8(x, False)
    return [jax.lax.bitcast_convert_type(q, jnp.uint8), scales]


class AllToAll:
    def __init__(self, axis, num_ranks, num_experts):
        self.axis, self.num_ranks, self.num_experts = axis, num_ranks, num_experts

    def dispatch(self, x, topk_idx, fp8):
        """-> (list of [R, T, ...] blocks received from each source, routing)."""
        goes, slot = _route(topk_idx, self.num_ranks, self.num_experts)
        t = x.shape[0]
        index = jnp.where(goes, slot, t)  # [T, R]
        out = []
        for part in _payload(x, fp8):
            blocks = jnp.zeros((self.num_ranks,) + part.shape, part.dtype)
            for d in range(self.num_ranks):
                blocks = blocks.at[d, index[:, d]].set(part, mode="drop")
            out.append(jax.lax.all_to_all(blocks, self.axis, 0, 0))
        return out, (goes, slot)

    def combine(self, rows, routing):
        """rows [R, T, H] (the received blocks after the experts) -> [T, H]."""
        goes, slot = routing
        back = jax.lax.all_to_all(rows, self.axis, 0, 0)
        acc = jnp.zeros(rows.shape[1:], jnp.float32)
        for d in range(self.num_ranks):
            acc = jnp.where(goes[:, d : d + 1], acc + back[d][slot[:, d]].astype(jnp.float32), acc)
        return acc.astype(rows.dtype)


class RaggedAllToAll:
    def __init__(self, axis, num_ranks, num_experts):
        self.axis, self.num_ranks, self.num_experts = axis, num_ranks, num_experts

    def dispatch(self, x, topk_idx, fp8):
        """-> (list of [R*T, ...] rows in (source rank, token) order, routing)."""
        goes, slot = _route(topk_idx, self.num_ranks, self.num_experts)
        t, r = x.shape[0], self.num_ranks
        sizes = goes.sum(axis=0, dtype=jnp.int32)  # rows to each rank
        counts = jax.lax.all_gather(sizes, self.axis)  # [src, dst]
        me = jax.lax.axis_index(self.axis)
        send_offsets = exclusive_cumsum(sizes)
        packed = jnp.where(goes, send_offsets[None, :] + slot, r * t)  # [T, R]
        token_of_row = (
            jnp.zeros(r * t, jnp.int32)
            .at[packed.reshape(-1)]
            .set(jnp.repeat(jnp.arange(t, dtype=jnp.int32), r), mode="drop")
        )
        recv_offsets = exclusive_cumsum(counts, axis=0)[me]  # where mine land at d
        recv_sizes = counts[:, me]
        out = []
        for part in _payload(x, fp8):
            send = part[token_of_row]
            output = jnp.zeros((r * t,) + part.shape[1:], part.dtype)
            out.append(
                jax.lax.ragged_all_to_all(
                    send, output, send_offsets, sizes, recv_offsets, recv_sizes, axis_name=self.axis
                )
            )
        routing = (goes, packed, counts, me, send_offsets, sizes)
        return out, routing

    def combine(self, rows, routing):
        """rows [R*T, H] in the received order -> [T, H]."""
        goes, packed, counts, me, send_offsets, sizes = routing
        first_row = exclusive_cumsum(counts[:, me])  # rows from each source
        back_to = exclusive_cumsum(counts, axis=1)[:, me]  # at the source
        output = jnp.zeros_like(rows)
        back = jax.lax.ragged_all_to_all(
            rows, output, first_row, counts[:, me], back_to, sizes, axis_name=self.axis
        )
        acc = jnp.zeros((goes.shape[0], rows.shape[1]), jnp.float32)
        for d in range(self.num_ranks):
            acc = jnp.where(
                goes[:, d : d + 1],
                acc + back[jnp.minimum(packed[:, d], rows.shape[0] - 1)].astype(jnp.float32),
                acc,
            )
        return acc.astype(rows.dtype)

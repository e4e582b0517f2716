"""dense_moe: jax_ep.nn's MoE layer on one device without expert parallelism, the reference the
tests and checks compare the layer with."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import layout
from jax_ep.nn import moe
from jax_ep.nn.config import MoEConfig
from jax_ep.nn.routing import check_routing_bias, expert_load, load_balancing_loss, route


def dense_moe(
    params, x, cfg: MoEConfig, *, num_ranks=1, tokens_per_rank=None, routing_bias=None, num_nodes=1
):
    """The same MoE on one device without expert parallelism: every expert on every token.
    x [G * R * T, H] holds the tokens of G EP groups of num_ranks ranks with tokens_per_rank
    each (default: one group), in rank order, as MoELayer splits them; with a capacity_factor
    (and not dropless) the rows the layer drops are left out, and combine_partial_dtype rounds
    each rank's partial sum as the layer's combine does (a dropless layer's rounds after the
    first round theirs apart). -> (y, MoEAux)."""
    check_routing_bias(cfg, routing_bias)
    moe.check_inputs(cfg, params, x)
    tokens_per_rank = tokens_per_rank or x.shape[0] // num_ranks
    topk_idx, topk_weights, scores = route(x, params["router"], cfg, routing_bias, num_nodes)
    per_expert = jax.vmap(lambda g, u, dn: moe.swiglu(x, g, u, dn, jnp.matmul), out_axes=1)(
        params["w_gate"], params["w_up"], params["w_down"]
    )  # [T, E, H]
    routed = jax.nn.one_hot(topk_idx, cfg.num_experts)
    mix = (routed * topk_weights[..., None]).sum(axis=1)  # [T, E]
    has = routed.max(axis=1) > 0  # one row each
    kept = _kept_rows(has, cfg, num_ranks, tokens_per_rank)
    # Each rank's weighted sum of a token's expert rows, in combine_partial_dtype, then the sum
    # over ranks in float32 (the layer's expert outputs are in x.dtype before the combine).
    weighted = per_expert.astype(x.dtype).astype(jnp.float32) * jnp.where(kept, mix, 0)[..., None]
    per_rank = cfg.num_experts // num_ranks  # sizes spelled out: there may be no tokens
    partial = weighted.reshape(x.shape[0], num_ranks, per_rank, x.shape[1]).sum(axis=2)
    y = partial.astype(cfg.combine_partial_dtype).astype(jnp.float32).sum(axis=1)
    if cfg.shared_ffn_hidden:
        y = y + moe.shared_expert(params, x).astype(x.dtype).astype(jnp.float32)
    aux = moe.MoEAux(
        load_balancing_loss(scores, topk_idx, cfg),
        (has & ~kept).sum(dtype=jnp.int32),
        expert_load(topk_idx, cfg.num_experts),
    )
    return y.astype(x.dtype), aux


def _kept_rows(routed, cfg, num_ranks, tokens_per_rank):
    """[tokens, E] bool: the (token, expert) rows an expert-layout dispatch with the layer's
    capacity keeps. On each receiving rank, local expert e's rows start after the aligned blocks
    of the experts before it; rows come by (source rank, token); those past the capacity drop."""
    capacity = moe.expert_capacity(cfg, tokens_per_rank, num_ranks)
    if capacity is None or cfg.dropless:
        return routed
    tokens, experts = routed.shape
    # [EP groups, source rank x token, receiving rank, local expert]
    has = routed.reshape(-1, num_ranks * tokens_per_rank, num_ranks, experts // num_ranks)
    count = has.sum(axis=1, dtype=jnp.int32)
    start = layout.exclusive_cumsum(layout.align_up(count, cfg.expert_alignment), axis=-1)
    within = layout.exclusive_cumsum(has, axis=1)
    return (has & (start[:, None] + within < capacity)).reshape(tokens, experts)

"""The router of jax_ep.nn's MoE layer: scores, top-k (DeepSeek-V3's group-limited top-k
optional), the routing bias for auxiliary-loss-free balancing, and what a layer reports about
its routing (load-balancing loss, tokens per expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.nn.config import MoEConfig


def route(x, router, cfg: MoEConfig, routing_bias=None, num_nodes=1):
    """-> topk_idx [T, K] int32, topk_weights [T, K] float32, scores [T, E] float32.
    routing_bias [E] (DeepSeek-V3's auxiliary-loss-free balancing) moves experts up or down in
    the choice of the top-k (and of the groups and nodes), not in the weights; it gets no
    gradient. num_nodes: the nodes the experts lie on, in equal consecutive blocks (a Buffer's
    num_nodes), for cfg.max_nodes_per_token."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.score == "softmax" else jax.nn.sigmoid(logits)
    choose = scores
    if routing_bias is not None:
        choose = scores + jax.lax.stop_gradient(routing_bias.astype(jnp.float32))
    if cfg.max_nodes_per_token and num_nodes > cfg.max_nodes_per_token:
        if cfg.num_topk > cfg.max_nodes_per_token * (cfg.num_experts // num_nodes):
            raise ValueError(
                f"jax_ep.nn: num_topk={cfg.num_topk} experts do not fit in max_nodes_per_token="
                f"{cfg.max_nodes_per_token} nodes of {cfg.num_experts // num_nodes} experts"
            )
        if not _group_limit_keeps_the_top_k(cfg, num_nodes):
            raise ValueError(
                f"jax_ep.nn: num_groups={cfg.num_groups} groups (topk_groups={cfg.topk_groups}) "
                f"and max_nodes_per_token={cfg.max_nodes_per_token} of {num_nodes} nodes may keep "
                f"fewer than num_topk={cfg.num_topk} experts on a token's nodes: groups must lie "
                "within nodes, or nodes within groups with the kept groups' nodes holding the "
                "top-k"
            )
        # DeepSeek-V3's node-limited routing: the nodes with the best sums of their top K / M
        per_node_top = max(1, cfg.num_topk // cfg.max_nodes_per_token)
        choose = _keep_best_blocks(choose, num_nodes, cfg.max_nodes_per_token, per_node_top)
    if cfg.num_groups > 1:  # keep the experts of the topk_groups groups with the best top-2 sum
        choose = _keep_best_blocks(choose, cfg.num_groups, cfg.topk_groups, 2)
    _, topk_idx = jax.lax.top_k(choose, cfg.num_topk)
    weights = jnp.take_along_axis(scores, topk_idx, axis=1)
    if cfg.normalize_weights:  # + a tiny term: sigmoid scores can all underflow to 0
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return topk_idx.astype(jnp.int32), weights * cfg.routed_scaling, scores


def _group_limit_keeps_the_top_k(cfg: MoEConfig, num_nodes):
    """Whether the group limit, applied after the node limit, always keeps num_topk experts on
    a token's nodes. The node limit leaves the other nodes' experts at -inf, and a group scores
    the sum of its top 2: a group with fewer than 2 experts left scores -inf and ties with
    groups wholly elsewhere, which the top-k would then take from."""
    groups, kept = cfg.num_groups, cfg.topk_groups
    if kept == groups or groups % num_nodes == 0:
        return True  # no group dropped, or groups within nodes: a kept group is whole or -inf
    per_node = cfg.num_experts // num_nodes
    if num_nodes % groups or per_node < 2:  # groups across node boundaries
        return False
    # Nodes within groups: each kept group with a finite score holds at least one whole node
    # of the token's, and all of them are kept when at most `kept` groups hold them.
    return cfg.num_topk <= min(kept, cfg.max_nodes_per_token) * per_node


def _keep_best_blocks(choose, num_blocks, keep, per_block_top):
    """choose [T, E] with -inf outside the `keep` blocks (of num_blocks consecutive experts)
    whose best per_block_top scores sum highest."""
    by_block = choose.reshape(choose.shape[0], num_blocks, choose.shape[1] // num_blocks)
    block_score = jax.lax.top_k(by_block, min(per_block_top, by_block.shape[-1]))[0].sum(-1)
    _, best = jax.lax.top_k(block_score, keep)
    kept = (
        jnp.zeros(block_score.shape, bool).at[jnp.arange(choose.shape[0])[:, None], best].set(True)
    )
    return jnp.where(jnp.repeat(kept, by_block.shape[-1], axis=1), choose, -jnp.inf)


def load_balancing_loss(scores, topk_idx, cfg: MoEConfig, token_axes=()):
    """Switch-style auxiliary loss E * sum_e f_e * p_e over all tokens (of every rank in
    token_axes): f_e the share of routed slots on expert e, p_e its mean router probability."""
    probs = scores / scores.sum(axis=-1, keepdims=True)
    slots = jax.nn.one_hot(topk_idx, cfg.num_experts).sum(axis=(0, 1))
    totals = (slots, probs.sum(axis=0), jnp.float32(scores.shape[0]))
    if token_axes:
        totals = jax.lax.psum(totals, token_axes)
    slots, prob_sum, tokens = totals
    tokens = jnp.maximum(tokens, 1.0)  # no tokens anywhere: no slots, a loss of 0
    return cfg.num_experts * jnp.sum(slots / (tokens * cfg.num_topk) * prob_sum / tokens)


def expert_load(topk_idx, num_experts, token_axes=()):
    """[E] int32: tokens routed to each expert (an expert twice in a token's top-k counts
    once, as the dispatch sends one row), over every rank of token_axes."""
    routed = (topk_idx[:, :, None] == jnp.arange(num_experts)).any(axis=1)
    load = routed.sum(axis=0, dtype=jnp.int32)
    return jax.lax.psum(load, token_axes) if token_axes else load


def update_routing_bias(bias, tokens_per_expert, rate):
    """DeepSeek-V3's balancing step: each expert's routing bias goes up by `rate` when it got
    fewer tokens than the mean, down when more (MoEAux.tokens_per_expert of a step)."""
    load = tokens_per_expert.astype(jnp.float32)
    return bias + rate * jnp.sign(load.mean() - load).astype(bias.dtype)


def check_routing_bias(cfg: MoEConfig, routing_bias):
    """routing_bias given exactly when cfg.routing_bias asks for it, shaped [E]."""
    if cfg.routing_bias and routing_bias is None:
        raise ValueError("jax_ep.nn: cfg.routing_bias is set: pass routing_bias ([E] float32)")
    if not cfg.routing_bias and routing_bias is not None:
        raise ValueError("jax_ep.nn: routing_bias given but cfg.routing_bias is False")
    if routing_bias is not None and routing_bias.shape != (cfg.num_experts,):
        raise ValueError(
            f"jax_ep.nn: routing_bias must have shape ({cfg.num_experts},), got "
            f"{routing_bias.shape}"
        )

"""An expert-parallel MoE block built on jax_ep (framework-neutral, functional).

    cfg = MoEConfig(num_experts=64, num_topk=6, hidden=1024, ffn_hidden=512, shared_ffn_hidden=1024)
    params = init_params(jax.random.key(0), cfg)               # global (unsharded) weights
    layer = MoELayer(cfg, mesh, data_axis="dp", expert_axis="ep", tokens_per_rank=4096)
    y, aux_loss = layer(params, x)        # under jit; x [tokens, hidden] sharded over (dp, ep)

Inside shard_map call `moe_block(buffer, params_local, x, cfg, token_axes)` directly. The router
(softmax or sigmoid scores, top-k, optional DeepSeek-V3 group-limited top-k) runs on every
token's rank; tokens go to their experts with an expert-layout dispatch; each rank runs its
experts as grouped matmuls (jax.lax.ragged_dot over group_sizes, SwiGLU); combine weights the
outputs with the router weights and adds the shared expert as its bias. `dense_moe` is the same
function without expert parallelism, for tests and checks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep.buffer import Buffer


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_topk: int
    hidden: int
    ffn_hidden: int
    score: str = "softmax"            # "softmax" or "sigmoid"
    num_groups: int = 1               # > 1: group-limited top-k (DeepSeek-V3)
    topk_groups: int = 1              # groups a token may use
    normalize_weights: bool = True    # top-k weights sum to 1 before routed_scaling
    routed_scaling: float = 1.0
    shared_ffn_hidden: int = 0        # 0: no shared expert
    expert_alignment: int = 1         # rows per expert block rounded up to this (grouped GEMMs)
    fp8: bool = False                 # FP8 dispatch (activations into the experts)

    def __post_init__(self):
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"jax_ep.nn: score must be 'softmax' or 'sigmoid', got {self.score!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError("jax_ep.nn: num_groups must divide num_experts and be >= topk_groups")


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def init_params(key, cfg: MoEConfig, dtype=jnp.float32):
    """Router, experts ([E, ...], sharded over the expert axis) and optional shared expert."""
    keys = jax.random.split(key, 7)
    h, f, e = cfg.hidden, cfg.ffn_hidden, cfg.num_experts

    def dense(k, shape, fan_in):
        return (jax.random.normal(k, shape) / jnp.sqrt(fan_in)).astype(dtype)

    params = dict(router=dense(keys[0], (h, e), h), w_gate=dense(keys[1], (e, h, f), h),
                  w_up=dense(keys[2], (e, h, f), h), w_down=dense(keys[3], (e, f, h), f))
    if cfg.shared_ffn_hidden:
        s = cfg.shared_ffn_hidden
        params.update(s_gate=dense(keys[4], (h, s), h), s_up=dense(keys[5], (h, s), h),
                      s_down=dense(keys[6], (s, h), s))
    return params


def route(x, router, cfg: MoEConfig):
    """-> topk_idx [T, K] int32, topk_weights [T, K] float32, scores [T, E] float32."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.score == "softmax" else jax.nn.sigmoid(logits)
    choose = scores
    if cfg.num_groups > 1:  # keep the experts of the topk_groups groups with the best top-2 sum
        grouped = scores.reshape(scores.shape[0], cfg.num_groups, -1)
        group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
        _, best = jax.lax.top_k(group_score, cfg.topk_groups)
        keep = jnp.zeros(group_score.shape, bool).at[
            jnp.arange(scores.shape[0])[:, None], best].set(True)
        choose = jnp.where(jnp.repeat(keep, grouped.shape[-1], axis=1), scores, -jnp.inf)
    _, topk_idx = jax.lax.top_k(choose, cfg.num_topk)
    weights = jnp.take_along_axis(scores, topk_idx, axis=1)
    if cfg.normalize_weights:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return topk_idx.astype(jnp.int32), weights * cfg.routed_scaling, scores


def load_balancing_loss(scores, topk_idx, cfg: MoEConfig, token_axes=()):
    """Switch-style auxiliary loss E * sum_e f_e * p_e over all tokens (of every rank in
    token_axes): f_e the share of routed slots on expert e, p_e its mean router probability."""
    probs = scores / scores.sum(axis=-1, keepdims=True)
    slots = jax.nn.one_hot(topk_idx, cfg.num_experts).sum(axis=(0, 1))
    totals = (slots, probs.sum(axis=0), jnp.float32(scores.shape[0]))
    if token_axes:
        totals = jax.lax.psum(totals, token_axes)
    slots, prob_sum, tokens = totals
    return cfg.num_experts * jnp.sum(slots / (tokens * cfg.num_topk) * prob_sum / tokens)


def _swiglu(x, gate, up, down, matmul):
    return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)


def shared_expert(params, x):
    return _swiglu(x, params["s_gate"], params["s_up"], params["s_down"], jnp.matmul)


def moe_block(buffer: Buffer, params, x, cfg: MoEConfig, token_axes=()):
    """Inside shard_map: x [T, H] this rank's tokens, params with this rank's experts ([E_l, ...])
    -> (y [T, H], auxiliary loss over every token of token_axes)."""
    topk_idx, topk_weights, scores = route(x, params["router"], cfg)
    d = buffer.dispatch(x, topk_idx, topk_weights, layout="expert",
                        expert_alignment=cfg.expert_alignment, fp8=cfg.fp8)
    rows = buffer.dequantize(d, x) if cfg.fp8 else d.x

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), d.group_sizes)

    out = _swiglu(rows, params["w_gate"], params["w_up"], params["w_down"], grouped)
    bias = shared_expert(params, x).astype(x.dtype) if cfg.shared_ffn_hidden else None
    y = buffer.combine(out.astype(x.dtype), d.handle, topk_weights=d.topk_weights, bias=bias)
    return y, load_balancing_loss(scores, topk_idx, cfg, token_axes)


def dense_moe(params, x, cfg: MoEConfig):
    """The same MoE on one device without expert parallelism: every expert on every token."""
    topk_idx, topk_weights, scores = route(x, params["router"], cfg)
    per_expert = jax.vmap(lambda g, u, dn: _swiglu(x, g, u, dn, jnp.matmul), out_axes=1)(
        params["w_gate"], params["w_up"], params["w_down"])                  # [T, E, H]
    mix = (jax.nn.one_hot(topk_idx, cfg.num_experts) * topk_weights[..., None]).sum(axis=1)
    y = jnp.einsum("teh,te->th", per_expert.astype(jnp.float32), mix)
    if cfg.shared_ffn_hidden:
        y = y + shared_expert(params, x).astype(jnp.float32)
    return y.astype(x.dtype), load_balancing_loss(scores, topk_idx, cfg)


class MoELayer:
    """moe_block on globally sharded arrays under jit: tokens split over (data_axis,
    expert_axis), expert weights over expert_axis, router and shared expert replicated. Create
    it outside jit (it owns the jax_ep Buffer); tokens_per_rank = tokens / mesh size."""

    def __init__(self, cfg: MoEConfig, mesh, *, expert_axis, tokens_per_rank, data_axis=None,
                 impl="auto", **buffer_options):
        self.cfg, self.mesh = cfg, mesh
        self.token_axes = tuple(a for a in (data_axis, expert_axis) if a is not None)
        self.expert_axis = expert_axis
        self.buffer = Buffer(mesh, expert_axis, num_experts=cfg.num_experts, hidden=cfg.hidden,
                             num_topk=cfg.num_topk, max_tokens_per_rank=tokens_per_rank,
                             impl=impl, **buffer_options)

    def param_specs(self, params):
        return {k: P(self.expert_axis) if k in EXPERT_WEIGHTS else P() for k in params}

    def __call__(self, params, x):
        """x [..., H] -> (y [..., H], auxiliary load-balancing loss)."""
        tokens = P(self.token_axes)
        fn = jax.shard_map(
            lambda p, t: moe_block(self.buffer, p, t, self.cfg, self.token_axes), mesh=self.mesh,
            in_specs=(self.param_specs(params), tokens), out_specs=(tokens, P()))
        y, aux = fn(params, x.reshape(-1, x.shape[-1]))
        return y.reshape(x.shape), aux

"""jax_ep.nn.eqx.MoE: the expert-parallel MoE block as an Equinox module.

    moe = MoE(cfg, mesh, expert_axis="ep", data_axis="dp", tokens_per_rank=n, key=key)
    y, aux = moe(x)                               # x [..., hidden], sharded over (dp, ep); MoEAux
    moe = moe.with_routing_bias_updated(aux.tokens_per_expert, rate=1e-3)  # cfg.routing_bias
    fp8 = moe.fp8_weights()      # with cfg.fp8: once per optimizer step, then every
    y, aux = moe(x, fp8)         # micro-batch until the weights change

The weights are created sharded (experts over expert_axis). routing_bias is state, not a
parameter: it gets zero gradients, so keep it out of the optimizer (e.g. optax.masked) when
the optimizer decays weights.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_ep.nn.config import MoEConfig
from jax_ep.nn.moe import MoELayer, init_params
from jax_ep.nn.routing import update_routing_bias


class MoE(eqx.Module):
    weights: dict
    routing_bias: jax.Array | None
    layer: MoELayer = eqx.field(static=True)

    def __init__(
        self,
        cfg: MoEConfig,
        mesh,
        *,
        expert_axis,
        tokens_per_rank,
        key,
        data_axis=None,
        impl="auto",
        **buffer_options,
    ):
        self.layer = MoELayer(
            cfg,
            mesh,
            expert_axis=expert_axis,
            data_axis=data_axis,
            tokens_per_rank=tokens_per_rank,
            impl=impl,
            **buffer_options,
        )
        self.weights = init_params(key, cfg, mesh=mesh, expert_axis=expert_axis)
        self.routing_bias = jnp.zeros(cfg.num_experts, jnp.float32) if cfg.routing_bias else None

    def fp8_weights(self):
        """MoELayer.fp8_weights of this module's weights, for __call__'s fp8_weights."""
        return self.layer.fp8_weights(self.weights)

    def __call__(self, x, fp8_weights=None):
        return self.layer(self.weights, x, self.routing_bias, fp8_weights)

    def with_routing_bias_updated(self, tokens_per_expert, rate):
        """This module after one balancing step of its routing bias (MoEAux.tokens_per_expert)."""
        if self.routing_bias is None:
            raise ValueError("jax_ep.nn: this MoE has no routing bias (cfg.routing_bias is False)")
        return eqx.tree_at(
            lambda m: m.routing_bias,
            self,
            update_routing_bias(self.routing_bias, tokens_per_expert, rate),
        )

"""jax_ep.nn.flax_nnx.MoE: the expert-parallel MoE block as a Flax NNX module.

    moe = MoE(cfg, mesh, expert_axis="ep", data_axis="dp", tokens_per_rank=n, rngs=nnx.Rngs(0))
    y = moe(x)                                   # x [..., hidden], sharded over (dp, ep)
    y, sown = nnx.capture(moe, nnx.Intermediate)(x)   # sown["aux"][0]: MoEAux (loss, ...);
                                                 # outside nnx.capture the MoEAux is not kept
    moe.update_routing_bias(aux.tokens_per_expert, rate=1e-3)   # with cfg.routing_bias
    fp8 = moe.fp8_weights()                      # with cfg.fp8: once per optimizer step, then
    y = moe(x, fp8_weights=fp8)                  # every micro-batch until the weights change

The weights are created sharded (experts over expert_axis) and carry nnx.with_partitioning
metadata, so nnx.get_partition_spec(nnx.state(moe)) gives their specs. The routing bias is a
RoutingBias variable, not an nnx.Param: optimizers over nnx.Param leave it alone.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_ep.nn.config import MoEConfig
from jax_ep.nn.moe import MoELayer, init_params
from jax_ep.nn.routing import update_routing_bias


def _capturing(module) -> bool:
    """Whether module runs under nnx.capture (as Module.sow itself tells, flax >= 0.12), or on a
    flax without nnx.capture. Outside it, sow would keep each call's MoEAux in the module: under
    nnx.jit a state that grows every step, so every step traced and compiled again."""
    return not hasattr(nnx, "capture") or hasattr(module, "__captures__")


class RoutingBias(nnx.Variable):
    """Per-expert bias of the top-k choice (auxiliary-loss-free balancing): state that the
    training loop steps, not a trained parameter."""


class MoE(nnx.Module):
    def __init__(
        self,
        cfg: MoEConfig,
        mesh,
        *,
        expert_axis,
        tokens_per_rank,
        rngs: nnx.Rngs,
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
        init = init_params(rngs.params(), cfg, mesh=mesh, expert_axis=expert_axis)
        specs = self.layer.param_specs(init)
        self.names = tuple(init)
        for name in self.names:
            value, spec = init[name], specs[name]
            axes = tuple(spec) + (None,) * (value.ndim - len(spec))
            # Already sharded by init_params: the initializer hands the array over.
            setattr(self, name, nnx.Param(nnx.with_partitioning(lambda v=value: v, axes, mesh)()))
        self.routing_bias = (
            RoutingBias(jnp.zeros(cfg.num_experts, jnp.float32)) if cfg.routing_bias else None
        )

    def weights(self):
        return {name: getattr(self, name)[...] for name in self.names}

    def fp8_weights(self):
        """MoELayer.fp8_weights of this module's weights, for __call__'s fp8_weights."""
        return self.layer.fp8_weights(self.weights())

    def __call__(self, x, fp8_weights=None):
        bias = None if self.routing_bias is None else self.routing_bias[...]
        y, aux = self.layer(self.weights(), x, bias, fp8_weights)
        if _capturing(self):
            self.sow(nnx.Intermediate, "aux", aux)
        return y

    def update_routing_bias(self, tokens_per_expert, rate):
        """One balancing step of the routing bias from a step's MoEAux.tokens_per_expert."""
        if self.routing_bias is None:
            raise ValueError("jax_ep.nn: this MoE has no routing bias (cfg.routing_bias is False)")
        self.routing_bias[...] = update_routing_bias(
            self.routing_bias[...], tokens_per_expert, rate
        )

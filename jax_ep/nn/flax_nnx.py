"""jax_ep.nn.flax_nnx.MoE: the expert-parallel MoE block as a Flax NNX module.

    moe = MoE(cfg, mesh, expert_axis="ep", data_axis="dp", tokens_per_rank=n, rngs=nnx.Rngs(0))
    y = moe(x)                                   # x [..., hidden], sharded over (dp, ep)
    y, sown = nnx.capture(moe, nnx.Intermediate)(x)   # sown["aux_loss"][0]: load-balancing loss
"""
from __future__ import annotations

from flax import nnx

from jax_ep.nn.moe import MoEConfig, MoELayer, init_params


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, mesh, *, expert_axis, tokens_per_rank, rngs: nnx.Rngs,
                 data_axis=None, impl="auto", **buffer_options):
        self.layer = MoELayer(cfg, mesh, expert_axis=expert_axis, data_axis=data_axis,
                              tokens_per_rank=tokens_per_rank, impl=impl, **buffer_options)
        self.names = tuple(init := init_params(rngs.params(), cfg))
        for name in self.names:
            setattr(self, name, nnx.Param(init[name]))

    def weights(self):
        return {name: getattr(self, name)[...] for name in self.names}

    def __call__(self, x):
        y, aux = self.layer(self.weights(), x)
        self.sow(nnx.Intermediate, "aux_loss", aux)
        return y

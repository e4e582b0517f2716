"""jax_ep.nn.eqx.MoE: the expert-parallel MoE block as an Equinox module.

    moe = MoE(cfg, mesh, expert_axis="ep", data_axis="dp", tokens_per_rank=n, key=key)
    y, aux_loss = moe(x)                          # x [..., hidden], sharded over (dp, ep)
"""
from __future__ import annotations

import equinox as eqx

from jax_ep.nn.moe import MoEConfig, MoELayer, init_params


class MoE(eqx.Module):
    weights: dict
    layer: MoELayer = eqx.field(static=True)

    def __init__(self, cfg: MoEConfig, mesh, *, expert_axis, tokens_per_rank, key,
                 data_axis=None, impl="auto", **buffer_options):
        self.layer = MoELayer(cfg, mesh, expert_axis=expert_axis, data_axis=data_axis,
                              tokens_per_rank=tokens_per_rank, impl=impl, **buffer_options)
        self.weights = init_params(key, cfg)

    def __call__(self, x):
        return self.layer(self.weights, x)

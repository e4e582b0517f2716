"""Expert-parallel MoE layers on jax_ep: the functional block (moe.py) and thin adapters for
Flax NNX (jax_ep.nn.flax_nnx, extra "flax") and Equinox (jax_ep.nn.eqx, extra "equinox")."""
from jax_ep.nn.moe import (EXPERT_WEIGHTS, MoEConfig, MoELayer, dense_moe, init_params,
                           load_balancing_loss, moe_block, route, shared_expert)

__all__ = ["EXPERT_WEIGHTS", "MoEConfig", "MoELayer", "dense_moe", "init_params",
           "load_balancing_loss", "moe_block", "route", "shared_expert"]

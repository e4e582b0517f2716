"""Expert-parallel MoE layers on jax_ep: the functional block (moe.py), its configuration
(config.py), router (routing.py), grouped matmuls (grouped.py, their Mosaic GPU kernels in
mosaic.py), a dense reference (reference.py) and thin adapters for Flax NNX (jax_ep.nn.flax_nnx,
extra "flax") and Equinox (jax_ep.nn.eqx, extra "equinox")."""

from jax_ep.fp8 import quantize_weights_fp8, transpose_weights_fp8
from jax_ep.nn.config import MoEConfig
from jax_ep.nn.grouped import fp8_grouped_matmul, grouped_matmul, masked_matmul
from jax_ep.nn.moe import (
    EXPERT_WEIGHTS,
    MoEAux,
    MoELayer,
    expert_capacity,
    expert_ffn,
    grouped_matmul_path,
    init_params,
    moe_block,
    quantize_expert_weights,
    shared_expert,
)
from jax_ep.nn.reference import dense_moe
from jax_ep.nn.routing import expert_load, load_balancing_loss, route, update_routing_bias

__all__ = [
    "EXPERT_WEIGHTS",
    "MoEAux",
    "MoEConfig",
    "MoELayer",
    "dense_moe",
    "expert_capacity",
    "expert_ffn",
    "expert_load",
    "fp8_grouped_matmul",
    "grouped_matmul",
    "masked_matmul",
    "grouped_matmul_path",
    "init_params",
    "load_balancing_loss",
    "moe_block",
    "quantize_expert_weights",
    "quantize_weights_fp8",
    "transpose_weights_fp8",
    "route",
    "shared_expert",
    "update_routing_bias",
]

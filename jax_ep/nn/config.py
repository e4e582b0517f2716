"""MoEConfig: what an MoE layer is (jax_ep.nn.moe), checked once when it is made."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax.numpy as jnp

from jax_ep.fp8 import FP8_BLOCK
from jax_ep.memory import FLOAT_ROWS, check_capacity_factor
from jax_ep.nn import grouped_impls

# The config's counts and the least each may be.
_COUNTS = dict(
    num_experts=1,
    num_topk=1,
    hidden=1,
    ffn_hidden=1,
    num_groups=1,
    topk_groups=1,
    shared_ffn_hidden=0,
    expert_alignment=1,
)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The shape and options of an MoE layer.

    Attributes:
        num_experts: routed experts E (a multiple of the expert axis' size).
        num_topk: experts per token K.
        hidden: the tokens' width H.
        ffn_hidden: each expert's SwiGLU width.
        score: the router's scores, "softmax" or "sigmoid".
        num_groups: > 1: group-limited top-k (DeepSeek-V3), the experts in this many groups.
        topk_groups: groups a token may use (their experts must hold num_topk).
        max_nodes_per_token: on a Buffer over ("node", "ep"): the most nodes a token's experts
            may span (DeepSeek-V3's node-limited routing: the nodes with the best sums of
            their top num_topk / M scores), before the group limit; None: any. Those nodes'
            experts must hold num_topk, and with a group limit groups and nodes must nest so
            that the kept groups hold the top-k on a token's nodes; both checked when the
            layer is traced.
        normalize_weights: top-k weights sum to 1 before routed_scaling.
        routed_scaling: the factor of the top-k weights.
        shared_ffn_hidden: the shared expert's SwiGLU width; 0: no shared expert.
        expert_alignment: rows per expert block rounded up to this (grouped GEMMs; 128 lets
            the Mosaic kernels take one block per tile; CUTLASS's take any groups, 1).
        fp8: FP8 dispatch (activations into the experts).
        fp8_experts: with fp8: the gate and up projections multiply the FP8 rows as they come
            (grouped.fp8_grouped_matmul, weights quantized 128 x 128 in the call; the layer's
            fp8_weights argument gives them quantized once); False: the rows are dequantized
            to the compute dtype first.
        fp8_down: with the FP8 gate and up projections (fp8 with fp8_experts, or the layer's
            fp8_weights): the down projection multiplies FP8 too, its input (the SwiGLU's
            output) quantized per row in 1 x 128 blocks as it is made, its weights 128 x 128
            (fp8_weights["w_down"], from quantize_expert_weights(params, down=True), or
            quantized in the call).
        fp8_dgrad: the FP8 projections' row gradients (d lhs) are FP8 products too
            (DeepSeek-V3's recipe): the output's gradient quantized per row in 1 x 128 blocks,
            times the forward's FP8 weights transposed. The weight gradients stay in the
            compute dtype. Without it the whole backward is bf16.
        capacity_factor: rows each rank receives, as a multiple of the balanced count (T * K
            per rank, split evenly over its experts, each block aligned); None: room for every
            row (nothing is dropped). Rows past it drop in the expert layout's row order (the
            rank's last experts first) and are counted in MoEAux.num_dropped.
        dropless: with capacity_factor: nothing drops, and each dispatch still holds at most
            capacity_factor x the balanced rows. The rows past it go in further rounds of the
            same capacity (dispatch, experts, combine), as many as the most loaded rank needs
            (agreed by every rank; no round runs empty), their outputs summed in float32.
        routing_bias: top-k over scores + a per-expert bias (the layer's routing_bias
            argument), weights from the scores alone.
        combine_partial_dtype: each rank's sum of a token's expert rows (bf16: half the
            combine's bytes; needed with max_row_dtype=bf16).
        grouped_matmul: the jax_ep.nn.grouped impl: "auto", "xla", "cutlass", "deepgemm" or
            "mosaic" ("auto" takes DeepGEMM's kernels on an H100 or H200 where
            expert_alignment is a multiple of 128).
    """

    num_experts: int
    num_topk: int
    hidden: int
    ffn_hidden: int
    score: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    max_nodes_per_token: int | None = None
    normalize_weights: bool = True
    routed_scaling: float = 1.0
    shared_ffn_hidden: int = 0
    expert_alignment: int = 1
    fp8: bool = False
    fp8_experts: bool = False
    fp8_down: bool = False
    fp8_dgrad: bool = False
    capacity_factor: float | None = None
    dropless: bool = False
    routing_bias: bool = False
    combine_partial_dtype: Any = jnp.float32
    grouped_matmul: str = "auto"

    def __post_init__(self):
        for name, least in _COUNTS.items():
            value = getattr(self, name)
            try:
                fits = not isinstance(value, bool) and operator.index(value) >= least
            except TypeError:
                fits = False
            if not fits:
                raise ValueError(f"jax_ep.nn: {name} must be an integer >= {least}, got {value!r}")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"jax_ep.nn: score must be 'softmax' or 'sigmoid', got {self.score!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError("jax_ep.nn: num_groups must divide num_experts and be >= topk_groups")
        if self.num_topk > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"jax_ep.nn: num_topk={self.num_topk} experts do not fit in topk_groups="
                f"{self.topk_groups} groups of {self.num_experts // self.num_groups} experts"
            )
        if self.max_nodes_per_token is not None and not (
            isinstance(self.max_nodes_per_token, int) and self.max_nodes_per_token > 0
        ):
            raise ValueError(
                f"jax_ep.nn: max_nodes_per_token must be a positive integer or None, got "
                f"{self.max_nodes_per_token!r}"
            )
        check_capacity_factor(self.capacity_factor)
        if not isinstance(self.dropless, bool) or self.dropless and self.capacity_factor is None:
            raise ValueError(
                f"jax_ep.nn: dropless must be a bool, and True only with a capacity_factor (the "
                f"rows of each round), got dropless={self.dropless!r}, capacity_factor="
                f"{self.capacity_factor!r}"
            )
        if jnp.dtype(self.combine_partial_dtype) not in FLOAT_ROWS:
            raise ValueError(
                f"jax_ep.nn: combine_partial_dtype must be float32 or bfloat16, got "
                f"{self.combine_partial_dtype!r}"
            )
        if self.fp8 and self.fp8_experts and self.ffn_hidden % FP8_BLOCK:
            raise ValueError(
                f"jax_ep.nn: fp8_experts multiplies FP8 weights in "
                f"{FP8_BLOCK} x {FP8_BLOCK} blocks: ffn_hidden must be "
                f"a multiple of {FP8_BLOCK}, got {self.ffn_hidden} (or set "
                f"fp8_experts=False)"
            )
        if self.fp8_down and (not self.fp8 or self.ffn_hidden % FP8_BLOCK):
            raise ValueError(
                f"jax_ep.nn: fp8_down needs fp8=True and ffn_hidden a multiple of {FP8_BLOCK} "
                f"(its FP8 blocks), got fp8={self.fp8}, ffn_hidden={self.ffn_hidden}"
            )
        if self.fp8_dgrad and not self.fp8:
            raise ValueError(
                "jax_ep.nn: fp8_dgrad makes the FP8 projections' row gradients FP8; it needs "
                "fp8=True"
            )
        if self.grouped_matmul not in grouped_impls.IMPLS:
            raise ValueError(
                f"jax_ep.nn: grouped_matmul must be one of {grouped_impls.IMPLS}, got "
                f"{self.grouped_matmul!r}"
            )

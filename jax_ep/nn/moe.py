"""An expert-parallel MoE block built on jax_ep (framework-neutral, functional).

    cfg = MoEConfig(num_experts=64, num_topk=6, hidden=1024, ffn_hidden=512, shared_ffn_hidden=1024)
    layer = MoELayer(cfg, mesh, data_axis="dp", expert_axis="ep", tokens_per_rank=4096)
    params = init_params(jax.random.key(0), cfg, mesh=mesh, expert_axis="ep")  # made sharded
    y, aux = layer(params, x)     # under jit; x [tokens, hidden] sharded over (dp, ep)
    loss = task_loss + 0.01 * aux.loss  # aux: MoEAux(loss, num_dropped, tokens_per_expert)

Inside shard_map call `moe_block(buffer, params_local, x, cfg, token_axes)` directly. The router
(softmax or sigmoid scores, top-k, optional DeepSeek-V3 group-limited top-k, optional routing
bias for auxiliary-loss-free balancing) runs on every token's rank; tokens go to their experts
with an expert-layout dispatch (capped at `capacity_factor` x the balanced rows, if given); each
rank runs its experts as grouped matmuls (jax_ep.nn.grouped: Mosaic GPU kernels on Hopper,
jax.lax.ragged_dot elsewhere; SwiGLU); combine weights the outputs with the router weights and
adds the shared expert as its bias. The configuration is jax_ep.nn.config's MoEConfig, the
router jax_ep.nn.routing; jax_ep.nn.reference's `dense_moe` is the same function without expert
parallelism (capacity drops and the combine's partial sums modelled), for tests and checks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep import layout, memory
from jax_ep.buffer import Buffer
from jax_ep.fp8 import FP8_BLOCK, quantize_fp8
from jax_ep.nn import grouped
from jax_ep.nn.config import MoEConfig
from jax_ep.nn.routing import (
    check_routing_bias,
    expert_load,
    load_balancing_loss,
    route,
)


class MoEAux(NamedTuple):
    """What a layer reports besides y, over every token of the layer (all ranks)."""

    loss: jax.Array  # [] float32 load-balancing loss (load_balancing_loss)
    num_dropped: jax.Array  # [] int32 (token, expert) rows dropped for capacity
    tokens_per_expert: jax.Array  # [E] int32 tokens routed to each expert (before drops)


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def param_specs(names, expert_axis):
    """Each parameter's PartitionSpec: the experts split over expert_axis, the rest replicated."""
    return {name: P(expert_axis) if name in EXPERT_WEIGHTS else P() for name in names}


def init_params(key, cfg: MoEConfig, dtype=jnp.float32, *, mesh=None, expert_axis=None):
    """Router, experts ([E, ...]) and optional shared expert. With a mesh, made under jit with
    the experts sharded over expert_axis and the rest replicated, so no device ever holds every
    expert (the values equal the unsharded ones)."""
    make = functools.partial(_init_params, cfg=cfg, dtype=dtype)
    if mesh is None:
        return make(key)
    names = jax.eval_shape(make, key)
    specs = param_specs(names, expert_axis)
    return jax.jit(make, out_shardings={k: NamedSharding(mesh, v) for k, v in specs.items()})(key)


def _init_params(key, cfg, dtype):
    keys = jax.random.split(key, 7)
    h, f, e = cfg.hidden, cfg.ffn_hidden, cfg.num_experts

    def dense(k, shape, fan_in):
        return (jax.random.normal(k, shape) / jnp.sqrt(fan_in)).astype(dtype)

    params = dict(
        router=dense(keys[0], (h, e), h),
        w_gate=dense(keys[1], (e, h, f), h),
        w_up=dense(keys[2], (e, h, f), h),
        w_down=dense(keys[3], (e, f, h), f),
    )
    if cfg.shared_ffn_hidden:
        s = cfg.shared_ffn_hidden
        params.update(
            s_gate=dense(keys[4], (h, s), h),
            s_up=dense(keys[5], (h, s), h),
            s_down=dense(keys[6], (s, h), s),
        )
    return params


def check_inputs(cfg: MoEConfig, params, x):
    """x's width and the parameters the layer reads, before any of them is used."""
    if x.shape[-1] != cfg.hidden:
        raise ValueError(f"jax_ep.nn: x has width {x.shape[-1]} but cfg.hidden is {cfg.hidden}")
    names = ("router", "w_gate", "w_up", "w_down")
    names += ("s_gate", "s_up", "s_down") if cfg.shared_ffn_hidden else ()
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(
            f"jax_ep.nn: params lack {missing} (cfg.shared_ffn_hidden={cfg.shared_ffn_hidden}; "
            f"init_params(key, cfg) makes them all)"
        )
    h, f, s = cfg.hidden, cfg.ffn_hidden, cfg.shared_ffn_hidden
    experts = params["w_gate"].shape[0] if params["w_gate"].ndim == 3 else None  # E or E_l here
    shapes = dict(
        router=(h, cfg.num_experts),
        w_gate=(experts, h, f),
        w_up=(experts, h, f),
        w_down=(experts, f, h),
        s_gate=(h, s),
        s_up=(h, s),
        s_down=(s, h),
    )
    for name in names:
        if tuple(params[name].shape) != shapes[name]:
            raise ValueError(
                f"jax_ep.nn: params[{name!r}] has shape {tuple(params[name].shape)}, not "
                f"{shapes[name]} (cfg: hidden {h}, ffn_hidden {f}, num_experts "
                f"{cfg.num_experts}, shared_ffn_hidden {s})"
            )


def expert_capacity(cfg: MoEConfig, tokens_per_rank, num_ranks):
    """Expert-layout rows per rank for cfg.capacity_factor (None without one): each local
    expert's share of the balanced T * K rows, times the factor, aligned; at most the rows
    that hold every token (jax_ep.memory.factor_capacity, which memory_plan sizes by too). No
    tokens: None (no capacity to size)."""
    if cfg.capacity_factor is None or tokens_per_rank == 0:
        return None
    return memory.factor_capacity(
        cfg.capacity_factor,
        num_ranks,
        tokens_per_rank,
        cfg.num_topk,
        cfg.num_experts // num_ranks,
        cfg.expert_alignment,
    )


def _glu(gate, up):
    return jax.nn.silu(gate) * up


def swiglu(x, gate, up, down, matmul):
    """SwiGLU: down(silu(x @ gate) * (x @ up)), each product by matmul."""
    return matmul(_glu(matmul(x, gate), matmul(x, up)), down)


def shared_expert(params, x):
    return swiglu(x, params["s_gate"], params["s_up"], params["s_down"], jnp.matmul)


FP8_WEIGHTS = ("w_gate", "w_up")  # the projections that can read the dispatch's FP8 rows


def quantize_expert_weights(params, down=False, dgrad=False):
    """{name: quantize_weights_fp8(params[name])} for the gate and up projections (and with
    down=True the down projection, which a layer with cfg.fp8_down reads): the FP8 weights of
    an fp8 layer, for its fp8_weights argument. Made once (e.g. per optimizer step, under jit,
    outside the gradient: they are sharded like the experts), they serve every call until the
    weights change, such as a step's micro-batches. dgrad=True (for cfg.fp8_dgrad): each also
    holds its transpose (transpose_weights_fp8; a second FP8 copy, which the backward reads).
    On GPUs jax_ep's kernel makes both in one pass over the weights (grouped.quantize_weights)."""
    names = FP8_WEIGHTS + (("w_down",) if down else ())
    return {name: grouped.quantize_weights(params[name], dgrad) for name in names}


def expert_ffn(
    params, rows, group_sizes, cfg: MoEConfig, group_alignment=None, fp8_rows=None, fp8_weights=None
):
    """The local experts' SwiGLU on rows in groups ([M, H] -> [M, H]): grouped matmuls
    (cfg.grouped_matmul), rows promised aligned to group_alignment (default
    cfg.expert_alignment). fp8_rows: (e4m3fn [M, H], scales [M, H/128]) whose value rows is:
    the gate and up projections then multiply them (grouped.fp8_grouped_matmul), with
    fp8_weights (quantize_expert_weights) or weights quantized here; with cfg.fp8_down the
    down projection too, from the SwiGLU's output quantized per row (jax_ep.fp8's rule); with
    cfg.fp8_dgrad the FP8 projections' row gradients are FP8 products as well."""
    options = dict(
        impl=cfg.grouped_matmul,
        group_alignment=(cfg.expert_alignment if group_alignment is None else group_alignment),
    )

    def project(name, rows, fp8_rows):
        if fp8_rows is None:
            return grouped.grouped_matmul(rows, params[name], group_sizes, **options)
        return grouped.fp8_grouped_matmul(
            rows,
            *fp8_rows,
            params[name],
            group_sizes,
            rhs_fp8=(fp8_weights or {}).get(name),
            fp8_dgrad=cfg.fp8_dgrad,
            **options,
        )

    hidden = _glu(project("w_gate", rows, fp8_rows), project("w_up", rows, fp8_rows))
    down_fp8 = quantize_fp8(hidden, False) if fp8_rows is not None and cfg.fp8_down else None
    return project("w_down", hidden, down_fp8)


def fp8_rows(d, cfg: MoEConfig, fp8_weights=None):
    """The dispatch's FP8 rows (d.x, d.scales) when the gate and up projections multiply them
    (cfg.fp8 with cfg.fp8_experts or FP8 weights given), else None."""
    return (d.x, d.scales) if cfg.fp8 and (cfg.fp8_experts or fp8_weights is not None) else None


def moe_block(
    buffer: Buffer, params, x, cfg: MoEConfig, token_axes=(), routing_bias=None, fp8_weights=None
):
    """Inside shard_map: x [T, H] this rank's tokens, params with this rank's experts ([E_l, ...])
    -> (y [T, H], MoEAux over every token of token_axes). routing_bias [E]: with
    cfg.routing_bias. fp8_weights: quantize_expert_weights(params) of this rank's experts, with
    cfg.fp8 (the gate and up projections then read them, whatever cfg.fp8_experts says)."""
    check_routing_bias(cfg, routing_bias)
    check_inputs(cfg, params, x)
    if fp8_weights is not None and not cfg.fp8:
        raise ValueError(
            "jax_ep.nn: fp8_weights given but cfg.fp8 is False (the FP8 weights "
            "multiply the dispatch's FP8 rows)"
        )
    topk_idx, topk_weights, scores = route(x, params["router"], cfg, routing_bias, buffer.num_nodes)
    capacity = expert_capacity(cfg, x.shape[0], buffer.num_ranks)

    def experts(idx):
        """The experts on the rows of a dispatch of the slots idx names -> (their outputs, the
        dispatch)."""
        d = buffer.dispatch(
            x,
            idx,
            topk_weights,
            layout="expert",
            expert_alignment=cfg.expert_alignment,
            fp8=cfg.fp8,
            capacity=capacity,
        )
        # With FP8 rows, their dequantized value carries the gradient to x (and is all that the
        # backward reads when the projections take the FP8 rows themselves).
        rows = buffer.dequantize(d, x) if cfg.fp8 else d.x
        out = expert_ffn(
            params,
            rows,
            d.group_sizes,
            cfg,
            fp8_rows=fp8_rows(d, cfg, fp8_weights),
            fp8_weights=fp8_weights,
        )
        return out.astype(x.dtype), d

    def combine(out, d, bias=None):
        return buffer.combine(
            out,
            d.handle,
            topk_weights=d.topk_weights,
            bias=bias,
            partial_dtype=cfg.combine_partial_dtype,
        )

    out, d = experts(topk_idx)
    bias = shared_expert(params, x).astype(x.dtype) if cfg.shared_ffn_hidden else None
    y, num_dropped = combine(out, d, bias), d.num_dropped
    if cfg.dropless and capacity is not None:
        more, delivered = overflow_rounds(buffer, x, topk_idx, cfg, capacity, experts, combine)
        y = (y.astype(jnp.float32) + more).astype(x.dtype)
        num_dropped = num_dropped - delivered  # 0 unless a round were missing
    num_dropped = jax.lax.psum(num_dropped, token_axes) if token_axes else num_dropped
    return y, MoEAux(
        load_balancing_loss(scores, topk_idx, cfg, token_axes),
        num_dropped,
        expert_load(topk_idx, cfg.num_experts, token_axes),
    )


def slot_rounds(buffer: Buffer, topk_idx, cfg: MoEConfig, capacity):
    """Inside shard_map: the dispatch round that delivers each of this rank's (token, slot)
    ([T, K] int32), and the rounds the EP group runs ([] int32, the same on every rank).

    A (token, expert) row's round is its place in the expert layout of a dispatch without a
    capacity, floor-divided by `capacity`: round 0 holds the rows a dispatch with `capacity`
    keeps, and round r's rows, dispatched alone, take the places [0, capacity) in the same order
    (capacity and every expert block's start are multiples of the alignment, so rounds split
    only within an expert's rows). The places come from every source's rows per expert (an
    all_gather of E counts), as the layout orders them: by expert, then source rank, then token."""
    tokens, experts = topk_idx.shape[0], cfg.num_experts
    has = jnp.zeros((tokens, experts), jnp.int32).at[jnp.arange(tokens)[:, None], topk_idx].set(1)
    counts = jax.lax.all_gather(has.sum(axis=0), buffer.axis_name)  # [R, E]: per source
    sources = jnp.arange(buffer.num_ranks)[:, None]
    before = jnp.where(sources < jax.lax.axis_index(buffer.axis_name), counts, 0).sum(axis=0)
    blocks = layout.align_up(counts.sum(axis=0), cfg.expert_alignment).reshape(sources.shape[0], -1)
    start = layout.exclusive_cumsum(blocks, axis=1).reshape(-1)  # each expert's on its rank
    place = start + before + layout.exclusive_cumsum(has, axis=0)  # [T, E]
    rounds = jnp.take_along_axis(place // capacity, topk_idx, axis=1)
    return rounds, -(-blocks.sum(axis=1).max() // capacity)


def overflow_rounds(buffer: Buffer, x, topk_idx, cfg: MoEConfig, capacity, experts, combine):
    """The rounds after the first of a dropless layer (slot_rounds): each dispatches only its
    own slots (the others -1), runs the experts and combines -> (the rounds' y summed in float32,
    the (token, expert) rows they delivered). A scan of static length (the worst case's rounds,
    memory.dropless_rounds) whose rounds past the needed ones are skipped by a cond every rank
    takes alike. Each round is rematerialized in the backward; that keeps, per round of the
    static length, what the Buffer saves under remat and the round's inputs (not yet hoisted
    out of the scan)."""
    rounds, needed = slot_rounds(buffer, topk_idx, cfg, capacity)
    # Zeros that vary over the ranks as the rounds' results do (shard_map checks it).
    none = jnp.zeros_like(x, jnp.float32), jnp.zeros_like(topk_idx[0, 0])

    @jax.checkpoint
    def run(r):
        out, d = experts(jnp.where(rounds == r, topk_idx, -1))
        return combine(out, d).astype(jnp.float32), d.tokens_per_expert.sum()

    def step(total, r):
        y, n = jax.lax.cond(r < needed, run, lambda _: none, r)
        return (total[0] + y, total[1] + n), None

    limit = memory.dropless_rounds(
        capacity,
        buffer.num_ranks,
        topk_idx.shape[0],
        cfg.num_topk,
        cfg.num_experts // buffer.num_ranks,
        cfg.expert_alignment,
    )
    return jax.lax.scan(step, none, jnp.arange(1, limit))[0]


def grouped_matmul_path(
    cfg: MoEConfig, num_ranks, tokens_per_rank, dtype=jnp.bfloat16, fp8_weights=False
):
    """The grouped-matmul implementations moe_block's experts take ("deepgemm", "cutlass",
    "mosaic" or "xla", with "_fp8" where the FP8 rows are multiplied as they come and
    "_fp8_dgrad" where their row gradients are FP8 products too, for the gate/up and the down
    projection) with tokens_per_rank tokens of `dtype` per rank; fp8_weights: whether the call
    gets fp8_weights (which make an fp8 layer's gate and up projections FP8)."""
    rows = expert_capacity(cfg, tokens_per_rank, num_ranks) or memory.default_capacity(
        "expert",
        num_ranks,
        tokens_per_rank,
        cfg.num_topk,
        cfg.num_experts // num_ranks,
        cfg.expert_alignment,
    )
    groups, h, f = cfg.num_experts // num_ranks, cfg.hidden, cfg.ffn_hidden
    paths = {
        name: grouped.resolve_impl(
            cfg.grouped_matmul,
            (rows, k),
            (groups, k, n),
            dtype,
            group_alignment=cfg.expert_alignment,
        )
        for name, (k, n) in (("gate_up", (h, f)), ("down", (f, h)))
    }
    fp8 = {"gate_up": cfg.fp8 and (cfg.fp8_experts or bool(fp8_weights))}
    fp8["down"] = fp8["gate_up"] and cfg.fp8_down
    for name, (k, n) in (("gate_up", (h, f)), ("down", (f, h))):
        if fp8[name]:
            paths[name] = (
                grouped.resolve_fp8_impl(
                    cfg.grouped_matmul, (rows, k), (groups, k, n), cfg.expert_alignment
                )
                + "_fp8"
                + ("_dgrad" if cfg.fp8_dgrad else "")
            )
    return paths


class MoELayer:
    """moe_block on globally sharded arrays under jit: tokens split over (data_axis,
    expert_axis), expert weights over expert_axis, router and shared expert replicated. Create
    it outside jit (it owns the jax_ep Buffer); tokens_per_rank = tokens / mesh size. On a mesh
    with explicit axes (jax.sharding.AxisType.Explicit) the inputs are resharded to those specs
    first; with auto axes shard_map does it."""

    def __init__(
        self,
        cfg: MoEConfig,
        mesh,
        *,
        expert_axis,
        tokens_per_rank,
        data_axis=None,
        impl="auto",
        **buffer_options,
    ):
        self.cfg, self.mesh = cfg, mesh
        # expert_axis may be a tuple, ("node", "ep"): the tokens are split over each of its axes
        self.token_axes = tuple(
            name
            for axis in (data_axis, expert_axis)
            if axis is not None
            for name in (axis if isinstance(axis, tuple) else (axis,))
        )
        if len(set(self.token_axes)) < len(self.token_axes):
            raise ValueError(
                f"jax_ep.nn: data_axis {data_axis!r} and expert_axis {expert_axis!r} must name "
                "different mesh axes (the tokens are split over each once)"
            )
        self.expert_axis = expert_axis
        self.buffer = Buffer(
            mesh,
            expert_axis,
            num_experts=cfg.num_experts,
            hidden=cfg.hidden,
            num_topk=cfg.num_topk,
            max_tokens_per_rank=tokens_per_rank,
            impl=impl,
            **buffer_options,
        )
        if jnp.dtype(cfg.combine_partial_dtype).itemsize > self.buffer.max_row_dtype.itemsize:
            raise ValueError(
                f"jax_ep.nn: combine_partial_dtype "
                f"{jnp.dtype(cfg.combine_partial_dtype)} is wider than the Buffer's "
                f"max_row_dtype {self.buffer.max_row_dtype}: set "
                f"combine_partial_dtype=jnp.bfloat16 too"
            )
        self._program = jax.jit(self._run)

    def param_specs(self, params):
        return param_specs(params, self.expert_axis)

    def fp8_weights(self, params):
        """FP8 weights for __call__'s fp8_weights (cfg.fp8): quantize_expert_weights(params),
        with the down projection's under cfg.fp8_down and the transposes under cfg.fp8_dgrad.
        Given to the call, they make the gate and up projections multiply FP8 whatever
        cfg.fp8_experts says. Valid until the weights change: make them again after each
        optimizer update (the forward reads them, the backward reads params)."""
        cfg = self.cfg
        if not cfg.fp8 or cfg.hidden % FP8_BLOCK or cfg.ffn_hidden % FP8_BLOCK:
            raise ValueError(
                f"jax_ep.nn: fp8_weights are for a layer with cfg.fp8 and hidden and ffn_hidden "
                f"multiples of {FP8_BLOCK} (fp8={cfg.fp8}, hidden={cfg.hidden}, "
                f"ffn_hidden={cfg.ffn_hidden})"
            )
        return quantize_expert_weights(params, down=cfg.fp8_down, dgrad=cfg.fp8_dgrad)

    def grouped_matmul_path(self, dtype=jnp.bfloat16, fp8_weights=False):
        """The grouped-matmul implementations of the experts for tokens of `dtype` (and with
        fp8_weights: for calls that get them)."""
        return grouped_matmul_path(
            self.cfg, self.buffer.num_ranks, self.buffer.max_tokens_per_rank, dtype, fp8_weights
        )

    def __call__(self, params, x, routing_bias=None, fp8_weights=None):
        """x [..., H] -> (y [..., H], MoEAux). routing_bias [E] float32: with cfg.routing_bias
        (e.g. kept as optimizer-free state, stepped by update_routing_bias). fp8_weights: with
        cfg.fp8, quantize_expert_weights(params) made beforehand (see there)."""
        args = (params, x.reshape(-1, x.shape[-1]), routing_bias, fp8_weights)
        y, aux = self._program(*self._resharded(args, self._specs(params, fp8_weights)))
        return y.reshape(x.shape), aux

    def _run(self, params, tokens, routing_bias, fp8_weights):
        """The shard_map of moe_block; jitted as self._program: the custom calls need a jit around
        them, and one program per argument shapes serves every call made outside a jit."""
        return jax.shard_map(
            lambda p, t, b, w: moe_block(self.buffer, p, t, self.cfg, self.token_axes, b, w),
            mesh=self.mesh,
            in_specs=self._specs(params, fp8_weights),
            out_specs=(P(self.token_axes), P()),
        )(params, tokens, routing_bias, fp8_weights)

    def _specs(self, params, fp8_weights):
        """The PartitionSpecs of __call__'s (params, tokens, routing_bias, fp8_weights)."""
        fp8_specs = jax.tree.map(lambda _: P(self.expert_axis), fp8_weights)
        return (self.param_specs(params), P(self.token_axes), P(), fp8_specs)

    def _resharded(self, args, specs):
        """args laid out as specs over the mesh's explicit axes (the ones shard_map checks)."""
        explicit = {
            name
            for name, kind in zip(self.mesh.axis_names, self.mesh.axis_types)
            if kind == jax.sharding.AxisType.Explicit
        }
        if not explicit:
            return args

        def over_explicit(entry):
            names = tuple(
                n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit
            )
            return names if len(names) > 1 else names[0] if names else None

        return jax.tree.map(
            lambda spec, a: (
                a
                if a is None
                else jax.sharding.reshard(a, NamedSharding(self.mesh, P(*map(over_explicit, spec))))
            ),
            specs,
            args,
            is_leaf=lambda node: isinstance(node, P),
        )

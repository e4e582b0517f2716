"""One MoE layer of DeepSeek-V3's shape, forward and train step: jax_ep's
layer against a MaxText-style layer and a dense capacity-padded all_to_all layer.

    python -m bench.moe_layer --machine nvidia-h200        # hidden 7168, 256 experts, top-8,
                                                           # ffn 2048, shared expert, 4096 tokens
    python -m bench.moe_layer --hidden 256 --experts 16 --topk 4 --ffn 128 --tokens 32 \\
        --alignment 8                                      # small, e.g. on 8 CPU devices

Per rank T tokens on an EP mesh of every device; the same router (softmax top-k), SwiGLU experts
and shared expert (jax_ep.nn, bfloat16 weights) in every layer, and the experts as the same
grouped matmuls (jax_ep.nn.grouped: CUTLASS's or the Mosaic GPU kernels on Hopper):

- jax_ep: jax_ep.nn.moe_block. Expert-layout dispatch (FP8 with --fp8, groups aligned to
  --alignment rows), grouped matmuls, weighted combine with the shared expert as its bias.
- maxtext: MaxText's dropless path. Sort the T*K (token, expert) rows by expert,
  jax.lax.ragged_all_to_all to the experts' ranks (offsets from an all_gather of the counts),
  sort the received rows by local expert, grouped matmuls (groups not aligned, as MaxText's sort
  gives them), back the same way, weighted sum over the top-k, plus the shared expert. GPUs
  only: XLA:CPU has no ragged_all_to_all.
- lax_all_to_all: dense capacity-padded (GShard-style). Each rank fills [E, C, H] with
  C = ceil(--capacity-factor * T*K/E) rows per expert (rows past C drop), jax.lax.all_to_all,
  grouped matmuls of equal groups (R*C rows), all_to_all back, weighted sum, shared expert.

Each layer is timed whole ("total") and in parts, each part its own jitted program on the same
inputs (the parts before it run once before the timed loop; bench.harness.loop_seconds): routing
(router and top-k, plus what the layer does with the routing before sending: the sort of the
maxtext layer, the slot of every row of the padded one), dispatch, matmuls (experts and shared
expert), combine. "train" is the value and gradient of sum(y) with respect to the parameters and
x, of the layer and of each part. tokens/s counts the tokens of every rank. Also the grouped
matmul's forward rate at the layer's expert shape (balanced groups) against the dense batched
matmul of the same FLOPs, and with --fp8 --fp8-experts call|once on Hopper the FP8 forward's
rate ("fp8_tflops", the weights quantized as the layer does).
--fp8-down multiplies the down projection in FP8 too (MoEConfig.fp8_down), --fp8-dgrad the FP8
projections' row gradients (MoEConfig.fp8_dgrad). --trace adds each phase's kernel times on the
devices (the whole layer's program, bench.trace).
Writes bench/results/moe_layer/moe-layer-<machine>-<date>[-fp8-<fp8 experts>[-down][-dgrad]].json
and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from bench.baselines import exclusive_cumsum
from bench.grouped_matmul import forward_rates, fp8_forward_rate
from bench.harness import (
    common_arguments,
    loop_program,
    loop_seconds,
    new_record,
    relative_error,
    save_record,
)
from bench.trace import device_kernels, kernel_summary, print_summary
from jax_ep.nn import grouped, moe

IMPLS = ("jax_ep", "maxtext", "lax_all_to_all")
FP8_WEIGHTS = "fp8_weights"  # with --fp8-experts once: the params' entry of the FP8 weights
PARTS = ("routing", "dispatch", "matmuls", "combine")
AXIS = "ep"
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class JaxEpLayer:
    """jax_ep.nn's block, in the four parts moe_block is made of."""

    def __init__(self, buffer, cfg):
        self.buffer, self.cfg = buffer, cfg

    def routing(self, x, router):
        return moe.route(x, router, self.cfg)[:2]

    def dispatch(self, x, routed):
        capacity = moe.expert_capacity(self.cfg, x.shape[0], self.buffer.num_ranks)
        return self.buffer.dispatch(
            x,
            *routed,
            layout="expert",
            fp8=self.cfg.fp8,
            expert_alignment=self.cfg.expert_alignment,
            capacity=capacity,
        )

    def matmuls(self, d, x, weights):
        rows = self.buffer.dequantize(d, x) if self.cfg.fp8 else d.x
        fp8_weights = weights.get(FP8_WEIGHTS)
        return (
            moe.expert_ffn(
                weights,
                rows,
                d.group_sizes,
                self.cfg,
                fp8_rows=moe.fp8_rows(d, self.cfg, fp8_weights),
                fp8_weights=fp8_weights,
            ),
            moe.shared_expert(weights, x).astype(x.dtype),
        )

    def for_combine(self, d):
        return d._replace(x=None, scales=None)  # the rows themselves are not combined

    def combine(self, out, x, routed, d):
        rows, shared = out
        return self.buffer.combine(
            rows.astype(x.dtype),
            d.handle,
            topk_weights=d.topk_weights,
            bias=shared,
            partial_dtype=self.cfg.combine_partial_dtype,
        )

    def total(self, x, params):
        return moe.moe_block(
            self.buffer, params, x, self.cfg, (AXIS,), fp8_weights=params.get(FP8_WEIGHTS)
        )[0]


class MaxTextLayer:
    """MaxText's dropless layer: sort, ragged_all_to_all, sort, grouped matmuls, and back."""

    def __init__(self, cfg, num_ranks):
        self.cfg, self.num_ranks = cfg, num_ranks
        self.local = cfg.num_experts // num_ranks

    def routing(self, x, router):
        idx, weights = moe.route(x, router, self.cfg)[:2]
        experts = idx.reshape(-1)
        order = jnp.argsort(experts, stable=True)  # rows by expert, then (token, slot)
        counts = jnp.zeros(self.cfg.num_experts, jnp.int32).at[experts].add(1)
        return weights, order, counts

    def dispatch(self, x, routed):
        _, order, counts = routed
        r, k = self.num_ranks, self.cfg.num_topk
        rows = x[order // k]  # [T*K, H] sorted
        everyone = jax.lax.all_gather(counts, AXIS)  # [src, E]
        me = jax.lax.axis_index(AXIS)
        by_rank = everyone.reshape(r, r, self.local).sum(-1)  # [src, dst]
        # The output operand varies over the EP axis like the rows (its type is the result's
        # inside shard_map).
        received = jax.lax.ragged_all_to_all(
            rows,
            jax.lax.pcast(
                jnp.zeros((r * rows.shape[0], rows.shape[1]), rows.dtype), (AXIS,), to="varying"
            ),
            exclusive_cumsum(by_rank[me]),
            by_rank[me],
            exclusive_cumsum(by_rank, axis=0)[me],
            by_rank[:, me],
            axis_name=AXIS,
        )
        # Received rows come by (source rank, local expert): sort them by local expert.
        mine = jax.lax.dynamic_slice_in_dim(everyone, me * self.local, self.local, axis=1)
        expert_of_row = jnp.repeat(
            jnp.tile(jnp.arange(self.local), r),
            mine.reshape(-1),
            total_repeat_length=received.shape[0],
        )
        valid = jnp.arange(received.shape[0]) < mine.sum()
        local_order = jnp.argsort(jnp.where(valid, expert_of_row, self.local), stable=True)
        return received[local_order], local_order, mine.sum(axis=0), by_rank

    def matmuls(self, sent, x, weights):
        rows, _, group_sizes, _ = sent
        return (
            moe.expert_ffn(weights, rows, group_sizes, self.cfg, group_alignment=1),
            moe.shared_expert(weights, x).astype(x.dtype),
        )

    def for_combine(self, sent):
        return sent[1:]

    def combine(self, out, x, routed, kept):
        weights, order, _ = routed
        local_order, _, by_rank = kept
        rows, shared = out
        me = jax.lax.axis_index(AXIS)
        unsorted = jnp.zeros_like(rows).at[local_order].set(rows)
        back = jax.lax.ragged_all_to_all(
            unsorted,
            jax.lax.pcast(
                jnp.zeros((x.shape[0] * self.cfg.num_topk, x.shape[1]), rows.dtype),
                (AXIS,),
                to="varying",
            ),
            exclusive_cumsum(by_rank[:, me]),
            by_rank[:, me],
            exclusive_cumsum(by_rank, axis=1)[:, me],
            by_rank[me],
            axis_name=AXIS,
        )
        per_slot = jnp.zeros_like(back).at[order].set(back).reshape(x.shape[0], -1, x.shape[1])
        y = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), weights)
        return (y + shared.astype(jnp.float32)).astype(x.dtype)


class PaddedAllToAllLayer:
    """Dense capacity-padded layer: [E, C, H] per rank through jax.lax.all_to_all."""

    def __init__(self, cfg, num_ranks, tokens, capacity_factor):
        self.cfg, self.num_ranks = cfg, num_ranks
        self.local = cfg.num_experts // num_ranks
        self.capacity = max(1, math.ceil(capacity_factor * tokens * cfg.num_topk / cfg.num_experts))

    def routing(self, x, router):
        idx, weights = moe.route(x, router, self.cfg)[:2]
        hits = jax.nn.one_hot(idx.reshape(-1), self.cfg.num_experts, dtype=jnp.int32)
        slot = (jnp.cumsum(hits, axis=0) * hits).sum(-1) - 1  # row within expert
        return weights, idx.reshape(-1), slot

    def dispatch(self, x, routed):
        _, experts, slot = routed
        k, c = self.cfg.num_topk, self.capacity
        tokens = jnp.arange(experts.shape[0]) // k
        blocks = (
            jnp.zeros((self.cfg.num_experts, c, x.shape[1]), x.dtype)
            .at[experts, slot]
            .set(x[tokens], mode="drop")
        )  # slot >= C drops
        received = jax.lax.all_to_all(blocks, AXIS, 0, 0, tiled=True)  # [R * E_l, C, H]
        received = received.reshape(self.num_ranks, self.local, c, -1).swapaxes(0, 1)
        return received.reshape(-1, x.shape[1])  # by expert, source

    def matmuls(self, rows, x, weights):
        sizes = jnp.full(self.local, self.num_ranks * self.capacity, jnp.int32)
        return (
            moe.expert_ffn(
                weights, rows, sizes, self.cfg, group_alignment=self.num_ranks * self.capacity
            ),
            moe.shared_expert(weights, x).astype(x.dtype),
        )

    def for_combine(self, rows):
        return None

    def combine(self, out, x, routed, kept):
        weights, experts, slot = routed
        out, shared = out
        c, r = self.capacity, self.num_ranks
        blocks = out.reshape(self.local, r, c, -1).swapaxes(0, 1).reshape(-1, c, out.shape[-1])
        back = jax.lax.all_to_all(blocks, AXIS, 0, 0, tiled=True)  # [E, C, H]
        in_capacity = (slot < c).reshape(weights.shape)
        per_slot = back[experts, jnp.minimum(slot, c - 1)].reshape(weights.shape + (-1,))
        y = jnp.einsum(
            "tkh,tk->th", per_slot.astype(jnp.float32), jnp.where(in_capacity, weights, 0)
        )
        return (y + shared.astype(jnp.float32)).astype(x.dtype)


def _experts_weights(params):
    return {k: v for k, v in params.items() if k != "router"}


def stages(layer):
    """The layer's parts: for each, (prologue of (x, params) -> the part's inputs, the part).
    Each part gets only what it uses (its gradients are then only those it makes)."""

    def routed(x, params):
        return layer.routing(x, params["router"])

    def sent(x, params):
        return layer.dispatch(x, routed(x, params))

    def combine_inputs(x, params):
        r = routed(x, params)
        s = layer.dispatch(x, r)
        return layer.matmuls(s, x, _experts_weights(params)), x, r, layer.for_combine(s)

    return {
        "routing": (lambda x, params: (x, params["router"]), layer.routing),
        "dispatch": (lambda x, params: (x, routed(x, params)), layer.dispatch),
        "matmuls": (
            lambda x, params: (sent(x, params), x, _experts_weights(params)),
            layer.matmuls,
        ),
        "combine": (combine_inputs, layer.combine),
    }


def total(layer):
    if isinstance(layer, JaxEpLayer):
        return layer.total

    def forward(x, params):
        r = layer.routing(x, params["router"])
        s = layer.dispatch(x, r)
        return layer.combine(
            layer.matmuls(s, x, _experts_weights(params)), x, r, layer.for_combine(s)
        )

    return forward


def trained(fn):
    """fn's value and gradient, sum of its floating-point outputs, with respect to its
    floating-point inputs (the train step of fn alone)."""

    def step(*args):
        leaves, tree = jax.tree.flatten(args)
        where = [i for i, leaf in enumerate(leaves) if jnp.dtype(leaf.dtype) in _FLOATS]

        def objective(floats):
            full = list(leaves)
            for i, value in zip(where, floats):
                full[i] = value
            out = fn(*jax.tree.unflatten(tree, full))
            return sum(
                jnp.sum(o.astype(jnp.float32))
                for o in jax.tree.leaves(out)
                if jnp.dtype(o.dtype) in _FLOATS
            )

        return jax.value_and_grad(objective)([leaves[i] for i in where])

    return step


def unavailable(impl, platform):
    """Why impl cannot run on this platform (None when it can)."""
    if impl == "maxtext" and platform == "cpu":
        return "XLA:CPU has no ragged_all_to_all"
    return None


def build(impl, mesh, cfg, tokens, capacity_factor, buffer_impl, num_sms=None):
    r = mesh.shape[AXIS]
    if impl == "jax_ep":
        buffer = jax_ep.Buffer(
            mesh,
            AXIS,
            num_experts=cfg.num_experts,
            hidden=cfg.hidden,
            num_topk=cfg.num_topk,
            max_tokens_per_rank=tokens,
            impl=buffer_impl,
            **({} if num_sms is None else {"num_sms": num_sms}),
        )
        return JaxEpLayer(buffer, cfg)
    if impl == "maxtext":
        return MaxTextLayer(cfg, r)
    return PaddedAllToAllLayer(cfg, r, tokens, capacity_factor)


def layer_specs(params):
    """(x, params) specs: tokens and experts split over the EP axis (the FP8 weights too)."""
    specs = moe.param_specs(params, AXIS)
    if FP8_WEIGHTS in params:
        specs[FP8_WEIGHTS] = jax.tree.map(lambda _: P(AXIS), params[FP8_WEIGHTS])
    return P(AXIS), specs


TRACE_STEPS = 3


def bench_layer(impl, layer, mesh, x, params, counts, repeats, phases, trace=False):
    specs = layer_specs(params)
    args = (x, params)
    tokens = x.shape[0]
    results = []
    for phase in phases:

        def seconds(step, prologue=None):
            return loop_seconds(
                trained(step) if phase == "train" else step,
                args,
                counts,
                repeats,
                mesh,
                specs,
                prologue,
            )

        parts = {}
        for name, (prologue, part) in stages(layer).items():
            parts[name] = seconds(part, prologue) * 1e3
        whole = seconds(total(layer))
        results.append(
            dict(
                impl=impl,
                phase=phase,
                tokens_per_rank=tokens // mesh.size,
                time_ms=whole * 1e3,
                tokens_per_s=tokens / whole,
                parts=parts,
            )
        )
        print(
            f"  {impl:15s} {phase:7s} total {whole * 1e3:9.3f} ms  "
            + "  ".join(f"{name} {ms:8.3f}" for name, ms in parts.items()),
            flush=True,
        )
        if trace:  # the whole layer's program once more, under the profiler
            step = trained(total(layer)) if phase == "train" else total(layer)
            run = functools.partial(loop_program(step, mesh, specs), TRACE_STEPS)
            jax.block_until_ready(run(*args))
            results[-1]["kernels"] = kernel_summary(device_kernels(run, args), TRACE_STEPS, 24)
            print(f"  {impl} {phase}: device kernels per step", flush=True)
            print_summary(results[-1]["kernels"], top=24)
    return results


def outputs(layer, mesh, x, params):
    specs = layer_specs(params)
    return np.asarray(
        jax.jit(jax.shard_map(total(layer), mesh=mesh, in_specs=specs, out_specs=P(AXIS)))(
            x, params
        ),
        np.float32,
    )


def table(results):
    lines = [
        f"{'impl':15s} {'phase':7s} {'tokens':>7s} {'total ms':>9s} {'tokens/s':>11s} "
        + " ".join(f"{p:>9s}" for p in PARTS)
    ]
    for r in results:
        lines.append(
            f"{r['impl']:15s} {r['phase']:7s} {r['tokens_per_rank']:7d} "
            f"{r['time_ms']:9.3f} {r['tokens_per_s']:11.4g} "
            + " ".join(f"{r['parts'][p]:9.3f}" for p in PARTS)
        )
    return "\n".join(lines)


def plot(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("forward", "train")
    fig, axes = plt.subplots(1, len(phases), figsize=(11, 4.2))
    for ax, phase in zip(axes, phases):
        rows = [r for r in record["results"] if r["phase"] == phase]
        names = [r["impl"] for r in rows]
        bottom = np.zeros(len(rows))
        for part in PARTS:
            values = np.array([r["parts"][part] for r in rows])
            ax.bar(names, values, bottom=bottom, label=part)
            bottom += values
        ax.scatter(
            names, [r["time_ms"] for r in rows], color="black", zorder=3, label="whole layer"
        )
        ax.set_ylabel("ms per layer (parts stacked)")
        ax.set_title(f"{phase}, {record['num_ranks']} x {record['device']}")
        ax.legend()
    fig.suptitle(
        f"MoE layer: H={record['hidden']}, {record['num_experts']} experts, "
        f"top-{record['num_topk']}, ffn {record['ffn']}, "
        f"{record['results'][0]['tokens_per_rank']} tokens/rank, {record['machine']}, "
        f"{record['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--shared-ffn", type=int, default=2048)
    parser.add_argument("--alignment", type=int, default=128, help="jax_ep's expert_alignment")
    parser.add_argument(
        "--grouped-matmul",
        default="auto",
        choices=grouped.IMPLS,
        help="jax_ep's grouped-matmul impl (MoEConfig.grouped_matmul)",
    )
    parser.add_argument("--fp8", action="store_true", help="jax_ep dispatches FP8 rows")
    parser.add_argument(
        "--fp8-experts",
        choices=("off", "call", "once"),
        default="off",
        help="with --fp8: the gate/up projections dequantize the rows (off) or "
        "multiply them in FP8, the weights quantized in each call (call) or "
        "once beforehand, outside the timed loop (once)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        help="rows per expert of the padded layer, x the balanced count",
    )
    parser.add_argument(
        "--fp8-down",
        action="store_true",
        help="with --fp8-experts: the down projection multiplies FP8 too (MoEConfig.fp8_down)",
    )
    parser.add_argument(
        "--fp8-dgrad",
        action="store_true",
        help="with --fp8-experts: the FP8 projections' row gradients are FP8 products too "
        "(MoEConfig.fp8_dgrad)",
    )
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--phases", default="forward,train")
    parser.add_argument("--buffer-impl", default="auto", help="jax_ep.Buffer impl")
    parser.add_argument(
        "--num-sms", type=int, default=None, help="jax_ep.Buffer num_sms (default: the Buffer's)"
    )
    parser.add_argument("--counts", default="1,3", help="loop lengths timed (low,high)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also record the whole layer's kernel times on the devices (profiler)",
    )
    common_arguments(parser, "moe_layer")
    args = parser.parse_args(argv)
    counts = tuple(int(c) for c in args.counts.split(","))
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    num_ranks, platform = mesh.size, devices[0].platform
    cfg = moe.MoEConfig(
        num_experts=args.experts,
        num_topk=args.topk,
        hidden=args.hidden,
        ffn_hidden=args.ffn,
        shared_ffn_hidden=args.shared_ffn,
        expert_alignment=args.alignment,
        grouped_matmul=args.grouped_matmul,
        fp8=args.fp8,
        fp8_experts=args.fp8_experts == "call",
        fp8_down=args.fp8_down,
        fp8_dgrad=args.fp8_dgrad,
        combine_partial_dtype=jnp.bfloat16,
    )
    params = moe.init_params(jax.random.key(0), cfg, jnp.bfloat16, mesh=mesh, expert_axis=AXIS)
    jax_ep_params = params
    if args.fp8 and args.fp8_experts == "once":
        quantize = functools.partial(
            moe.quantize_expert_weights, down=args.fp8_down, dgrad=args.fp8_dgrad
        )
        jax_ep_params = dict(params, **{FP8_WEIGHTS: jax.jit(quantize)(params)})
    x = jax.device_put(
        jax.random.normal(jax.random.key(1), (num_ranks * args.tokens, args.hidden), jnp.bfloat16),
        NamedSharding(mesh, P(AXIS)),
    )
    paths = moe.grouped_matmul_path(
        dataclasses.replace(cfg, fp8_experts=args.fp8_experts != "off"), num_ranks, args.tokens
    )
    print(
        f"{num_ranks} x {devices[0].device_kind}, jax {jax.__version__}: {args.tokens} "
        f"tokens/rank, H {args.hidden}, {args.experts} experts, top-{args.topk}, ffn "
        f"{args.ffn}; jax_ep grouped matmuls: {paths}",
        flush=True,
    )
    results, skipped, checks, reference = [], {}, {}, None
    for impl in args.impls.split(","):
        if unavailable(impl, platform):
            skipped[impl] = unavailable(impl, platform)
            print(f"  {impl}: skipped ({skipped[impl]})", flush=True)
            continue
        layer = build(
            impl, mesh, cfg, args.tokens, args.capacity_factor, args.buffer_impl, args.num_sms
        )
        layer_params = jax_ep_params if impl == "jax_ep" else params
        try:
            y = outputs(layer, mesh, x, layer_params)
            if reference is None:
                reference = y
            checks[impl] = relative_error(y, reference)
            print(
                f"  {impl}: relative difference of y from {args.impls.split(',')[0]}'s: "
                f"{checks[impl]:.3g}",
                flush=True,
            )
            results += bench_layer(
                impl,
                layer,
                mesh,
                x,
                layer_params,
                counts,
                args.repeats,
                args.phases.split(","),
                args.trace,
            )
        except Exception as e:  # noqa: BLE001  (one layer failing leaves the others' numbers)
            skipped[impl] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"  {impl}: {skipped[impl]}", flush=True)
    print(table(results))
    local = args.experts // num_ranks
    per_group = args.tokens * args.topk // local
    balanced = np.full(local, -(-per_group // args.alignment) * args.alignment, np.int32)
    rows = int(balanced.sum())
    rate, dense_rate = forward_rates(
        rows, args.hidden, args.ffn, balanced, args.grouped_matmul, args.alignment
    )
    bf16 = dataclasses.replace(cfg, fp8=False, fp8_down=False, fp8_dgrad=False)
    bf16_impl = moe.grouped_matmul_path(bf16, num_ranks, args.tokens)
    matmul = dict(impl=bf16_impl["gate_up"], tflops=rate, dense_tflops=dense_rate)
    print(
        f"grouped matmul ({bf16_impl['gate_up']}, {local} groups of {balanced[0]} rows, "
        f"{args.hidden} x {args.ffn}): {rate:.1f} TFLOP/s, dense batched {dense_rate:.1f}"
    )
    if "_fp8" in paths["gate_up"]:
        once = args.fp8_experts == "once"
        matmul["fp8_tflops"] = fp8_forward_rate(
            rows,
            args.hidden,
            args.ffn,
            balanced,
            args.alignment,
            prequantized=once,
            impl=paths["gate_up"].split("_fp8")[0],
        )
        print(
            f"  FP8 forward (weights quantized {'beforehand' if once else 'in the call'}): "
            f"{matmul['fp8_tflops']:.1f} TFLOP/s"
        )
    record = new_record(
        args,
        "bench.moe_layer",
        argv,
        config="moe_layer",
        num_ranks=num_ranks,
        device=devices[0].device_kind,
        jax_version=jax.__version__,
        tokens_per_rank=args.tokens,
        hidden=args.hidden,
        num_experts=args.experts,
        num_topk=args.topk,
        ffn=args.ffn,
        shared_ffn=args.shared_ffn,
        expert_alignment=args.alignment,
        grouped_matmul_impl=args.grouped_matmul,
        fp8=args.fp8,
        fp8_experts=args.fp8_experts if args.fp8 else None,
        fp8_down=args.fp8_down,
        fp8_dgrad=args.fp8_dgrad,
        capacity_factor=args.capacity_factor,
        buffer_impl=args.buffer_impl,
        num_sms=args.num_sms,
        combine_partial_dtype=jnp.dtype(cfg.combine_partial_dtype).name,
        results=results,
        skipped=skipped,
        relative_difference_of_y=checks,
        grouped_matmul=matmul,
    )
    stem = save_record(
        record,
        args.out,
        "moe-layer",
        (
            f"-fp8-{args.fp8_experts}"
            + ("-down" if args.fp8_down else "")
            + ("-dgrad" if args.fp8_dgrad else "")
        )
        if args.fp8
        else "",
    )
    if not args.no_plot and results:
        try:
            plot(record, stem + ".png")
        except ImportError:
            print("matplotlib missing: no plot")
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()

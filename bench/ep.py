"""Dispatch and combine: jax_ep against the JAX-native baselines, in one run.

    python -m bench.ep --config v3          # 4096 tokens/rank, H 7168, 256 experts, top-8
    python -m bench.ep --config ll          # 128 tokens/rank, same model

Each op runs many times back to back inside one jitted program; the time per op is the
difference between two program lengths divided by the extra ops (launch and sync cost cancel),
less the per-step cost of the harness itself (measured in the same run). Bytes follow
DeepEP's convention: logical = rows received including the local ones, physical = rows that
crossed NVLink; FP8 rows count H bytes + H/128 float32 scales, BF16 rows 2H bytes.
Writes bench/results/<config>-<machine>-<date>.json and a PNG; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from bench.baselines import AllToAll, RaggedAllToAll
from bench.harness import common_arguments, copy_engine_gbps, new_record, save_record
from bench.trace import device_kernels, kernel_summary, print_summary

CONFIGS = {
    "v3": dict(
        tokens=4096,
        hidden=7168,
        num_experts=256,
        num_topk=8,
        sweep=(128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        steps=(2, 12),
    ),
    "ll": dict(
        tokens=128,
        hidden=7168,
        num_experts=256,
        num_topk=8,
        sweep=(1, 8, 32, 128, 256),
        steps=(4, 44),
    ),
}
IMPLS = ("jax_ep", "lax_all_to_all", "lax_ragged_all_to_all")
GRAPH_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,COLLECTIVES"
    " --xla_gpu_graph_min_graph_size=1"
)
# Commands of a command buffer ordered by the buffers they share, not by program order: what lets
# a matmul run beside a send half on one GPU.
CONCURRENT_FLAGS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
# jax_ep variants: (mode, layout, cached). "jax_ep" lets the Buffer choose (low-latency kernels up
# to 256 tokens per rank); the others force one family, time the expert_padded decode layout, or
# time dispatch with a cached handle (only x moves: the routing work of a fresh dispatch is left
# out).
JAX_EP = {
    "jax_ep": ("auto", "rank", False),
    "jax_ep_normal": ("normal", "rank", False),
    "jax_ep_low_latency": ("low_latency", "rank", False),
    "jax_ep_padded": ("auto", "expert_padded", False),
    "jax_ep_cached": ("auto", "rank", True),
}


def routing(rng, num_ranks, tokens, num_experts, num_topk):
    """Uniform random top-k (distinct experts per token), [R*T, K]."""
    scores = rng.random((num_ranks * tokens, num_experts))
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def wire_rows(topk_idx, num_ranks, num_experts):
    """rows[s, d]: tokens rank s sends to rank d (once per rank)."""
    per_rank = topk_idx.reshape(num_ranks, -1, topk_idx.shape[1]) // (num_experts // num_ranks)
    hit = (per_rank[..., None] == np.arange(num_ranks)).any(axis=2)  # [s, T, d]
    return hit.sum(axis=1)


class Timer:
    """Per-op time of `step(carry) -> carry`: two jitted programs run it `short` and `long`
    times back to back after `prologue(x, topk_idx)`; the difference of their times over the
    extra steps cancels launch, prologue and sync costs."""

    def __init__(self, mesh, prologue, step, short=2, long=12):
        spec = P("ep")

        def program(n):
            def body(x, idx):
                carry = prologue(x, idx)
                for _ in range(n):
                    carry = step(carry)
                # Everything the steps made is an output: nothing in it is dead code.
                return jax.tree.map(
                    lambda a: a.reshape((1,) + a.shape) if a.ndim == 0 else a, carry
                )

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))

        self.steps, self.long_steps = long - short, long
        self.short, self.long = program(short), program(long)
        self.kernels = None

    def __call__(self, args, repeats=5, trace=None):  # args = (x, topk_idx)
        """Seconds per step; with `trace` (a label) also the device kernels, in self.kernels."""

        def seconds(fn):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return time.perf_counter() - start

        seconds(self.short), seconds(self.long)  # compile and warm up
        short = min(seconds(self.short) for _ in range(repeats))
        long = min(seconds(self.long) for _ in range(repeats))
        if trace:  # the long program once more, under the profiler
            print(f"  {trace}: device kernels per step of the long program:", flush=True)
            self.kernels = kernel_summary(device_kernels(self.long, args), self.long_steps)
            print_summary(self.kernels)
        return (long - short) / self.steps


def repeat(op):
    """A step running op(input, routing) again. Every step's output stays a program output (no
    step is dead code) and the next input depends on it through one element (no two steps are
    the same computation, so XLA can neither merge nor reorder them)."""

    def step(carry):
        value, routing, outputs = carry
        out = op(value, routing)
        tick = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32) * 0
        value = value.at[0, 0].add(tick.astype(value.dtype))
        return value, routing, outputs + (out,)

    return step


def harness_seconds(mesh, x, idx, steps):
    """Per-step time of the timing harness itself (the step's tick, an op that only slices):
    subtracted from every implementation's time."""
    return Timer(mesh, lambda x, i: (x, i, ()), repeat(lambda v, i: (v[:1],)), *steps)((x, idx))


def bench_size(mesh, cfg, tokens, impls, num_sms, fp8, rng, check, steps=(2, 12), trace=False):
    num_ranks = mesh.size
    hidden, num_experts, num_topk = cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    sharding = NamedSharding(mesh, P("ep"))
    idx_np = routing(rng, num_ranks, tokens, num_experts, num_topk)
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((num_ranks * tokens, hidden)), jnp.bfloat16), sharding
    )
    idx = jax.device_put(jnp.asarray(idx_np), sharding)
    rows = wire_rows(idx_np, num_ranks, num_experts)
    dispatch_row = hidden + hidden // 128 * 4 if fp8 else 2 * hidden
    combine_row = 2 * hidden
    received = rows.sum(axis=0).mean()  # per rank, local rows included
    crossed = (rows.sum() - np.trace(rows)) / num_ranks  # per rank, over NVLink
    spec = P("ep")
    results, outputs = [], {}
    harness = harness_seconds(mesh, x, idx, steps)
    print(f"  harness: {harness * 1e6:.1f} us per step (subtracted)", flush=True)
    for impl in impls:
        mode, lay, cached = JAX_EP.get(impl, (None, None, False))
        if impl in JAX_EP:
            buf = jax_ep.Buffer(
                mesh,
                "ep",
                num_experts=num_experts,
                hidden=hidden,
                num_topk=num_topk,
                max_tokens_per_rank=tokens,
                num_sms=num_sms,
            )

            def dispatch(x, idx, buf=buf, mode=mode, lay=lay):
                d = buf.dispatch(x, idx, fp8=fp8, mode=mode, layout=lay)
                return d, (d.x, d.scales) if fp8 else (d.x,)

            def combine(rows, d, buf=buf):
                weights = None if d.handle.layout == "rank" else d.topk_weights
                return buf.combine(rows, d.handle, topk_weights=weights)

            def expert_rows(d):
                if not fp8:
                    return d.x
                return jax_ep.dequantize_fp8(d.x, d.scales).astype(jnp.bfloat16)
        else:
            base = (AllToAll if impl == "lax_all_to_all" else RaggedAllToAll)(
                "ep", num_ranks, num_experts
            )

            def dispatch(x, idx, base=base):
                parts, ctx = base.dispatch(x, idx, fp8)
                return (parts, ctx), tuple(parts)

            def combine(rows, d, base=base):
                return base.combine(rows, d[1])

            def expert_rows(d):
                parts = d[0]
                if not fp8:
                    return parts[0]
                q = jax.lax.bitcast_convert_type(parts[0], jnp.float8_e4m3fn)
                return jax_ep.dequantize_fp8(q, parts[1]).astype(jnp.bfloat16)

        def dispatch_outputs(x, idx, dispatch=dispatch):
            return dispatch(x, idx)[1]

        def dispatch_prologue(x, idx):
            return x, idx, ()

        if cached:  # the steps' routing is the handle of one fresh dispatch

            def dispatch_outputs(x, handle, buf=buf):
                d = buf.dispatch(x, handle=handle, fp8=fp8)
                return (d.x, d.scales) if fp8 else (d.x,)

            def dispatch_prologue(x, idx, dispatch=dispatch):
                return x, dispatch(x, idx)[0].handle, ()

        # Combine needs the routing of a dispatch: one runs first.
        def combine_prologue(x, idx, dispatch=dispatch, expert_rows=expert_rows):
            d, _ = dispatch(x, idx)
            return expert_rows(d), d, ()

        def round_trip(x, idx, prologue=combine_prologue, combine=combine):
            rows, d, _ = prologue(x, idx)
            return combine(rows, d)

        timers = {
            "dispatch": Timer(mesh, dispatch_prologue, repeat(dispatch_outputs), *steps),
            "combine": Timer(mesh, combine_prologue, repeat(combine), *steps),
        }
        raw = {}
        for op, timer in timers.items():
            raw[op] = timer((x, idx), trace=f"{impl} {op}" if trace else None)
        if check and impl != "jax_ep_padded":  # weighted (by 0): not the same round trip
            # Finished before this impl's Buffer can be collected (a closed Buffer fails its
            # queued ops).
            outputs[impl] = jax.block_until_ready(
                jax.jit(
                    jax.shard_map(round_trip, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
                )(x, idx)
            )
        for op, row in (("dispatch", dispatch_row), ("combine", combine_row)):
            seconds = raw[op] - harness
            results.append(
                dict(
                    impl=impl,
                    op=op,
                    tokens_per_rank=tokens,
                    time_us=seconds * 1e6,
                    raw_time_us=raw[op] * 1e6,
                    harness_us=harness * 1e6,
                    logical_gbps=received * row / seconds / 1e9,
                    physical_gbps=crossed * row / seconds / 1e9,
                    num_sms=num_sms if impl in JAX_EP else None,
                    mode=mode,
                    layout=lay,
                    dtype="fp8" if op == "dispatch" and fp8 else "bf16",
                    **({"kernels": timers[op].kernels} if trace else {}),
                )
            )
    if check:  # every implementation routed the same way: same round trip
        ref = np.asarray(outputs[impls[0]], np.float32)
        for r in results:
            if r["impl"] in outputs:
                r["max_abs_diff_vs_" + impls[0]] = float(
                    np.abs(np.asarray(outputs[r["impl"]], np.float32) - ref).max()
                )
        for impl in outputs:
            diff = float(np.abs(np.asarray(outputs[impl], np.float32) - ref).max())
            print(f"  check {impl}: max |round trip - {impls[0]}| = {diff:.3g}", flush=True)
    return results


def bench_overlap(mesh, cfg, tokens, num_sms, fp8, rng, steps, matmul=2048, trace=False):
    """Split dispatch and combine with a matmul between each send and recv (run_between),
    against the two alone: the overlap saves what `apart - together` says; on GPUs only with
    --concurrent (command buffers whose commands XLA orders by the buffers they share). With
    `trace`, each variant's kernels."""
    num_ranks, hidden = mesh.size, cfg["hidden"]
    sharding = NamedSharding(mesh, P("ep"))
    idx = jax.device_put(
        jnp.asarray(routing(rng, num_ranks, tokens, cfg["num_experts"], cfg["num_topk"])), sharding
    )
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((num_ranks * tokens, hidden)), jnp.bfloat16), sharding
    )
    buf = jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=cfg["num_experts"],
        hidden=hidden,
        num_topk=cfg["num_topk"],
        max_tokens_per_rank=tokens,
        num_sms=num_sms,
        timeout_s=10.0,
    )
    weights = [jnp.full((matmul, matmul), w, jnp.bfloat16) for w in (0.01, 0.02)]

    def busy(value, which):  # compute that does not depend on the communication; the two
        weight = weights[which]  # differ, or XLA would compute them once
        return (jnp.broadcast_to(value[:1, :1], (matmul, matmul)) + weight) @ weight

    def layer(comm=True, work=True):
        def op(value, idx):
            if not comm:
                out = (busy(value, 0), busy(value, 1))
            else:
                p = buf.dispatch_send(value, idx, fp8=fp8)
                out = ()
                if work:
                    p, m = p.run_between(lambda v: busy(v, 0), value)
                    out += (m,)
                d = buf.dispatch_recv(p)
                rows = (jax_ep.dequantize_fp8(d.x, d.scales) if fp8 else d.x).astype(jnp.bfloat16)
                p = buf.combine_send(rows, d.handle)
                if work:
                    p, m = p.run_between(lambda v: busy(v, 1), rows)
                    out += (m,)
                out += (buf.combine_recv(p),)
            # The next step waits for all of this one: XLA may neither merge steps' matmuls nor
            # start a send before the previous step's recv (a kind's halves run in order).
            return (sum(o.reshape(-1)[0].astype(jnp.float32) for o in out),) + out

        return op

    harness = harness_seconds(mesh, x, idx, steps)

    kernels = {}

    def time(op, name):
        timer = Timer(mesh, lambda x, i: (x, i, ()), repeat(op), *steps)
        seconds = timer((x, idx), trace=f"overlap, {name}" if trace else None)
        if trace:
            kernels[name] = timer.kernels
        return (seconds - harness) * 1e6

    out = dict(
        tokens_per_rank=tokens,
        matmul=matmul,
        harness_us=harness * 1e6,
        comm_us=time(layer(work=False), "comm"),
        matmuls_us=time(layer(comm=False), "matmuls"),
        together_us=time(layer(), "together"),
    )
    print("  overlap:", json.dumps(out), flush=True)
    return dict(out, kernels=kernels) if trace else out


def table(results):
    """The results as text; with --trace also each op's device busy time per step (slowest GPU)."""
    traced = any("kernels" in r for r in results)
    lines = [
        f"{'impl':24s} {'op':9s} {'tokens':>7s} {'time us':>10s} {'logical':>9s} "
        f"{'physical':>9s}" + (f" {'device us':>10s}" if traced else "")
    ]
    for r in results:
        busy = max((s["busy_us_per_step"] for s in r.get("kernels", {}).values()), default=0.0)
        lines.append(
            f"{r['impl']:24s} {r['op']:9s} {r['tokens_per_rank']:7d} "
            f"{r['time_us']:10.1f} {r['logical_gbps']:9.1f} {r['physical_gbps']:9.1f}"
            + (f" {busy:10.1f}" if traced else "")
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="v3")
    parser.add_argument(
        "--tokens",
        default=None,
        help="comma-separated tokens per rank (default: the config's sweep)",
    )
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--bf16", action="store_true", help="BF16 dispatch instead of FP8")
    common_arguments(parser)
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="run under XLA command buffers (CUDA graphs), as decode loops do",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="--graphs with independent commands run concurrently (%s)" % CONCURRENT_FLAGS,
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also time split ops around a matmul (the config's token count)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also record each op's kernel times on the devices (profiler)",
    )
    args = parser.parse_args(argv)
    cfg = CONFIGS[args.config]
    args.graphs |= args.concurrent
    flags = [GRAPH_FLAGS] * args.graphs + [CONCURRENT_FLAGS] * args.concurrent
    if flags:  # before the backend starts
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    impls = tuple(args.impls.split(","))
    sizes = [int(t) for t in args.tokens.split(",")] if args.tokens else list(cfg["sweep"])
    p2p = p2p_both = None
    if len(devices) > 1 and devices[0].platform == "gpu":
        p2p, p2p_both = copy_engine_gbps(False), copy_engine_gbps(True)
        if p2p is None or p2p_both is None:
            print(
                "peer copy bandwidth: not measured (needs bench._probe: bench/probe.py says how "
                "to build it)",
                flush=True,
            )
        else:
            print(
                f"peer copy GPU0 -> GPU1 (copy engine): {p2p:.1f} GB/s; both directions at "
                f"once: {p2p_both:.1f} GB/s each",
                flush=True,
            )
    rng = np.random.default_rng(0)
    results = []
    for i, tokens in enumerate(sizes):
        print(f"tokens/rank {tokens} ...", flush=True)
        results += bench_size(
            mesh,
            cfg,
            tokens,
            impls,
            args.num_sms,
            not args.bf16,
            rng,
            check=i == 0,
            steps=cfg["steps"],
            trace=args.trace,
        )
    print(table(results))
    overlap = (
        bench_overlap(
            mesh,
            cfg,
            cfg["tokens"],
            args.num_sms,
            not args.bf16,
            rng,
            cfg["steps"],
            trace=args.trace,
        )
        if args.overlap
        else None
    )
    record = new_record(
        args,
        "ep",
        argv,
        config=args.config,
        num_ranks=len(devices),
        device=devices[0].device_kind,
        p2p_copy_gbps=p2p,
        p2p_copy_both_ways_gbps=p2p_both,
        hidden=cfg["hidden"],
        num_experts=cfg["num_experts"],
        num_topk=cfg["num_topk"],
        jax_version=jax.__version__,
        results=results,
        command_buffers=args.graphs,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        overlap=overlap,
    )
    stem = save_record(
        record,
        args.out,
        args.config,
        "-concurrent" if args.concurrent else "-graphs" if args.graphs else "",
    )
    if not args.no_plot:
        from bench.plot import plot

        plot([record], stem + ".png")
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()

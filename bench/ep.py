"""Dispatch and combine: jax_ep against the JAX-native baselines, in one run.

    python -m bench.ep --config v3          # 4096 tokens/rank, H 7168, 256 experts, top-8
    python -m bench.ep --config ll          # 128 tokens/rank, same model
    python -m bench.ep --config ll --nodes 2  # a ("node", "ep") Buffer and each of its legs

Each op runs many times back to back inside one jitted program; the time per op is the
difference between two program lengths divided by the extra ops (launch and sync cost cancel),
less the per-step cost of the harness itself (measured in the same run). Bytes follow
DeepEP's convention: logical = rows received including the local ones, physical = rows that
crossed NVLink; FP8 rows count H bytes + H/128 float32 scales, BF16 rows 2H bytes.
With --nodes M the devices form a ("node", "ep") mesh of M x (devices / M), and the run times
the tuple-axis Buffer's dispatch and combine whole and each of its two legs alone (bench_nodes).
Writes bench/results/ops/<config>-<machine>-<date>.json and a PNG; prints a table.
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
from bench.harness import common_arguments, copy_engine_gbps, new_record, perturbed, save_record
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
HARNESS_WARN_S = 20e-6
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
    times back to back after `prologue(x, topk_idx)` (both split over every mesh axis); the
    difference of their times over the extra steps cancels launch, prologue and sync costs."""

    def __init__(self, mesh, prologue, step, short=2, long=12):
        spec = P(tuple(mesh.axis_names))  # rank-major rows over every mesh axis

        def program(n):
            def body(x, idx):
                value, routing, outputs = prologue(x, idx)
                carry = value, routing, outputs, value[(0,) * value.ndim]
                for _ in range(n):
                    carry = step(carry)
                carry = carry[:3]
                # Everything the steps made is an output: nothing in it is dead code.
                return jax.tree.map(
                    lambda a: a.reshape((1,) + a.shape) if a.ndim == 0 else a, carry
                )

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))

        self.steps = long - short
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
        if trace:
            self.trace(args, trace)
        return (long - short) / self.steps

    def trace(self, args, label):
        """Both programs once more, under the profiler: the steps' kernels (kernel_summary), in
        self.kernels, printed under `label`."""
        print(f"  {label}: device kernels per step:", flush=True)
        self.kernels = kernel_summary(
            device_kernels(self.long, args), self.steps, fewer=device_kernels(self.short, args)
        )
        print_summary(self.kernels)
        return self.kernels


def repeat(op):
    """A step running op(input, routing) again. Every step's output stays a program output (no
    step is dead code) and the next input depends on it through one element (no two steps are
    the same computation, so XLA can neither merge nor reorder them). That element is set to
    its value read before the first step (carried as `kept`), not added to: where the step read
    the element it wrote, XLA copied the whole input every step of the harness's own program
    but not of the ops' (the harness took 31-54 us a step at V3 4096 on 2026-12-05, 4 us
    without the copy), and subtracting it made the ops' times too small."""

    def step(carry):
        value, routing, outputs, kept = carry
        out = op(value, routing)
        (value,) = perturbed((value,), 0, jax.tree.leaves(out)[0].reshape(-1)[0], kept)
        return value, routing, outputs + (out,), kept

    return step


def harness_seconds(mesh, x, idx, steps, trace=False):
    """Per-step time of the timing harness itself (the step's tick, an op that only slices):
    subtracted from every implementation's time. With trace, its kernels are printed: a copy
    among them would be subtracted from ops that do not make it."""
    seconds = harness_timer(mesh, steps)((x, idx), trace="harness" if trace else None)
    if seconds > HARNESS_WARN_S:  # 3-5 us a step where XLA copies nothing
        print(
            f"WARNING: the harness takes {seconds * 1e6:.1f} us a step: XLA likely copies x every "
            "step of its program (at V3 4096 with --steps 2,52, 50 us on an H100), and every op's "
            "time_us subtracts it: use raw_time_us",
            flush=True,
        )
    return seconds


def harness_timer(mesh, steps):
    """A Timer of the harness alone: each step's tick and an op that only slices."""
    return Timer(mesh, lambda x, i: (x, i, ()), repeat(lambda v, i: (v[:1],)), *steps)


def buffer_ops(buf, fp8, mode="auto", lay="rank", capacity=None):
    """A Buffer's ops as the timers take them: dispatch(x, idx) -> (result, its arrays),
    combine(rows, result) and expert_rows(result) (the rows combine gets: dequantized FP8).
    capacity: the expert_padded layout's rows per expert (None: the worst case)."""

    def dispatch(x, idx):
        d = buf.dispatch(
            x,
            idx,
            fp8=fp8,
            mode=mode,
            layout=lay,
            capacity=capacity if lay == "expert_padded" else None,
        )
        return d, (d.x, d.scales) if fp8 else (d.x,)

    def combine(rows, d):
        weights = None if d.handle.layout == "rank" else d.topk_weights
        return buf.combine(rows, d.handle, topk_weights=weights)

    def expert_rows(d):
        if not fp8:
            return d.x
        return jax_ep.dequantize_fp8(d.x, d.scales).astype(jnp.bfloat16)

    return dispatch, combine, expert_rows


def op_timers(mesh, dispatch, combine, expert_rows, steps):
    """Timers of dispatch (a fresh routing each step) and of combine (the rows of one dispatch,
    which runs first: combine needs its routing)."""

    def combine_prologue(x, idx):
        d, _ = dispatch(x, idx)
        return expert_rows(d), d, ()

    return {
        "dispatch": Timer(
            mesh, lambda x, idx: (x, idx, ()), repeat(lambda x, idx: dispatch(x, idx)[1]), *steps
        ),
        "combine": Timer(mesh, combine_prologue, repeat(combine), *steps),
    }


def cached_dispatch_timer(mesh, buf, dispatch, fp8, steps):
    """A Timer of buf's dispatch with a cached handle, that of one fresh dispatch (buffer_ops's
    `dispatch`) before the steps."""

    def cached_outputs(x, handle):
        d = buf.dispatch(x, handle=handle, fp8=fp8)
        return (d.x, d.scales) if fp8 else (d.x,)

    def cached_prologue(x, idx):
        return x, dispatch(x, idx)[0].handle, ()

    return Timer(mesh, cached_prologue, repeat(cached_outputs), *steps)


def result(impl, op, tokens, raw, harness, received_bytes, crossed_bytes, **fields):
    """One timed op's record: time less the harness's; GB/s of the bytes a rank received
    (logical, its own rows included) and of those that crossed a link (physical)."""
    seconds = raw - harness
    return dict(
        impl=impl,
        op=op,
        tokens_per_rank=tokens,
        time_us=seconds * 1e6,
        raw_time_us=raw * 1e6,
        harness_us=harness * 1e6,
        logical_gbps=received_bytes / seconds / 1e9,
        physical_gbps=crossed_bytes / seconds / 1e9,
        **fields,
    )


def row_bytes(hidden, fp8):
    """A dispatched row's bytes: FP8 (H bytes and H/128 float32 scales) or BF16."""
    return hidden + hidden // 128 * 4 if fp8 else 2 * hidden


def bench_size(
    mesh, cfg, tokens, impls, num_sms, fp8, rng, check, steps=(2, 12), trace=False, capacity=None
):
    num_ranks = mesh.size
    hidden, num_experts, num_topk = cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    sharding = NamedSharding(mesh, P("ep"))
    idx_np = routing(rng, num_ranks, tokens, num_experts, num_topk)
    x = jax.device_put(
        jnp.asarray(rng.standard_normal((num_ranks * tokens, hidden)), jnp.bfloat16), sharding
    )
    idx = jax.device_put(jnp.asarray(idx_np), sharding)
    rows = wire_rows(idx_np, num_ranks, num_experts)
    received = rows.sum(axis=0).mean()  # per rank, local rows included
    crossed = (rows.sum() - np.trace(rows)) / num_ranks  # per rank, over NVLink
    spec = P("ep")
    results, outputs = [], {}
    harness = harness_seconds(mesh, x, idx, steps, trace)
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
            dispatch, combine, expert_rows = buffer_ops(buf, fp8, mode, lay, capacity)
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

        timers = op_timers(mesh, dispatch, combine, expert_rows, steps)
        if cached:
            timers["dispatch"] = cached_dispatch_timer(mesh, buf, dispatch, fp8, steps)

        def round_trip(x, idx, dispatch=dispatch, combine=combine, expert_rows=expert_rows):
            d, _ = dispatch(x, idx)
            return combine(expert_rows(d), d)

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
        for op, row in (("dispatch", row_bytes(hidden, fp8)), ("combine", 2 * hidden)):
            results.append(
                result(
                    impl,
                    op,
                    tokens,
                    raw[op],
                    harness,
                    received * row,
                    crossed * row,
                    num_sms=num_sms if impl in JAX_EP else None,
                    mode=mode,
                    layout=lay,
                    dtype="fp8" if op == "dispatch" and fp8 else "bf16",
                    **({"kernels": timers[op].kernels} if trace else {}),
                )
            )
    if check and outputs:  # every implementation routed the same way: same round trip
        first = next(iter(outputs))
        ref = np.asarray(outputs[first], np.float32)
        for r in results:
            if r["impl"] in outputs:
                r["max_abs_diff_vs_" + first] = float(
                    np.abs(np.asarray(outputs[r["impl"]], np.float32) - ref).max()
                )
        for impl in outputs:
            diff = float(np.abs(np.asarray(outputs[impl], np.float32) - ref).max())
            print(f"  check {impl}: max |round trip - {first}| = {diff:.3g}", flush=True)
    return results


def fast_leg_routing(topk_idx, num_nodes, ranks_per_node, num_experts):
    """The top-k that a tuple-axis Buffer's fast leg gets, [R * M * T, K], from the ranks'
    [R * T, K]: rank (node n, local l) gets from each node s in turn the tokens of rank (s, l),
    their experts cut to node n's (local ids, -1 for the other nodes'), as the node leg brings
    them."""
    k = topk_idx.shape[1]
    node_experts = num_experts // num_nodes
    sent = topk_idx.reshape(1, num_nodes, ranks_per_node, -1, k)  # [1, s, l, T, K]
    node = np.arange(num_nodes).reshape(-1, 1, 1, 1, 1)  # the destination n
    cut = np.where(sent // node_experts == node, sent - node * node_experts, -1)
    return cut.transpose(0, 2, 1, 3, 4).reshape(-1, k).astype(np.int32)  # [n, l, s, T, K]


def node_leg_payload(x, num_nodes, fp8):
    """What the node leg carries of a rank's x [T, H], [M, T, W]: its rows for each node (one
    block of T rows per node); FP8 in 32-bit words, the e4m3 bytes then H/128 float32 scales (the
    bytes are what counts here: unscaled values, unit scales)."""
    if fp8:
        t, h = x.shape
        q = x.astype(jnp.float8_e4m3fn).reshape(t, -1, 4)
        scales = jnp.ones((t, h // 128), jnp.float32)
        x = jnp.concatenate(
            [
                jax.lax.bitcast_convert_type(q, jnp.uint32),
                jax.lax.bitcast_convert_type(scales, jnp.uint32),
            ],
            axis=1,
        )
    return jnp.broadcast_to(x, (num_nodes,) + x.shape)


def bench_nodes(mesh, cfg, tokens, num_sms, fp8, rng, check, steps=(2, 12), trace=False):
    """On a ("node", "ep") mesh of M x L: the tuple-axis Buffer's dispatch and combine whole
    ("jax_ep"), and each of its legs alone. "fast_leg": a Buffer over "ep" with a node's E / M
    experts and the M * T tokens per rank that the node leg brings, routed as they arrive
    (fast_leg_routing); its FP8 dispatch moves what the tuple-axis Buffer's does, float32 rows
    of 33 H / 128 words, unquantized. "node_leg": lax.all_to_all over "node" of M blocks of T
    rows (node_leg_payload; combine: float32 partials). Bytes per rank: the whole's as for one
    axis of R ranks; the fast leg's of its rows within the node; the node leg's M * T rows
    received, (M - 1) * T of them from other nodes."""
    num_nodes, ranks_per_node = mesh.shape["node"], mesh.shape["ep"]
    num_ranks = mesh.size
    hidden, num_experts, num_topk = cfg["hidden"], cfg["num_experts"], cfg["num_topk"]
    node_experts = num_experts // num_nodes
    spec = P(tuple(mesh.axis_names))

    def put(value):
        return jax.device_put(jnp.asarray(value), NamedSharding(mesh, spec))

    def random_rows(tokens_per_rank, width, dtype):
        shape = (num_ranks * tokens_per_rank, width)
        return put(jnp.asarray(rng.standard_normal(shape), dtype))

    def buffer(axis, experts, width, tokens_per_rank):
        return jax_ep.Buffer(
            mesh,
            axis,
            num_experts=experts,
            hidden=width,
            num_topk=num_topk,
            max_tokens_per_rank=tokens_per_rank,
            num_sms=num_sms,
        )

    idx_np = routing(rng, num_ranks, tokens, num_experts, num_topk)
    fast_idx_np = fast_leg_routing(idx_np, num_nodes, ranks_per_node, num_experts)
    x, idx, fast_idx = random_rows(tokens, hidden, jnp.bfloat16), put(idx_np), put(fast_idx_np)
    fast_x = random_rows(num_nodes * tokens, hidden, jnp.bfloat16)
    whole = buffer(("node", "ep"), num_experts, hidden, tokens)
    fast = buffer("ep", node_experts, hidden, num_nodes * tokens)
    fast_words, fast_words_x = fast, fast_x
    if fp8:  # FP8 rows as the tuple-axis Buffer's fast leg moves them
        fast_words = buffer("ep", node_experts, hidden * 33 // 128, num_nodes * tokens)
        fast_words_x = random_rows(num_nodes * tokens, hidden * 33 // 128, jnp.float32)

    def across_nodes(blocks, _):
        return (jax.lax.all_to_all(blocks, "node", 0, 0),)

    def node_leg_timer(fp8, dtype):
        def prologue(x, idx):
            return node_leg_payload(x.astype(dtype), num_nodes, fp8), idx, ()

        return Timer(mesh, prologue, repeat(across_nodes), *steps)

    timed = {  # impl: {op: (timer, its arguments)}
        "jax_ep": {
            op: (timer, (x, idx))
            for op, timer in op_timers(mesh, *buffer_ops(whole, fp8), steps).items()
        },
        "fast_leg": {
            "dispatch": (
                op_timers(mesh, *buffer_ops(fast_words, False), steps)["dispatch"],
                (fast_words_x, fast_idx),
            ),
            "combine": (
                op_timers(mesh, *buffer_ops(fast, False), steps)["combine"],
                (fast_x, fast_idx),
            ),
        },
        "node_leg": {
            "dispatch": (node_leg_timer(fp8, jnp.bfloat16), (x, idx)),
            "combine": (node_leg_timer(False, jnp.float32), (x, idx)),
        },
    }
    rows = wire_rows(idx_np, num_ranks, num_experts)
    per_node = [
        wire_rows(part, ranks_per_node, node_experts)
        for part in fast_idx_np.reshape(num_nodes, -1, num_topk)
    ]
    moved = {  # impl: (rows a rank receives, rows that crossed to it)
        "jax_ep": (rows.sum(axis=0).mean(), (rows.sum() - np.trace(rows)) / num_ranks),
        "fast_leg": (
            np.mean([r.sum(axis=0).mean() for r in per_node]),
            np.mean([(r.sum() - np.trace(r)) / ranks_per_node for r in per_node]),
        ),
        "node_leg": (num_nodes * tokens, (num_nodes - 1) * tokens),
    }
    combined = {"jax_ep": ("bf16", 2), "fast_leg": ("bf16", 2), "node_leg": ("float32", 4)}
    checked = {}
    if check:  # the fast leg gets from each local source what the tuple-axis Buffer gets from
        # the ranks of that local index on every node

        def received(buf, x, idx):  # [R, rows from each source]
            count = jax.shard_map(
                lambda x, idx: buf.dispatch(x, idx).handle.recv_counts[None],
                mesh=mesh,
                in_specs=(spec, spec),
                out_specs=spec,
            )
            return np.asarray(jax.jit(count)(x, idx))

        by_local_source = received(whole, x, idx).reshape(num_ranks, num_nodes, -1).sum(axis=1)
        same = bool(np.array_equal(by_local_source, received(fast, fast_x, fast_idx)))
        print(f"  check fast_leg: the tuple-axis Buffer's rows per source: {same}", flush=True)
        checked = dict(rows_as_jax_ep=same)
    harness = harness_seconds(mesh, x, idx, steps, trace)
    print(f"  harness: {harness * 1e6:.1f} us per step (subtracted)", flush=True)
    results = []
    for impl, ops in timed.items():
        for op, (timer, args) in ops.items():
            raw = timer(args, trace=f"{impl} {op}" if trace else None)
            dtype, row = ("fp8" if fp8 else "bf16", row_bytes(hidden, fp8))
            if op == "combine":  # dtype, bytes per element
                dtype, row = combined[impl][0], combined[impl][1] * hidden
            results.append(
                result(
                    impl,
                    op,
                    tokens,
                    raw,
                    harness,
                    moved[impl][0] * row,
                    moved[impl][1] * row,
                    num_nodes=num_nodes,
                    num_sms=None if impl == "node_leg" else num_sms,
                    dtype=dtype,
                    **(checked if impl == "fast_leg" else {}),
                    **({"kernels": timer.kernels} if trace else {}),
                )
            )
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

    harness = harness_seconds(mesh, x, idx, steps, trace)

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
    common_arguments(parser, "ops")
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
        "--nodes",
        type=int,
        default=None,
        help="M: a (node, ep) mesh of M x devices/M; times the tuple-axis Buffer and each leg",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also time split ops around a matmul (the config's token count)",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="rows per expert of jax_ep_padded's expert_padded layout (default: the worst "
        "case, tokens x ranks)",
    )
    parser.add_argument(
        "--steps",
        default=None,
        help="SHORT,LONG: the steps of the two timed programs, whose difference is timed "
        "(default: the config's)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also record each op's kernel times on the devices (profiler)",
    )
    args = parser.parse_args(argv)
    if args.nodes and args.overlap:
        parser.error("--overlap times one axis: not with --nodes")
    cfg = dict(CONFIGS[args.config])
    if args.steps:
        cfg["steps"] = tuple(int(n) for n in args.steps.split(","))
    args.graphs |= args.concurrent
    flags = [GRAPH_FLAGS] * args.graphs + [CONCURRENT_FLAGS] * args.concurrent
    if flags:  # before the backend starts
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
    devices = jax.devices()
    if args.nodes:
        if len(devices) % args.nodes:
            parser.error(f"--nodes {args.nodes} does not divide the {len(devices)} devices")
        mesh = jax.sharding.Mesh(np.array(devices).reshape(args.nodes, -1), ("node", "ep"))
    else:
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
        timing = dict(check=i == 0, steps=cfg["steps"], trace=args.trace)
        if args.nodes:
            results += bench_nodes(mesh, cfg, tokens, args.num_sms, not args.bf16, rng, **timing)
        else:
            results += bench_size(
                mesh,
                cfg,
                tokens,
                impls,
                args.num_sms,
                not args.bf16,
                rng,
                capacity=args.capacity,
                **timing,
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
        "bench.ep",
        argv,
        config=args.config,
        num_ranks=len(devices),
        num_nodes=args.nodes or 1,
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
        expert_padded_capacity=args.capacity,
        steps=cfg["steps"],
    )
    stem = save_record(
        record,
        args.out,
        args.config,
        ("-concurrent" if args.concurrent else "-graphs" if args.graphs else "")
        + (f"-nodes{args.nodes}" if args.nodes else "")
        + (f"-capacity{args.capacity}" if args.capacity else ""),
    )
    if not args.no_plot:
        from bench.plot import plot

        plot([record], stem + ".png")
    print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()

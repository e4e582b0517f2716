"""Grouped matmuls of DeepSeek-V3's experts on one GPU: jax_ep.nn.grouped's CUTLASS, DeepGEMM and
Mosaic GPU kernels against the dense batched matmul of the same FLOPs and XLA's ragged_dot.

    python -m bench.grouped_matmul --machine nvidia-h200      # a few minutes on one H200

The rows of one rank of an EP group of R ranks (R = 1, 2: 256 and 128 local experts): 4096
tokens x top-8 = 32768 rows in groups of multiples of 128 rows (as a dispatch with
expert_alignment=128 delivers them), sizes uniform or skewed (Zipf: a few large groups, many
empty); gate/up (K 7168, N 2048) and down (K 2048, N 7168). Each product (forward gmm, d lhs
gmm_t, d rhs tgmm) is timed with bench.harness.loop_seconds; TFLOP/s count 2 * rows * K * N.
"dense" is the batched einsum of the same FLOPs ([G, rows/G, K] x [G, K, N]: the grouped
matmul of uniform groups known in advance); "xla" jax.lax.ragged_dot's product (the forward
only, and skipped where its dense operand [M, G*K] would exceed 20 GB); "cutlass" CUTLASS's
grouped GEMMs (nn/cutlass.py; "cutlass_fp8" and "cutlass_fp8_kernel" its FP8 forward, as the
Mosaic ones below, with the same block scales, and "cutlass_fp8_dgrad_kernel" its FP8 d lhs as
fp8_dgrad runs it, the operands quantized and transposed beforehand); "deepgemm" and
"deepgemm_fp8", "deepgemm_fp8_kernel", "deepgemm_fp8_dgrad_kernel" the same with DeepGEMM's
kernels (the groups aligned; with --buffer also "<impl>_buffer" and "<impl>_fp8_kernel_buffer":
the forward on a dispatch's worst-case expert buffer, R times the rows); "mosaic" the kernels of
jax_ep.nn.grouped (its kernels for aligned groups), and "mosaic_unaligned" the products with
group_alignment=1 (jax's ragged_dot_mgpu and transposed_ragged_dot_mgpu); "mosaic_fp8" the FP8
forward of the MoE layer (grouped.fp8_grouped_matmul: rows quantized 1 x 128 beforehand, as
dispatch delivers them, the weights 128 x 128 in the call) and "mosaic_fp8_kernel" the same
with the weights quantized beforehand (its TFLOP/s against the dense bf16 rate: FP8's peak is
twice bf16's). Where torch is importable with a GPU, its forwards run too, in a child process
(its own CUDA context and allocator) on the same shapes and group sizes: "torch_dense"
(torch.bmm), "torch_grouped" (torch._grouped_mm, bf16) and "torch_scaled_grouped"
(torch._scaled_grouped_mm, FP8 with one scale per row of lhs and per column of each weight,
coarser than jax_ep's 1 x 128 / 128 x 128 blocks), timed as ours. Every timing starts after
--warm-s seconds of the same calls, so that ours and torch's run on a GPU in the state
sustained work keeps it in (lab.gemm_clocks). The first case of each projection sweeps a
few Mosaic block sizes per product (the other cases use the best) and CUTLASS's tile orders
("cutlass_order", "cutlass_fp8_order": cutlass.ORDERS takes the best). Prints a table; writes
bench/results/grouped_matmul/grouped-matmul-<machine>-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from bench.harness import common_arguments, loop_seconds, new_record, save_record
from jax_ep.fp8 import transpose_weights_fp8
from jax_ep.nn import cutlass, grouped
from jax_ep.nn.grouped import Blocks

EINSUMS = {"gmm": "gmk,gkn->gmn", "gmm_t": "gmn,gkn->gmk", "tgmm": "gmk,gmn->gkn"}
SWEEP = {  # (block_m, block_n, block_k, max_concurrent_steps, grid_block_n, programs_per_sm)
    "gmm": [Blocks(128, 128, 64, 4, 8), Blocks(128, 128, 128, 3, 8), Blocks(128, 128, 64, 2, 8, 2)],
    "tgmm": [
        Blocks(128, 128, 64, 4, 8),
        Blocks(128, 128, 64, 2, 8, 2),
        Blocks(64, 128, 64, 3, 8, 2),
    ],
}
SWEEP["gmm_t"] = SWEEP["gmm"]
ORDER_SWEEP = [cutlass.Order(r, w) for r, w in (("m", 1), ("n", 1), ("m", 4), ("n", 4), ("m", 8))]
XLA_MEMORY_LIMIT = 20e9


def group_sizes(distribution, rows, groups, alignment):
    """[groups] int32 multiples of alignment summing to rows (a multiple of alignment)."""
    units = rows // alignment
    if distribution == "uniform":
        share = np.full(groups, 1.0 / groups)
    else:  # Zipf: group g gets a share proportional to 1 / (g + 1)
        share = 1.0 / np.arange(1, groups + 1)
        share /= share.sum()
    sizes = np.floor(share * units).astype(np.int64)
    sizes[0] += units - sizes.sum()
    return (sizes * alignment).astype(np.int32)


def operands(rows, k, n, groups):
    keys = jax.random.split(jax.random.key(0), 3)
    make = jax.jit(
        lambda: (
            jax.random.normal(keys[0], (rows, k), jnp.bfloat16),
            (jax.random.normal(keys[1], (groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16),
            jax.random.normal(keys[2], (rows, n), jnp.bfloat16),
        )
    )
    return make()


def product_operands(kind, lhs, rhs, ct):
    return {"gmm": (lhs, rhs), "gmm_t": (ct, rhs), "tgmm": (lhs, ct)}[kind]


def grouped_step(kind, impl, alignment, blocks=grouped.MOSAIC_BLOCKS):
    def step(a, b, sizes):
        return grouped.product(
            kind, a, b, sizes, impl=impl, group_alignment=alignment, blocks=blocks
        )

    return step


def fp8_step(alignment, prequantized, impl="mosaic"):
    """grouped.fp8_grouped_matmul's forward as the MoE layer calls it (weights quantized in the
    call) or with the weights quantized beforehand (the kernel alone). The scales come first:
    loop_seconds perturbs them, so no call is loop-invariant."""

    def step(scales, lhs_q, rhs, rhs_q, rhs_scales, sizes):
        lhs = jnp.zeros(lhs_q.shape, jnp.bfloat16)  # read by the backward only
        return grouped.fp8_grouped_matmul(
            lhs,
            lhs_q,
            scales,
            rhs,
            sizes,
            impl=impl,
            group_alignment=alignment,
            rhs_fp8=(rhs_q, rhs_scales) if prequantized else None,
        )

    return step


def fp8_order_step(order):
    """The CUTLASS FP8 kernel alone (weights quantized beforehand) with the tiles in order."""

    def step(scales, lhs_q, rhs, rhs_q, rhs_scales, sizes):
        del rhs
        return cutlass.gmm_fp8(lhs_q, scales, rhs_q, rhs_scales, sizes, jnp.bfloat16, order)

    return step


def fp8_operands(lhs, rhs, sizes):
    lhs_q, scales = jax.jit(lambda a: jax_ep.quantize_fp8(a, False))(lhs)
    return (scales, lhs_q, rhs) + jax.jit(grouped.quantize_weights_fp8)(rhs) + (sizes,)


def fp8_dgrad_operands(ct, rhs, sizes):
    """The FP8 d lhs's operands as fp8_grouped_matmul(fp8_dgrad=True) makes them: the output's
    gradient quantized 1 x 128 and the forward's FP8 weights transposed ([G, K, N])."""
    ct_q, ct_scales = jax.jit(lambda a: jax_ep.quantize_fp8(a, False))(ct)
    weights = jax.jit(lambda w: transpose_weights_fp8(*grouped.quantize_weights_fp8(w)))(rhs)
    return (ct_scales, ct_q) + weights + (sizes,)


def fp8_dgrad_step(deep_gemm):
    """The FP8 kernel as the FP8 d lhs (its operands made beforehand)."""

    def step(scales, ct_q, rhs_q, rhs_scales, sizes):
        return cutlass.gmm_fp8(
            ct_q, scales, rhs_q, rhs_scales, sizes, jnp.bfloat16, deep_gemm=deep_gemm
        )

    return step


def dense_step(kind, groups):
    def step(a, b, sizes):  # sizes unused: every group has rows / groups rows
        split = lambda x: x.reshape((groups, -1) + x.shape[1:])
        out = jnp.einsum(EINSUMS[kind], split(a), split(b) if kind == "tgmm" else b)
        return out if kind == "tgmm" else out.reshape(-1, out.shape[-1])

    return step


def xla_expansion_bytes(lhs, rhs):
    """The dense operand XLA:GPU builds for ragged_dot ([M, G*K]: lhs masked per group; its
    autotuner alone then asks for more than that, so the check cannot be a compilation)."""
    return rhs.shape[0] * lhs.size * lhs.dtype.itemsize


def tflops(rows, k, n, seconds):
    return 2 * rows * k * n / seconds / 1e12


class Timing(NamedTuple):
    """How every product is timed (ours by loop_seconds, torch's alike): the loop lengths whose
    difference is timed, and the seconds of calls before each (warm_s; 0: none)."""

    counts: tuple = (1, 4)
    warm_s: float = 0.0

    def seconds(self, step, args, repeats=5):
        return loop_seconds(step, args, self.counts, repeats, warm_s=self.warm_s)


def forward_rates(rows, k, n, sizes, impl, alignment, counts=(1, 4)):
    """TFLOP/s of grouped_matmul's forward with these group sizes and of the dense batched
    matmul of the same FLOPs (for bench.moe_layer)."""
    lhs, rhs, _ = operands(rows, k, n, len(sizes))
    args = (lhs, rhs, jnp.asarray(sizes))
    grouped_s = loop_seconds(grouped_step("gmm", impl, alignment), args, counts)
    dense_s = loop_seconds(dense_step("gmm", len(sizes)), args, counts)
    return tflops(int(np.sum(sizes)), k, n, grouped_s), tflops(rows, k, n, dense_s)


def fp8_forward_rate(rows, k, n, sizes, alignment, prequantized, counts=(1, 4), impl="mosaic"):
    """TFLOP/s of the MoE layer's FP8 forward (the weights quantized in the call, or
    beforehand) with these group sizes (for bench.moe_layer)."""
    lhs, rhs, _ = operands(rows, k, n, len(sizes))
    seconds = loop_seconds(
        fp8_step(alignment, prequantized, impl), fp8_operands(lhs, rhs, jnp.asarray(sizes)), counts
    )
    return tflops(int(np.sum(sizes)), k, n, seconds)


def torch_seconds(rows, k, n, sizes, timing, repeats=5):
    """{impl: seconds per call} of torch's forwards on these shapes (run in a child process),
    timed as loop_seconds times ours: after timing.warm_s seconds of calls, the best of
    `repeats` host-timed runs of each count of back-to-back calls (synchronized before and
    after), their difference over the extra calls; {impl: error text} where one fails, {}
    without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    groups, gpu = len(sizes), torch.device("cuda")
    lhs = torch.randn(rows, k, device=gpu, dtype=torch.bfloat16)
    # Each weight [K, N] with K contiguous ("column-major"), as the grouped kernels take it.
    rhs = (torch.randn(groups, n, k, device=gpu) / k**0.5).to(torch.bfloat16).transpose(-2, -1)
    ends = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=gpu)
    fp8 = torch.float8_e4m3fn
    lhs_q, rhs_q = lhs.to(fp8), (rhs.transpose(-2, -1) * 16).to(fp8).transpose(-2, -1)
    lhs_scales = torch.ones(rows, device=gpu, dtype=torch.float32)
    rhs_scales = torch.full((groups, n), 1 / 16, device=gpu, dtype=torch.float32)
    calls = {
        "torch_dense": lambda: torch.bmm(lhs.view(groups, -1, k), rhs),
        "torch_grouped": lambda: torch._grouped_mm(lhs, rhs, offs=ends),
        "torch_scaled_grouped": lambda: torch._scaled_grouped_mm(
            lhs_q, rhs_q, lhs_scales, rhs_scales, offs=ends, out_dtype=torch.bfloat16
        ),
    }

    def best(call, count):
        warm_until = time.perf_counter() + timing.warm_s
        while time.perf_counter() < warm_until:
            call()
            torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(count):
                call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    out = {}
    low, high = timing.counts
    for impl, call in calls.items():
        try:
            call()
            out[impl] = (best(call, high) - best(call, low)) / (high - low)
        except Exception as e:  # noqa: BLE001  (an op this torch or GPU lacks)
            out[impl] = str(e).splitlines()[0][:200]
    return out


def torch_forwards(rows, k, n, sizes, timing):
    """torch_seconds in a child process (spawned: no CUDA state of this one); {} without
    torch."""
    if importlib.util.find_spec("torch") is None:
        return {}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(torch_seconds, (rows, k, n, [int(s) for s in sizes], timing))


def run_case(case, plan, sweep, timing, results):
    """Times the implementations of the three products of one case. plan: the Mosaic blocks;
    sweep: what to sweep ("mosaic": also SWEEP's blocks, jax's unaligned forward kernels, and
    return the best blocks per product; "cutlass": also ORDER_SWEEP's tile orders)."""
    ranks, groups, rows, projection, k, n, distribution, alignment = case
    sizes = group_sizes(distribution, rows, groups, alignment)
    lhs, rhs, ct = operands(rows, k, n, groups)
    base = dict(
        ranks=ranks,
        groups=groups,
        rows=rows,
        projection=projection,
        k=k,
        n=n,
        distribution=distribution,
        nonempty_groups=int((sizes > 0).sum()),
    )

    def timed(kind, impl, step, args, blocks=None, repeats=5):
        """Seconds per call, recorded and printed (None, with the error, if it fails)."""
        label = (
            f"R={ranks} {projection:7s} {distribution:7s} {kind:5s} {impl:16s} "
            f"{'' if blocks is None else blocks}"
        )
        record = dict(base, product=kind, impl=impl, blocks=blocks)
        return measure(timing, step, args, results, record, label, repeats)

    for impl, value in torch_forwards(rows, k, n, sizes, timing).items():
        measured = not isinstance(value, str)
        results.append(
            dict(
                base,
                product="gmm",
                impl=impl,
                blocks=None,
                error=None if measured else value,
                time_ms=value * 1e3 if measured else None,
                tflops=tflops(rows, k, n, value) if measured else None,
            )
        )
        print(
            f"  R={ranks} {projection:7s} {distribution:7s} gmm   {impl:16s}: "
            + (
                f"{value * 1e3:8.3f} ms {tflops(rows, k, n, value):7.1f} TFLOP/s"
                if measured
                else f"failed ({value})"
            ),
            flush=True,
        )
    mosaic = not grouped.mosaic_misfits((rows, k), (groups, k, n), jnp.bfloat16, plan)
    use_cutlass = not grouped.cutlass_misfits((rows, k), (groups, k, n), jnp.bfloat16)
    deepgemm_misfits = grouped.deepgemm_misfits(
        (rows, k), (groups, k, n), jnp.bfloat16, alignment, fp8=True
    ) + grouped.deepgemm_misfits((rows, k), (groups, k, n), jnp.bfloat16, alignment)
    if deepgemm_misfits and ranks == 1 and projection == "gate_up":
        print("  deepgemm not timed:", "; ".join(sorted(set(deepgemm_misfits))), flush=True)
    best = {}

    def fp8_forwards(impl, group_alignment, blocks=None):
        """The FP8 forward as the layer runs it ("<impl>_fp8") and with the weights quantized
        beforehand ("<impl>_fp8_kernel"); returns its operands."""
        fp8_args = fp8_operands(lhs, rhs, jnp.asarray(sizes))
        for prequantized in (True, False):
            timed(
                "gmm",
                impl + "_fp8" + ("_kernel" if prequantized else ""),
                fp8_step(group_alignment, prequantized, impl),
                fp8_args,
                blocks,
            )
        return fp8_args

    for kind in grouped.PRODUCTS:
        args = product_operands(kind, lhs, rhs, ct) + (jnp.asarray(sizes),)
        if use_cutlass:
            timed(kind, "cutlass", grouped_step(kind, "cutlass", 1), args)
            if kind == "gmm":
                fp8_args = fp8_forwards("cutlass", 1)
            if kind == "gmm_t":
                dgrad_args = fp8_dgrad_operands(ct, rhs, jnp.asarray(sizes))
                timed(kind, "cutlass_fp8_dgrad_kernel", fp8_dgrad_step(False), dgrad_args)
            if not deepgemm_misfits:
                timed(kind, "deepgemm", grouped_step(kind, "deepgemm", alignment), args)
                if kind == "gmm":
                    fp8_forwards("deepgemm", alignment)
                elif kind == "gmm_t":
                    timed(kind, "deepgemm_fp8_dgrad_kernel", fp8_dgrad_step(True), dgrad_args)
            for order in ORDER_SWEEP if "cutlass" in sweep else ():
                step = lambda a, b, sizes, order=order: cutlass.product(
                    kind, a, b, sizes, order=order
                )
                timed(kind, "cutlass_order", step, args, list(order))
                if kind == "gmm":
                    timed(kind, "cutlass_fp8_order", fp8_order_step(order), fp8_args, list(order))
        if distribution == "uniform":
            timed(kind, "dense", dense_step(kind, groups), args)
            if kind == "gmm":
                expansion = xla_expansion_bytes(lhs, rhs)
                if expansion > XLA_MEMORY_LIMIT:
                    error = f"skipped: a {expansion / 1e9:.0f} GB dense operand"
                    print(f"  xla {kind}: {error}", flush=True)
                    results.append(
                        dict(base, product=kind, impl="xla", error=error, time_ms=None, tflops=None)
                    )
                else:
                    timed(kind, "xla", grouped_step(kind, "xla", alignment), args, repeats=2)
        if not mosaic:
            continue
        candidates = SWEEP[kind] if "mosaic" in sweep else [getattr(plan, kind)]
        times = []
        for blocks in candidates:
            step = grouped_step(
                kind, "mosaic", alignment, dataclasses.replace(plan, **{kind: blocks})
            )
            seconds = timed(kind, "mosaic", step, args, list(blocks))
            if seconds is not None:
                times.append((seconds, blocks))
        if times:
            best[kind] = min(times)[1]
        if kind == "gmm" and not grouped.fp8_misfits((rows, k), (groups, k, n), alignment):
            fp8_forwards("mosaic", alignment, list(grouped.FP8_TILES))
        if "mosaic" in sweep:  # jax's kernels, for groups of any size
            blocks = best.get(kind, candidates[0])
            timed(
                kind,
                "mosaic_unaligned",
                grouped_step(kind, "mosaic", 1, dataclasses.replace(plan, **{kind: blocks})),
                args,
                list(blocks),
            )
    return best


def measure(timing, step, args, results, record, label, repeats=5, unit="ms"):
    """Times step(*args); appends record with the outcome (error, time_ms, and tflops over
    record["rows"] rows) to results and prints it after label. A step that cannot run here (a
    build without DeepGEMM's kernels, blocks that do not fit) records its error. Returns the
    seconds per call, or None."""
    seconds = error = None
    try:
        seconds = timing.seconds(step, args, repeats)
    except Exception as e:  # noqa: BLE001
        error = str(e).splitlines()[0][:200]
    rate = None if error else tflops(record["rows"], record["k"], record["n"], seconds)
    results.append(dict(record, error=error, time_ms=None if error else seconds * 1e3, tflops=rate))
    scale, width = {"ms": (1e3, "8.3f"), "us": (1e6, "8.1f")}[unit]
    outcome = f"{seconds * scale:{width}} {unit} {rate:7.1f} TFLOP/s" if seconds else ""
    print(f"  {label}: " + (f"failed ({error})" if error else outcome), flush=True)
    return seconds


def buffer_case(ranks, rows, groups, buffer_rows, k, n, projection, timing, results):
    """The forward on a dispatch's worst-case expert buffer: lhs of buffer_rows rows of which the
    first `rows` are in uniform groups (multiples of 128). CUTLASS's and DeepGEMM's kernels (bf16,
    and FP8 with the weights made beforehand), which must not pay for the rows past the groups.
    TFLOP/s count the rows in groups."""
    sizes = jnp.asarray(group_sizes("uniform", rows, groups, 128))
    lhs, rhs, _ = operands(buffer_rows, k, n, groups)
    fp8_args = fp8_operands(lhs, rhs, sizes)
    base = dict(ranks=ranks, groups=groups, rows=rows, buffer_rows=buffer_rows)
    base.update(projection=projection, k=k, n=n, distribution="uniform", product="gmm")
    for impl in ("cutlass", "deepgemm"):
        for name, step, args in (
            ("", grouped_step("gmm", impl, 128), (lhs, rhs, sizes)),
            ("_fp8_kernel", fp8_step(128, True, impl), fp8_args),
        ):
            record = dict(base, impl=impl + name + "_buffer", blocks=None)
            label = (
                f"R={ranks} {projection:7s} {rows} rows in a buffer of {buffer_rows} "
                f"{impl + name:20s}"
            )
            measure(timing, step, args, results, record, label)


def decode_case(ranks, tokens, topk, experts, k, n, projection, timing, results, seed=0):
    """The decode MLP on one rank of R: [E/R, R * tokens, K] rows in the expert_padded layout,
    each expert's first rows (as a uniform random top-k routing of R * tokens tokens gives)
    holding data, times its weights: masked_matmul's kernel against the batched einsum over
    every row. TFLOP/s count the rows of data only."""
    groups, capacity = experts // ranks, ranks * tokens
    rng = np.random.default_rng(seed)
    chosen = np.argsort(-rng.random((ranks * tokens, experts)), axis=1)[:, :topk]
    rows = np.bincount(chosen.reshape(-1), minlength=experts)[:groups].astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), 2)
    lhs = jax.random.normal(keys[0], (groups, capacity, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (groups, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    for impl in ("cutlass", "mosaic", "xla"):
        record = dict(
            ranks=ranks,
            groups=groups,
            rows=int(rows.sum()),
            capacity=capacity,
            projection=projection,
            k=k,
            n=n,
            distribution="decode",
            product="masked",
            impl="batched_einsum" if impl == "xla" else "masked_" + impl,
        )
        label = (
            f"R={ranks} {projection:7s} decode {groups} x {capacity} rows "
            f"({int(rows.sum())} of data) {impl:7s}"
        )
        step = lambda a, b, r, impl=impl: grouped.masked_matmul(a, b, r, impl=impl)  # noqa: E731
        measure(timing, step, (lhs, rhs, jnp.asarray(rows)), results, record, label, unit="us")


def table(results):
    dense = {
        (r["ranks"], r["projection"], r["product"]): r["tflops"]
        for r in results
        if r["impl"] == "dense"
    }
    best = {}
    for r in results:
        if r["tflops"] is not None and r["impl"] != "dense":
            key = (r["ranks"], r["projection"], r["distribution"], r["product"], r["impl"])
            best[key] = max(best.get(key, 0.0), r["tflops"])
    lines = [
        f"{'R':>2s} {'projection':10s} {'groups':8s} {'product':7s} {'impl':16s} "
        f"{'TFLOP/s':>8s} {'dense':>8s} {'share':>6s}"
    ]
    for (ranks, projection, distribution, kind, impl), rate in sorted(best.items()):
        ref = dense.get((ranks, projection, kind))
        lines.append(
            f"{ranks:2d} {projection:10s} {distribution:8s} {kind:7s} {impl:16s} "
            f"{rate:8.1f} {ref or float('nan'):8.1f} "
            f"{rate / ref if ref else float('nan'):6.0%}"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2", help="EP ranks whose per-rank shapes to time")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--alignment", type=int, default=128)
    parser.add_argument("--counts", default="1,4", help="loop lengths timed (low,high)")
    parser.add_argument(
        "--warm-s",
        type=float,
        default=0.5,
        help="seconds of calls before each timing, ours and torch's alike (0: none): a GPU "
        "timed in the state sustained work keeps it in",
    )
    parser.add_argument(
        "--sweep",
        default="mosaic,cutlass",
        help="sweep these kernels' blocks or tile orders in each projection's first case "
        "(comma-separated; empty: the defaults only)",
    )
    parser.add_argument(
        "--buffer",
        action="store_true",
        help="also the forward on a dispatch's worst-case expert buffer (ranks * tokens * topk "
        "rows, of which tokens * topk in groups): CUTLASS's and DeepGEMM's kernels",
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=128,
        help="tokens per rank of the decode MLP cases (expert_padded rows; 0: none)",
    )
    common_arguments(parser, "grouped_matmul")
    args = parser.parse_args(argv)
    timing = Timing(tuple(int(c) for c in args.counts.split(",")), args.warm_s)
    rows = args.tokens * args.topk
    cases = [
        (ranks, args.experts // ranks, rows, projection, k, n, distribution, args.alignment)
        for ranks in (int(r) for r in args.ranks.split(","))
        for projection, (k, n) in (
            ("gate_up", (args.hidden, args.ffn)),
            ("down", (args.ffn, args.hidden)),
        )
        for distribution in ("uniform", "zipf")
    ]
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {rows} rows per rank", flush=True
    )
    _, groups, rows, _, k, n, _, _ = cases[0]
    problems = grouped.mosaic_misfits((rows, k), (groups, k, n), jnp.bfloat16)
    if problems:
        print("  mosaic kernels not timed:", "; ".join(problems), flush=True)
    results, blocks = [], {}  # the best blocks per projection, from its first case
    for case in cases:
        projection = case[3]
        found = run_case(
            case,
            dataclasses.replace(grouped.MOSAIC_BLOCKS, **blocks.get(projection, {})),
            () if projection in blocks else args.sweep.split(","),
            timing,
            results,
        )
        blocks.setdefault(projection, found)
    for ranks in (int(r) for r in args.ranks.split(",")) if args.buffer else ():
        for projection, (k, n) in (
            ("gate_up", (args.hidden, args.ffn)),
            ("down", (args.ffn, args.hidden)),
        ):
            buffer_case(
                ranks, rows, args.experts // ranks, ranks * rows, k, n, projection, timing, results
            )
    for ranks in (int(r) for r in args.ranks.split(",")) if args.decode_tokens else ():
        for projection, (k, n) in (
            ("gate_up", (args.hidden, args.ffn)),
            ("down", (args.ffn, args.hidden)),
        ):
            decode_case(
                ranks,
                args.decode_tokens,
                args.topk,
                args.experts,
                k,
                n,
                projection,
                timing,
                results,
            )
    print(table(results))
    best_blocks = {p: {kind: list(b) for kind, b in found.items()} for p, found in blocks.items()}
    print("best blocks:", best_blocks)
    record = new_record(
        args,
        "bench.grouped_matmul",
        argv,
        config="grouped_matmul",
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        default_blocks={
            kind: list(getattr(grouped.MOSAIC_BLOCKS, kind)) for kind in grouped.PRODUCTS
        },
        best_blocks=best_blocks,
        counts=list(timing.counts),
        warm_s=timing.warm_s,
        results=results,
    )
    print(f"wrote {save_record(record, args.out, 'grouped-matmul')}.json")


if __name__ == "__main__":
    main()

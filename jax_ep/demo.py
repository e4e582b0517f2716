"""An MoE layer on whatever devices JAX sees, one expert-parallel rank per device: dispatch (FP8),
expert matmuls, combine.

    python -m jax_ep.demo            # 8 CPU devices when there is no accelerator

Runs the layer on jax_ep's custom calls and on its jax.lax reference path, checks that they
agree and prints the time of each: per Python call (as a program that calls the layer once per
step meets it, host dispatch included) and per step of a loop inside one jitted program (the
device's work alone). On GPUs the layer is sized to the devices' memory.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.nn.grouped import grouped_matmul, resolve_impl

EXPERT_ALIGNMENT = 128  # rows per expert block rounded up to this (grouped-matmul friendly)
GPU_MEMORY_SHARE = 0.5  # of a GPU's memory the layer's compiled step may use


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: int  # per rank
    hidden: int
    experts_per_rank: int
    topk: int
    ffn: int  # hidden size of each expert


CPU_SIZES = Sizes(tokens=64, hidden=128, experts_per_rank=2, topk=2, ffn=128)
LOOP_STEPS = {"cpu": 4, "gpu": 20}  # steps of the timed loop
# DeepSeek-V3's hidden, top-k and expert ffn, largest first (XLA's ragged_dot, where the grouped
# matmul falls back to it, holds a [experts, rows, hidden] array: 256 experts per rank would not
# fit one GPU).
GPU_SIZES = [
    Sizes(tokens, 7168, experts, 8, 2048)
    for tokens, experts in (
        (4096, 32),
        (4096, 16),
        (4096, 8),
        (2048, 8),
        (1024, 8),
        (512, 8),
        (256, 8),
    )
]


def experts(rows, group_sizes, w_in, w_out):
    """Each local expert's rows (contiguous, group_sizes of them) through its own GELU MLP, as
    grouped matmuls (Pallas Mosaic GPU kernels on Hopper GPUs, jax.lax.ragged_dot elsewhere)."""

    def matmul(lhs, rhs):
        return grouped_matmul(lhs, rhs, group_sizes, group_alignment=EXPERT_ALIGNMENT)

    h = jax.nn.gelu(matmul(rows, w_in))
    return matmul(h.astype(rows.dtype), w_out)


def moe_layer(buf, x, topk_idx, topk_weights, w_in, w_out):
    """Per rank, inside shard_map: x [T, H] -> [T, H]."""
    d = buf.dispatch(
        x, topk_idx, topk_weights, layout="expert", expert_alignment=EXPERT_ALIGNMENT, fp8=True
    )
    out = experts(buf.dequantize(d, x), d.group_sizes, w_in, w_out)
    return buf.combine(out.astype(x.dtype), d.handle, topk_weights=d.topk_weights)


def round_trip(buf, x, topk_idx, topk_weights, w_in, w_out):
    """dispatch and combine alone (identity experts): jax_ep's own work in the layer."""
    d = buf.dispatch(
        x, topk_idx, topk_weights, layout="expert", expert_alignment=EXPERT_ALIGNMENT, fp8=True
    )
    return buf.combine(buf.dequantize(d, x), d.handle, topk_weights=d.topk_weights)


def in_a_loop(body, steps):
    """body run `steps` times in one jitted loop, each step's x the last step's output (scaled
    to unit RMS, so that values stay finite): the time per step without a Python call each."""

    def run(buf, x, *rest):
        def step(_, x):
            y = body(buf, x, *rest).astype(jnp.float32)
            return (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(x.dtype)

        return jax.lax.fori_loop(0, steps, step, x)

    return run


def make_buffer(mesh, sizes, impl):
    return jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=sizes.experts_per_rank * mesh.size,
        hidden=sizes.hidden,
        num_topk=sizes.topk,
        max_tokens_per_rank=sizes.tokens,
        impl=impl,
    )


def program(body, mesh, buf):
    """body(buf, *shards) over every rank's shards, jitted."""
    return jax.jit(
        jax.shard_map(lambda *a: body(buf, *a), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    )


def input_shapes(mesh, sizes):
    r, s = mesh.size, sizes
    shard = NamedSharding(mesh, P("ep"))
    shapes = (
        ((r * s.tokens, s.hidden), jnp.bfloat16),
        ((r * s.tokens, s.topk), jnp.int32),
        ((r * s.tokens, s.topk), jnp.float32),
        ((r * s.experts_per_rank, s.hidden, s.ffn), jnp.bfloat16),
        ((r * s.experts_per_rank, s.ffn, s.hidden), jnp.bfloat16),
    )
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=shard) for shape, dtype in shapes]


def compile_layer(mesh, sizes, buf):
    """(the layer on buf, compiled; the device memory per device that XLA says it needs:
    arguments, outputs and temporaries)."""
    layer = program(moe_layer, mesh, buf).lower(*input_shapes(mesh, sizes)).compile()
    stats = layer.memory_analysis()
    need = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return layer, need


def choose_sizes(mesh):
    """(sizes, why these, the reference path's layer compiled for them): fixed on CPUs; on GPUs
    the largest layer whose compiled step fits."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        layer, _ = compile_layer(mesh, CPU_SIZES, make_buffer(mesh, CPU_SIZES, "reference"))
        return CPU_SIZES, "small, for CPUs", layer
    limit = device.memory_stats()["bytes_limit"]
    for sizes in GPU_SIZES:
        layer, need = compile_layer(mesh, sizes, make_buffer(mesh, sizes, "reference"))
        if need <= GPU_MEMORY_SHARE * limit:
            return (
                sizes,
                (
                    f"the largest that fits: XLA needs {need / 2**30:.1f} GiB per GPU for "
                    f"the layer, of {limit / 2**30:.1f} GiB"
                ),
                layer,
            )
    raise SystemExit(
        f"jax_ep demo: even {GPU_SIZES[-1]} needs more than "
        f"{GPU_MEMORY_SHARE:.0%} of the {limit / 2**30:.1f} GiB of {device}"
    )


def random_inputs(mesh, sizes):
    """Tokens, a random top-k routing (distinct experts per token) and expert weights, each
    rank's shard made on its device."""
    shapes = input_shapes(mesh, sizes)
    x_s, idx_s, w_s, in_s, out_s = shapes
    keys = jax.random.split(jax.random.key(0), 5)

    @functools.partial(jax.jit, out_shardings=tuple(s.sharding for s in shapes))
    def make():
        scores = jax.random.uniform(keys[1], (idx_s.shape[0], sizes.experts_per_rank * mesh.size))
        return (
            jax.random.normal(keys[0], x_s.shape, x_s.dtype),
            jax.lax.top_k(scores, sizes.topk)[1].astype(jnp.int32),
            jax.random.uniform(keys[2], w_s.shape, w_s.dtype),
            jax.random.normal(keys[3], in_s.shape, in_s.dtype) * sizes.hidden**-0.5,
            jax.random.normal(keys[4], out_s.shape, out_s.dtype) * sizes.ffn**-0.5,
        )

    return make()


def best_time_ms(fn, args, runs=3, steps=1):
    """(fn's output, the best of `runs` timed calls in ms per step: fn runs `steps` steps)."""
    out = jax.block_until_ready(fn(*args))  # compiles, or warms up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, 1e3 * min(times) / steps


def relative_difference(a, b):
    """DeepEP's calc_diff: 1 - 2 <a, b> / (|a|^2 + |b|^2), 0 when a == b."""
    a, b = (np.asarray(v, np.float64) for v in (a, b))
    return 1 - 2 * (a * b).sum() / max((a * a + b * b).sum(), 1e-30)


def main():
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    backend = "CUDA kernels" if devices[0].platform == "gpu" else "CPU backend"
    print(
        f"jax_ep demo: {len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, one "
        f"expert-parallel rank per device (compiling takes a minute or two on GPUs)",
        flush=True,
    )
    sizes, why, reference_layer = choose_sizes(mesh)
    print(
        f"  MoE layer: {sizes.tokens} tokens per rank, hidden {sizes.hidden}, "
        f"{sizes.experts_per_rank * len(devices)} experts ({sizes.experts_per_rank} per rank, "
        f"ffn {sizes.ffn}), top-{sizes.topk} ({why})"
    )
    rows = sizes.tokens * mesh.size * sizes.topk  # an upper bound of a rank's expert rows
    path = resolve_impl(
        "auto",
        (rows, sizes.hidden),
        (sizes.experts_per_rank, sizes.hidden, sizes.ffn),
        jnp.bfloat16,
    )
    print(
        f"  per rank: FP8 dispatch of its tokens to their experts' ranks, each expert's rows "
        f"through its MLP (grouped matmuls: {path}), weighted combine back",
        flush=True,
    )
    args = random_inputs(mesh, sizes)
    steps = LOOP_STEPS["gpu" if devices[0].platform == "gpu" else "cpu"]
    print(
        f"  {'ms per step, best of 3':27s} {'layer':>9s} {'in a loop':>10s}   "
        f"{'dispatch + combine':>18s} {'in a loop':>10s}\n"
        f"  {'':27s} {'per call':>9s} {f'of {steps}':>10s}   {'per call':>18s} "
        f"{f'of {steps}':>10s}",
        flush=True,
    )
    outputs = {}
    for impl, name in (("ffi", f"custom calls ({backend})"), ("reference", "jax.lax reference")):
        buf = make_buffer(mesh, sizes, impl)  # referenced until its programs' results are ready
        layer = reference_layer if impl == "reference" else compile_layer(mesh, sizes, buf)[0]
        layer_out, layer_ms = best_time_ms(layer, args)
        trip_out, trip_ms = best_time_ms(program(round_trip, mesh, buf), args)
        times = [layer_ms]
        for body, per_call in ((moe_layer, None), (round_trip, trip_ms)):
            if per_call is not None:
                times.append(per_call)
            loop = program(in_a_loop(body, steps), mesh, buf)
            times.append(best_time_ms(loop, args, steps=steps)[1])
        outputs[impl] = layer_out, trip_out
        print(
            f"  {name:27s} {times[0]:9.2f} {times[1]:10.2f}   {times[2]:18.2f} {times[3]:10.2f}",
            flush=True,
        )
    (layer, trip), (ref_layer, ref_trip) = outputs["ffi"], outputs["reference"]
    same_trip = np.array_equal(np.asarray(trip), np.asarray(ref_trip))
    diff = relative_difference(layer, ref_layer)
    print(
        f"  against the reference path: dispatch + combine "
        f"{'bitwise equal' if same_trip else 'DIFFERENT'}, layer output relative difference "
        f"{diff:.1e}"
    )
    if not same_trip or diff > 1e-4:
        raise SystemExit("jax_ep demo: MISMATCH between the custom calls and the reference path")
    if len(devices) == 1:
        print(
            "  with one device no row crosses a link: these times are each path's local work "
            "(the reference path's all_to_all moves nothing at all); the README's benchmark "
            "tables (python -m bench.ep) have the figures across ranks"
        )
    print("  OK")


if __name__ == "__main__":
    # Without an accelerator, eight CPU devices (read when JAX starts its backends, below).
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
    main()

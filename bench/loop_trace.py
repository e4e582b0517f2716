"""What loop_seconds's program runs on the GPU per call: the kernels of each step (from the
profiler) of CUTLASS's bf16 grouped forward and of the dense batched einsum at the EP8 per-rank
V3 shapes, next to loop_seconds's rate and to bare calls repeated without any loop (as torch's
timing runs them). A harness cost shows here as a kernel or a gap that is not the product.

    python -m bench.loop_trace      # ~15 s on one H200
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bench.grouped_matmul import dense_step, group_sizes, grouped_step, operands, tflops
from bench.harness import loop_program, loop_seconds
from bench.trace import device_kernels, kernel_summary, print_summary

ROWS, GROUPS, STEPS = 32768, 32, 8


def bare_calls_seconds(step, args, calls=20, repeats=5, warm_s=0.5):
    call = jax.jit(step)
    jax.block_until_ready(call(*args))
    until = time.perf_counter() + warm_s
    while time.perf_counter() < until:
        jax.block_until_ready(call(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([call(*args) for _ in range(calls)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main():
    for k, n in ((7168, 2048), (2048, 7168)):
        sizes = jnp.asarray(group_sizes("uniform", ROWS, GROUPS, 128))
        lhs, rhs, _ = operands(ROWS, k, n, GROUPS)
        args = (lhs, rhs, sizes)
        gmm = grouped_step("gmm", "cutlass", 1)
        for name, step in (("cutlass", gmm), ("dense", dense_step("gmm", GROUPS))):
            run = loop_program(step)
            jax.block_until_ready(run(STEPS, *args))
            print(f"K {k} N {n} {name}: trace of run({STEPS})", flush=True)
            planes = device_kernels(lambda *a, run=run: run(STEPS, *a), args)
            print_summary(kernel_summary(planes, STEPS), top=8)
            seconds = loop_seconds(step, args, (1, 4), warm_s=0.5)
            print(f"  loop_seconds warm 0.5: {tflops(ROWS, k, n, seconds):.1f} TFLOP/s", flush=True)
        seconds = bare_calls_seconds(gmm, args)
        print(
            f"K {k} N {n} cutlass bare calls x20 after warm: "
            f"{tflops(ROWS, k, n, seconds):.1f} TFLOP/s (best of 5)",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""What loop_seconds's program runs on the GPU per call: the kernels of each step (from the
profiler) of grouped forwards and of the dense batched einsum at the EP8 per-rank V3 shapes,
next to loop_seconds's rate and to bare calls repeated without any loop (as torch's timing runs
them). A harness cost, or a kernel of a call that is not its product, shows here.

    python -m lab.loop_trace      # ~15 s on one H200
    python -m lab.loop_trace --impls deepgemm_fp8,cutlass_fp8   # FP8, weights made beforehand

impls: "cutlass", "deepgemm" (bf16 forward, groups of 128 rows), "cutlass_fp8", "deepgemm_fp8"
(the FP8 forward with the weights quantized beforehand), "dense".
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from bench.grouped_matmul import (
    dense_step,
    fp8_operands,
    fp8_step,
    group_sizes,
    grouped_step,
    operands,
    tflops,
)
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


def step_and_args(impl, lhs, rhs, sizes):
    """The timed step of `impl` and its operands (the groups are multiples of 128 rows)."""
    if impl.endswith("_fp8"):
        return fp8_step(128, True, impl.removesuffix("_fp8")), fp8_operands(lhs, rhs, sizes)
    step = dense_step("gmm", GROUPS) if impl == "dense" else grouped_step("gmm", impl, 128)
    return step, (lhs, rhs, sizes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", default="cutlass,dense")
    args = parser.parse_args(argv)
    impls = args.impls.split(",")
    for k, n in ((7168, 2048), (2048, 7168)):
        sizes = jnp.asarray(group_sizes("uniform", ROWS, GROUPS, 128))
        lhs, rhs, _ = operands(ROWS, k, n, GROUPS)
        for name in impls:
            step, step_args = step_and_args(name, lhs, rhs, sizes)
            run = loop_program(step)
            jax.block_until_ready(run(STEPS, *step_args))
            print(f"K {k} N {n} {name}: trace of run({STEPS})", flush=True)
            planes = device_kernels(lambda *a, run=run: run(STEPS, *a), step_args)
            print_summary(kernel_summary(planes, STEPS), top=8)
            seconds = loop_seconds(step, step_args, (1, 4), warm_s=0.5)
            print(f"  loop_seconds warm 0.5: {tflops(ROWS, k, n, seconds):.1f} TFLOP/s", flush=True)
            if name == "dense":
                continue
            seconds = bare_calls_seconds(step, step_args)
            print(
                f"K {k} N {n} {name} bare calls x20 after warm: "
                f"{tflops(ROWS, k, n, seconds):.1f} TFLOP/s (best of 5)",
                flush=True,
            )


if __name__ == "__main__":
    main()

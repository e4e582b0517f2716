"""How the GPU's state under load moves a grouped matmul's rate: CUTLASS's bf16 forward at the EP8
per-rank V3 shapes (32768 rows in 32 uniform groups; gate/up and down), timed as consecutive
bursts of 20 calls (host-timed, each right after the one before) and by loop_seconds (what
bench.grouped_matmul reports).

    python -m lab.gemm_clocks      # ~10 s on one H200
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bench.grouped_matmul import group_sizes, operands, tflops
from bench.harness import loop_seconds
from jax_ep.nn import cutlass

ROWS, GROUPS = 32768, 32


def main():
    def step(a, b, s):
        return cutlass.product("gmm", a, b, s)

    call = jax.jit(step)
    for k, n in ((7168, 2048), (2048, 7168)):
        sizes = jnp.asarray(group_sizes("uniform", ROWS, GROUPS, 128))
        lhs, rhs, _ = operands(ROWS, k, n, GROUPS)
        jax.block_until_ready(call(lhs, rhs, sizes))
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready([call(lhs, rhs, sizes) for _ in range(20)])
            seconds = (time.perf_counter() - start) / 20
            print(f"K {k} N {n}: burst of 20 calls {tflops(ROWS, k, n, seconds):.1f} TFLOP/s")
        for counts in ((1, 4), (2, 22), (1, 4), (2, 22)):
            seconds = loop_seconds(step, (lhs, rhs, sizes), counts)
            print(f"K {k} N {n}: loop_seconds {counts} {tflops(ROWS, k, n, seconds):.1f} TFLOP/s")


if __name__ == "__main__":
    main()

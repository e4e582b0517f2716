"""jax_ep's bf16 grouped forward (CUTLASS) and torch's `_grouped_mm` timed in turns: the GPU's
state under load moves a rate by 10-15% (lab.gemm_clocks), and bench.grouped_matmul times
torch's forwards first, from an idle GPU. Here each round times ours (this process) and then
torch's (one child process kept for the whole run, its operands made once), both as
loop_seconds times: after --warm-s seconds of calls, the best of 5 runs of 1 and of 4 calls.

    python -m lab.versus_torch      # ~1 minute on one H200 with torch installed
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing

import jax
import jax.numpy as jnp

from bench.grouped_matmul import Timing, group_sizes, grouped_step, operands, tflops, torch_seconds

ROWS, GROUPS = 32768, 32


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("lab.versus_torch needs torch")
    timing = Timing((1, 4), args.warm_s)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    step = grouped_step("gmm", "cutlass", 1)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        for k, n in ((7168, 2048), (2048, 7168)):
            lhs, rhs, _ = operands(ROWS, k, n, GROUPS)
            for distribution in ("uniform", "zipf"):
                sizes = group_sizes(distribution, ROWS, GROUPS, 128)
                for round_ in range(args.rounds):
                    ours = timing.seconds(step, (lhs, rhs, jnp.asarray(sizes)))
                    theirs = pool.apply(torch_seconds, (ROWS, k, n, sizes.tolist(), timing))
                    rates = {"jax_ep": tflops(ROWS, k, n, ours)} | {
                        impl: tflops(ROWS, k, n, s)
                        for impl, s in theirs.items()
                        if isinstance(s, float)
                    }
                    print(
                        f"K {k} N {n} {distribution} round {round_}: "
                        + ", ".join(f"{impl} {rate:.1f}" for impl, rate in rates.items())
                        + " TFLOP/s",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

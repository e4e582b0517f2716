"""The expert_padded placement alone: one custom call that turns a rank's received rows into the
decode layout [E_l, C, H] (maps, weights, rows and FP8 scales). Its kernel time per call, from
the device trace, at several counts of rank-level rows (128: EP=1 at 128 tokens; 512 to 1024:
what one rank of EP=8 receives at 128 tokens per rank).

    python -m lab.expert_padded --rows 128,512,1024 [--hidden 7168 --experts-per-rank 256]

Rows are FP8 with one float32 scale per 128 columns, as the low-latency dispatch delivers them;
each row names topk distinct local experts, drawn uniformly.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import common_arguments, loop_program, new_record, save_record
from bench.trace import device_kernels, kernel_summary, print_summary
from jax_ep import ffi_path
from jax_ep.fp8 import FP8_BLOCK


def padded_inputs(rng, rows, hidden, experts_per_rank, topk):
    topk_rows = np.stack([rng.choice(experts_per_rank, topk, replace=False) for _ in range(rows)])
    weights = rng.random((rows, topk), dtype=np.float32)
    x = rng.integers(0, 255, (rows, hidden), dtype=np.uint8).view(jnp.float8_e4m3fn)
    scales = rng.random((rows, hidden // FP8_BLOCK), dtype=np.float32)
    return [jnp.asarray(a) for a in (topk_rows.astype(np.int32), weights, x, scales)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128,512,1024", help="rank-level rows per call")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts-per-rank", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=128, help="rows per expert C")
    parser.add_argument("--steps", type=int, default=200, help="calls in the traced program")
    common_arguments(parser, "ops")
    args = parser.parse_args(argv)
    jax.devices()  # the backends exist before their targets are registered
    ffi_path.register_targets()
    ffi = ffi_path.Ffi(0, 1, args.experts_per_rank)  # expert_padded reads no Buffer

    def step(topk_rows, weights, x, scales):
        return ffi.expert_padded(
            topk_rows,
            weights,
            (x, scales),
            experts_per_rank=args.experts_per_rank,
            capacity=args.capacity,
        )

    record = new_record(
        args,
        "lab.expert_padded",
        argv,
        device=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        hidden=args.hidden,
        experts_per_rank=args.experts_per_rank,
        topk=args.topk,
        capacity=args.capacity,
        results=[],
    )
    run = loop_program(step)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = padded_inputs(
            np.random.default_rng(rows), rows, args.hidden, args.experts_per_rank, args.topk
        )
        jax.block_until_ready(run(args.steps, *inputs))  # compile and warm up
        summary = kernel_summary(device_kernels(run, (args.steps, *inputs)), args.steps)
        print(f"  {rows} rank-level rows, {rows * args.topk} expert rows:", flush=True)
        print_summary(summary)
        kernels = [
            k
            for plane in summary.values()
            for name, k in plane["kernels"].items()
            if "padded" in name
        ]
        record["results"].append(
            dict(
                rows=rows,
                expert_rows=rows * args.topk,
                kernel_us=kernels[0]["median_us"] if kernels else None,
                kernels=summary,
            )
        )
    print("saved", save_record(record, args.out, "expert-padded") + ".json")


if __name__ == "__main__":
    main()

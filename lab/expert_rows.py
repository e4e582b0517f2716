"""The expert layout's row expansion alone: a rank's received rows [S, H] -> its expert rows
[C, H] (each token's row once per local expert, zeros on padding; jax_ep.layout.expand_rows),
gathered by element (layout.take) and as 4-byte words (layout.take_rows, what expand_rows uses),
for bf16 and FP8 rows; and its adjoint (each token's expert rows summed, the dispatch's
backward), of one cotangent and of two summed first (the gate and up projections' row
gradients). Kernel times per call from the device trace.

    python -m lab.expert_rows [--tokens 4096 --hidden 7168 --experts 32 --topk 8]

The defaults are the 32-expert layer's shape on one GPU (bench.moe_layer --experts 32): every
token's eight experts are local, so 4096 rows expand to 32768.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import common_arguments, loop_program, new_record, save_record
from bench.trace import device_kernels, kernel_summary, print_summary
from jax_ep import layout

STEPS = 5


def expert_maps(rng, tokens, experts, topk):
    """(expert_src, expert_rows) of jax_ep's expert layout (alignment 1, no drops) for tokens
    naming topk distinct experts drawn uniformly."""
    ids = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    maps = layout.expert_layout(jnp.asarray(ids, jnp.int32), experts, 1, tokens * topk)
    return maps.expert_src, maps.expert_rows


def kernel_times(fn, *args):
    """fn's device kernels per call, in bench.harness's loop program."""
    run = functools.partial(loop_program(fn), STEPS)
    jax.block_until_ready(run(*args))
    return kernel_summary(device_kernels(run, args), STEPS, 4)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    common_arguments(parser, "ops")
    args = parser.parse_args(argv)
    src, rows = expert_maps(np.random.default_rng(0), args.tokens, args.experts, args.topk)
    x = jax.random.normal(jax.random.key(0), (args.tokens, args.hidden), jnp.bfloat16)
    expanded = jax.random.normal(jax.random.key(1), (2, src.shape[0], args.hidden), jnp.bfloat16)

    def fp8(fn):  # FP8 rows made in the call: the loop perturbs a floating-point input
        return lambda x: fn(x.astype(jnp.float8_e4m3fn))

    cases = {
        "bf16 rows, by element (take)": (lambda x: layout.take(x, src), x),
        "bf16 rows, as words (take_rows)": (lambda x: layout.take_rows(x, src), x),
        "FP8 rows made from x, by element": (fp8(lambda q: layout.take(q, src)), x),
        "FP8 rows made from x, as words": (fp8(lambda q: layout.take_rows(q, src)), x),
        "adjoint of one cotangent": (
            lambda a: layout.reduce_expert_rows(a, None, src, rows).astype(a.dtype),
            expanded[0],
        ),
        "adjoint of two summed": (
            lambda a, b: layout.reduce_expert_rows(a + b, None, src, rows).astype(a.dtype),
            expanded[0],
            expanded[1],
        ),
    }
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):  # the two gathers agree to the bit
        rows_in = x.astype(dtype)
        bits = jnp.uint16 if dtype == jnp.bfloat16 else jnp.uint8
        by_element, as_words = layout.take(rows_in, src), layout.take_rows(rows_in, src)
        assert (
            jax.lax.bitcast_convert_type(by_element, bits)
            == jax.lax.bitcast_convert_type(as_words, bits)
        ).all()
    record = new_record(
        args, "lab.expert_rows", argv, device=jax.devices()[0].device_kind, cases={}
    )
    print(
        f"{args.tokens} tokens x {args.hidden} -> {src.shape[0]} expert rows "
        f"({src.shape[0] * args.hidden * 2 / 1e6:.0f} MB of bf16)",
        flush=True,
    )
    for name, (fn, *inputs) in cases.items():
        summary = kernel_times(fn, *inputs)
        record["cases"][name] = summary
        print(name, flush=True)
        print_summary(summary, top=3)
    save_record(record, args.out, "expert-rows")


if __name__ == "__main__":
    main()

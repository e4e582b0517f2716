"""Where the demo's time goes on one GPU: each kernel of the demo's programs (the layer and
dispatch + combine alone), per path, from JAX's profiler, and the host's share of a call.

    python -m lab.demo_profile [--tokens 4096 --experts 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from bench.trace import device_kernels, kernel_summary
from jax_ep import demo


def host_and_device_ms(fn, args, runs=5):
    """(ms until the call returns, ms until its result is ready), best of runs."""
    jax.block_until_ready(fn(*args))
    returned, ready = [], []
    for _ in range(runs):
        start = time.perf_counter()
        out = fn(*args)
        returned.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        ready.append(time.perf_counter() - start)
    return 1e3 * min(returned), 1e3 * min(ready)


def demo_inputs(**options):
    """(parsed arguments, the mesh of every device, the demo's sizes for --tokens and --experts,
    its inputs); options: more arguments, name -> default."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=32)
    for name, default in options.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    a = parser.parse_args()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    sizes = demo.Sizes(a.tokens, 7168, a.experts, 8, 2048)
    return a, mesh, sizes, demo.random_inputs(mesh, sizes)


def main():
    a, mesh, sizes, args = demo_inputs(top=14)
    for impl in ("ffi", "reference"):
        buf = demo.make_buffer(mesh, sizes, impl)
        for name, body in (("round_trip", demo.round_trip), ("layer", demo.moe_layer)):
            fn = demo.program(body, mesh, buf)
            returned, ready = host_and_device_ms(fn, args)
            loop = demo.program(demo.in_a_loop(body, 20), mesh, buf)
            loop_ms = host_and_device_ms(loop, args)[1] / 20
            print(
                f"== {impl} {name}: call returns {returned:.3f} ms, ready {ready:.3f} ms; "
                f"in a loop of 20 {loop_ms:.3f} ms/step",
                flush=True,
            )
            summary = kernel_summary(device_kernels(fn, args), steps=1, top=a.top)
            for plane, s in summary.items():
                print(
                    f"   {plane}: busy {s['busy_us_per_step']:.1f} us, span "
                    f"{s['span_us_per_step']:.1f} us"
                )
                for k, v in s["kernels"].items():
                    print(f"     {v['median_us']:9.1f} us x{v['calls_per_step']:.0f}  {k}")
            print(flush=True)


if __name__ == "__main__":
    main()

"""What one Python call of a small jitted program costs, as a decode loop calls it: a jitted
dispatch + combine (rank layout) on jax_ep's custom calls, on its jax.lax reference path, and a
program without a Buffer (x * 2), each called and waited for `--calls` times, best of
`--repeats`, side by side in one run. At these sizes the ops themselves take microseconds: the
figures are the host's cost per call (JAX's dispatch, the ordering token, the backend's hand-offs).

    python -m bench.call_cost                  # 2 CPU devices without an accelerator
    python -m bench.call_cost --devices 1      # e.g. one GPU

Writes bench/results/ops/call-cost-<machine>-<date>.json; prints a table.
"""

from __future__ import annotations

import argparse
import os
import time

PROGRAMS = ("no_buffer", "reference", "ffi")


def timed_calls(step, args, calls, repeats):
    """ms per call of step(*args), each call waited for: the best of `repeats` runs of `calls`."""
    step(*args).block_until_ready()  # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step(*args).block_until_ready()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e3 * best


def measure(mesh, tokens, hidden, num_experts, num_topk, placed, calls, repeats):
    """{program: ms per call}; placed: the inputs already sharded over the mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep

    r = mesh.size
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (r * tokens, hidden), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.uniform(keys[1], (r * tokens, num_experts)), num_topk)[1]
    w = jax.random.uniform(keys[2], (r * tokens, num_topk))
    args = (x, idx.astype(jnp.int32), w)
    if placed:
        args = jax.device_put(args, NamedSharding(mesh, P("ep")))
    times = {}
    for name in PROGRAMS:
        buf = None
        if name != "no_buffer":
            buf = jax_ep.Buffer(
                mesh,
                "ep",
                num_experts=num_experts,
                hidden=hidden,
                num_topk=num_topk,
                max_tokens_per_rank=tokens,
                impl=name,
            )

        def body(x, idx, w, buf=buf):
            if buf is None:
                return x * 2
            d = buf.dispatch(x, idx, w, layout="rank")
            return buf.combine(d.x, d.handle)

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        times[name] = timed_calls(step, args, calls, repeats)
    return times


def main(argv=None):
    from bench import harness

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    harness.common_arguments(parser, "ops")
    args = parser.parse_args(argv)
    import jax
    import numpy as np

    devices = jax.devices()[: args.devices]
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    shape = dict(
        tokens=args.tokens,
        hidden=args.hidden,
        num_experts=args.experts_per_rank * len(devices),
        num_topk=args.topk,
    )
    results = []
    print(f"ms per call, {len(devices)} x {devices[0].device_kind}, {shape}")
    print(f"{'inputs':22s}" + "".join(f"{name:>12s}" for name in PROGRAMS))
    for placed in (True, False):
        times = measure(mesh, **shape, placed=placed, calls=args.calls, repeats=args.repeats)
        where = "sharded on the mesh" if placed else "on one device"
        print(f"{where:22s}" + "".join(f"{times[name]:12.3f}" for name in PROGRAMS), flush=True)
        results.append(dict(inputs=where, ms_per_call=times))
    record = harness.new_record(
        args,
        "bench.call_cost",
        argv,
        config="call_cost",
        device=devices[0].device_kind,
        num_ranks=len(devices),
        jax_version=jax.__version__,
        **shape,
        calls=args.calls,
        results=results,
    )
    print("wrote", harness.save_record(record, args.out, "call-cost") + ".json")


if __name__ == "__main__":
    import sys

    # Without an accelerator, --devices CPU devices (read when JAX starts its backends).
    count = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "2"
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
        ).strip()
    main()

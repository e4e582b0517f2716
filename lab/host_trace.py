"""Where a call's host time goes: the host events of JAX's profiler (XLA's thunk launches, PjRt's
execute, Python) for one call of the demo's dispatch + combine, per path, and cProfile's top
functions over many calls.

    python -m lab.host_trace [--tokens 4096 --experts 32]
"""

from __future__ import annotations

import collections
import cProfile
import pathlib
import pstats
import tempfile
import time

import jax
import numpy as np

from jax_ep import demo
from lab.demo_profile import demo_inputs


def host_events(fn, args, calls=5):
    """{event name: (count, total us)} over `calls` calls, host planes only."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        data = jax.profiler.ProfileData.from_file(
            str(next(pathlib.Path(log_dir).rglob("*.xplane.pb")))
        )
    found = collections.defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                f = found[(plane.name[:12], line.name[:20], e.name[:70])]
                f[0] += 1
                f[1] += e.duration_ns / 1e3
    return found


def main():
    _, mesh, sizes, args = demo_inputs()
    for impl in ("ffi", "reference"):
        buf = demo.make_buffer(mesh, sizes, impl)
        fn = demo.program(demo.round_trip, mesh, buf)
        jax.block_until_ready(fn(*args))
        returned = []
        for _ in range(20):
            start = time.perf_counter()
            out = fn(*args)
            returned.append(time.perf_counter() - start)
            jax.block_until_ready(out)
        print(f"== {impl}: call returns in {1e3 * np.median(returned):.3f} ms (median of 20)")
        events = host_events(fn, args)
        for (plane, line, name), (count, total) in sorted(events.items(), key=lambda kv: -kv[1][1])[
            :45
        ]:
            print(f"  {total / 5:9.1f} us/call x{count / 5:5.1f}  {plane:12s} {line:20s} {name}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            jax.block_until_ready(fn(*args))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
        print(flush=True)


if __name__ == "__main__":
    main()

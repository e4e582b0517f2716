"""Device-side kernel times from JAX's profiler: what each kernel of a timed program takes on
each GPU, free of launch, host and harness costs (bench.ep's times include those).

    python -m bench.ep --config ll --tokens 128 --trace    # adds `kernels` to each result
"""

from __future__ import annotations

import collections
import pathlib
import tempfile

import jax
import numpy as np


def device_kernels(fn, args):
    """Runs fn(*args) once under the profiler. {device plane: [(kernel, start_ns, dur_ns)]}."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            jax.block_until_ready(fn(*args))
        found = list(pathlib.Path(log_dir).rglob("*.xplane.pb"))
        if not found:
            return {}
        data = jax.profiler.ProfileData.from_file(str(found[0]))
        planes = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU:"):
                continue
            lines = [line for line in plane.lines if line.name.startswith("Stream")]
            if not lines:
                print(f"    {plane.name}: no stream lines in {[l.name for l in plane.lines]}")
            events = [(e.name, e.start_ns, e.duration_ns) for line in lines for e in line.events]
            planes[plane.name] = sorted(events, key=lambda e: e[1])
        return planes


def kernel_summary(planes, steps, top=8):
    """Per device plane: the device's busy time and span per step (span includes the gaps
    between kernels), and the `top` kernels by time with their calls per step and median
    microseconds; the program's kernels outside its steps (a prologue) count in, at fewer than
    one call per step."""
    summary = {}
    for plane, events in planes.items():
        by_name = collections.defaultdict(list)
        for name, _, dur in events:
            by_name[name[:60]].append(dur / 1e3)
        span = (events[-1][1] + events[-1][2] - events[0][1]) / 1e3 if events else 0.0
        summary[plane] = dict(
            busy_us_per_step=sum(d for _, _, d in events) / 1e3 / steps,
            span_us_per_step=span / steps,
            kernels={
                n: dict(calls_per_step=len(d) / steps, median_us=float(np.median(d)))
                for n, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
            },
        )
    return summary


def print_summary(summary, top=6):
    for plane, s in summary.items():
        print(
            f"    {plane}: busy {s['busy_us_per_step']:.1f} us/step, span "
            f"{s['span_us_per_step']:.1f} us/step",
            flush=True,
        )
        for name, k in list(s["kernels"].items())[:top]:
            print(f"      {k['median_us']:8.1f} us x{k['calls_per_step']:.2f}  {name}", flush=True)

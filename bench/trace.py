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


def kernel_summary(planes, steps, top=8, fewer=None):
    """Per device plane: the device's busy time and span per step (span includes the gaps
    between kernels), and the `top` kernels by time with their calls per step and median
    microseconds. Alone, the program's kernels outside its steps (a prologue) count in, at fewer
    than one call per step. With `fewer`, the planes of the same program run with `steps` steps
    fewer, it is the summary of those steps alone: the difference of the two runs, as bench.ep
    differences its two programs' times (a prologue, and whatever else both runs do once, count
    out)."""
    summary = {}
    for plane, events in planes.items():
        base = (fewer or {}).get(plane, [])
        durations, base_durations = _by_name(events), _by_name(base)
        net = {n: sum(d) - sum(base_durations.get(n, ())) for n, d in durations.items()}
        calls = {n: (len(d) - len(base_durations.get(n, ()))) / steps for n, d in durations.items()}
        listed = [n for n in sorted(durations, key=lambda n: -net[n]) if calls[n] > 0][:top]
        summary[plane] = dict(
            busy_us_per_step=(_busy_us(events) - _busy_us(base)) / steps,
            span_us_per_step=(_span_us(events) - _span_us(base)) / steps,
            kernels={
                n: dict(calls_per_step=calls[n], median_us=float(np.median(durations[n])))
                for n in listed
            },
        )
    return summary


def _by_name(events):
    by_name = collections.defaultdict(list)
    for name, _, dur in events:
        by_name[name[:60]].append(dur / 1e3)
    return by_name


def _busy_us(events):
    return sum(d for _, _, d in events) / 1e3


def _span_us(events):
    return (events[-1][1] + events[-1][2] - events[0][1]) / 1e3 if events else 0.0


def print_summary(summary, top=6):
    for plane, s in summary.items():
        print(
            f"    {plane}: busy {s['busy_us_per_step']:.1f} us/step, span "
            f"{s['span_us_per_step']:.1f} us/step",
            flush=True,
        )
        for name, k in list(s["kernels"].items())[:top]:
            print(f"      {k['median_us']:8.1f} us x{k['calls_per_step']:.2f}  {name}", flush=True)

"""What every benchmark shares: loop timing (loop_seconds), the options every command takes
(common_arguments), result records with the run's machine, date and command (new_record,
save_record), how far one result is from another (relative_error), and the machine's peer copy
bandwidth (copy_engine_gbps, through bench._probe)."""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

_PERTURBABLE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def loop_seconds(
    step, args, counts=(1, 4), repeats=5, mesh=None, in_specs=None, prologue=None, warm_s=0.0
):
    """Seconds per call of `step(*inputs) -> out`, for work too large to keep every call's output
    (bench.ep's Timer keeps them): a jitted program (loop_program) computes inputs =
    prologue(*args) (or args) once, then calls step n times in a loop, each call's first
    floating-point input depending on the last output through one element (no call is
    loop-invariant or dead code); the difference of the best times at the counts over the
    extra calls cancels launch, prologue and sync costs. With a mesh, the program is a
    shard_map over it (in_specs per argument, step per rank) and every output leaf is split
    over the mesh's axes. warm_s: seconds of runs before each count is timed, so that a GPU is
    timed in the state sustained work keeps it in (under load its clocks drop within about a
    second: lab.gemm_clocks)."""
    run = loop_program(step, mesh, in_specs, prologue)

    def best(n):
        jax.block_until_ready(run(n, *args))  # compile (once) and warm up
        warm_until = time.perf_counter() + warm_s
        while time.perf_counter() < warm_until:
            jax.block_until_ready(run(n, *args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(n, *args))
            times.append(time.perf_counter() - start)
        return min(times)

    low, high = counts
    return (best(high) - best(low)) / (high - low)


def loop_program(step, mesh=None, in_specs=None, prologue=None):
    """loop_seconds's program, jitted: run(n, *args) calls step n times. On GPUs n is static (a
    compilation per count): a GPU runs a loop of known trip count without the host reading its
    condition after every call, which left it idle ~80 us a call (2026-12-03). Elsewhere n is a
    run-time value, and one compilation serves every count."""

    def program(n, *args):
        inputs = tuple(prologue(*args)) if prologue else args
        leaves = jax.tree.leaves(inputs)
        i = next(i for i, leaf in enumerate(leaves) if jnp.dtype(leaf.dtype) in _PERTURBABLE)
        kept = leaves[i][(0,) * leaves[i].ndim]  # the element each call rewrites, read once

        def again(_, carry):
            inputs, out = carry
            inputs = perturbed(inputs, i, jax.tree.leaves(out)[0].reshape(-1)[0], kept)
            return inputs, step(*inputs)

        out = jax.lax.fori_loop(1, n, again, (inputs, step(*inputs)))[1]
        return jax.tree.map(lambda a: a.reshape((1,) + a.shape) if a.ndim == 0 else a, out)

    static = (0,) if jax.default_backend() == "gpu" else ()
    if mesh is None:
        return jax.jit(program, static_argnums=static)
    return jax.jit(
        lambda n, *args: jax.shard_map(
            functools.partial(program, n),
            mesh=mesh,
            in_specs=tuple(in_specs),
            out_specs=P(tuple(mesh.axis_names)),
        )(*args),
        static_argnums=static,
    )


def perturbed(inputs, i, value, kept):
    """inputs with the first element of their leaf i (the first floating-point one) set to
    kept + value * 0 (kept: that element's value). Set, not added to: an update that reads the
    element it writes made XLA copy the whole leaf every call (280 us of a 1.6 ms grouped
    matmul whose rows are the leaf, 2026-12-03); one that only writes is done in place."""
    leaves, tree = jax.tree.flatten(inputs)
    tick = (kept.astype(jnp.float32) + value.astype(jnp.float32) * 0).astype(leaves[i].dtype)
    leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(tick)
    return jax.tree.unflatten(tree, leaves)


def common_arguments(parser, kind):
    """The options every benchmark takes: where results go (by default bench/results/<kind>, the
    folder of its kind: ops, grouped_matmul, moe_layer, accuracy) and under which machine name."""
    parser.add_argument("--machine", default=os.environ.get("JAX_EP_MACHINE", "unknown"))
    parser.add_argument("--out", default=f"bench/results/{kind}")
    parser.add_argument("--no-plot", action="store_true")


def new_record(args, module, argv, **fields):
    """A result record: the machine (args.machine), today's date and the command line
    (`python -m <module>` and argv, or this process's arguments when argv is None), then
    fields."""
    return dict(
        machine=args.machine,
        date=datetime.date.today().isoformat(),
        command=f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
        **fields,
    )


def save_record(record, out_dir, name, suffix=""):
    """Writes record as <out_dir>/<name>-<machine>-<date><suffix>.json; returns the path
    without .json (for the plot)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{name}-{record['machine']}-{record['date']}{suffix}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    return stem


def relative_error(got, want):
    """|got - want| / |want| (Frobenius norms, in float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def copy_engine_gbps(both_ways):
    """GB/s per direction of 256 MiB copied GPU0 -> GPU1 by the copy engine (and GPU1 -> GPU0 at
    the same time when both_ways), or None when it was not measured: bench._probe not built
    (bench/probe.py says how to build it), or the copy failed."""
    try:
        from bench import _probe
    except ImportError:
        return None
    gbps = _probe.peer_gbps(0, 1, 256 << 20, 0, -1, 20, both_ways)
    return gbps if gbps > 0 else None

"""DeepEP V1 (its intranode kernels) beside jax_ep, each as R processes sharing GPU 0 under MPS.

Both libraries run as R processes on GPU 0 under a private MPS daemon (rows cross HBM instead of
NVLink), every rank's kernels on 24 SMs, routing the same tokens. Per op (dispatch, combine,
cached dispatch): time per op, kernel time and GB/s of the bytes a rank receives (DeepEP's
convention: logical, its own rows included; an FP8 row is H bytes and H/128 float32 scales, a
BF16 row 2H bytes), each the mean over ranks.

    bench/deepep_build.sh          # once: DeepEP's source in .deepep/, built in place (~2 min)
    python -m bench.versus_deepep  # --processes 2,4 --config v3,ll: ~5 min on one H100

Each (config, R, library) is a group of R processes (this module with --worker), each printing
one JSON line per op; a group that fails, or outlives --group-timeout, is recorded with its error
and the run goes on; groups not started within --budget-s are recorded as not run. Every rank
makes the same inputs from --seed and its rank (rank_routing, rank_tokens): uniform random top-k
of distinct experts, 256 experts over the R ranks. Each worker imports only its own library.

jax_ep times as bench.ep does (many ops in one jitted program, the difference of two program
lengths, less the harness's own step; kernel time: the device's busy time per step from JAX's
profiler, less the harness's), on its CUDA-IPC engine, rank layout, FP8 dispatch (quantized inside
the op); it picks its low-latency kernels up to 256 tokens per rank. DeepEP: CUDA events around
many calls after a warm-up, the best of 5 runs; kernel time: its deep_ep:: kernels per call from
torch's profiler; its normal kernels at every size (its low-latency ones need NVSHMEM). Its FP8
dispatch takes x already quantized (its caller casts it: not timed). `dispatch` is
get_dispatch_layout and dispatch with num_worst_tokens = R * T (no host sync, like jax_ep's static
output shape); `dispatch_host_sync` (DeepEP only) is its default dispatch, whose host waits for
the received counts; `cached_dispatch` reuses that dispatch's handle; `combine` sends back BF16
rows, unweighted. DeepEP's dispatch also moves the top-k weights, which jax_ep's rank layout
leaves out (K floats beside a row of H + H/32 bytes).

Writes bench/results/ops/versus-deepep-<machine>-<date>.json and prints a table. DeepEP is no
dependency of jax_ep: its workers need torch, and `deep_ep` built in --deepep (put on their
PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from bench.process_group import MPSUnavailable, finish, free_port, private_mps

LIBRARIES = ("jax_ep", "deepep")
OPS = ("dispatch", "combine", "cached_dispatch", "dispatch_host_sync")  # the last: DeepEP's only
LINE = "VERSUS_DEEPEP "  # a worker's report lines start with it; the rest of its output is log
REPEATS, WARMUP = 5, 10  # DeepEP: best of REPEATS runs of `calls` calls, after WARMUP calls
CALLS = {"v3": 50, "ll": 200}  # ~15-20 ms of DeepEP ops per timed run
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every worker's environment, beside the MPS daemon's variables: GPU 0, JAX's memory taken as
# needed (the ranks share the GPU), jax_ep's CUDA-IPC engine, torch's gloo on the loopback, and
# no NVLink multicast in any library.
WORKER_ENV = dict(
    CUDA_VISIBLE_DEVICES="0",
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
    JAX_PLATFORMS="cuda",
    JAX_EP_ENGINE="cuda_ipc",
    GLOO_SOCKET_IFNAME="lo",
    NCCL_NVLS_ENABLE="0",
    NVSHMEM_DISABLE_NVLS="1",
    TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    PYTHONUNBUFFERED="1",
)


def rank_routing(shape, rank, seed):
    """This rank's top-k ([T, K] int32, distinct experts: the K best of uniform random scores)
    and weights ([T, K] float32, each token's summing to 1), the same in every library."""
    rng = np.random.default_rng([seed, rank, 0])
    scores = rng.random((shape["tokens"], shape["num_experts"]))
    idx = np.argsort(-scores, axis=1)[:, : shape["num_topk"]].astype(np.int32)
    weights = np.take_along_axis(scores, idx, axis=1).astype(np.float32)
    return idx, weights / weights.sum(axis=1, keepdims=True)


def rank_tokens(shape, rank, seed):
    """This rank's tokens, [T, H] float32 (each library casts them to bfloat16)."""
    rng = np.random.default_rng([seed, rank, 1])
    return rng.standard_normal((shape["tokens"], shape["hidden"]), np.float32)


def received_rows(shape, num_ranks, seed):
    """[R]: the rows each rank receives in a dispatch, its own included: a token goes once to
    each rank that holds one of its experts."""
    per_rank = shape["num_experts"] // num_ranks
    rows = np.zeros(num_ranks, np.int64)
    for source in range(num_ranks):
        owner = rank_routing(shape, source, seed)[0] // per_rank  # [T, K]
        rows += (owner[..., None] == np.arange(num_ranks)).any(axis=1).sum(axis=0)
    return rows


def op_row_bytes(op, hidden):
    """Bytes of one row an op moves: dispatches FP8 (H bytes and H/128 float32 scales), combine
    BF16."""
    return 2 * hidden if op == "combine" else hidden + hidden // 128 * 4


def deepep_commit(tree):
    """The DeepEP commit of a source tree, from the COMMIT file its extraction wrote (see
    bench/deepep_build.sh), or None."""
    try:
        with open(os.path.join(tree, "COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return None


def summarize(library, num_ranks, config, shape, reports, received):
    """One result per op from every rank's reports ({op, time_us, kernel_us, ...} each): the mean
    time and kernel time over ranks, and the mean over ranks of each rank's received bytes per
    second of time (logical_gbps) and of kernel time (kernel_gbps); per-rank values kept."""
    results = []
    for op in OPS:
        mine = [next((r for r in rank if r.get("op") == op), None) for rank in reports]
        if any(r is None for r in mine):
            continue
        moved = [int(n) * op_row_bytes(op, shape["hidden"]) for n in received]
        times = [r["time_us"] for r in mine]
        kernels = [r.get("kernel_us") for r in mine]
        has_kernels = all(k is not None and k > 0 for k in kernels)
        results.append(
            dict(
                library=library,
                num_ranks=num_ranks,
                config=config,
                op=op,
                tokens_per_rank=shape["tokens"],
                time_us=float(np.mean(times)),
                kernel_us=float(np.mean(kernels)) if has_kernels else None,
                logical_gbps=float(np.mean([b / t / 1e3 for b, t in zip(moved, times)])),
                kernel_gbps=(
                    float(np.mean([b / k / 1e3 for b, k in zip(moved, kernels)]))
                    if has_kernels
                    else None
                ),
                received_rows=[int(n) for n in received],
                bytes_per_rank=moved,
                ranks=mine,
            )
        )
    return results


def report(**fields):
    print(LINE + json.dumps(fields), flush=True)


def reports_of(output):
    """The report lines of one worker's output, as dicts."""
    return [json.loads(line[len(LINE) :]) for line in output.splitlines() if line.startswith(LINE)]


# ---- the workers: one rank each


def jax_ep_worker(spec):
    """One rank of jax_ep's group (jax.distributed over the group's processes): a Buffer on the
    CUDA-IPC engine, each op timed by bench.ep's Timer."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from bench import ep

    rank, num_ranks, shape = spec["rank"], spec["num_ranks"], spec["shape"]
    jax.distributed.initialize(
        f"127.0.0.1:{spec['port']}",
        num_processes=num_ranks,
        process_id=rank,
        initialization_timeout=120,
    )
    assert jax.process_index() == rank and jax.local_device_count() == 1, jax.local_devices()
    devices = sorted(jax.devices(), key=lambda d: d.process_index)  # rank r: process r's GPU
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    report(device=devices[rank].device_kind, jax=jax.__version__)

    def global_array(rows):  # this rank's rows of one array split over the ranks
        sharding = NamedSharding(mesh, P("ep"))
        return jax.make_array_from_callback(
            (num_ranks * len(rows),) + rows.shape[1:], sharding, lambda index: rows
        )

    x = global_array(rank_tokens(shape, rank, spec["seed"]).astype(jnp.bfloat16))
    idx = global_array(rank_routing(shape, rank, spec["seed"])[0])
    buf = jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=shape["num_experts"],
        hidden=shape["hidden"],
        num_topk=shape["num_topk"],
        max_tokens_per_rank=shape["tokens"],
        num_sms=spec["num_sms"],
        timeout_s=30.0,
    )
    count = jax.jit(
        jax.shard_map(
            lambda x, i: buf.dispatch(x, i, fp8=True).num_recv.reshape(1),
            mesh=mesh,
            in_specs=(P("ep"), P("ep")),
            out_specs=P("ep"),
        )
    )
    received = int(np.asarray(count(x, idx).addressable_shards[0].data)[0])
    report(engine=buf.engine, received_rows=received)
    steps = tuple(shape["steps"])
    dispatch, combine, expert_rows = ep.buffer_ops(buf, True)
    timers = dict(ep.op_timers(mesh, dispatch, combine, expert_rows, steps))
    timers["cached_dispatch"] = ep.cached_dispatch_timer(mesh, buf, dispatch, True, steps)
    harness = ep.harness_timer(mesh, steps)
    harness_s = harness((x, idx))

    def busy_us(timer, label):  # the device's busy time per step (one GPU plane per process)
        planes = timer.trace((x, idx), label) if spec["kernels"] else {}
        return max((p["busy_us_per_step"] for p in planes.values()), default=None)

    harness_busy = busy_us(harness, "harness")
    for op, timer in timers.items():
        seconds = timer((x, idx))
        busy = busy_us(timer, op)
        report(
            op=op,
            time_us=(seconds - harness_s) * 1e6,
            raw_time_us=seconds * 1e6,
            harness_us=harness_s * 1e6,
            kernel_us=None if busy is None or harness_busy is None else busy - harness_busy,
            kernels=timer.kernels,
        )
    jax.distributed.shutdown()  # a barrier: process 0's exit ends the others' coordination


def deepep_worker(spec):
    """One rank of DeepEP's group (torch.distributed over gloo: NCCL refuses two ranks on one
    GPU; DeepEP only gathers device ids and IPC handles through it): a deep_ep.Buffer of the
    intranode kernels with Buffer.get_dispatch_config/get_combine_config at --num-sms SMs."""
    import datetime

    import deep_ep
    import torch
    import torch.distributed as dist

    rank, num_ranks, shape = spec["rank"], spec["num_ranks"], spec["shape"]
    hidden, num_experts = shape["hidden"], shape["num_experts"]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=num_ranks,
        timeout=datetime.timedelta(seconds=120),
    )
    group = dist.new_group(list(range(num_ranks)))
    report(device=torch.cuda.get_device_name(), torch=torch.__version__)
    deep_ep.Buffer.set_num_sms(spec["num_sms"])
    dispatch_config = deep_ep.Buffer.get_dispatch_config(num_ranks)
    combine_config = deep_ep.Buffer.get_combine_config(num_ranks)
    nvl_bytes = max(
        c.get_nvl_buffer_size_hint(2 * hidden, num_ranks) for c in (dispatch_config, combine_config)
    )
    buf = deep_ep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)

    x = torch.from_numpy(rank_tokens(shape, rank, spec["seed"])).cuda().bfloat16()
    blocks = x.float().view(x.shape[0], -1, 128)  # FP8 as jax_ep's: a scale per 128 channels
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (448.0 / amax)[..., None]).to(torch.float8_e4m3fn).view(x.shape)
    scales = amax / 448.0
    idx, weights = rank_routing(shape, rank, spec["seed"])
    idx = torch.from_numpy(idx).cuda().to(deep_ep.topk_idx_t)
    weights = torch.from_numpy(weights).cuda()

    def dispatch(worst=0):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        return buf.dispatch(
            (q, scales),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=weights,
            num_worst_tokens=worst,
            config=dispatch_config,
        )

    (recv_q, recv_scales), _, _, _, handle, _ = dispatch()
    report(received_rows=recv_q.shape[0])
    rows = (recv_q.float().view(recv_q.shape[0], -1, 128) * recv_scales[..., None]).view(
        recv_q.shape
    )
    rows = rows.bfloat16()
    ops = {
        "dispatch": lambda: dispatch(num_ranks * shape["tokens"]),
        "combine": lambda: buf.combine(rows, handle, config=combine_config),
        "cached_dispatch": lambda: buf.dispatch((q, scales), handle=handle, config=dispatch_config),
        "dispatch_host_sync": dispatch,
    }
    calls = spec["calls"]
    for op, fn in ops.items():
        for _ in range(WARMUP):
            fn()
        best = float("inf")
        for _ in range(REPEATS):
            torch.cuda.synchronize()
            dist.barrier(group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / calls)
        kernels = deepep_kernels(fn, calls, group) if spec["kernels"] else {}
        ours = [us for name, us in kernels.items() if "deep_ep" in name]
        report(op=op, time_us=best, kernel_us=sum(ours) if ours else None, kernels=kernels)
    torch.cuda.synchronize()
    dist.barrier(group)
    buf.destroy()
    dist.destroy_process_group()


def deepep_kernels(fn, calls, group):
    """{kernel: microseconds per call} of `calls` calls of fn under torch's profiler (CUDA
    activity only)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernel_times(json.load(f)["traceEvents"], calls)


def kernel_times(events, calls):
    """{kernel: microseconds per call} of a chrome trace's kernel events (durations in
    microseconds) over `calls` calls; names cut at their argument list."""
    per_call = {}
    for e in events:
        if e.get("cat") == "kernel":
            name = e["name"].removeprefix("void ").split("(")[0][:100]
            per_call[name] = per_call.get(name, 0.0) + e["dur"] / calls
    return per_call


def worker(spec):
    """A worker process's life: its library's ranks, then a report line saying how it ended."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # finish() asks before a kill
    try:
        (jax_ep_worker if spec["library"] == "jax_ep" else deepep_worker)(spec)
    except BaseException as e:
        traceback.print_exc()
        report(error=f"{type(e).__name__}: {' | '.join(str(e).splitlines()[:8])[:2000]}")
        sys.stdout.flush()
        os._exit(1)  # its peers fail or time out; the group's wait ends them
    report(done=True)
    os._exit(0)  # no teardown of CUDA contexts and Buffers: the results are out


# ---- the run: every group in turn


def run_group(library, num_ranks, config, shape, args, env, timeout, log_dir):
    """Launches one group, waits for it, and returns (reports per rank, its record): exit codes,
    seconds, and the first error a rank reported (else the end of a failed rank's output)."""
    port, start = free_port(), time.monotonic()
    spec = dict(
        library=library,
        num_ranks=num_ranks,
        port=port,
        shape=shape,
        seed=args.seed,
        num_sms=args.num_sms,
        calls=CALLS[config],
        kernels=not args.no_kernels,
    )
    with contextlib.ExitStack() as stack:
        paths = [
            os.path.join(log_dir, f"{config}-{library}-{num_ranks}-rank{r}.log")
            for r in range(num_ranks)
        ]
        files = [stack.enter_context(open(p, "w+")) for p in paths]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.versus_deepep",
                    "--worker",
                    json.dumps(dict(spec, rank=r)),
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
            for r, f in enumerate(files)
        ]
        codes = finish(procs, timeout, grace=args.grace_s)
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
    reports = [reports_of(out) for out in outputs]
    errors = [r["error"] for rank in reports for r in rank if "error" in r]
    failed = [
        (r, code)
        for r, code in enumerate(codes)
        if code != 0 or not any(x.get("done") for x in reports[r])
    ]
    error = errors[0] if errors else None
    if failed and error is None:
        r, code = failed[0]
        what = "killed after the group's timeout" if code is None else f"exit {code}"
        error = f"rank {r}: {what}; its output ends: {outputs[r][-1500:]}"
    for r, code in failed:
        print(
            f"--- {library} R={num_ranks} {config} rank {r} (exit {code}), its output's end:\n"
            f"{outputs[r][-4000:]}",
            flush=True,
        )
    group = dict(
        library=library,
        num_ranks=num_ranks,
        config=config,
        seconds=round(time.monotonic() - start, 1),
        exit_codes=codes,
        error=error,
    )
    return reports, group


def run_groups(configs, counts, libraries, shapes, args, env, log_dir):
    """Every (config, R, library) group in turn, until --budget-s is spent: (results, group
    records, the devices the workers saw)."""
    start, results, groups, devices = time.monotonic(), [], [], set()
    for config in configs:
        for num_ranks in counts:
            received = received_rows(shapes[config], num_ranks, args.seed)
            for library in libraries:
                left = args.budget_s - (time.monotonic() - start)
                if left <= 0:
                    groups.append(
                        dict(
                            library=library,
                            num_ranks=num_ranks,
                            config=config,
                            error="not run: --budget-s spent",
                        )
                    )
                    continue
                print(f"{config} R={num_ranks} {library} ...", flush=True)
                timeout = min(args.group_timeout, left)
                reports, group = run_group(
                    library, num_ranks, config, shapes[config], args, env, timeout, log_dir
                )
                seen = [
                    next((r["received_rows"] for r in rank if "received_rows" in r), None)
                    for rank in reports
                ]
                group["received_rows_as_routed"] = seen == received.tolist()
                devices |= {r["device"] for rank in reports for r in rank if "device" in r}
                groups.append(group)
                done = summarize(library, num_ranks, config, shapes[config], reports, received)
                results += done
                print(
                    f"  {group['seconds']} s, {len(done)} ops"
                    + (f"; ERROR {group['error']}" if group["error"] else ""),
                    flush=True,
                )
    return results, groups, sorted(devices)


def table(results):
    """Both libraries side by side per (config, R, op): time, kernel time, GB/s of time."""

    def cells(r):
        if r is None:
            return f"{'-':>9s} {'-':>9s} {'-':>7s}"
        kernel = f"{r['kernel_us']:9.1f}" if r["kernel_us"] is not None else f"{'-':>9s}"
        return f"{r['time_us']:9.1f} {kernel} {r['logical_gbps']:7.1f}"

    by_key = {(r["config"], r["num_ranks"], r["op"], r["library"]): r for r in results}
    keys = sorted({k[:3] for k in by_key}, key=lambda k: (k[0], k[1], OPS.index(k[2])))
    lines = [
        f"{'':6s} {'R':>2s} {'op':18s} | {'jax_ep us':>9s} {'kernel':>9s} {'GB/s':>7s} | "
        f"{'deepep us':>9s} {'kernel':>9s} {'GB/s':>7s} | deepep/jax_ep time"
    ]
    for config, num_ranks, op in keys:
        ours, theirs = (by_key.get((config, num_ranks, op, lib)) for lib in LIBRARIES)
        ratio = f"{theirs['time_us'] / ours['time_us']:.2f}" if ours and theirs else "-"
        lines.append(
            f"{config:6s} {num_ranks:2d} {op:18s} | {cells(ours)} | {cells(theirs)} | {ratio}"
        )
    return "\n".join(lines)


def main(argv=None):
    from bench.ep import CONFIGS
    from bench.harness import common_arguments, new_record, save_record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4", help="comma-separated rank counts R")
    parser.add_argument("--config", default="v3,ll", help="comma-separated: v3, ll (bench.ep's)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--num-sms", type=int, default=24, help="SMs of each rank's kernels")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--deepep", default=".deepep", help="DeepEP's built source tree (bench/deepep_build.sh)"
    )
    parser.add_argument("--group-timeout", type=float, default=240.0, help="seconds per group")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="seconds a group's other ranks get once one has failed",
    )
    parser.add_argument(
        "--budget-s", type=float, default=400.0, help="no group starts after this many seconds"
    )
    parser.add_argument("--no-kernels", action="store_true", help="skip the profilers")
    parser.add_argument("--logs", default=None, help="keep every rank's output in this folder")
    common_arguments(parser, "ops")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.processes.split(",")]
    configs = args.config.split(",")
    libraries = args.libraries.split(",")
    unknown = [c for c in configs if c not in CONFIGS] + [
        lib for lib in libraries if lib not in LIBRARIES
    ]
    if unknown:
        parser.error(f"unknown config or library: {', '.join(unknown)}")
    shapes = {
        c: {k: CONFIGS[c][k] for k in ("tokens", "hidden", "num_experts", "num_topk", "steps")}
        for c in configs
    }
    for c, s in shapes.items():
        bad = [n for n in counts if s["num_experts"] % n]
        if bad:
            parser.error(f"{c}: {s['num_experts']} experts do not split over {bad} ranks")
    env = dict(
        os.environ,
        **WORKER_ENV,
        PYTHONPATH=os.pathsep.join(
            [ROOT, os.path.abspath(args.deepep)]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    )
    with contextlib.ExitStack() as stack:
        log_dir = args.logs or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(log_dir, exist_ok=True)
        try:
            env.update(stack.enter_context(private_mps()))
        except MPSUnavailable as e:
            raise SystemExit(f"bench.versus_deepep: {e}") from None
        results, groups, devices = run_groups(
            configs, counts, libraries, shapes, args, env, log_dir
        )
    print(table(results))
    record = new_record(
        args,
        "bench.versus_deepep",
        argv,
        device=devices,
        deepep_commit=deepep_commit(args.deepep),
        num_sms=args.num_sms,
        seed=args.seed,
        shapes=shapes,
        deepep_calls=CALLS,
        groups=groups,
        results=results,
    )
    stem = save_record(record, args.out, "versus-deepep")
    print(f"wrote {stem}.json")
    return 1 if any(g["error"] for g in groups) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # run_group's processes: before main() imports JAX
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())

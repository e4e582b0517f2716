"""How a Buffer's native side comes up on every process of its mesh.

A Buffer owns the communication window of every EP group of its axis: the devices along the axis
at one coordinate of the other mesh axes, in axis order (their position is their rank). Each
process builds the windows of its own devices; the processes meet in jax.distributed's key-value
store between the steps (jax_ep/meeting.py), watch each other (jax_ep/liveness.py), choose the
GPU engine (jax_ep/engine.py), and share their windows: NCCL's, or through descriptor sockets
(CPUs and CUDA IPC). Creation holds a lock of the process (several threads may create Buffers).
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time

from jax_ep import _testing, engine, liveness, meeting
from jax_ep._jax import BufferOrder, release_tokens
from jax_ep.meeting import SLICE_S, PeersEnded, Plan
from jax_ep.memory import fail, limits

_log = logging.getLogger("jax_ep")

# One Buffer is created at a time in a process: a Buffer's key counts the Buffers created before
# it, and the processes meet in the key-value store under that key. Held from the plan to the
# registered native side; reentrant (creation drops the Buffers collected meanwhile).
creating = threading.RLock()

engines: dict[int, str] = {}  # the engine of each Buffer's key in this process


def create(config):
    """The native side of a Buffer of `config` (a BufferConfig), made with the other processes
    of its mesh, and its Plan. Call it holding `creating`."""
    p = meeting.plan(config.mesh, config.fast_axis)
    if p.platform is None:
        fail(
            f"the custom calls run on CPU and CUDA devices, not on "
            f"{config.mesh.devices.flat[0].platform}: use impl='reference' there"
        )
    bound = limits()["max_gpu_ranks" if p.platform == "cuda" else "max_cpu_ranks"]
    if config.ranks_per_node > bound:
        fail(
            f"axis {config.fast_axis!r} has {config.ranks_per_node} ranks; the {p.platform} "
            f"backend takes at most {bound} in one group"
        )
    knobs = _testing.knobs
    if not 0 <= knobs.first_op < 1 << 62:  # checked here, after the plan, like any local check
        fail(f"_testing's first_op must be in [0, 2^62), got {knobs.first_op}")
    arguments = dict(
        num_experts=config.num_experts,
        hidden=config.hidden,
        num_topk=config.num_topk,
        max_tokens_per_rank=config.max_tokens_per_rank,
        max_row_dtype=config.max_row_dtype.name,
        num_sms=config.num_sms,
        low_latency_tokens=config.low_latency_tokens,
        timeout_s=config.timeout_s,
        direct_local=knobs.direct_local,
        axis_name=list(config.axes),
        check_invalid=config.check_invalid,
        mesh=dict(
            axis_names=list(config.mesh.axis_names),
            shape=list(config.mesh.devices.shape),
            device_ids=[d.id for d in config.mesh.devices.flat],
        ),
        first_op=knobs.first_op,
    )
    meeting.commit(p)
    meeting.check_same_arguments(p, arguments, config.timeout_s)
    native = connect(p, config.window(), config.timeout_s, config.num_sms, knobs)
    return native, p


def _comparable_pids(mine: dict, theirs: dict) -> bool:
    """Whether this process sees the other's process id as it published it: one host, one pid
    namespace."""
    return bool(mine["pidns"]) and (mine["host"], mine["pidns"]) == (
        theirs["host"],
        theirs["pidns"],
    )


def descriptor_sockets(p: Plan, hello: dict) -> tuple[str, bytes, list]:
    """Where this process serves its windows' descriptors (the CPU engine's and CUDA IPC's,
    transport/fd_socket.h), the job's secret that both ends check, and the processes allowed
    to ask: (socket name, secret, pids). The name carries the Buffer's key, the first process's
    nonce (a Buffer of an earlier run with the same key, still alive, cannot answer for this one)
    and this process's number. Process ids are checked where every process of this host shares
    this process's pid namespace (elsewhere an id is not comparable): pids is then theirs, else
    empty (any process of this user)."""
    first, mine = hello[p.processes[0]], hello[p.process]
    here = [h for h in hello.values() if h["host"] == mine["host"]]
    same = all(_comparable_pids(mine, h) for h in here)
    pids = sorted({h["pid"] for h in here}) if same else []
    name = f"jax_ep_{p.key:x}_{first['nonce']}_p{p.process}"
    return name, bytes.fromhex(first["secret"]), pids


def join_windows(p: Plan, native, hello: dict, timeout_s: float):
    """After `native` made and served this process's windows: every process publishes where it
    serves them, receives its peers' (in slices of at most SLICE_S, so that Ctrl-C acts at once;
    a rank not served within timeout_s is named), and stops serving once all did."""
    for note in native.notes:
        _log.warning("%s", note)
    served = meeting.exchange(p, "created", {"socket": native.socket}, timeout_s)
    mine, peers = hello[p.process], []
    for group in sorted({g for _, g, _ in p.local}):
        for rank, q in enumerate(p.rank_processes[group]):
            if q != p.process:
                theirs = hello[q]
                pid = theirs["pid"] if _comparable_pids(mine, theirs) else 0
                peers.append((group, rank, served[q]["socket"], pid))
    deadline = time.monotonic() + timeout_s
    while missing := native.connect(peers, max(min(SLICE_S, deadline - time.monotonic()), 0.001)):
        if gone := meeting.ended().intersection(p.rank_processes[g][r] for g, r in missing):
            raise RuntimeError(f"jax_ep: {PeersEnded(gone)} before serving their windows")
        if time.monotonic() >= deadline:
            names = ", ".join(
                f"rank {r} of EP group {g} (process {p.rank_processes[g][r]}, socket "
                f"'@{served[p.rank_processes[g][r]]['socket']}')"
                for g, r in missing
            )
            raise RuntimeError(
                f"jax_ep: {names} did not serve its window within {timeout_s} s (did its "
                f"process stop?)"
            )
    liveness.watch_peers(p)
    meeting.meet(p, "connected", timeout_s)
    native.stop_serving()


def _one_host(p: Plan, hello: dict):
    """The CPU engine's windows are one host's shared memory: every EP group on one host."""
    for group in sorted({g for _, g, _ in p.local}):
        hosts = {hello[q]["host"] for q in p.rank_processes[group]}
        if len(hosts) > 1:
            raise ValueError(
                f"jax_ep: EP group {group} spans {len(hosts)} hosts, but the CPU backend's "
                f"windows are one host's shared memory: put each EP group's processes on one "
                f"host (a tuple axis ('node', 'ep') crosses hosts)"
            )


def connect(p: Plan, window, timeout_s, num_sms, knobs):
    """Builds and registers the Buffer's native side on this process; returns it."""
    from jax_ep import _native

    forget()  # Buffers collected since: their memory first
    met = meeting.introductions(p, timeout_s)
    liveness.announce_liveness(p, met)  # before any later step: the others watch it from the next
    try:
        native = _build(p, met, window, timeout_s, num_sms, knobs)
    except BaseException:
        liveness.release_liveness(p.key)
        raise
    _native.register_buffer(p.key, native)
    _native.watch_buffer(native, [list(r) for r in p.rank_processes])
    _forget_at_exit()
    return native


def _build(p: Plan, met: dict, window, timeout_s, num_sms, knobs):
    """The native side of the Buffer on this process, once the processes met for it."""
    from jax_ep import _native

    if p.platform == "cpu":
        _one_host(p, met)
        name, secret, pids = descriptor_sockets(p, met)
        native = _native.CpuBuffer(
            window, name, secret, pids, timeout_s, list(p.local), knobs.first_op
        )
        join_windows(p, native, met, timeout_s)
        engines[p.key] = "shm"
    else:
        if not _native.has_cuda:
            raise ValueError(
                "jax_ep: this build has no CUDA backend, so a Buffer cannot run on "
                "GPUs. Reinstall where the CUDA toolkit (nvcc) is found, e.g. "
                "JAX_EP_CUDA=ON pip install --no-build-isolation . (or use "
                "impl='reference')"
            )
        chosen, _ = engine.gpu_engine(p, timeout_s)
        if chosen == "nccl":
            library = engine.nccl_library()
            ids = {
                g: meeting.share(
                    p,
                    f"nccl/{g}",
                    lambda: _native.nccl_unique_id(library),
                    p.group_owners[g],
                    timeout_s,
                )
                for g in sorted({group for _, group, _ in p.local})
            }
            native = _native.CudaBuffer(
                window,
                library,
                timeout_s,
                num_sms,
                list(p.local),
                ids,
                knobs.direct_local,
                knobs.first_op,
            )
            liveness.watch_peers(p)
            meeting.meet(p, "connected", timeout_s)
        else:
            name, secret, pids = descriptor_sockets(p, met)
            native = _native.CudaIpcBuffer(
                window,
                name,
                secret,
                pids,
                timeout_s,
                num_sms,
                list(p.local),
                knobs.direct_local,
                knobs.first_op,
            )
            join_windows(p, native, met, timeout_s)  # every window is zeroed when served
        engines[p.key] = chosen
    return native


_to_forget: list = []  # keys of Buffers collected by the garbage collector


def forget_later(key):
    """From a finalizer: only records the key (list.append is atomic); no native work there."""
    _to_forget.append(key)


def forget(key=None):
    """Drops the native side of Buffer `key` (and of the Buffers collected since the last call)
    from the registry; its memory goes when the last program using it does. A failed last
    program's tokens go too (`release_tokens`: JAX would raise its error again at exit), and
    the liveness listener with the last Buffer."""
    from jax_ep import _native

    keys = [] if key is None else [key]
    while _to_forget:
        keys.append(_to_forget.pop())
    for k in keys:
        _native.forget_buffer(k)
        release_tokens(BufferOrder(k))
        liveness.release_liveness(k)


@functools.cache
def _forget_at_exit():
    """The registry holds the native Buffers: let them go before the interpreter does, and the
    tokens of the collected ones before JAX waits for every token (atexit runs the last
    registered first: JAX's own hooks were registered when it was imported)."""
    from jax_ep import _native

    atexit.register(_native.forget_all_buffers)
    atexit.register(_forget_at_exit_now)


def _forget_at_exit_now():
    liveness.mark_exiting()
    forget()
    liveness.close_listener()  # Buffers still open: their peers learn that this process exits

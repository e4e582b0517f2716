"""How a Buffer's native side comes up on every process of its mesh.

A Buffer owns the communication window of every EP group of its axis: the devices along the axis
at one coordinate of the other mesh axes, in axis order (their position is their rank). Each
process builds the windows of its own devices; processes meet in jax.distributed's key-value
store between the steps (one process draws what must be shared: NCCL's unique id, shared-memory
and socket names; every process publishes its GPUs, from which all choose the GPU engine) and
check that they all asked for the same Buffer. Nothing of this depends on what else a process
traced or compiled: the Buffer's key is the same on every process as long as every
process of the mesh creates the mesh's Buffers in the same order (like any collective).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import secrets
import socket
import threading

import numpy as np

from jax_ep._jax import BufferOrder, coordinator_address, distributed_client, release_tokens

_created: dict[tuple, int] = {}  # Buffers created so far, per set of processes


@dataclasses.dataclass(frozen=True)
class Plan:
    key: int  # names the Buffer in compiled programs: the same on every process
    seq: int  # the Buffer's number among those of its processes
    platform: str  # "cpu" or "cuda"
    local: tuple  # (device number, group, rank) of this process's devices
    group_owners: tuple  # per group: the process that draws what the group shares
    processes: tuple  # the processes holding devices of the mesh, sorted
    process: int  # this process

    @property
    def multi_process(self):
        return len(self.processes) > 1


def plan(mesh, axis_name):
    """The groups of `axis_name` in `mesh` and this process's part in them."""
    import jax

    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), -1)
    groups = devices.reshape(-1, devices.shape[-1])
    platforms = {d.platform for d in groups.flat}
    if len(platforms) != 1:
        raise ValueError(f"jax_ep: the mesh mixes device platforms {sorted(platforms)}")
    platform = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(platforms.pop())
    me = jax.process_index()
    # The device number XLA gives a custom call: the device's id on CPUs, its local ordinal on GPUs.
    ordinal = (lambda d: d.id) if platform == "cpu" else (lambda d: d.local_hardware_id)
    local = tuple(
        (ordinal(d), g, r)
        for g, row in enumerate(groups)
        for r, d in enumerate(row)
        if d.process_index == me
    )
    processes = tuple(sorted({d.process_index for d in groups.flat}))
    if me not in processes:
        raise ValueError("jax_ep: this process holds no device of the Buffer's mesh")
    seq = _created.get(processes, 0) + 1  # counted by commit(), once the local checks passed
    digest = hashlib.sha256(repr((processes, seq)).encode()).digest()
    key = int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)
    return Plan(
        key, seq, platform, local, tuple(int(row[0].process_index) for row in groups), processes, me
    )


def commit(p: Plan):
    """Counts the Buffer as created: after the local checks (a Buffer refused on one process
    only must not shift the keys of the later ones), before the first step every process takes
    together (from there on, all processes either create the Buffer or raise alike)."""
    if _created.get(p.processes, 0) != p.seq - 1:
        raise RuntimeError(
            "jax_ep: Buffers were created concurrently on several threads; create "
            "them one at a time, in the same order on every process"
        )
    _created[p.processes] = p.seq


def first_op():
    """The number the Buffer's ops count from: 0, or for tests $JAX_EP_TESTING_FIRST_OP (e.g.
    just below 2^32, to show that op numbers do not wrap). Testing only; every process of the
    mesh must set the same."""
    value = int(os.environ.get("JAX_EP_TESTING_FIRST_OP", "0"))
    if not 0 <= value < 1 << 62:
        raise ValueError(f"jax_ep: JAX_EP_TESTING_FIRST_OP must be in [0, 2^62), got {value}")
    return value


def _wait_all(p: Plan, step: str, timeout_s: float):
    """Every process of the mesh has reached `step`; names the missing ones after timeout_s."""
    client = distributed_client()
    prefix = f"jax_ep/{p.key:x}/{step}"
    client.key_value_set(f"{prefix}/{p.process}", "1", allow_overwrite=True)
    try:
        for q in p.processes:
            client.blocking_key_value_get(f"{prefix}/{q}", int(timeout_s * 1000))
    except Exception:
        missing = [q for q in p.processes if not _try_get(client, f"{prefix}/{q}")]
        raise RuntimeError(
            f"jax_ep: process(es) {missing} did not reach '{step}' of creating "
            f"a Buffer within {timeout_s} s (every process of the mesh must "
            f"create the same Buffers in the same order)"
        ) from None


def _try_get(client, key):
    try:
        return client.key_value_try_get(key)
    except Exception:
        return None


_ALIVE = b"+"  # a running process's answer on its liveness socket
_liveness_address: str | None = None  # this process's liveness socket, once listening
_peer_liveness: dict[int, str] = {}  # the others', as read from the store (they never change)


def announce_liveness(p: Plan):
    """Lets the mesh's other processes ask whether this one still runs (stopped_processes): a
    TCP socket listens, a thread answers each connection with one byte and closes it, and the
    key-value store holds the address. When the process ends, however it ends, the kernel
    closes the socket; while it is ending, its kernel may still accept a connection, but no
    thread answers it."""
    global _liveness_address
    if not p.multi_process:
        return
    if _liveness_address is None:
        server = socket.create_server(("", 0), backlog=64)
        threading.Thread(
            target=serve_liveness, args=(server,), name="jax_ep liveness", daemon=True
        ).start()
        _liveness_address = f"{_reachable_address()}:{server.getsockname()[1]}"
    distributed_client().key_value_set(
        f"jax_ep/alive/{p.process}", _liveness_address, allow_overwrite=True
    )


def serve_liveness(server: socket.socket):
    """Answers each connection to the listening `server` with one byte, forever."""
    while True:
        connection, _ = server.accept()
        with connection:
            try:
                connection.sendall(_ALIVE)
            except OSError:  # the asker gave up
                pass


def _reachable_address() -> str:
    """This host's address on the route to jax.distributed's coordinator (how the others reach
    it; no packet is sent)."""
    host = (coordinator_address() or "127.0.0.1").rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host.strip("[]"), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def stopped_processes(p: Plan, timeout_s: float = 2.0) -> dict:
    """{process: why} for the mesh's other processes that no longer run (their liveness socket
    refuses connections, or closes one unanswered: a process that is ending) or do not answer
    within timeout_s. Asks each once; waits for nothing else."""
    if not p.multi_process:
        return {}
    client, stopped = distributed_client(), {}
    for q in p.processes:
        if q != p.process and q not in _peer_liveness:
            if address := _try_get(client, f"jax_ep/alive/{q}"):
                _peer_liveness[q] = address
        if q == p.process or q not in _peer_liveness:
            continue
        if why := why_stopped(_peer_liveness[q], timeout_s):
            stopped[q] = why
    return stopped


def why_stopped(address: str, timeout_s: float) -> str | None:
    """Why the process with this liveness address ("host:port") no longer runs, or None while
    it answers."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
            answer = connection.recv(len(_ALIVE))
    except (ConnectionRefusedError, ConnectionResetError):
        answer = b""
    except OSError as e:
        return f"it does not answer ({e})"
    return None if answer == _ALIVE else "it has ended"


def meet(p: Plan, step: str, timeout_s: float):
    """A barrier over the mesh's processes (nothing to do in one process)."""
    if p.multi_process:
        _wait_all(p, step, timeout_s)


def share(p: Plan, name: str, make, owner: int, timeout_s: float) -> bytes:
    """make() on process `owner`, its bytes on every process that asks."""
    if not p.multi_process:
        return make()
    client = distributed_client()
    key = f"jax_ep/{p.key:x}/share/{name}"
    if p.process == owner:
        value = make()
        client.key_value_set_bytes(key, value)
        return value
    try:
        return client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
    except Exception:
        raise RuntimeError(
            f"jax_ep: process {owner} did not share '{name}' within {timeout_s} s "
            f"while creating a Buffer"
        ) from None


def nonce(p: Plan, timeout_s: float) -> str:
    """Random, the same on every process: names the Buffer's shared memory on each host."""
    return share(
        p, "nonce", lambda: secrets.token_hex(8).encode(), p.processes[0], timeout_s
    ).decode()


def check_same_arguments(p: Plan, arguments: dict, timeout_s: float):
    """Raises on every process if the processes asked for different Buffers."""
    if not p.multi_process:
        return
    client = distributed_client()
    prefix = f"jax_ep/{p.key:x}/arguments"
    mine = json.dumps(arguments, sort_keys=True)
    client.key_value_set(f"{prefix}/{p.process}", mine)
    first = p.processes[0]
    if p.process == first:
        verdict = "same"
        for q in p.processes[1:]:
            try:
                theirs = client.blocking_key_value_get(f"{prefix}/{q}", int(timeout_s * 1000))
            except Exception:
                verdict = f"process {q} did not create the Buffer within {timeout_s} s"
                break
            if theirs != mine:
                asked = json.loads(theirs)
                diff = {k: (v, asked.get(k)) for k, v in arguments.items() if asked.get(k) != v}
                verdict = (
                    f"process {q} asked for another Buffer than process {first}: "
                    + ", ".join(f"{k}={b!r} there, {a!r} here" for k, (a, b) in diff.items())
                )
                break
        verdict = _first_verdict(client, f"{prefix}/verdict", verdict)
    else:
        try:
            verdict = client.blocking_key_value_get(f"{prefix}/verdict", int(timeout_s * 1000))
        except Exception:
            # Said where the late first process reads it: it then fails at once rather than
            # waiting for this process in the next step (and every retry would be off by it).
            verdict = _first_verdict(
                client,
                f"{prefix}/verdict",
                f"process {first} did not create the Buffer within {timeout_s} s (process "
                f"{p.process} gave up waiting)",
            )
    if verdict != "same":
        raise ValueError(f"jax_ep: {verdict}")


def _first_verdict(client, key, verdict):
    """The verdict stored at key: this one, unless another process stored one first."""
    try:
        client.key_value_set(key, verdict)
    except Exception:  # already set: the first word stands
        return client.blocking_key_value_get(key, 1000)
    return verdict


def nccl_library():
    """The libnccl to load: $JAX_EP_NCCL_LIBRARY, the nvidia-nccl wheel's (the one jax's CUDA
    plugin loads), or the system's."""
    path = os.environ.get("JAX_EP_NCCL_LIBRARY")
    if path:
        return path
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(candidate):
            return candidate
    return "libnccl.so.2"


ENGINES = ("auto", "nccl", "cuda_ipc")
NCCL_DEVICE_API = 22800  # NCCL 2.28: the device API (symmetric windows, LSA pointers)
engines: dict[int, str] = {}  # the engine of each Buffer's key in this process


def requested_engine() -> str:
    """$JAX_EP_ENGINE: auto (the default), nccl or cuda_ipc."""
    value = os.environ.get("JAX_EP_ENGINE", "").strip().lower() or "auto"
    if value not in ENGINES:
        raise ValueError(
            f"jax_ep: JAX_EP_ENGINE must be one of {', '.join(ENGINES)}, got {value!r}"
        )
    return value


def nccl_serves(library_version: int, built_version: int) -> bool:
    """Whether NCCL's library can serve the engine: the device API, and the minor version this
    build's device code was compiled against (its windows' layout comes from the headers)."""
    return library_version >= NCCL_DEVICE_API and library_version // 100 == built_version // 100


def choose_engine(requested: str, processes: dict) -> tuple[str, str]:
    """The GPU engine of a Buffer, and why. `processes`: per process, what it published:
    {"engine": requested, "nccl": [library version, built version], "host": host id,
    "ranks": [[group, rank, GPU uuid], ...]}. The same answer on every process (it sees the
    same table); raises ValueError where no engine can serve.

    auto: NCCL wherever it can serve (a library with the device API on every process, no two
    ranks of a group on one GPU), else CUDA IPC (every group on one host)."""
    asked = {p: info["engine"] for p, info in processes.items()}
    if len(set(asked.values())) > 1:
        raise ValueError(
            "jax_ep: the processes set JAX_EP_ENGINE differently: "
            + ", ".join(f"process {p}: {e}" for p, e in sorted(asked.items()))
        )
    where = {}  # (group, rank) -> (host, uuid)
    for info in processes.values():
        for group, rank, uuid in info["ranks"]:
            where[(group, rank)] = (info["host"], uuid)
    shared, hosts = [], {}
    for (group, rank), place in sorted(where.items()):
        hosts.setdefault(group, set()).add(place[0])
        twin = [
            r
            for (g, r), other in sorted(where.items())
            if g == group and r < rank and other == place
        ]
        if twin:
            shared.append(f"ranks {twin[0]} and {rank} of EP group {group}")
    spread = [g for g, h in sorted(hosts.items()) if len(h) > 1]
    old = sorted(p for p, info in processes.items() if not nccl_serves(*info["nccl"]))

    def no_ipc(why):
        return ValueError(
            f"jax_ep: {why}; the cuda_ipc engine needs every rank of an EP group "
            f"on one host, but EP group {spread[0]} spans "
            f"{len(hosts[spread[0]])} hosts"
        )

    if requested == "nccl":
        if shared:
            raise ValueError(
                f"jax_ep: JAX_EP_ENGINE=nccl, but {shared[0]} share a GPU, which "
                f"NCCL refuses; use JAX_EP_ENGINE=cuda_ipc (or auto)"
            )
        return "nccl", "JAX_EP_ENGINE=nccl"
    if requested == "cuda_ipc":
        if spread:
            raise no_ipc("JAX_EP_ENGINE=cuda_ipc")
        return "cuda_ipc", "JAX_EP_ENGINE=cuda_ipc"
    if not shared and not old:
        return "nccl", "NCCL serves every rank"
    if shared:
        why = f"{shared[0]} share a GPU (NCCL refuses that)"
    else:
        library, built = processes[old[0]]["nccl"]
        why = (
            f"process {old[0]} has no NCCL with the device API this build needs (found "
            f"{library or 'none'}, built against {built}; {NCCL_DEVICE_API} or newer, "
            f"same minor version)"
        )
    if spread:
        raise no_ipc(why)
    return "cuda_ipc", why


def host_id() -> str:
    """This host: its name and boot id (two containers of one name on two machines differ)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def exchange(p: Plan, name: str, mine: dict, timeout_s: float) -> dict:
    """Every process's `mine` (JSON), by process; names the processes missing after timeout_s."""
    if not p.multi_process:
        return {p.process: mine}
    client = distributed_client()
    prefix = f"jax_ep/{p.key:x}/{name}"
    client.key_value_set(f"{prefix}/{p.process}", json.dumps(mine))
    out = {}
    for q in p.processes:
        try:
            out[q] = json.loads(
                client.blocking_key_value_get(f"{prefix}/{q}", int(timeout_s * 1000))
            )
        except Exception:
            missing = [
                q for q in p.processes if q not in out and not _try_get(client, f"{prefix}/{q}")
            ]
            raise RuntimeError(
                f"jax_ep: process(es) {missing} did not publish '{name}' within "
                f"{timeout_s} s while creating a Buffer"
            ) from None
    return out


def gpu_engine(p: Plan, timeout_s: float) -> tuple[str, str]:
    """Publishes this process's GPUs and NCCL, and chooses the Buffer's engine with the others."""
    from jax_ep import _native

    requested = requested_engine()
    library = nccl_library()
    mine = dict(
        engine=requested,
        host=host_id(),
        nccl=[_native.nccl_library_version(library), _native.nccl_built_version()],
        ranks=[[group, rank, _native.cuda_device_uuid(device)] for device, group, rank in p.local],
    )
    return choose_engine(requested, exchange(p, "engine", mine, timeout_s))


def ipc_prefix(p: Plan, timeout_s: float) -> str:
    """Names the Buffer's sockets on the host: its key and a nonce (a Buffer of an earlier run
    with the same key, still alive, cannot answer for this one)."""
    return f"jax_ep_{p.key:x}_{nonce(p, timeout_s)}"


def connect(p: Plan, window, *, timeout_s, num_sms, direct_local):
    """Builds and registers the Buffer's native side on this process; returns it."""
    from jax_ep import _native

    forget()  # Buffers collected since: their memory first

    if p.platform == "cpu":
        native = _native.CpuBuffer(
            window, f"/jax_ep_{nonce(p, timeout_s)}", timeout_s, list(p.local), first_op()
        )
        meet(p, "created", timeout_s)
        native.connect()
        meet(p, "connected", timeout_s)
        native.unlink()
        engines[p.key] = "shm"
    else:
        if not _native.has_cuda:
            raise ValueError(
                "jax_ep: this build has no CUDA backend, so a Buffer cannot run on "
                "GPUs. Reinstall where the CUDA toolkit (nvcc) is found, e.g. "
                "JAX_EP_CUDA=ON pip install --no-build-isolation . (or use "
                "impl='reference')"
            )
        engine, _ = gpu_engine(p, timeout_s)
        if engine == "nccl":
            library = nccl_library()
            ids = {
                g: share(
                    p,
                    f"nccl/{g}",
                    lambda: _native.nccl_unique_id(library),
                    p.group_owners[g],
                    timeout_s,
                )
                for g in sorted({group for _, group, _ in p.local})
            }
            native = _native.CudaBuffer(
                window, library, timeout_s, num_sms, list(p.local), ids, direct_local, first_op()
            )
            meet(p, "connected", timeout_s)
        else:
            native = _native.CudaIpcBuffer(
                window,
                ipc_prefix(p, timeout_s),
                p.key,
                timeout_s,
                num_sms,
                list(p.local),
                direct_local,
                first_op(),
            )
            meet(p, "created", timeout_s)  # every window is zeroed and served
            native.connect()
            meet(p, "connected", timeout_s)
            native.stop_serving()
        engines[p.key] = engine
    _native.register_buffer(p.key, native)
    _forget_at_exit()
    announce_liveness(p)
    return native


_to_forget: list = []  # keys of Buffers collected by the garbage collector


def forget_later(key):
    """From a finalizer: only records the key (list.append is atomic); no native work there."""
    _to_forget.append(key)


def forget(key=None):
    """Drops the native side of Buffer `key` (and of the Buffers collected since the last call)
    from the registry; its memory goes when the last program using it does. A failed last
    program's tokens go too (`release_tokens`: JAX would raise its error again at exit)."""
    from jax_ep import _native

    keys = [] if key is None else [key]
    while _to_forget:
        keys.append(_to_forget.pop())
    for k in keys:
        _native.forget_buffer(k)
        release_tokens(BufferOrder(k))


@functools.cache
def _forget_at_exit():
    """The registry holds the native Buffers: let them go before the interpreter does, and the
    tokens of the collected ones before JAX waits for every token (atexit runs the last
    registered first: JAX's own hooks were registered when it was imported)."""
    from jax_ep import _native

    atexit.register(_native.forget_all_buffers)
    atexit.register(forget)

"""How a Buffer's native side comes up on every process of its mesh.

A Buffer owns the communication window of every EP group of its axis: the devices along the axis
at one coordinate of the other mesh axes, in axis order (their position is their rank). Each
process builds the windows of its own devices; processes meet in jax.distributed's key-value
store between the steps (one process draws what must be shared: NCCL's unique id, shared-memory
names) and check that they all asked for the same Buffer. Nothing of this depends on what else a
process traced or compiled: the Buffer's key is the same on every process as long as every
process of the mesh creates the mesh's Buffers in the same order (like any collective).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib.util
import hashlib
import json
import os
import secrets

import numpy as np

_created: dict[tuple, int] = {}  # Buffers created so far, per set of processes


@dataclasses.dataclass(frozen=True)
class Plan:
    key: int                  # names the Buffer in compiled programs: the same on every process
    seq: int                  # the Buffer's number among those of its processes
    platform: str             # "cpu" or "cuda"
    local: tuple              # (device number, group, rank) of this process's devices
    group_owners: tuple       # per group: the process that draws what the group shares
    processes: tuple          # the processes holding devices of the mesh, sorted
    process: int              # this process

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
    local = tuple((ordinal(d), g, r) for g, row in enumerate(groups)
                  for r, d in enumerate(row) if d.process_index == me)
    processes = tuple(sorted({d.process_index for d in groups.flat}))
    if me not in processes:
        raise ValueError("jax_ep: this process holds no device of the Buffer's mesh")
    seq = _created.get(processes, 0) + 1  # counted by commit(), once the local checks passed
    digest = hashlib.sha256(repr((processes, seq)).encode()).digest()
    key = int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)
    return Plan(key, seq, platform, local,
                tuple(int(row[0].process_index) for row in groups), processes, me)


def commit(p: Plan):
    """Counts the Buffer as created: after the local checks (a Buffer refused on one process
    only must not shift the keys of the later ones), before the first step every process takes
    together (from there on, all processes either create the Buffer or raise alike)."""
    if _created.get(p.processes, 0) != p.seq - 1:
        raise RuntimeError("jax_ep: Buffers were created concurrently on several threads; create "
                           "them one at a time, in the same order on every process")
    _created[p.processes] = p.seq


def first_op():
    """The number the Buffer's ops count from: 0, or for tests $JAX_EP_TESTING_FIRST_OP (e.g.
    just below 2^32, to show that op numbers do not wrap). Testing only; every process of the
    mesh must set the same."""
    value = int(os.environ.get("JAX_EP_TESTING_FIRST_OP", "0"))
    if not 0 <= value < 1 << 62:
        raise ValueError(f"jax_ep: JAX_EP_TESTING_FIRST_OP must be in [0, 2^62), got {value}")
    return value


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise ValueError("jax_ep: the mesh spans several processes but jax.distributed is not "
                         "initialized (call jax.distributed.initialize() first)")
    return client


def _wait_all(p: Plan, step: str, timeout_s: float):
    """Every process of the mesh has reached `step`; names the missing ones after timeout_s."""
    client = _client()
    prefix = f"jax_ep/{p.key:x}/{step}"
    client.key_value_set(f"{prefix}/{p.process}", "1", allow_overwrite=True)
    try:
        for q in p.processes:
            client.blocking_key_value_get(f"{prefix}/{q}", int(timeout_s * 1000))
    except Exception:
        missing = [q for q in p.processes if not _try_get(client, f"{prefix}/{q}")]
        raise RuntimeError(f"jax_ep: process(es) {missing} did not reach '{step}' of creating "
                           f"a Buffer within {timeout_s} s (every process of the mesh must "
                           f"create the same Buffers in the same order)") from None


def _try_get(client, key):
    try:
        return client.key_value_try_get(key)
    except Exception:
        return None


def meet(p: Plan, step: str, timeout_s: float):
    """A barrier over the mesh's processes (nothing to do in one process)."""
    if p.multi_process:
        _wait_all(p, step, timeout_s)


def share(p: Plan, name: str, make, owner: int, timeout_s: float) -> bytes:
    """make() on process `owner`, its bytes on every process that asks."""
    if not p.multi_process:
        return make()
    client = _client()
    key = f"jax_ep/{p.key:x}/share/{name}"
    if p.process == owner:
        value = make()
        client.key_value_set_bytes(key, value)
        return value
    try:
        return client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
    except Exception:
        raise RuntimeError(f"jax_ep: process {owner} did not share '{name}' within {timeout_s} s "
                           f"while creating a Buffer") from None


def nonce(p: Plan, timeout_s: float) -> str:
    """Random, the same on every process: names the Buffer's shared memory on each host."""
    return share(p, "nonce", lambda: secrets.token_hex(8).encode(), p.processes[0],
                 timeout_s).decode()


def check_same_arguments(p: Plan, arguments: dict, timeout_s: float):
    """Raises on every process if the processes asked for different Buffers."""
    if not p.multi_process:
        return
    client = _client()
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
                verdict = (f"process {q} asked for another Buffer than process {first}: "
                           + ", ".join(f"{k}={b!r} there, {a!r} here" for k, (a, b) in diff.items()))
                break
        client.key_value_set(f"{prefix}/verdict", verdict)
    else:
        try:
            verdict = client.blocking_key_value_get(f"{prefix}/verdict", int(timeout_s * 1000))
        except Exception:
            verdict = f"process {first} did not check the Buffer's arguments within {timeout_s} s"
    if verdict != "same":
        raise ValueError(f"jax_ep: {verdict}")


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


def connect(p: Plan, window, *, timeout_s, num_sms, direct_local):
    """Builds and registers the Buffer's native side on this process; returns it."""
    from jax_ep import _native

    forget()  # Buffers collected since: their memory first

    if p.platform == "cpu":
        native = _native.CpuBuffer(window, f"/jax_ep_{nonce(p, timeout_s)}", timeout_s,
                                   list(p.local), first_op())
        native.create()
        meet(p, "created", timeout_s)
        native.connect()
        meet(p, "connected", timeout_s)
        native.unlink()
    else:
        if not _native.has_cuda:
            raise ValueError("jax_ep: this build has no CUDA backend, so a Buffer cannot run on "
                             "GPUs. Reinstall where the CUDA toolkit (nvcc) is found, e.g. "
                             "JAX_EP_CUDA=ON pip install --no-build-isolation . (or use "
                             "impl='reference')")
        library = nccl_library()
        ids = {g: share(p, f"nccl/{g}", lambda: _native.nccl_unique_id(library),
                        p.group_owners[g], timeout_s)
               for g in sorted({group for _, group, _ in p.local})}
        native = _native.CudaBuffer(window, library, timeout_s, num_sms, list(p.local), ids,
                                    direct_local, first_op())
        meet(p, "connected", timeout_s)
    _native.register_buffer(p.key, native)
    _forget_at_exit()
    return native


_to_forget: list = []  # keys of Buffers collected by the garbage collector


def forget_later(key):
    """From a finalizer: only records the key (list.append is atomic); no native work there."""
    _to_forget.append(key)


def forget(key=None):
    """Drops the native side of Buffer `key` (and of the Buffers collected since the last call)
    from the registry; its memory goes when the last program using it does."""
    from jax_ep import _native

    keys = [] if key is None else [key]
    while _to_forget:
        keys.append(_to_forget.pop())
    for k in keys:
        _native.forget_buffer(k)


@functools.cache
def _forget_at_exit():
    """The registry holds the native Buffers: let them go before the interpreter does."""
    from jax_ep import _native
    atexit.register(_native.forget_all_buffers)

"""Which engine makes a Buffer's windows reachable on GPUs: NCCL or CUDA IPC, chosen alike on
every process from what each publishes ($JAX_EP_ENGINE, its NCCL, its GPUs; docs/API.md, "GPUs:
the engines")."""

from __future__ import annotations

import importlib.util
import os

from jax_ep import meeting
from jax_ep.meeting import Plan


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


def gpu_engine(p: Plan, timeout_s: float) -> tuple[str, str]:
    """Publishes this process's GPUs and NCCL, and chooses the Buffer's engine with the others."""
    from jax_ep import _native

    requested = requested_engine()
    library = nccl_library()
    mine = dict(
        engine=requested,
        host=meeting.host_id(),
        nccl=[_native.nccl_library_version(library), _native.nccl_built_version()],
        ranks=[[group, rank, _native.cuda_device_uuid(device)] for device, group, rank in p.local],
    )
    return choose_engine(requested, meeting.exchange(p, "engine", mine, timeout_s))

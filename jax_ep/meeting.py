"""How the processes of a Buffer's mesh meet in jax.distributed's key-value store.

Every process of the mesh creates the Buffer; plan() says which groups and ranks this process
holds and gives the Buffer's key, the same on every process as long as every process of the mesh
creates the mesh's Buffers in the same order (like any collective). The processes introduce
themselves (introductions), then meet between the steps of creation (meet, share, exchange) and
check that they all asked for the same Buffer (check_same_arguments). Every wait returns to
Python at least once a second (SLICE_S, so that Ctrl-C acts at once) and gives up at once on a
process that the liveness watch (jax_ep/liveness.py) saw end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import socket
import time

import numpy as np

from jax_ep._jax import coordinator_address, distributed_client

_created: dict[tuple, int] = {}  # Buffers created so far, per set of processes

# The longest a key-value call or native wait of creation lasts before Python runs again (a
# signal's handler, e.g. Ctrl-C's KeyboardInterrupt, runs between two).
SLICE_S = 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    key: int  # names the Buffer in compiled programs: the same on every process
    seq: int  # the Buffer's number among those of its processes
    platform: str  # "cpu" or "cuda"
    local: tuple  # (device number, group, rank) of this process's devices
    group_owners: tuple  # per group: the process that draws what the group shares
    processes: tuple  # the processes holding devices of the mesh, sorted
    process: int  # this process
    rank_processes: tuple = ()  # per group, per rank: the process that holds it

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
        key,
        seq,
        platform,
        local,
        tuple(int(row[0].process_index) for row in groups),
        processes,
        me,
        tuple(tuple(int(d.process_index) for d in row) for row in groups),
    )


def commit(p: Plan):
    """Counts the Buffer as created: after the local checks (a Buffer refused on one process
    only must not shift the keys of the later ones), before the first step every process takes
    together (from there on, all processes either create the Buffer or raise alike)."""
    if _created.get(p.processes, 0) != p.seq - 1:
        raise RuntimeError(
            "jax_ep: two Buffers of the same processes were planned at once (jax_ep."
            "bootstrap.creating must be held from plan() to commit())"
        )
    _created[p.processes] = p.seq


def blocking_get(client, key: str, timeout_s: float, *, as_bytes: bool = False, needs=()):
    """The value of `key` in the key-value store, waiting up to timeout_s for it to be set: in
    calls of at most SLICE_S, so that Python handles signals (Ctrl-C) between them. Raises what
    the store raised: DEADLINE_EXCEEDED once timeout_s is over; PeersEnded at once where a
    process of `needs` has ended."""
    get = client.blocking_key_value_get_bytes if as_bytes else client.blocking_key_value_get
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return get(key, max(1, int(min(SLICE_S, left) * 1000)))
        except Exception as e:
            if "DEADLINE_EXCEEDED" not in str(e) or time.monotonic() >= deadline:
                raise
            if gone := ended().intersection(needs):
                raise PeersEnded(gone) from None


def _wait_all(p: Plan, step: str, timeout_s: float):
    """Every process of the mesh has reached `step`; names the missing ones after timeout_s."""
    _gather(
        p,
        f"jax_ep/{p.key:x}/{step}",
        "1",
        timeout_s,
        f"before reaching '{step}' of creating a Buffer",
        f"did not reach '{step}' of creating a Buffer within {timeout_s} s (every process of "
        f"the mesh must create the same Buffers in the same order)",
        overwrite=True,
    )


def _gather(p: Plan, prefix, mine, timeout_s, before, missing, overwrite=False) -> dict:
    """Every process's value under `prefix` (this process's `mine` put there first), by process,
    within one deadline; `before` and `missing` end the errors of a process that has ended and
    of those still missing at the deadline."""
    client = distributed_client()
    client.key_value_set(f"{prefix}/{p.process}", mine, allow_overwrite=overwrite)
    out, deadline = {}, time.monotonic() + timeout_s
    try:
        for q in p.processes:
            left = max(deadline - time.monotonic(), 0.001)
            out[q] = blocking_get(client, f"{prefix}/{q}", left, needs=p.processes)
    except PeersEnded as e:
        raise RuntimeError(f"jax_ep: {e} {before}") from None
    except Exception:
        gone = [q for q in p.processes if q not in out and not _try_get(client, f"{prefix}/{q}")]
        raise RuntimeError(f"jax_ep: process(es) {gone} {missing}") from None
    return out


def _try_get(client, key):
    try:
        return client.key_value_try_get(key)
    except Exception:
        return None


def ended() -> set[int]:
    """The processes that the liveness watch (liveness.watch_peers) found ended."""
    from jax_ep import _native

    return set(_native.ended_processes())


class PeersEnded(RuntimeError):
    """Processes that a wait of creation needs have ended (the liveness watch saw them end)."""

    def __init__(self, processes):
        self.processes = sorted(processes)
        super().__init__(f"process(es) {self.processes} ended (their liveness connection closed)")


def route_address(host: str, port: int) -> tuple[int, str] | None:
    """(family, this host's address) on the route to host:port (a UDP connect(): the routing
    table answers, no packet is sent), or None where there is no route."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                return family, probe.getsockname()[0]
        except OSError:
            continue
    return None


def coordinator_route() -> tuple[int, str] | None:
    """(family, this host's address) on the route to jax.distributed's coordinator, or None."""
    address = coordinator_address()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    return route_address(host.strip("[]"), int(port) if port.isdigit() else 9)


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
        return blocking_get(client, key, timeout_s, as_bytes=True, needs=(owner,))
    except PeersEnded as e:
        raise RuntimeError(f"jax_ep: {e} before sharing '{name}' of a Buffer") from None
    except Exception:
        raise RuntimeError(
            f"jax_ep: process {owner} did not share '{name}' within {timeout_s} s "
            f"while creating a Buffer"
        ) from None


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
        deadline = time.monotonic() + timeout_s
        for q in p.processes[1:]:
            try:
                theirs = blocking_get(
                    client, f"{prefix}/{q}", max(deadline - time.monotonic(), 0.001), needs=(q,)
                )
            except PeersEnded as e:
                verdict = f"{e} before creating the Buffer"
                break
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
            verdict = blocking_get(client, f"{prefix}/verdict", timeout_s, needs=(first,))
        except PeersEnded as e:
            verdict = f"{e} before giving its verdict on the Buffer's arguments"
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
        return blocking_get(client, key, 1.0)
    return verdict


def host_id() -> str:
    """This host: its name and boot id (two containers of one name on two machines differ)."""
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
    found = _gather(
        p,
        f"jax_ep/{p.key:x}/{name}",
        json.dumps(mine),
        timeout_s,
        f"before publishing '{name}' while creating a Buffer",
        f"did not publish '{name}' within {timeout_s} s while creating a Buffer",
    )
    return {q: json.loads(value) for q, value in found.items()}


def pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"), or "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def introductions(p: Plan, timeout_s: float) -> dict:
    """Every process's introduction, by process: its process id and pid namespace, its host, its
    address towards the coordinator, and a secret and a nonce (the first process's are the
    Buffer's: see bootstrap.descriptor_sockets)."""
    route = coordinator_route()
    mine = dict(
        pid=os.getpid(),
        pidns=pid_namespace(),
        host=host_id(),
        route=route[1] if route else "",
        secret=secrets.token_hex(16),
        nonce=secrets.token_hex(8),
    )
    return exchange(p, "hello", mine, timeout_s)

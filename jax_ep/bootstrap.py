"""How a Buffer's native side comes up on every process of its mesh.

A Buffer owns the communication window of every EP group of its axis: the devices along the axis
at one coordinate of the other mesh axes, in axis order (their position is their rank). Each
process builds the windows of its own devices; processes meet in jax.distributed's key-value
store between the steps (one process draws what must be shared: NCCL's unique id, the secret
and nonce of the descriptor sockets; every process publishes its process id and GPUs, from which
all choose the GPU engine) and check that they all asked for the same Buffer. Nothing of this
depends on what else a process traced or compiled: the Buffer's key is the same on every process
as long as every process of the mesh creates the mesh's Buffers in the same order (like any
collective). Creation holds a lock of the process (several threads may create Buffers), and
every wait returns to Python at least once a second (so that Ctrl-C acts at once).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time

import numpy as np

from jax_ep._jax import BufferOrder, coordinator_address, distributed_client, release_tokens

_created: dict[tuple, int] = {}  # Buffers created so far, per set of processes
_log = logging.getLogger("jax_ep")

# One Buffer is created at a time in a process: a Buffer's key counts the Buffers created before
# it, and the processes meet in the key-value store under that key. Held from the plan to the
# registered native side; reentrant (creation drops the Buffers collected meanwhile).
creating = threading.RLock()

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


def first_op():
    """The number the Buffer's ops count from: 0, or for tests $JAX_EP_TESTING_FIRST_OP (e.g.
    just below 2^32, to show that op numbers do not wrap). Testing only; every process of the
    mesh must set the same."""
    value = int(os.environ.get("JAX_EP_TESTING_FIRST_OP", "0"))
    if not 0 <= value < 1 << 62:
        raise ValueError(f"jax_ep: JAX_EP_TESTING_FIRST_OP must be in [0, 2^62), got {value}")
    return value


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
    client = distributed_client()
    prefix = f"jax_ep/{p.key:x}/{step}"
    client.key_value_set(f"{prefix}/{p.process}", "1", allow_overwrite=True)
    deadline = time.monotonic() + timeout_s
    try:
        for q in p.processes:
            blocking_get(
                client,
                f"{prefix}/{q}",
                max(deadline - time.monotonic(), 0.001),
                needs=p.processes,
            )
    except PeersEnded as e:
        raise RuntimeError(f"jax_ep: {e} before reaching '{step}' of creating a Buffer") from None
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
# What a listener that closes sends the connections it holds (ffi/ended.h reads it): its process
# goes on without a Buffer, or its interpreter exits. A connection closed without either byte
# means that the process was killed or crashed.
_GOODBYE = b"-"
_EXITING = b"x"
_CLOSED = "closed"  # its liveness address in the store once it closed its last Buffer
_exiting = False  # set at the interpreter's exit
_liveness_lock = threading.Lock()  # guards the two below (never held while waiting for a peer)
_listener = None  # this process's liveness listener, while a Buffer that announced it is open
_listening_for: set[int] = set()  # the keys of those Buffers
_peer_liveness: dict[int, str] = {}  # the others' addresses, as last read from the store
# How soon a watch finds a host that vanished without closing its connections (no FIN): TCP
# keepalive probes after this many idle seconds, every as many seconds, this many times.
WATCH_KEEPALIVE = (5, 5, 4)


class Listener:
    """A TCP socket bound to `address` (never to every interface) and a thread that answers each
    connection with one byte and holds it open until the other end closes it (serve_liveness):
    a watcher (watch_peers) holds its connection for as long as the process runs. close() stops
    both."""

    def __init__(self, family: int, address: str):
        self.server = socket.create_server((address, 0), family=family, backlog=64)
        port = self.server.getsockname()[1]
        self.address = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
        self.key = None  # where the store holds the address
        self.stopping = threading.Event()
        self.farewell = _GOODBYE  # what the held connections get at close()
        self.thread = threading.Thread(
            target=serve_liveness,
            args=(self.server, self.stopping, self),
            name="jax_ep liveness",
            daemon=True,
        )
        self.thread.start()

    def close(self, farewell: bytes = _GOODBYE):
        self.farewell = farewell
        self.stopping.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the thread's select()
        except OSError:
            pass
        self.thread.join(timeout=5)
        self.server.close()


def announce_liveness(p: Plan, hello: dict):
    """Lets the mesh's other processes ask whether this one still runs (stopped_processes), and
    watch it (watch_peers): a Listener on this host's address towards the others
    (local_address), its address in the key-value store. One per process, shared by its
    Buffers: it closes with the last of them (release_liveness), and the store then says so.
    When the process ends, however it ends, the kernel closes the socket and the connections it
    holds; while it is ending, its kernel may still accept a connection, but no thread answers
    it."""
    global _listener
    if not p.multi_process:
        return
    with _liveness_lock:
        if _listener is None:
            _listener = Listener(*local_address(p, hello))
            _listener.key = f"jax_ep/alive/{p.process}"
            distributed_client().key_value_set(
                _listener.key, _listener.address, allow_overwrite=True
            )
        _listening_for.add(p.key)


def release_liveness(key: int):
    """Buffer `key` is gone: the listener closes if it was the last that announced it, and this
    process stops watching the others."""
    with _liveness_lock:
        if key not in _listening_for:
            return
        _listening_for.discard(key)
        if _listening_for or _listener is None:
            return
        _close_listener()


def _close_listener():
    """Closes the listener (held by _liveness_lock) and the watches. Its watchers learn why: at
    the interpreter's exit that the process has ended, else that it has no Buffer open (as the
    store says from then on to those that ask)."""
    global _listener
    from jax_ep import _native

    listener, _listener = _listener, None
    listener.close(_EXITING if _exiting else _GOODBYE)
    _native.stop_watching()
    if _exiting:  # the closed port says that the process has ended
        return
    try:
        distributed_client().key_value_set(listener.key, _CLOSED, allow_overwrite=True)
    except Exception:  # jax.distributed already shut down: nobody asks any more
        pass


def watch_peers(p: Plan):
    """Watches the processes this one's ranks wait for (the others of its EP groups) and
    jax.distributed's process 0 (which hosts the coordination service): a connection to each
    one's liveness listener, held by jax_ep._native's thread (ffi/ended.h). When one ends
    (killed, crashed; found at once, or by TCP keepalive where its host vanished), this
    process's waits for its ranks give up (NaN results, the next call raises), and stderr says
    so at once. Called once every process announced its listener and before the processes next
    meet, so that every watch is in place when the Buffer is: a peer that ends later is seen."""
    from jax_ep import _native

    if not p.multi_process:
        return
    groups = {g for _, g, _ in p.local}
    watched = {q for g in groups for q in p.rank_processes[g]} | ({0} & set(p.processes))
    client = distributed_client()
    for q in sorted(watched - {p.process} - ended()):
        address = _read_liveness(client, q)
        connection = _watch_connection(address) if address and address != _CLOSED else None
        if connection is None:  # its Buffers' waits still end after timeout_s
            _log.warning("jax_ep: cannot watch process %d (liveness address %s)", q, address)
            continue
        message = (
            f"jax_ep: process {q} has ended (its liveness connection to process {p.process} "
            f"closed): the jax_ep ops here that wait for it stop now (their results NaN, the "
            f"next call raises; Buffer.status() says more)."
        )
        if q == 0:
            message += (
                " It hosted jax.distributed's coordination service: JAX terminates this "
                "process next."
            )
        _native.watch_process(q, connection.detach(), message + "\n")


def _watch_connection(address: str) -> socket.socket | None:
    """A connection to the liveness listener at `address` that answered, with TCP keepalive
    (WATCH_KEEPALIVE), or None."""
    host, port = address.rsplit(":", 1)
    try:
        connection = socket.create_connection((host.strip("[]"), int(port)), timeout=SLICE_S)
    except OSError:
        return None
    try:
        if connection.recv(len(_ALIVE)) != _ALIVE:
            raise OSError("no answer")
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), WATCH_KEEPALIVE):
            if hasattr(socket, option):
                connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:
        connection.close()
        return None
    return connection


def ended() -> set[int]:
    """The processes that the liveness watch (watch_peers) found ended."""
    from jax_ep import _native

    return set(_native.ended_processes())


class PeersEnded(RuntimeError):
    """Processes that a wait of creation needs have ended (the liveness watch saw them end)."""

    def __init__(self, processes):
        self.processes = sorted(processes)
        super().__init__(f"process(es) {self.processes} ended (their liveness connection closed)")


def serve_liveness(server, stopping: threading.Event | None = None, listener=None):
    """Answers each connection to the listening `server` with one byte and holds it open until
    the other end closes it (a status() probe reads the byte and closes; a watch holds it); once
    `stopping` is set (or the socket is closed), sends `listener.farewell` (else _GOODBYE) on
    every connection it holds and closes them. An accept() that fails (out of descriptors, say)
    is logged and tried again, ever more slowly: the thread never ends on it."""
    held = selectors.DefaultSelector()
    held.register(server, selectors.EVENT_READ)
    failures = 0
    try:
        while not (stopping is not None and stopping.is_set()):
            for key, _ in held.select():
                if key.fileobj is not server:  # its other end closed (or wrote): done
                    try:
                        key.fileobj.recv(16)
                    except OSError:
                        pass
                    held.unregister(key.fileobj)
                    key.fileobj.close()
                    continue
                try:
                    connection, _ = server.accept()
                except OSError as e:
                    if (stopping is not None and stopping.is_set()) or server.fileno() < 0:
                        return
                    failures += 1
                    if failures == 1 or failures % 100 == 0:
                        _log.warning(
                            "jax_ep: the liveness listener's accept() failed (%s; %d time(s) "
                            "in a row); retrying",
                            e,
                            failures,
                        )
                    time.sleep(min(0.01 * failures, 1.0))
                    continue
                failures = 0
                try:
                    connection.sendall(_ALIVE)
                    held.register(connection, selectors.EVENT_READ)
                except OSError:  # the asker gave up
                    connection.close()
    finally:
        farewell = listener.farewell if listener is not None else _GOODBYE
        for key in list(held.get_map().values()):
            if key.fileobj is not server:
                try:
                    key.fileobj.sendall(farewell)
                except OSError:
                    pass
                key.fileobj.close()
        held.close()


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


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


def _coordinator_route() -> tuple[int, str] | None:
    address = coordinator_address()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    return route_address(host.strip("[]"), int(port) if port.isdigit() else 9)


def local_address(p: Plan, hello: dict) -> tuple[int, str]:
    """(family, address) of this host that the mesh's other processes reach: the one on the
    route to jax.distributed's coordinator; where that is a loopback address but processes of
    the mesh run on other hosts (a coordinator named "localhost" on its own host), the one on
    the route to their addresses."""
    mine = hello.get(p.process, {})
    found = _coordinator_route() or (socket.AF_INET, "127.0.0.1")
    if _is_loopback(found[1]):
        for _, theirs in sorted(hello.items()):
            route = theirs.get("route", "")
            if theirs.get("host") != mine.get("host") and route and not _is_loopback(route):
                found = route_address(route, 9) or found
                break
    return found


def stopped_processes(p: Plan, timeout_s: float = 2.0) -> dict:
    """{process: why} for the mesh's other processes that no longer run (the liveness watch saw
    them end, their liveness socket refuses connections, or closes one unanswered: a process
    that is ending), do not answer within timeout_s, or closed their last Buffer. Asks each
    once, at the address last read from the store (read again where that one does not answer:
    the process may have moved to a new listener); waits for nothing else. A process that has
    not announced itself is not asked."""
    if not p.multi_process:
        return {}
    client, stopped, gone = distributed_client(), {}, ended()
    for q in p.processes:
        if q == p.process:
            continue
        if q in gone:
            stopped[q] = "it has ended"
            continue
        address = _peer_liveness.get(q) or _read_liveness(client, q)
        why = _why_stopped(address, timeout_s) if address else None
        if why:
            fresh = _read_liveness(client, q)
            if fresh != address:
                why = _why_stopped(fresh, timeout_s) if fresh else None
        if why:
            stopped[q] = why
    return stopped


def _read_liveness(client, q: int) -> str | None:
    """Process q's liveness address as the store holds it now (None: it has not announced one);
    where the store does not answer (its process may have ended), the one last read."""
    try:
        _peer_liveness[q] = client.key_value_try_get(f"jax_ep/alive/{q}")
    except Exception as e:
        if "NOT_FOUND" in str(e):
            _peer_liveness.pop(q, None)
    return _peer_liveness.get(q)


def _why_stopped(address: str, timeout_s: float) -> str | None:
    if address == _CLOSED:
        return "it has closed its Buffers (it runs, with no Buffer open)"
    return why_stopped(address, timeout_s)


def why_stopped(address: str, timeout_s: float) -> str | None:
    """Why the process with this liveness address ("host:port", "[v6 host]:port") no longer
    runs, or None while it answers."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=timeout_s
        ) as connection:
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
    out, deadline = {}, time.monotonic() + timeout_s
    for q in p.processes:
        try:
            out[q] = json.loads(
                blocking_get(
                    client,
                    f"{prefix}/{q}",
                    max(deadline - time.monotonic(), 0.001),
                    needs=p.processes,
                )
            )
        except PeersEnded as e:
            raise RuntimeError(
                f"jax_ep: {e} before publishing '{name}' while creating a Buffer"
            ) from None
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


def pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"), or "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def introductions(p: Plan, timeout_s: float) -> dict:
    """Every process's introduction, by process: its process id and pid namespace, its host, its
    address towards the coordinator, and a secret and a nonce (the first process's are the
    Buffer's: see descriptor_sockets)."""
    route = _coordinator_route()
    mine = dict(
        pid=os.getpid(),
        pidns=pid_namespace(),
        host=host_id(),
        route=route[1] if route else "",
        secret=secrets.token_hex(16),
        nonce=secrets.token_hex(8),
    )
    return exchange(p, "hello", mine, timeout_s)


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
    served = exchange(p, "created", {"socket": native.socket}, timeout_s)
    mine, peers = hello[p.process], []
    for group in sorted({g for _, g, _ in p.local}):
        for rank, q in enumerate(p.rank_processes[group]):
            if q != p.process:
                theirs = hello[q]
                pid = theirs["pid"] if _comparable_pids(mine, theirs) else 0
                peers.append((group, rank, served[q]["socket"], pid))
    deadline = time.monotonic() + timeout_s
    while missing := native.connect(peers, max(min(SLICE_S, deadline - time.monotonic()), 0.001)):
        if gone := ended().intersection(p.rank_processes[g][r] for g, r in missing):
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
    watch_peers(p)
    meet(p, "connected", timeout_s)
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


def connect(p: Plan, window, *, timeout_s, num_sms, direct_local):
    """Builds and registers the Buffer's native side on this process; returns it."""
    from jax_ep import _native

    forget()  # Buffers collected since: their memory first
    met = introductions(p, timeout_s)
    announce_liveness(p, met)  # before any later step: the others watch it from the next
    try:
        native = _build(p, met, window, timeout_s, num_sms, direct_local)
    except BaseException:
        release_liveness(p.key)
        raise
    _native.register_buffer(p.key, native)
    _native.watch_buffer(native, [list(r) for r in p.rank_processes])
    _forget_at_exit()
    return native


def _build(p: Plan, met: dict, window, timeout_s, num_sms, direct_local):
    """The native side of the Buffer on this process, once the processes met for it."""
    from jax_ep import _native

    if p.platform == "cpu":
        _one_host(p, met)
        name, secret, pids = descriptor_sockets(p, met)
        native = _native.CpuBuffer(window, name, secret, pids, timeout_s, list(p.local), first_op())
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
            watch_peers(p)
            meet(p, "connected", timeout_s)
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
                direct_local,
                first_op(),
            )
            join_windows(p, native, met, timeout_s)  # every window is zeroed when served
        engines[p.key] = engine
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
        release_liveness(k)


@functools.cache
def _forget_at_exit():
    """The registry holds the native Buffers: let them go before the interpreter does, and the
    tokens of the collected ones before JAX waits for every token (atexit runs the last
    registered first: JAX's own hooks were registered when it was imported)."""
    from jax_ep import _native

    atexit.register(_native.forget_all_buffers)
    atexit.register(_forget_at_exit_now)


def _forget_at_exit_now():
    global _exiting
    _exiting = True
    forget()
    with _liveness_lock:  # Buffers still open: their peers learn that this process exits
        _listening_for.clear()
        if _listener is not None:
            _close_listener()

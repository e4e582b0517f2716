"""Whether the other processes of a Buffer's mesh still run.

Each process of a multi-process mesh listens on a TCP port while it has a Buffer open (Listener:
bound to its address towards the coordinator, never to every interface), its address in the
key-value store. Buffer.status() connects to the others' (stopped_processes) to name a process
that has ended or does not answer; before the processes last meet to create a Buffer, each
connects to the listeners of the processes it waits for and hands the connections to the
extension (watch_peers, ffi/ended.h), which marks a process ended once its connection closes
without a goodbye. docs/ARCHITECTURE.md, "How a Buffer comes up", says what each byte means.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time

from jax_ep import meeting
from jax_ep._jax import distributed_client
from jax_ep.meeting import SLICE_S, Plan

_log = logging.getLogger("jax_ep")

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


def mark_exiting():
    """The interpreter exits: a listener that closes from now on tells its watchers so."""
    global _exiting
    _exiting = True


def close_listener():
    """Closes the listener, whatever Buffers announced it (the interpreter's exit)."""
    with _liveness_lock:
        _listening_for.clear()
        if _listener is not None:
            _close_listener()


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
    for q in sorted(watched - {p.process} - meeting.ended()):
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


def local_address(p: Plan, hello: dict) -> tuple[int, str]:
    """(family, address) of this host that the mesh's other processes reach: the one on the
    route to jax.distributed's coordinator; where that is a loopback address but processes of
    the mesh run on other hosts (a coordinator named "localhost" on its own host), the one on
    the route to their addresses."""
    mine = hello.get(p.process, {})
    found = meeting.coordinator_route() or (socket.AF_INET, "127.0.0.1")
    if _is_loopback(found[1]):
        for _, theirs in sorted(hello.items()):
            route = theirs.get("route", "")
            if theirs.get("host") != mine.get("host") and route and not _is_loopback(route):
                found = meeting.route_address(route, 9) or found
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
    client, stopped, gone = distributed_client(), {}, meeting.ended()
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

"""jax_ep.liveness and jax_ep.bootstrap in one process: the liveness probe, on local sockets (a
running process answers, an ending one (its kernel accepts, no thread answers, then the socket
closes) and an ended one (the port refuses) are told apart); the liveness listener (the address
it binds and publishes, accept errors, closing with the last Buffer); the watch (a killed
process, one that exits, one that closes its Buffers); Buffers created from several threads."""

import dataclasses
import errno
import logging
import os
import socket
import sys
import threading
import time

import jax
import pytest

import jax_ep
from jax_ep import liveness, meeting


def address(server):
    return "127.0.0.1:%d" % server.getsockname()[1]


def test_a_process_that_answers_runs():
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=liveness.serve_liveness, args=(server,), daemon=True).start()
    assert liveness.why_stopped(address(server), timeout_s=5) is None
    assert liveness.why_stopped(address(server), timeout_s=5) is None  # each asks anew


def test_a_process_that_is_ending_has_ended():
    """Its socket still listens, but nothing answers and it closes: not taken as running."""
    server = socket.create_server(("127.0.0.1", 0))
    found = []
    asker = threading.Thread(
        target=lambda: found.append(liveness.why_stopped(address(server), timeout_s=10))
    )
    asker.start()
    time.sleep(0.3)  # the connection waits, accepted by the kernel alone
    server.close()
    asker.join(timeout=10)
    assert found == ["it has ended"]


def test_a_process_that_never_answers_is_named():
    server = socket.create_server(("127.0.0.1", 0))
    why = liveness.why_stopped(address(server), timeout_s=0.2)
    server.close()
    assert why is not None and why.startswith("it does not answer"), why


def test_a_closed_port_has_ended():
    server = socket.create_server(("127.0.0.1", 0))
    closed = address(server)
    server.close()
    assert liveness.why_stopped(closed, timeout_s=5) == "it has ended"


# ---- the listener: the address it binds, errors, closing with the last Buffer


class Store:
    """The key-value calls of jax.distributed's client that the listener makes."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_delete(self, key):
        self.values.pop(key, None)

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[key]


def two_processes(key):
    return meeting.Plan(key, 1, "cpu", ((0, 0, 0),), (0,), (0, 1), 0, ((0, 1),))


def introductions(route="127.0.0.1", peer_host="this host"):
    return {
        0: dict(pid=os.getpid(), pidns="", host="this host", route="127.0.0.1"),
        1: dict(pid=1, pidns="", host=peer_host, route=route),
    }


@pytest.fixture
def store(monkeypatch):
    store = Store()
    monkeypatch.setattr(liveness, "distributed_client", lambda: store)
    monkeypatch.setattr(meeting, "coordinator_address", lambda: "127.0.0.1:8476")
    yield store
    for key in list(liveness._listening_for):
        liveness.release_liveness(key)


def test_the_listener_binds_the_address_it_publishes_and_closes_with_the_last_buffer(store):
    liveness.announce_liveness(two_processes(1), introductions())
    published = store.values["jax_ep/alive/0"]
    host, port = liveness._listener.server.getsockname()[:2]
    assert published == f"{host}:{port}" and host == "127.0.0.1"  # not 0.0.0.0
    liveness.announce_liveness(two_processes(2), introductions())  # shared by both Buffers
    assert store.values["jax_ep/alive/0"] == published
    thread = liveness._listener.thread
    liveness.release_liveness(1)
    assert liveness.why_stopped(published, timeout_s=5) is None  # Buffer 2 is still open
    liveness.release_liveness(2)
    assert liveness.why_stopped(published, timeout_s=5) == "it has ended"
    assert not thread.is_alive() and store.values["jax_ep/alive/0"] == "closed"
    assert liveness.stopped_processes(dataclasses.replace(two_processes(3), process=1)) == {
        0: "it has closed its Buffers (it runs, with no Buffer open)"
    }
    liveness.announce_liveness(two_processes(4), introductions())  # a new Buffer: a new port
    assert store.values["jax_ep/alive/0"] not in (published, "closed")
    assert liveness.stopped_processes(dataclasses.replace(two_processes(3), process=1)) == {}


def test_a_loopback_coordinator_with_peers_on_other_hosts():
    """The coordinator named as 127.0.0.1 here while processes of the mesh run on other hosts:
    the address towards them is published, not loopback."""
    found = meeting.route_address("10.11.12.13", 9)
    if found is None or found[1].startswith("127."):
        pytest.skip("this host has no route beyond loopback")
    plan = two_processes(1)
    assert liveness.local_address(plan, introductions())[1] == "127.0.0.1"
    other = introductions(route="10.11.12.13", peer_host="another host")
    assert liveness.local_address(plan, other) == found


def test_the_listener_survives_accept_errors(caplog):
    server = socket.create_server(("127.0.0.1", 0))

    class OutOfDescriptors:  # accept() fails three times, then works
        failures = 3

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return server.accept()

        def fileno(self):
            return server.fileno()

    stopping = threading.Event()
    thread = threading.Thread(target=liveness.serve_liveness, args=(OutOfDescriptors(), stopping))
    with caplog.at_level(logging.WARNING, logger="jax_ep"):
        thread.start()
        assert liveness.why_stopped(address(server), timeout_s=5) is None
        assert liveness.why_stopped(address(server), timeout_s=5) is None
    assert thread.is_alive() and "accept() failed" in caplog.text
    stopping.set()
    server.shutdown(socket.SHUT_RDWR)
    thread.join(timeout=5)
    server.close()
    assert not thread.is_alive()


# ---- the watch (ffi/ended.h): how a watched process's connection ends


def watched_ending(process, farewell, capfd):
    """Process `process` (a number no real one has) watched through one end of a socket pair,
    the other end closed after `farewell`: (whether it is found ended, what stderr got)."""
    from jax_ep import _native

    theirs, ours = socket.socketpair()
    _native.watch_process(process, ours.detach(), f"process {process} ended\n")
    if farewell:
        theirs.sendall(farewell)
        theirs.settimeout(5)
        assert theirs.recv(1) == b""  # the watch read it and closed its end
    theirs.close()
    deadline = time.monotonic() + 5
    while farewell != liveness._GOODBYE and process not in meeting.ended():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return process in meeting.ended(), capfd.readouterr().err


def test_a_watched_process_that_is_killed_has_ended(capfd):
    assert watched_ending(1001, b"", capfd) == (True, "process 1001 ended\n")


def test_a_watched_process_that_exits_has_ended_quietly(capfd):
    assert watched_ending(1002, liveness._EXITING, capfd) == (True, "")


def test_a_watched_process_that_closes_its_buffers_goes_on(capfd):
    assert watched_ending(1003, liveness._GOODBYE, capfd) == (False, "")


def test_the_listener_says_goodbye_to_its_watchers_when_it_closes():
    listener = liveness.Listener(socket.AF_INET, "127.0.0.1")
    watcher = liveness._watch_connection(listener.address)
    assert watcher is not None and watcher.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    assert liveness.why_stopped(listener.address, timeout_s=5) is None  # a probe meanwhile
    listener.close()
    watcher.settimeout(5)
    assert watcher.recv(16) == liveness._GOODBYE
    watcher.close()


# ---- creation from several threads


def test_buffers_created_from_several_threads_at_once():
    """Creation is one at a time in a process (bootstrap.creating): each thread's Buffer comes
    up, with a key of its own."""
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("ep",))
    kwargs = dict(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: without the lock, most runs fail
    try:
        create_in_pairs(mesh, kwargs, rounds=16)
    finally:
        sys.setswitchinterval(interval)


def create_in_pairs(mesh, kwargs, rounds):
    for _ in range(rounds):
        made, errors, start = [], [], threading.Barrier(2)

        def create():
            start.wait()
            try:
                made.append(jax_ep.Buffer(mesh, "ep", **kwargs))
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=create) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len({b._key for b in made}) == 2
        for b in made:
            b.close()

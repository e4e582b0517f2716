"""jax_ep.bootstrap's liveness probe, on local sockets: a running process answers, an ending one
(its kernel accepts, no thread answers, then the socket closes) and an ended one (the port
refuses) are told apart."""

import socket
import threading
import time

from jax_ep import bootstrap


def address(server):
    return "127.0.0.1:%d" % server.getsockname()[1]


def test_a_process_that_answers_runs():
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=bootstrap.serve_liveness, args=(server,), daemon=True).start()
    assert bootstrap.why_stopped(address(server), timeout_s=5) is None
    assert bootstrap.why_stopped(address(server), timeout_s=5) is None  # each asks anew


def test_a_process_that_is_ending_has_ended():
    """Its socket still listens, but nothing answers and it closes: not taken as running."""
    server = socket.create_server(("127.0.0.1", 0))
    found = []
    asker = threading.Thread(
        target=lambda: found.append(bootstrap.why_stopped(address(server), timeout_s=10))
    )
    asker.start()
    time.sleep(0.3)  # the connection waits, accepted by the kernel alone
    server.close()
    asker.join(timeout=10)
    assert found == ["it has ended"]


def test_a_process_that_never_answers_is_named():
    server = socket.create_server(("127.0.0.1", 0))
    why = bootstrap.why_stopped(address(server), timeout_s=0.2)
    server.close()
    assert why is not None and why.startswith("it does not answer"), why


def test_a_closed_port_has_ended():
    server = socket.create_server(("127.0.0.1", 0))
    closed = address(server)
    server.close()
    assert bootstrap.why_stopped(closed, timeout_s=5) == "it has ended"

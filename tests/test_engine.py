"""The GPU engine choice (jax_ep/engine.py: JAX_EP_ENGINE, NCCL or CUDA IPC) and the
descriptor passing of the CUDA-IPC engine (transport/fd_socket.h), which need no GPU."""

import os
import secrets
import subprocess
import sys
import time

import pytest

from jax_ep import _native
from jax_ep.engine import choose_engine, nccl_serves, requested_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW, OLD = [22809, 22809], [21805, 22809]  # [library, built] NCCL versions


def table(*processes):
    """{process: published info} from (host, [(group, rank, gpu)], nccl) per process."""
    return {
        p: dict(
            engine="auto",
            host=host,
            nccl=nccl,
            ranks=[[g, r, f"gpu-{host}-{gpu}"] for g, r, gpu in ranks],
        )
        for p, (host, ranks, nccl) in enumerate(processes)
    }


def test_auto_takes_nccl_where_it_serves():
    one_per_gpu = table(("a", [(0, 0, 0)], NEW), ("a", [(0, 1, 1)], NEW))
    assert choose_engine("auto", one_per_gpu)[0] == "nccl"
    one_process = table(("a", [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)], NEW))
    assert choose_engine("auto", one_process)[0] == "nccl"
    across_hosts = table(("a", [(0, 0, 0)], NEW), ("b", [(0, 1, 0)], NEW))
    assert choose_engine("auto", across_hosts)[0] == "nccl"


@pytest.mark.parametrize("num_processes", [2, 4])
def test_auto_takes_cuda_ipc_for_ranks_that_share_a_gpu(num_processes):
    same_gpu = table(*[("a", [(0, r, 0)], NEW) for r in range(num_processes)])
    engine, why = choose_engine("auto", same_gpu)
    assert engine == "cuda_ipc" and "ranks 0 and 1 of EP group 0 share a GPU" in why
    # Two groups (dp=2), each on GPUs of its own, but group 1's ranks share one.
    mixed = table(("a", [(0, 0, 0), (1, 0, 2)], NEW), ("a", [(0, 1, 1), (1, 1, 2)], NEW))
    engine, why = choose_engine("auto", mixed)
    assert engine == "cuda_ipc" and "EP group 1" in why


@pytest.mark.parametrize(
    "nccl", [OLD, [0, 22809], [22903, 22809]], ids=["nccl-2.18", "no-nccl", "other-minor"]
)
def test_auto_takes_cuda_ipc_without_a_usable_nccl(nccl):
    processes = table(("a", [(0, 0, 0)], NEW), ("a", [(0, 1, 1)], nccl))
    engine, why = choose_engine("auto", processes)
    assert engine == "cuda_ipc" and "process 1 has no NCCL with the device API" in why


def test_asked_engines_and_their_limits():
    same_gpu = table(("a", [(0, 0, 0)], NEW), ("a", [(0, 1, 0)], NEW))
    assert choose_engine("cuda_ipc", same_gpu)[0] == "cuda_ipc"
    with pytest.raises(
        ValueError, match="JAX_EP_ENGINE=nccl, but ranks 0 and 1 of EP group 0 share a GPU"
    ):
        choose_engine("nccl", same_gpu)
    distinct = table(("a", [(0, 0, 0)], OLD), ("a", [(0, 1, 1)], OLD))
    assert choose_engine("nccl", distinct)[0] == "nccl"  # the library says what is wrong
    assert choose_engine("cuda_ipc", distinct)[0] == "cuda_ipc"
    across_hosts = table(("a", [(0, 0, 0)], OLD), ("b", [(0, 1, 0)], OLD))
    with pytest.raises(
        ValueError,
        match="needs every rank of an EP group on one host, but EP group 0 spans 2 hosts",
    ):
        choose_engine("auto", across_hosts)
    with pytest.raises(ValueError, match="JAX_EP_ENGINE=cuda_ipc; the cuda_ipc engine needs"):
        choose_engine("cuda_ipc", table(("a", [(0, 0, 0)], NEW), ("b", [(0, 1, 0)], NEW)))


def test_processes_that_ask_for_different_engines_raise():
    processes = table(("a", [(0, 0, 0)], NEW), ("a", [(0, 1, 1)], NEW))
    processes[1]["engine"] = "cuda_ipc"
    with pytest.raises(ValueError, match="process 0: auto, process 1: cuda_ipc"):
        choose_engine("auto", processes)


def test_the_engine_variable(monkeypatch):
    for value, want in (("", "auto"), ("NCCL", "nccl"), (" cuda_ipc", "cuda_ipc")):
        monkeypatch.setenv("JAX_EP_ENGINE", value)
        assert requested_engine() == want
    monkeypatch.setenv("JAX_EP_ENGINE", "nvshmem")
    with pytest.raises(
        ValueError, match="JAX_EP_ENGINE must be one of auto, nccl, cuda_ipc, got 'nvshmem'"
    ):
        requested_engine()


def test_nccl_serves():
    assert nccl_serves(22809, 22809) and nccl_serves(22800, 22809)
    assert not nccl_serves(21805, 22809)  # no device API
    assert not nccl_serves(22903, 22809)  # another window layout
    assert not nccl_serves(0, 22809)  # no library


def test_cpu_buffers_name_their_engine():
    import jax

    import jax_ep

    mesh = jax.sharding.Mesh(jax.devices()[:2], ("ep",))
    kwargs = dict(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)
    assert jax_ep.Buffer(mesh, "ep", **kwargs).engine == "shm"
    assert jax_ep.Buffer(mesh, "ep", impl="reference", **kwargs).engine is None


# ---- descriptor passing (both engines', on memfds)


SECRET = bytes(range(16))


def memfd(content: bytes):
    fd = os.memfd_create("jax_ep_test")
    os.write(fd, content)
    return fd


def read_all(fd):
    return os.pread(fd, 1 << 16, 0)


def name():
    return f"jax_ep_test_{secrets.token_hex(6)}"


def test_a_descriptor_passes_to_every_peer_that_asks():
    fd, other, where = memfd(b"window of rank 0"), memfd(b"rank 1"), name()
    server = _native.FdServer(where, SECRET, {(0, 0): (fd, 4096), (0, 1): (other, 6)})
    try:
        assert server.name == where and server.notes == []
        for i in range(3):
            got, size = _native.receive_fd(where, 0, 0, SECRET, 5.0, os.getpid())
            assert got != fd and size == 4096
            assert read_all(got) == b"window of rank 0" + b"!" * i
            os.write(got, b"!")  # the same file, not a copy
            os.close(got)
        assert read_all(fd) == b"window of rank 0!!!"
        got, size = _native.receive_fd(where, 0, 1, SECRET, 5.0)
        assert size == 6 and read_all(got) == b"rank 1"
        os.close(got)
        with pytest.raises(RuntimeError, match="serves no window of rank 2 of EP group 0"):
            _native.receive_fd(where, 0, 2, SECRET, 5.0)
        deadline = time.monotonic() + 10  # the server counts a peer after answering it
        while server.served < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.served == 4 and server.refused == 0
    finally:
        server.stop()
        os.close(fd)
        os.close(other)


def run_python(code):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=ROOT,
    )


def test_a_descriptor_passes_to_another_process():
    fd, where = memfd(b"shared"), name()
    server = _native.FdServer(where, SECRET, {(1, 0): (fd, 6)})
    code = (
        f"import os; from jax_ep import _native; fd, n = _native.receive_fd({where!r}, 1, 0, "
        f"{SECRET!r}, 10.0, {os.getpid()}); os.write(fd, b' by a peer'); print(n)"
    )
    try:
        out = run_python(code)
        assert out.returncode == 0 and out.stdout.split() == ["6"], out.stderr[-2000:]
        assert read_all(fd) == b"shared by a peer"
    finally:
        server.stop()
        os.close(fd)


def test_both_ends_check_the_other():
    """The server answers only the processes it expects, with the job's secret; the client takes
    a window only from the process it expects, with the secret back."""
    fd, where = memfd(b"x"), name()
    me = os.getpid()
    server = _native.FdServer(where, SECRET, {(0, 0): (fd, 1)}, pids=[me + 1])
    try:  # this process is not among those expected
        with pytest.raises(RuntimeError, match="closed the connection without an answer"):
            _native.receive_fd(where, 0, 0, SECRET, 2.0)
        assert server.refused == 1
    finally:
        server.stop()
    server = _native.FdServer(where, SECRET, {(0, 0): (fd, 1)}, pids=[me])
    try:
        with pytest.raises(RuntimeError, match="closed the connection without an answer"):
            _native.receive_fd(where, 0, 0, bytes(16), 2.0)  # another job's secret
        with pytest.raises(RuntimeError, match=rf"is served by process {me} .*, not by process 1 "):
            _native.receive_fd(where, 0, 0, SECRET, 2.0, 1)  # not the process expected
        with pytest.raises(RuntimeError, match="must be 16 bytes"):
            _native.receive_fd(where, 0, 0, b"key", 2.0)
        got, _ = _native.receive_fd(where, 0, 0, SECRET, 2.0, me)
        os.close(got)
    finally:
        server.stop()
        os.close(fd)


def test_a_peer_that_never_serves_is_named_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank 3 of EP group 1 did not serve its window within 0\.3"
    ):
        _native.receive_fd(name(), 1, 3, SECRET, 0.3)
    assert 0.25 < time.monotonic() - start < 5


def test_a_taken_name_is_named_and_another_is_served():
    fd, where = memfd(b"x"), name()
    server = _native.FdServer(where, SECRET, {(0, 0): (fd, 1)})
    assert _native.socket_owner(where).startswith(f"process {os.getpid()} (uid ")
    second = _native.FdServer(where, SECRET, {(0, 0): (fd, 1)})
    try:
        assert second.name != where and second.name.startswith(where + "_")
        assert (
            len(second.notes) == 1
            and f"'@{where}' is taken (by process {os.getpid()}" in (second.notes[0])
        )
        got, _ = _native.receive_fd(second.name, 0, 0, SECRET, 2.0)
        os.close(got)
    finally:
        second.stop()
    server.stop()
    with pytest.raises(RuntimeError, match="did not serve its window"):
        _native.receive_fd(where, 0, 0, SECRET, 0.2)
    assert _native.socket_owner(where) == ""
    again = _native.FdServer(where, SECRET, {(0, 0): (fd, 1)})  # the name is free again
    assert again.name == where
    again.stop()
    os.close(fd)


def test_socket_names_are_bounded():
    with pytest.raises(RuntimeError, match="longer than 107 bytes"):
        _native.receive_fd("n" * 200, 0, 0, SECRET, 0.1)
    with pytest.raises(RuntimeError, match="longer than 107 bytes"):  # with a retry's suffix
        _native.FdServer("n" * 100, SECRET, {})
    # The Buffer's names: key, nonce and process, and a retry's suffix, well within the bound.
    assert len(f"jax_ep_{(1 << 62) - 1:x}_{'f' * 16}_p{65535}_ffffffff") < 107

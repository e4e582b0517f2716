"""The GPU engine choice (jax_ep/bootstrap.py: JAX_EP_ENGINE, NCCL or CUDA IPC) and the
descriptor passing of the CUDA-IPC engine (kernels/comm/fd_socket.h), which need no GPU."""

import os
import secrets
import subprocess
import sys
import time

import pytest

from jax_ep import _native, bootstrap
from jax_ep.bootstrap import choose_engine

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
        assert bootstrap.requested_engine() == want
    monkeypatch.setenv("JAX_EP_ENGINE", "nvshmem")
    with pytest.raises(
        ValueError, match="JAX_EP_ENGINE must be one of auto, nccl, cuda_ipc, got 'nvshmem'"
    ):
        bootstrap.requested_engine()


def test_nccl_serves():
    assert bootstrap.nccl_serves(22809, 22809) and bootstrap.nccl_serves(22800, 22809)
    assert not bootstrap.nccl_serves(21805, 22809)  # no device API
    assert not bootstrap.nccl_serves(22903, 22809)  # another window layout
    assert not bootstrap.nccl_serves(0, 22809)  # no library


def test_cpu_buffers_name_their_engine():
    import jax

    import jax_ep

    mesh = jax.sharding.Mesh(jax.devices()[:2], ("ep",))
    kwargs = dict(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)
    assert jax_ep.Buffer(mesh, "ep", **kwargs).engine == "shm"
    assert jax_ep.Buffer(mesh, "ep", impl="reference", **kwargs).engine is None


# ---- descriptor passing (the CUDA-IPC engine's, on memfds)


def memfd(content: bytes):
    fd = os.memfd_create("jax_ep_test")
    os.write(fd, content)
    return fd


def read_all(fd):
    return os.pread(fd, 1 << 16, 0)


def name():
    return f"jax_ep_test_{secrets.token_hex(6)}"


def test_a_descriptor_passes_to_every_peer_that_asks():
    fd, where = memfd(b"window of rank 0"), name()
    server = _native.FdServer(where, fd, 4096, 77)
    try:
        for i in range(3):
            got, size = _native.receive_fd(where, 77, 5.0, "rank 0 of EP group 0")
            assert got != fd and size == 4096
            assert read_all(got) == b"window of rank 0" + b"!" * i
            os.write(got, b"!")  # the same file, not a copy
            os.close(got)
        assert read_all(fd) == b"window of rank 0!!!"
        deadline = time.monotonic() + 10  # the server counts a peer after answering it
        while server.served < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.served == 3
    finally:
        server.stop()
        os.close(fd)


def test_a_descriptor_passes_to_another_process():
    fd, where = memfd(b"shared"), name()
    server = _native.FdServer(where, fd, 6, 5)
    code = (
        f"import os; from jax_ep import _native; fd, n = _native.receive_fd({where!r}, 5, 10.0,"
        f" 'rank 1 of EP group 0'); os.write(fd, b' by a peer'); print(n)"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=ROOT),
            cwd=ROOT,
        )
        assert out.returncode == 0 and out.stdout.split() == ["6"], out.stderr[-2000:]
        assert read_all(fd) == b"shared by a peer"
    finally:
        server.stop()
        os.close(fd)


def test_a_peer_that_never_serves_is_named_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"rank 3 of EP group 1 did not serve its window "
        r"within 0\.3",
    ):
        _native.receive_fd(name(), 1, 0.3, "rank 3 of EP group 1")
    assert 0.25 < time.monotonic() - start < 5


def test_a_stopped_server_frees_its_name_and_answers_no_more():
    fd, where = memfd(b"x"), name()
    server = _native.FdServer(where, fd, 1, 9)
    with pytest.raises(RuntimeError, match="the name is taken"):
        _native.FdServer(where, fd, 1, 9)
    server.stop()
    with pytest.raises(RuntimeError, match="did not serve its window"):
        _native.receive_fd(where, 9, 0.2, "rank 0 of EP group 0")
    again = _native.FdServer(where, fd, 1, 9)  # the name is free again
    again.stop()
    os.close(fd)


def test_another_buffers_descriptor_is_refused():
    fd, where = memfd(b"x"), name()
    server = _native.FdServer(where, fd, 1, 1234)
    try:
        with pytest.raises(RuntimeError, match="another Buffer's tag"):
            _native.receive_fd(where, 4321, 2.0, "rank 1 of EP group 0")
    finally:
        server.stop()
        os.close(fd)


def test_socket_names_are_bounded():
    with pytest.raises(RuntimeError, match="longer than 107 bytes"):
        _native.receive_fd("n" * 200, 1, 0.1, "rank 0 of EP group 0")
    # The Buffer's names: key and nonce, then group and rank, well within the bound.
    assert len(f"jax_ep_{(1 << 62) - 1:x}_{'f' * 16}_g{4095}_r{1023}") < 107

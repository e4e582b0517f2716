"""Several processes on one GPU (jax.distributed on 127.0.0.1, every process with
CUDA_VISIBLE_DEVICES=0), each a rank of one global mesh: the cross-rank GPU path on the CUDA-IPC
engine, on the one GPU a machine may have. A private MPS daemon, started and stopped here, lets
the processes' spin-waiting kernels run at once (without it they time-slice: milliseconds per
wait). One group of processes per process count runs every case of
tests/gpu_process_scenarios.py (process start-up and compiles are slow); each test below reads
its case's verdict from every process; only the groups of the selected tests run (`-k
4-processes`: the four processes' only). Run with bench/run_gpu.sh processes."""

import contextlib
import os

import pytest
from gpu_process_scenarios import case_names
from processes import launch
from test_process_failures import check_a_killed_process

from bench.process_group import MPSUnavailable, private_mps

pytestmark = pytest.mark.gpu

PROCESS_COUNTS = [2, 4]
# Every process: GPU 0, JAX's memory taken as needed (the ranks share the GPU), no NVLink
# multicast; cpu: check_invalid's host callback.
GPU_ENV = dict(
    CUDA_VISIBLE_DEVICES="0",
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
    NCCL_NVLS_ENABLE="0",
    JAX_PLATFORMS="cuda,cpu",
)


@pytest.fixture(scope="module")
def mps():
    """bench.process_group's private MPS daemon for the module; skips, saying why, where it
    cannot start."""
    with contextlib.ExitStack() as stack:
        try:
            env = stack.enter_context(private_mps())
        except MPSUnavailable as e:
            pytest.skip(str(e))
        yield env


def selected_counts(request):
    """The process counts of this module's selected tests (`-k 4-processes` runs one group)."""
    return sorted(
        {
            item.callspec.params["num_processes"]
            for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
        }
    )


@pytest.fixture(scope="module")
def groups(mps, request):
    """Every process's output of one suite() run per selected process count, all on GPU 0; the
    groups run at once (each has its own Buffers, sockets and port)."""
    from concurrent.futures import ThreadPoolExecutor

    env = dict(mps, **GPU_ENV)
    timeout = int(os.environ.get("JAX_EP_GROUP_TIMEOUT", 900))
    counts = selected_counts(request)
    with ThreadPoolExecutor(len(counts)) as pool:
        runs = {
            n: pool.submit(launch, "gpu_process_scenarios:suite", n, 1, timeout, env)
            for n in counts
        }
        return {n: run.result() for n, run in runs.items()}


def verdict(out, name):
    for line in out.splitlines():
        if line.startswith(f"CASE {name} "):
            return line[len(f"CASE {name} ") :]
    return None


def assert_case(results, name):
    for p, (code, out) in enumerate(results):
        said = verdict(out, name)
        where = f"process {p} of {len(results)} (exit {code})"
        if said is None:
            raise AssertionError(f"{where} never reported case {name}:\n{out[-6000:]}")
        if said != "OK":
            start = out.find(f"CASE {name} ")
            raise AssertionError(f"{where}: {said}\n{out[max(0, start - 6000) : start]}")


@pytest.mark.parametrize("name", case_names())
@pytest.mark.parametrize("num_processes", PROCESS_COUNTS, ids=lambda n: f"{n}-processes")
def test_gpu_processes(num_processes, name, groups):
    results = groups[num_processes]
    assert_case(results, name)
    for p, (code, out) in enumerate(results):
        where = f"process {p} of {num_processes} (exit {code})"
        if name == "timing":
            print("\n".join(line for line in out.splitlines() if line.startswith("TIME")))
        if name in ("timeout", "early-exit") and p < num_processes - 1:
            assert "RAISED:" in out, f"{where} raised nothing in case {name}"
    if name == "early-exit":  # the others finished the suite (the last one left early)
        for p, (code, out) in enumerate(results[:-1]):
            assert code == 0 and "SCENARIO OK" in out, f"process {p} (exit {code}):\n{out[-4000:]}"


@pytest.mark.parametrize("num_processes", PROCESS_COUNTS)
def test_a_killed_process_is_an_error_in_every_survivor_on_gpus(num_processes, mps, tmp_path):
    """tests/test_process_failures.py's SIGKILL on the CUDA kernels: the survivors' waits see the
    killed process's ranks ended (the rank's host-written bit) and their steps end in NaN."""
    check_a_killed_process(tmp_path, num_processes, 1, dict(mps, **GPU_ENV))

"""Groups of processes on this host, as the multi-process tests and bench.versus_deepep run them:
a free port for their rendezvous (free_port), a private MPS daemon that lets processes sharing one
GPU run their kernels at once (private_mps), and waiting for a group with a deadline (finish)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MPSUnavailable(RuntimeError):
    """The MPS control daemon is not there or did not start (the message says which)."""


@contextlib.contextmanager
def private_mps():
    """A private MPS control daemon (its own pipe and log directories) for the processes started
    inside: yields the variables that point a CUDA process at it; stops it at the end and prints
    its logs' tails. Without MPS, processes sharing a GPU take turns on it, and kernels that
    spin-wait for each other's writes wait milliseconds (or forever). Raises MPSUnavailable where
    it cannot start."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise MPSUnavailable(
            "nvidia-cuda-mps-control is not on the PATH: without MPS the ranks' kernels "
            "cannot run at once on one GPU"
        )
    pipe = tempfile.mkdtemp(prefix="jax_ep_mps_pipe_")
    log = tempfile.mkdtemp(prefix="jax_ep_mps_log_")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log)
    try:
        started = subprocess.run(
            [control, "-d"], env=env, capture_output=True, text=True, timeout=60
        )
        if started.returncode != 0:
            raise MPSUnavailable(
                f"the MPS daemon did not start (exit {started.returncode}): "
                f"{(started.stdout + started.stderr).strip()[-500:]}"
            )
        try:
            yield {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
        finally:
            subprocess.run(
                [control], input="quit\n", env=env, capture_output=True, text=True, timeout=60
            )
            for name in sorted(os.listdir(log)):
                if name.endswith(".log"):
                    with open(os.path.join(log, name)) as f:
                        print(f"--- MPS {name}:\n{f.read()[-3000:]}", flush=True)
    finally:
        shutil.rmtree(pipe, ignore_errors=True)
        shutil.rmtree(log, ignore_errors=True)


def finish(procs, timeout, grace=None):
    """Waits for the processes (Popen) until `timeout` s from now; with `grace`, only that long
    once one has exited with an error (its peers then usually wait for it in vain). One still
    running at the end is asked for its threads' Python stacks (SIGUSR1: a faulthandler it
    registered prints them) and killed. Their exit codes, None for those killed. Their output
    should go to files: a pipe nobody reads stops a process once it is full."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and [p.poll() for p in procs].count(None):  # polls all
        if grace is not None and any(p.returncode not in (None, 0) for p in procs):
            deadline, grace = min(deadline, time.monotonic() + grace), None
        time.sleep(0.1)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        p.send_signal(signal.SIGUSR1)
    if late:
        time.sleep(2)
    for p in late:
        p.kill()
        p.wait()
    return [None if p in late else p.returncode for p in procs]

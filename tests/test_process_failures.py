"""Jobs that end abruptly (tests/processes.py, CPU devices): every process of a job killed
(SIGKILL) at any stage of a Buffer's life leaves nothing behind, no /dev/shm segment, socket or
port; Ctrl-C (SIGINT) ends a wait at creation at once. (On the way: the liveness listener of a
job on 127.0.0.1 binds the address it publishes.)"""

import os
import re
import signal
import subprocess
import time

import pytest
from processes import start


def wait_for(procs, logs, marker, timeout=180):
    """Until every process printed `marker`; fails with their output if one ends first."""
    deadline = time.monotonic() + timeout
    while True:
        outputs = [log.read_text() for log in logs]
        if all(marker in out for out in outputs):
            return
        ended = [p for p, proc in enumerate(procs) if proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            every = "\n".join(f"---- process {p}:\n{out[-4000:]}" for p, out in enumerate(outputs))
            raise AssertionError(f"no '{marker}' from every process (ended: {ended})\n{every}")
        time.sleep(0.05)


def held_by(pid):
    """What process `pid` holds that could outlive it: the shared-memory files it maps (their
    paths as /proc shows them) and the inodes of its sockets."""
    mapped, sockets = set(), set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                mapped.add(fields[5].strip())
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets.add(target[len("socket:[") : -1])
    return mapped, sockets


def open_sockets():
    """The inodes of this network namespace's Unix and TCP sockets."""
    inodes = set()
    for table, column in (("unix", 6), ("tcp", 9), ("tcp6", 9)):
        try:
            with open(f"/proc/net/{table}") as f:
                next(f)
                inodes.update(line.split()[column] for line in f if len(line.split()) > column)
        except OSError:
            pass
    return inodes - {"0"}


def shm_names():
    return {n for n in os.listdir("/dev/shm") if "jax_ep" in n}


def start_logged(tmp_path, scenario, num_processes, devices, env):
    logs = [tmp_path / f"process{p}.log" for p in range(num_processes)]
    files = [open(log, "w") for log in logs]
    try:
        procs = start(scenario, num_processes, devices, env=env, output=files)
    finally:
        for f in files:
            f.close()
    return procs, logs


@pytest.mark.parametrize(
    "stage,num_processes",
    [("created", 2), ("created", 4), ("connected", 2), ("idle", 2), ("running", 2)],
    ids=["created", "created-4-processes", "connected", "idle", "running"],
)
def test_a_job_killed_at_any_stage_leaves_nothing_behind(stage, num_processes, tmp_path):
    before = shm_names()
    devices = 4 // num_processes
    procs, logs = start_logged(tmp_path, "killed", num_processes, devices, {"STAGE": stage})
    try:
        wait_for(procs, logs, f"AT {stage}")
        held = [held_by(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # SIGKILL
        for proc in procs:
            proc.wait()
    mapped = set().union(*(m for m, _ in held))
    sockets = set().union(*(s for _, s in held))
    assert len(mapped) >= num_processes, mapped  # the windows exist: each maps its own at least
    # Segments of other jobs on this host may come and go meanwhile: only new ones that stay
    # count, and every named file this job mapped.
    deadline = time.monotonic() + 5
    while (left := shm_names() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    named = sorted(m for m in mapped if not m.endswith("(deleted)") and os.path.exists(m))
    assert not named and not left, (named, left)
    assert not sockets & open_sockets()
    if stage == "idle":  # the liveness listener binds the address it publishes, never 0.0.0.0
        for log in logs:
            said = next(
                line for line in log.read_text().splitlines() if line.startswith("LISTENER")
            )
            _, _, bound, _, published = said.split()
            assert bound == published and bound.startswith("127.0.0.1:"), said


# jax.distributed's default: the coordination service ends the job between 50 and 100 s after a
# process dies (a heartbeat every 50 s, dead after 100 s without one). jax_ep's error must come
# far sooner.
SOON_S = 10


def said_at(log, marker):
    """The time a process printed after `marker` ("NAN at <time.time()> ...")."""
    line = next(line for line in log.read_text().splitlines() if line.startswith(marker))
    return float(line.split()[len(marker.split())])


@pytest.mark.parametrize("num_processes,devices", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_a_killed_process_is_an_error_in_every_survivor(num_processes, devices, tmp_path):
    check_a_killed_process(tmp_path, num_processes, devices)


def check_a_killed_process(tmp_path, num_processes, devices, env=None):
    """The last process is killed (SIGKILL) while all dispatch in a loop: every survivor's step
    has that step's rows or NaN (never another step's), NaN comes within SOON_S (timeout_s is
    60 s), status() names the killed process, the next call raises. With 4 processes process 0 is
    killed next: it hosts jax.distributed's coordination service, and JAX ends the survivors at
    once (assert_ended_by_jax). env: the processes' environment beside the test's (GPUs:
    tests/test_gpu_processes.py)."""
    then_0 = {"THEN_PROCESS_0": "1"} if num_processes == 4 else {}
    procs, logs = start_logged(tmp_path, "dying", num_processes, devices, (env or {}) | then_0)
    victim = num_processes - 1
    survivors = range(victim)
    try:
        wait_for(procs, logs, "AT running")
        time.sleep(0.5)  # mid-run: steps go on meanwhile
        killed = time.time()
        procs[victim].kill()
        wait_for(procs[:victim], logs[:victim], "SURVIVED", timeout=60)
        took = [said_at(logs[p], "NAN at") - killed for p in survivors]
        held = f"rank {', '.join(str(victim * devices + d) for d in range(devices))} of 'ep'"
        for p in survivors:
            out = logs[p].read_text()
            assert f"process {victim} ({held}) stopped: it has ended" in out, out[-3000:]
            ended = re.search(r"the process of rank (\d+) has ended", out)
            assert ended and int(ended[1]) // devices == victim, out[-3000:]
            assert "RAISED:" in out and "has ended" in out.split("RAISED:")[1], out[-3000:]
        assert max(took) < SOON_S, took
        print(f"survivors saw NaN {', '.join(f'{t:.3f}' for t in took)} s after the kill")
        if not then_0:
            procs[0].wait(timeout=30)
            assert procs[0].returncode == 0, logs[0].read_text()[-3000:]
            return
        procs[0].kill()
        for p in range(1, victim):
            assert_ended_by_jax(procs[p], logs[p])
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def assert_ended_by_jax(proc, log):
    """What a survivor of process 0 sees (docs/API.md, When a process dies): JAX aborts it within
    milliseconds; jax_ep's line on the end of process 0 is in its output, beside JAX's own (they
    come within a millisecond of each other, either first)."""
    proc.wait(timeout=SOON_S)
    out = log.read_text()
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, out[-3000:])
    assert "Terminating process because the JAX distributed service" in out, out[-3000:]
    ours = out.find("jax_ep: process 0 has ended")
    assert ours >= 0, out[-3000:]
    assert "coordination service: JAX terminates this process" in out[ours:], out[-3000:]


def test_process_0_killed_ends_the_job(tmp_path):
    """Process 0 (it hosts jax.distributed's coordination service) killed while both dispatch:
    JAX ends the other process at once, and jax_ep says which process ended."""
    procs, logs = start_logged(tmp_path, "dying", 2, 1, {})
    try:
        wait_for(procs, logs, "AT running")
        time.sleep(0.5)
        procs[0].kill()
        assert_ended_by_jax(procs[1], logs[1])
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@pytest.mark.xfail(
    strict=False,
    reason="passes run alone (9 of 9, also beside CPU burners and the process tests), but failed "
    "in 2 of 2 runs of the whole suite: the SIGINT'd process was still in meeting.blocking_get "
    "30 s later; the cause is not found yet",
)
def test_ctrl_c_ends_a_wait_at_creation_at_once(tmp_path):
    """Process 0 waits for a Buffer that process 1 never creates; SIGINT raises
    KeyboardInterrupt there within about a second, not after timeout_s (60 s)."""
    procs, logs = start_logged(tmp_path, "interrupted", 2, 1, {})
    try:
        wait_for(procs[:1], logs[:1], "AT waiting")
        wait_for(procs[1:], logs[1:], "AT idle")
        time.sleep(3)  # inside the wait, also on a loaded machine
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGINT)
        try:
            procs[0].wait(timeout=30)
        except subprocess.TimeoutExpired:  # where it waits: its threads' stacks, in its log
            procs[0].send_signal(signal.SIGUSR1)
            time.sleep(2)
            out = logs[0].read_text()[-6000:]
            raise AssertionError(f"no exit 30 s after SIGINT:\n{out}") from None
        took = time.monotonic() - sent
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    out = logs[0].read_text()
    assert procs[0].returncode == 0 and "INTERRUPTED" in out, out[-4000:]
    assert took < 2.5, (took, out[-2000:])

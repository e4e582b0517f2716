"""Several JAX processes on this host (jax.distributed on 127.0.0.1, XLA's CPU collectives
through gloo), each running one scenario of tests/test_processes.py on its share of one global
mesh. launch() starts them and returns what each printed; run as a script, this file is one
such process:

    python tests/processes.py SCENARIO PROCESS NUM_PROCESSES PORT DEVICES_PER_PROCESS

SCENARIO names a function of process_scenarios.py, or MODULE:FUNCTION of another module here.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import tempfile

from bench.process_group import finish, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def start(scenario, num_processes, devices_per_process, env=None, output=None):
    """Starts `scenario` in num_processes processes; their Popen objects. `output`: a list of
    open files, one per process, for what each prints (else pipes)."""
    port = free_port()
    # Each process sets its own device count; XLA's other flags (tests/conftest.py) carry over,
    # unless launch(env=) gives its own.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = os.environ | {"XLA_FLAGS": " ".join(flags)} | (env or {})
    # This checkout's jax_ep, as in the tests' own process (pyproject's pythonpath).
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "processes.py"),
                scenario,
                str(p),
                str(num_processes),
                str(port),
                str(devices_per_process),
            ],
            stdout=output[p] if output else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=HERE,
        )
        for p in range(num_processes)
    ]


def launch(scenario, num_processes, devices_per_process, timeout=600, env=None):
    """Runs `scenario` in num_processes processes; [(returncode, stdout + stderr)] per process
    (a process still running `timeout` s after the start prints its threads' stacks and is
    killed: returncode None)."""
    files = [tempfile.TemporaryFile("w+") for _ in range(num_processes)]
    try:
        codes = finish(start(scenario, num_processes, devices_per_process, env, files), timeout)
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
        return list(zip(codes, outputs))
    finally:
        for f in files:
            f.close()


def _start(process, num_processes, port, devices):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launch() asks before a kill
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes > 1:
        jax.distributed.initialize(
            f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process,
            initialization_timeout=120,
        )
    return jax


if __name__ == "__main__":
    scenario, process, num_processes, port, devices = sys.argv[1:6]
    _start(int(process), int(num_processes), int(port), int(devices))
    import importlib

    module, _, name = scenario.rpartition(":")  # "module:function", else process_scenarios'
    getattr(importlib.import_module(module or "process_scenarios"), name)()
    print("SCENARIO OK", flush=True)

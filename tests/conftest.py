import importlib.util
import os


def _add_xla_flag(name, value):
    """Appends --name=value to XLA_FLAGS unless the user set that flag; before jax is imported."""
    if f"--{name}" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()


# Eight host devices for the CPU backend.
_add_xla_flag("xla_force_host_platform_device_count", 8)
# Without JAX's CUDA plugin (CI, CPU machines): XLA:CPU's LLVM backend at -O0. Compiling is most
# of this suite's time on CPUs, and LLVM's optimizations are most of a compile (a reference-path
# pipeline of tests/test_ffi_path.py: 23 s of CPU at the default level, 3 s at 0); the programs
# only move and combine a few KB, so they run as fast. The results the tests compare are
# computed the same way (no fast-math at either level). With the CUDA plugin the flag is left
# alone (it sets the GPU backend's level too, and GPU tests time kernels). Set
# XLA_FLAGS=--xla_backend_optimization_level=2 to test at the default level.
if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    _add_xla_flag("xla_backend_optimization_level", 0)

import jax  # noqa: E402
import jaxlib  # noqa: E402
import pytest  # noqa: E402


def gpu_count():
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, but none with GPUs (every GPU test
    uses all of them; two workers would share them)."""
    if gpu_count():
        return 0
    return None  # xdist's own count


def pytest_report_header(config):
    devices = jax.devices()
    return (
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"{len(devices)} x {devices[0].device_kind}"
    )


# Files of the longest tests (several processes each), run first: with pytest-xdist's worksteal
# the workers then take the short tests last and end together.
LONGEST_FIRST = (
    "test_processes.py",
    "test_process_failures.py",
    "test_examples.py",
    "test_bench.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable within a file
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs CUDA GPUs")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

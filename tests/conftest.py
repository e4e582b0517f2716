import os

# Eight host devices for the CPU backend; must be set before jax is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jaxlib  # noqa: E402
import pytest  # noqa: E402


def gpu_count():
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def pytest_report_header(config):
    devices = jax.devices()
    return (f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
            f"{len(devices)} x {devices[0].device_kind}")


def pytest_collection_modifyitems(config, items):
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs CUDA GPUs")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

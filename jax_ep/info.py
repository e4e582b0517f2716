"""`python -m jax_ep.info`: what a bug report needs to say about this machine: jax_ep, jax,
jaxlib and the CUDA plugin, the NCCL runtime (and whether its device API is there), the engine
each platform would use, and the devices."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os

import jax

import jax_ep


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_version():
    """The NCCL runtime jax_ep would load, as 'major.minor.patch', or why there is none."""
    from jax_ep.engine import nccl_library

    library = nccl_library()
    try:
        nccl = ctypes.CDLL(library)
    except OSError as e:
        return f"not loadable ({library}: {e})"
    code = ctypes.c_int()
    if nccl.ncclGetVersion(ctypes.byref(code)) != 0:
        return f"unknown ({library})"
    v = code.value  # 2.19 and newer: major * 10000 + minor * 100 + patch
    return f"{v // 10000}.{v // 100 % 100}.{v % 100} ({library})"


def report():
    """The lines `python -m jax_ep.info` prints."""
    from jax_ep import _native

    lines = [
        f"jax_ep {jax_ep.__version__} (CUDA backend built: {_native.has_cuda}; CUTLASS grouped "
        f"matmuls: {_native.has_grouped_gemm}; DeepGEMM's: {_native.has_deep_gemm})",
        f"jax {jax.__version__}, jaxlib {_version('jaxlib')}",
    ]
    plugins = {name: _version(name) for name in ("jax-cuda13-plugin", "jax-cuda12-plugin")}
    lines.append(
        "CUDA plugin: " + (", ".join(f"{n} {v}" for n, v in plugins.items() if v) or "none")
    )
    for platform in ("cpu", "gpu"):
        try:
            devices = jax.devices(platform)
        except RuntimeError:
            continue
        if platform == "gpu":
            lines.append(f"NCCL runtime: {nccl_version()}")
            engine = os.environ.get("JAX_EP_ENGINE", "auto")
            lines.append(
                f"gpu engine: JAX_EP_ENGINE={engine} (auto: NCCL where it serves, else "
                "CUDA IPC; docs/API.md)"
            )
        else:
            lines.append("cpu engine: POSIX shared memory")
        lines.append(f"{platform} devices: {len(devices)} x {devices[0].device_kind}")
    return lines


if __name__ == "__main__":
    print("\n".join(report()))

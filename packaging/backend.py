"""jax_ep's build backend: scikit-build-core, asking in addition for NCCL's headers (the
nvidia-nccl wheel of the CUDA toolkit's major version), CUTLASS's (the nvidia-cutlass wheel, for
the grouped matmuls) and DeepGEMM's (the sgl-deep-gemm wheel, its headers only: the version whose
kernel templates kernels/cuda/deep_gemm.cu instantiates) when the CUDA backend will be built, so
that `pip install .` builds it with build isolation too."""

import os
import re
import shutil
import subprocess

from scikit_build_core import build as _build
from scikit_build_core.build import *  # noqa: F401,F403  (the other PEP 517 hooks)


def _cuda_requirements():
    if os.environ.get("JAX_EP_CUDA", "AUTO").upper() == "OFF":
        return []
    nvcc = shutil.which("nvcc") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"
    )
    try:
        version = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # no CUDA toolkit: the CPU backend alone
    major = re.search(r"release (\d+)\.", version)
    return [
        f"nvidia-nccl-cu{major.group(1) if major else 13}>=2.28",
        "nvidia-cutlass>=4.2",
        "sgl-deep-gemm==0.2.5",
    ]


def get_requires_for_build_wheel(config_settings=None):
    return _build.get_requires_for_build_wheel(config_settings) + _cuda_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _build.get_requires_for_build_editable(config_settings) + _cuda_requirements()

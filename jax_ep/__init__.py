"""jax_ep: expert-parallel dispatch and combine for JAX (docs/API.md)."""

import importlib.metadata
import importlib.util
import os

from jax_ep.buffer import Buffer
from jax_ep.fp8 import dequantize_fp8, quantize_fp8
from jax_ep.halves import Pending
from jax_ep.memory import limits, memory_plan
from jax_ep.results import DispatchResult, Handle

__all__ = [
    "Buffer",
    "DispatchResult",
    "Handle",
    "Pending",
    "dequantize_fp8",
    "limits",
    "memory_plan",
    "quantize_fp8",
]

try:
    __version__ = importlib.metadata.version("jax_ep")
except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "unknown"


def _find_native():
    # Run from a source checkout, the compiled extension is the installed one (pip install .).
    if importlib.util.find_spec("jax_ep._native") is None:
        try:
            installed = str(importlib.metadata.distribution("jax_ep").locate_file("jax_ep"))
        except importlib.metadata.PackageNotFoundError:
            return  # not built: only impl="reference" works
        if os.path.isdir(installed) and installed not in __path__:
            __path__.append(installed)


_find_native()

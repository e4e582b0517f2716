"""jax_ep: expert-parallel dispatch and combine for JAX (SPEC §3)."""
from jax_ep.buffer import Buffer
from jax_ep.layout import dequantize_fp8
from jax_ep.types import DispatchResult, Handle

__all__ = ["Buffer", "DispatchResult", "Handle", "dequantize_fp8"]


def _register():
    try:
        from jax_ep import ffi_path
    except ImportError:  # source tree without the built extension: the reference path still works
        return
    ffi_path.register_targets()


_register()

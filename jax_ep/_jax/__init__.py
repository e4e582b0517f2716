"""Everything jax_ep takes from JAX's private modules (`jax._src`), one module per concern:

- `order`: the ordered effect of each Buffer (`BufferOrder`) and the primitive that makes its
  custom calls carry it (`ordered_ffi_call`, `SendMark`, `sending`);
- `tokens`: a Buffer's runtime tokens kept per process, its programs launched one at a time,
  and what closing it lets go of (`release_tokens`);
- `aot`: JAX's C++ fast path for ahead-of-time compiled programs, kept by programs without a
  Buffer;
- `remat`: jax.checkpoint's rounding of saved float8 residuals around a Buffer's calls;
- `distributed`: jax.distributed's key-value client and coordinator address;
- `shard_map`: the mesh axes a value varies over, and whether ops run eagerly in shard_map.

Each module names the jax versions it was checked on and fails at import, naming the jax
version and what is missing, on a jax that moved what it uses (`require`).

The mends of `tokens`, `aot` and `remat` replace JAX functions, so they are applied only when a
process makes its first Buffer (`install`, from Buffer's constructor): `import jax_ep` alone
changes nothing in JAX, and each mend hands JAX every program and effect that is not a Buffer's
unchanged.
"""

from __future__ import annotations

import threading

from jax_ep._jax import aot, remat, tokens
from jax_ep._jax.distributed import coordinator_address, distributed_client
from jax_ep._jax.order import BufferOrder, SendMark, ordered_ffi_call, sending
from jax_ep._jax.shard_map import in_eager_shard_map, varying_axes
from jax_ep._jax.tokens import release_tokens

__all__ = [
    "BufferOrder",
    "SendMark",
    "coordinator_address",
    "distributed_client",
    "in_eager_shard_map",
    "install",
    "installed",
    "ordered_ffi_call",
    "release_tokens",
    "sending",
    "varying_axes",
]

# The mends, as (owner, name, jax_ep's function): applied by install(), not at import.
_MENDS = tokens.MENDS + aot.MENDS + remat.MENDS
_install = threading.Lock()


def install():
    """Applies the mends, once per process, when its first Buffer is made."""
    with _install:
        for owner, name, mend in _MENDS:
            if getattr(owner, name) is not mend:
                setattr(owner, name, mend)


def installed() -> bool:
    """Whether install() has mended JAX in this process."""
    return all(getattr(owner, name) is mend for owner, name, mend in _MENDS)

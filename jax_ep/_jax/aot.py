"""JAX's C++ fast path for an ahead-of-time compiled program (jit(f).lower(...).compile()).

Its second call runs through that path, which passes no runtime tokens: XLA then refuses a
program with ordered effects ("Execution supplied N arguments but compiled program expected
N + 1"). Programs that use a Buffer keep JAX's Python path, which passes them (as jit's own calls
do for ordered effects); every other program gets JAX's own fast path, the same object.

Mend (`MENDS`, applied by jax_ep._jax.install): pxla.MeshExecutable.create_cpp_call. Checked on
jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

from jax_ep._jax.order import orders_in
from jax_ep._jax.require import require

pxla = require(__name__, "jax._src.interpreters.pxla", "MeshExecutable.create_cpp_call")

_jax_create_cpp_call = pxla.MeshExecutable.create_cpp_call


def _create_cpp_call(self, params):
    if orders_in(getattr(self.unsafe_call, "ordered_effects", ())):
        return None
    return _jax_create_cpp_call(self, params)


MENDS = ((pxla.MeshExecutable, "create_cpp_call", _create_cpp_call),)

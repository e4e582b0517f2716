"""jax.checkpoint's rounding of saved residuals, in checkpoints around a Buffer's calls.

A JAX bug that jax_ep's FP8 rows meet (docs/API.md has the report for JAX): jax.checkpoint
rounds every saved float residual with reduce_precision(exponent_bits, mantissa_bits) of its
dtype, and XLA's reduce_precision has IEEE semantics, where the top exponent means inf or NaN.
float8_e4m3fn (jax_ep's FP8 rows) has no inf and uses that exponent for 256..448: a saved FP8 row
came back NaN in every such element on jax 0.10.2 (0.12.1 keeps it). In a checkpoint whose jaxpr
carries a Buffer's effect, float types without inf keep one more exponent bit
(`_remat_residual_rounding`), which leaves their values as they are (the mantissa is still
rounded to theirs); every other checkpoint gets JAX's own rounding, the same object.

Mend (`MENDS`, applied by jax_ep._jax.install): ad_checkpoint._insert_reduce_precision. Checked on
jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

import numpy as np

from jax_ep._jax.order import orders_in
from jax_ep._jax.require import require

ad_checkpoint = require(__name__, "jax._src.ad_checkpoint", "_insert_reduce_precision")
dtypes = require(__name__, "jax._src.dtypes", "issubdtype", "finfo")
lax = require(__name__, "jax._src.lax.lax", "reduce_precision_p")

_jax_insert_reduce_precision = ad_checkpoint._insert_reduce_precision


def _has_inf(dtype) -> bool:
    return bool(np.isinf(np.asarray(np.inf, np.float32).astype(dtype)))


def _remat_residual_rounding(jaxpr, num_res):
    rounded = _jax_insert_reduce_precision(jaxpr, num_res)
    if not orders_in(jaxpr.effects):  # only checkpoints around a Buffer's calls
        return rounded
    eqns = list(rounded.eqns)
    for i, eqn in enumerate(eqns):
        dtype = eqn.outvars[0].aval.dtype if eqn.primitive is lax.reduce_precision_p else None
        if dtype is None or not dtypes.issubdtype(dtype, np.floating) or _has_inf(dtype):
            continue
        if eqn.params["exponent_bits"] == dtypes.finfo(dtype).nexp:
            eqns[i] = eqn.replace(
                params=dict(eqn.params, exponent_bits=eqn.params["exponent_bits"] + 1)
            )
    return rounded.replace(eqns=eqns)


MENDS = ((ad_checkpoint, "_insert_reduce_precision", _remat_residual_rounding),)

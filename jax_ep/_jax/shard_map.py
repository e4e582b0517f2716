"""What a value and the running trace say of shard_map: the mesh axes a value varies over
(`varying_axes`, the aval's manual_axis_type) and whether ops run one by one inside shard_map
(`in_eager_shard_map`, from jax._src.core's trace context: a ShardMapTrace before any
DynamicJaxprTrace). Checked on jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

import jax

from jax_ep._jax.require import require

core = require(__name__, "jax._src.core", "trace_ctx", "ShapedArray.manual_axis_type")
shard_map = require(__name__, "jax._src.shard_map", "ShardMapTrace")
partial_eval = require(__name__, "jax._src.interpreters.partial_eval", "DynamicJaxprTrace")


def in_eager_shard_map() -> bool:
    """Whether this runs op by op inside shard_map (no jit around it): JAX cannot run a
    custom_vjp with symbolic zeros there, which every op of the custom calls is."""
    trace = core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, shard_map.ShardMapTrace):
            return True
        if isinstance(trace, partial_eval.DynamicJaxprTrace):
            return False
        trace = getattr(trace, "parent_trace", None)
    return False


def varying_axes(value) -> frozenset:
    """The mesh axes `value` varies over inside shard_map."""
    return frozenset(jax.typeof(value).manual_axis_type.varying)

"""jax.distributed's key-value client (`distributed_client`), where the processes of a mesh meet
to bring a Buffer up, and its coordinator's address (`coordinator_address`), through
jax._src.distributed.global_state. Checked on jax 0.10.2, 0.11.2 and 0.12.1.
"""

from __future__ import annotations

from jax_ep._jax.require import require

distributed = require(
    __name__,
    "jax._src.distributed",
    "global_state.client",
    "global_state.coordinator_address",
)


def distributed_client():
    """jax.distributed's key-value client, or a ValueError when it is not initialized."""
    client = distributed.global_state.client
    if client is None:
        raise ValueError(
            "jax_ep: the mesh spans several processes but jax.distributed is not "
            "initialized (call jax.distributed.initialize() first)"
        )
    return client


def coordinator_address() -> str | None:
    """jax.distributed's coordinator ("host:port"), or None when it is not initialized."""
    return distributed.global_state.coordinator_address

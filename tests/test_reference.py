"""The reference path (jax.lax.all_to_all) against the numpy oracle of docs/API.md."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from helpers import assert_matches_oracle, make_mesh, pipeline, random_inputs, run

import jax_ep

T, H, E, K = 12, 256, 16, 4

CONFIGS = [  # num_ranks, dp, layout, alignment, fp8, round_scale, capacity, dtype
    (1, 1, "rank", 1, False, False, None, jnp.bfloat16),
    (2, 1, "expert", 4, True, False, None, jnp.bfloat16),
    (4, 2, "rank", 1, True, True, None, jnp.float32),
    (4, 2, "expert", 1, False, False, None, jnp.float32),
    (8, 1, "rank", 8, False, False, 50, jnp.bfloat16),
    (8, 1, "expert", 4, True, True, 40, jnp.bfloat16),
    (2, 1, "expert_padded", 1, True, False, None, jnp.bfloat16),
    (4, 2, "expert_padded", 1, False, False, 5, jnp.float32),
]


@pytest.mark.parametrize("num_ranks,dp,lay,alignment,fp8,round_scale,capacity,dtype", CONFIGS)
@pytest.mark.parametrize("kind", ["random", "one_expert", "skip_rank", "duplicates"])
def test_reference_matches_oracle(
    num_ranks, dp, lay, alignment, fp8, round_scale, capacity, dtype, kind
):
    devices = num_ranks * dp
    mesh = make_mesh(num_ranks, dp)
    rng = np.random.default_rng(hash((num_ranks, lay, kind)) % 2**32)
    x, idx, w = random_inputs(rng, devices, T, H, E, K, num_ranks, kind, dtype)
    bias = jnp.asarray(rng.standard_normal((devices * T, H)), dtype)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )
    out = run(mesh, pipeline(buf, lay, alignment, fp8, round_scale, capacity), x, idx, w, bias, x)
    assert_matches_oracle(
        out, (x, idx, w, bias), num_ranks, dp, lay, alignment, fp8, round_scale, capacity
    )


def test_oracle_fp8_matches_ml_dtypes_rounding():
    q, scales = oracle.quantize(np.full(128, 0.5, np.float32), False)
    assert scales[0] == np.float32(0.5) * np.float32(1 / 448)
    assert q.astype(np.float32)[0] == 448.0 and q.dtype == ml_dtypes.float8_e4m3fn

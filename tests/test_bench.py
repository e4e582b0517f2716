"""bench/ep.py on CPU devices at a small shape: every implementation times both ops and makes
the same round trip (dispatch, dequantise, combine) as jax_ep. (XLA:CPU has no
ragged-all-to-all, so that baseline runs on GPUs only.)"""
import math

import jax
import numpy as np
import pytest

from bench.ep import JAX_EP, bench_size


@pytest.mark.parametrize("fp8", [True, False])
def test_every_implementation_times_and_agrees(fp8):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("ep",))
    cfg = dict(hidden=256, num_experts=16, num_topk=4)
    impls = ("jax_ep", "jax_ep_cached", "jax_ep_normal", "lax_all_to_all")
    results = bench_size(mesh, cfg, 8, impls, num_sms=24, fp8=fp8,
                         rng=np.random.default_rng(0), check=True, steps=(1, 2))
    assert sorted((r["impl"], r["op"]) for r in results) == sorted(
        (i, op) for i in impls for op in ("dispatch", "combine"))
    for r in results:
        assert math.isfinite(r["raw_time_us"])  # CPU timings are noise: only present
        assert r["num_sms"] == (24 if r["impl"] in JAX_EP else None)
        assert r["max_abs_diff_vs_jax_ep"] == 0, r

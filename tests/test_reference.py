"""The reference path (jax.lax.all_to_all) against the numpy oracle of docs/API.md."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracle
import pytest
from helpers import calc_diff, make_mesh, per_rank, pipeline, random_inputs, run

import jax_ep
from jax_ep import layout

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

    def groups(a):  # [devices, ...] -> [dp, R, ...]
        a = per_rank(a, devices)
        return a.reshape((dp, num_ranks) + a.shape[1:])

    xs, idxs, ws, biases = (groups(np.asarray(a)) for a in (x, idx, w, bias))
    d = {k: groups(v) for k, v in out["d"]._asdict().items() if v is not None}
    y, expert_out = groups(out["y"]), groups(out["expert_out"])
    send_pos = groups(out["send_pos"])
    padded = lay == "expert_padded"
    if padded:  # [dp, R, E_l, B, ...] -> [dp, R, E_l * B, ...]
        block = d["x"].shape[3]
        assert d["x"].shape[2] == E // num_ranks
        assert block == (capacity or num_ranks * T)
        for f in ("x", "scales", "topk_idx", "topk_weights"):
            if f in d:
                d[f] = d[f].reshape(d[f].shape[:2] + (-1,) + d[f].shape[4:])
        expert_out = expert_out.reshape(expert_out.shape[:2] + (-1, H))
    el = E // num_ranks
    for g in range(dp):
        rows = capacity if lay == "rank" else num_ranks * T
        if lay == "rank" and capacity is None:
            rows = num_ranks * T
        want = oracle.dispatch_rank(xs[g], idxs[g], ws[g], E, rows, fp8, round_scale)
        np.testing.assert_array_equal(send_pos[g], want["send_pos"])
        np.testing.assert_array_equal(d["num_invalid"][g][:, 0], want["num_invalid"])
        if lay == "rank":
            n = want["x"].shape[1]  # default capacity is R*N rows with N = T here
            for f in ("topk_idx", "topk_weights", "tokens_per_expert"):
                np.testing.assert_array_equal(d[f][g], want[f], err_msg=f)
            np.testing.assert_array_equal(d["x"][g][:, :n].view(np.uint8), want["x"].view(np.uint8))
            if fp8:
                np.testing.assert_array_equal(d["scales"][g], want["scales"])
            np.testing.assert_array_equal(d["num_recv"][g][:, 0], want["num_recv"])
            np.testing.assert_array_equal(d["num_dropped"][g][:, 0], want["num_dropped"])
            partial = expert_out[g]
        else:
            partial = []
            cap = d["x"].shape[2]  # expert rows (all experts' blocks when padded)
            for r in range(num_ranks):
                src, expert, weight, present, dropped = oracle.expert_layout(
                    want["topk_idx"][r],
                    want["topk_weights"][r],
                    el,
                    alignment,
                    cap,
                    block if padded else 0,
                )
                np.testing.assert_array_equal(d["topk_idx"][g][r], expert)
                np.testing.assert_allclose(d["topk_weights"][g][r], weight, rtol=1e-6)
                np.testing.assert_array_equal(d["tokens_per_expert"][g][r], present)
                assert d["num_dropped"][g][r, 0] == dropped
                gathered = np.where((src >= 0)[:, None], want["x"][r][np.maximum(src, 0)], 0)
                np.testing.assert_array_equal(
                    d["x"][g][r].view(np.uint8), gathered.astype(want["x"].dtype).view(np.uint8)
                )
                sizes = layout.align_up(present, alignment)
                assert d["num_recv"][g][r, 0] == sizes.sum()
                # The expert rows of each rank-level row, weighted, in expert order.
                acc = np.zeros((rows, H), np.float32)
                for i in range(cap):
                    if src[i] >= 0:
                        acc[src[i]] += weight[i] * expert_out[g][r][i].astype(np.float32)
                partial.append(acc)
        want_y = oracle.combine(partial, want["send_pos"], biases[g])
        assert calc_diff(y[g].astype(np.float32), want_y.astype(dtype).astype(np.float32)) < 5e-6


def test_oracle_fp8_matches_ml_dtypes_rounding():
    q, scales = oracle.quantize(np.full(128, 0.5, np.float32), False)
    assert scales[0] == np.float32(0.5) * np.float32(1 / 448)
    assert q.astype(np.float32)[0] == 448.0 and q.dtype == ml_dtypes.float8_e4m3fn

"""bench/moe_layer.py and bench/grouped_matmul.py at tiny shapes on the CPU devices: every part
and phase is timed, the JSON has the documented schema, and the layers compute the same y.
(The MaxText layer needs ragged_all_to_all, which XLA:CPU lacks: reported as skipped.)"""
import json
import math

import pytest

from bench import grouped_matmul, moe_layer

TINY_LAYER = ["--hidden", "256", "--experts", "16", "--topk", "4", "--ffn", "128",
              "--shared-ffn", "128", "--tokens", "32", "--alignment", "8",
              # C = 4 * T*K/E = T rows per expert: the padded layer drops nothing
              "--capacity-factor", "4", "--counts", "1,2", "--repeats", "1", "--no-plot"]


def read_record(directory):
    (path,) = directory.glob("*.json")
    with open(path) as f:
        return json.load(f)


def test_moe_layer_benchmark(tmp_path):
    moe_layer.main(TINY_LAYER + ["--machine", "cpu-test", "--out", str(tmp_path)])
    record = read_record(tmp_path)
    assert record["config"] == "moe_layer" and record["machine"] == "cpu-test"
    assert record["num_ranks"] == 8
    assert record["skipped"] == {"maxtext": "XLA:CPU has no ragged_all_to_all"}
    assert sorted((r["impl"], r["phase"]) for r in record["results"]) == [
        ("jax_ep", "forward"), ("jax_ep", "train"), ("lax_all_to_all", "forward"),
        ("lax_all_to_all", "train")]
    for r in record["results"]:
        assert r["tokens_per_rank"] == 32 and set(r["parts"]) == set(moe_layer.PARTS)
        assert math.isfinite(r["time_ms"])
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / (r["time_ms"] / 1e3))
        assert all(math.isfinite(ms) for ms in r["parts"].values())  # CPU times: only present
    assert record["relative_difference_of_y"]["jax_ep"] == 0
    assert record["relative_difference_of_y"]["lax_all_to_all"] < 2e-2  # bfloat16 roundings
    matmul = record["grouped_matmul"]
    assert matmul["impl"] == "xla" and matmul["tflops"] > 0 and matmul["dense_tflops"] > 0


def test_grouped_matmul_benchmark(tmp_path):
    grouped_matmul.main(["--tokens", "64", "--topk", "2", "--experts", "8", "--hidden", "256",
                         "--ffn", "128", "--alignment", "8", "--machine", "cpu-test",
                         "--out", str(tmp_path)])
    record = read_record(tmp_path)
    assert record["config"] == "grouped_matmul"
    timed = {(r["ranks"], r["projection"], r["product"], r["impl"]) for r in record["results"]
             if r["tflops"]}
    for ranks in (1, 2):
        for projection in ("gate_up", "down"):
            assert (ranks, projection, "gmm", "xla") in timed
            for product in ("gmm", "gmm_t", "tgmm"):
                assert (ranks, projection, product, "dense") in timed
    # Without a Hopper GPU the Mosaic kernels are not timed (nor claimed).
    assert not any(r["impl"].startswith("mosaic") for r in record["results"])


def test_zipf_group_sizes():
    sizes = grouped_matmul.group_sizes("zipf", 32768, 256, 128)
    assert sizes.sum() == 32768 and not (sizes % 128).any()
    assert sizes[0] > sizes[1] > 0 and (sizes == 0).sum() > 128
    assert set(grouped_matmul.group_sizes("uniform", 32768, 256, 128)) == {128}

"""bench/moe_layer.py and bench/grouped_matmul.py at tiny shapes on the CPU devices: every part
and phase is timed, the JSON has the documented schema, and the layers compute the same y.
The MaxText layer needs ragged_all_to_all, which XLA:CPU lacks: the benchmark reports it as
skipped, and a second run checks its routing logic with ragged_all_to_all emulated by an
all_gather (the real collective runs only on GPUs)."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from bench import grouped_matmul, moe_layer
from jax_ep._jax import varying_axes

TINY_LAYER = [
    "--hidden",
    "256",
    "--experts",
    "16",
    "--topk",
    "4",
    "--ffn",
    "128",
    "--shared-ffn",
    "128",
    "--tokens",
    "32",
    "--alignment",
    "8",
    # C = 4 * T*K/E = T rows per expert: the padded layer drops nothing
    "--capacity-factor",
    "4",
    "--counts",
    "1,2",
    "--repeats",
    "1",
    "--no-plot",
]


def read_record(directory):
    (path,) = directory.glob("*.json")
    with open(path) as f:
        return json.load(f)


def test_moe_layer_benchmark(tmp_path):
    argv = ["--machine", "cpu-test", "--out", str(tmp_path), "--grouped-matmul", "xla"]
    argv += ["--num-sms", "8"]  # the Buffer takes it (the CPU backend ignores it)
    moe_layer.main(TINY_LAYER + argv)
    record = read_record(tmp_path)
    assert record["config"] == "moe_layer" and record["machine"] == "cpu-test"
    assert record["grouped_matmul_impl"] == "xla" and record["grouped_matmul"]["impl"] == "xla"
    assert record["num_sms"] == 8
    assert record["num_ranks"] == 8
    assert record["skipped"] == {"maxtext": "XLA:CPU has no ragged_all_to_all"}
    assert sorted((r["impl"], r["phase"]) for r in record["results"]) == [
        ("jax_ep", "forward"),
        ("jax_ep", "train"),
        ("lax_all_to_all", "forward"),
        ("lax_all_to_all", "train"),
    ]
    for r in record["results"]:
        assert r["tokens_per_rank"] == 32 and set(r["parts"]) == set(moe_layer.PARTS)
        assert math.isfinite(r["time_ms"])
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / (r["time_ms"] / 1e3))
        assert all(math.isfinite(ms) for ms in r["parts"].values())  # CPU times: only present
    assert record["relative_difference_of_y"]["jax_ep"] == 0
    assert record["relative_difference_of_y"]["lax_all_to_all"] < 2e-2  # bfloat16 roundings
    matmul = record["grouped_matmul"]
    assert matmul["impl"] == "xla" and matmul["tflops"] > 0 and matmul["dense_tflops"] > 0


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """jax.lax.ragged_all_to_all's result from all_gathers: rank r's output rows
    [output_offsets_s[r], + send_sizes_s[r]) are source s's rows from input_offsets_s[r].
    Like the real collective's, the result has the output operand's type inside shard_map: an
    output that does not vary over the axis is refused (the timing loops' carries would differ)."""
    assert axis_name in varying_axes(output), "output must vary over the axis"
    gathered = [
        jax.lax.all_gather(a, axis_name)
        for a in (operand, input_offsets, send_sizes, output_offsets)
    ]
    operands, starts, sizes, destinations = gathered
    me = jax.lax.axis_index(axis_name)
    row = jnp.arange(output.shape[0])
    for s in range(operands.shape[0]):
        within = row - destinations[s, me]
        mine = (within >= 0) & (within < sizes[s, me])
        source = jnp.clip(starts[s, me] + within, 0, operands.shape[1] - 1)
        output = jnp.where(mine[:, None], operands[s][source], output)
    return output


def test_maxtext_layer_with_emulated_ragged_all_to_all(tmp_path, monkeypatch):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(moe_layer, "unavailable", lambda impl, platform: None)
    moe_layer.main(
        TINY_LAYER + ["--impls", "jax_ep,maxtext", "--machine", "cpu-test", "--out", str(tmp_path)]
    )
    record = read_record(tmp_path)
    assert not record["skipped"]
    assert {(r["impl"], r["phase"]) for r in record["results"]} == {
        (impl, phase) for impl in ("jax_ep", "maxtext") for phase in ("forward", "train")
    }
    assert record["relative_difference_of_y"]["maxtext"] < 2e-2


def test_grouped_matmul_benchmark(tmp_path):
    grouped_matmul.main(
        [
            "--tokens",
            "64",
            "--topk",
            "2",
            "--experts",
            "8",
            "--hidden",
            "256",
            "--ffn",
            "128",
            "--alignment",
            "8",
            "--machine",
            "cpu-test",
            "--out",
            str(tmp_path),
        ]
    )
    record = read_record(tmp_path)
    assert record["config"] == "grouped_matmul"
    timed = {
        (r["ranks"], r["projection"], r["product"], r["impl"])
        for r in record["results"]
        if r["tflops"]
    }
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


@pytest.mark.parametrize("down", [False, True])
def test_moe_layer_benchmark_fp8_weights_once(tmp_path, down):
    """--fp8 --fp8-experts once: jax_ep's layer multiplies FP8 rows by FP8 weights made before
    the timed loops (with --fp8-down its down projection too, and --fp8-dgrad their row
    gradients); y stays within FP8's error of the bf16 padded layer's."""
    moe_layer.main(
        TINY_LAYER
        + ["--fp8-down", "--fp8-dgrad"] * down
        + [
            "--fp8",
            "--fp8-experts",
            "once",
            "--impls",
            "jax_ep,lax_all_to_all",
            "--machine",
            "cpu-test",
            "--out",
            str(tmp_path),
        ]
    )
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith("-fp8-once" + "-down-dgrad" * down + ".json")
    record = read_record(tmp_path)
    assert record["fp8"] and record["fp8_experts"] == "once"
    assert record["fp8_down"] == record["fp8_dgrad"] == down
    assert {(r["impl"], r["phase"]) for r in record["results"]} == {
        (impl, phase) for impl in ("jax_ep", "lax_all_to_all") for phase in ("forward", "train")
    }
    assert 0 < record["relative_difference_of_y"]["lax_all_to_all"] < 0.1

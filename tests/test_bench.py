"""bench/ep.py on CPU devices at a small shape: every implementation times both ops and makes
the same round trip (dispatch, dequantise, combine) as jax_ep; --nodes times a tuple-axis Buffer
and each of its legs. (XLA:CPU has no ragged-all-to-all, so that baseline runs on GPUs only.)
bench/grouped_matmul.py's cases and decode MLP at a tiny shape. bench/versus_deepep.py's routing,
byte accounting and whole run on CPUs (its DeepEP side fails there, as it should be recorded)."""

import contextlib
import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from bench import ep, fp8_accuracy, harness, probe, process_group, versus_deepep
from bench.ep import JAX_EP, bench_size, table
from bench.trace import device_kernels, kernel_summary


@pytest.mark.parametrize("fp8", [True, False])
def test_every_implementation_times_and_agrees(fp8):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("ep",))
    cfg = dict(hidden=256, num_experts=16, num_topk=4)
    impls = ("jax_ep", "jax_ep_cached", "jax_ep_normal", "lax_all_to_all")
    results = bench_size(
        mesh,
        cfg,
        8,
        impls,
        num_sms=24,
        fp8=fp8,
        rng=np.random.default_rng(0),
        check=True,
        steps=(1, 2),
    )
    assert sorted((r["impl"], r["op"]) for r in results) == sorted(
        (i, op) for i in impls for op in ("dispatch", "combine")
    )
    for r in results:
        assert math.isfinite(r["raw_time_us"])  # CPU timings are noise: only present
        assert r["num_sms"] == (24 if r["impl"] in JAX_EP else None)
        assert r["max_abs_diff_vs_jax_ep"] == 0, r


def test_nodes_times_the_whole_and_each_leg(tmp_path, monkeypatch, capsys):
    """--nodes 2 on the 8 CPU devices (2 x 4) at a small shape, through the command line: the
    record holds both ops of the tuple-axis Buffer and of each leg, and the fast leg's routing
    gives each rank the rows the tuple-axis Buffer gives it; --steps replaces the config's; a
    harness slower than HARNESS_WARN_S a step is a warning."""
    small = dict(tokens=4, hidden=256, num_experts=16, num_topk=4, sweep=(4,), steps=(1, 2))
    monkeypatch.setitem(ep.CONFIGS, "ll", small)
    monkeypatch.setattr(ep, "HARNESS_WARN_S", float("-inf"))  # CPU times can be < 0
    ep.main(
        ["--config", "ll", "--nodes", "2", "--steps", "1,3", "--machine", "test"]
        + ["--out", str(tmp_path), "--no-plot"]
    )
    (path,) = tmp_path.glob("ll-test-*-nodes2.json")
    with open(path) as f:
        record = json.load(f)
    assert record["num_nodes"] == 2 and "--nodes 2" in record["command"]
    assert record["steps"] == [1, 3] and small["steps"] == (1, 2)
    results = record["results"]
    assert sorted((r["impl"], r["op"]) for r in results) == sorted(
        (impl, op) for impl in ("jax_ep", "fast_leg", "node_leg") for op in ("dispatch", "combine")
    )
    for r in results:
        assert math.isfinite(r["raw_time_us"]) and r["num_nodes"] == 2
    assert all(r["rows_as_jax_ep"] for r in results if r["impl"] == "fast_leg")
    assert [r["dtype"] for r in results if r["op"] == "combine"] == ["bf16", "bf16", "float32"]
    out = capsys.readouterr().out
    assert "fast_leg" in out and "WARNING: the harness takes" in out  # the table, the warning


def test_loop_program_calls_leave_the_inputs_unchanged():
    """Each call rewrites one element of the first floating-point input with its own value (so
    that no call is loop-invariant): the result after n calls is one call's."""
    a = jax.random.normal(jax.random.key(0), (8, 16), jax.numpy.bfloat16) + 3
    b = jax.random.normal(jax.random.key(1), (16, 4), jax.numpy.bfloat16)
    step = lambda x, y: (x @ y, x.sum())
    want = step(a, b)
    for n in (1, 3):
        got = harness.loop_program(step)(n, a, b)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1])[None])


def test_kernel_summary_per_step_and_table_column():
    # Two steps of a program on one GPU: kernel a twice (3 and 5 us), b once (2 us) with a gap.
    events = [("a", 0, 3000), ("b", 3000, 2000), ("a", 10000, 5000)]
    summary = kernel_summary({"/device:GPU:0": events}, steps=2)["/device:GPU:0"]
    assert summary["busy_us_per_step"] == pytest.approx(5.0)
    assert summary["span_us_per_step"] == pytest.approx(7.5)
    assert summary["kernels"]["a"] == dict(calls_per_step=1.0, median_us=4.0)
    assert summary["kernels"]["b"] == dict(calls_per_step=0.5, median_us=2.0)
    assert list(summary["kernels"]) == ["a", "b"]  # most time first
    result = dict(
        impl="jax_ep",
        op="dispatch",
        tokens_per_rank=1,
        time_us=1.0,
        logical_gbps=0.0,
        physical_gbps=0.0,
        kernels={"/device:GPU:0": summary, "/device:GPU:1": dict(summary, busy_us_per_step=6.5)},
    )
    assert table([result]).splitlines()[1].split()[-1] == "6.5"  # the slowest GPU


def test_kernel_summary_of_the_steps_alone():
    """With the same program's run of fewer steps, a prologue counts out: its kernel is not
    listed and its time is not in the steps' busy time or span."""
    prologue = [("prologue", 0, 10000)]

    def run(steps):
        return {"/device:GPU:0": prologue + [("a", 10000 + 3000 * s, 2000) for s in range(steps)]}

    summary = kernel_summary(run(3), steps=2, fewer=run(1))["/device:GPU:0"]
    assert summary["busy_us_per_step"] == pytest.approx(2.0)
    assert summary["span_us_per_step"] == pytest.approx(3.0)
    assert summary["kernels"] == {"a": dict(calls_per_step=1.0, median_us=2.0)}
    alone = kernel_summary(run(3), steps=3)["/device:GPU:0"]
    assert alone["busy_us_per_step"] == pytest.approx(16 / 3)  # with the prologue


def test_device_kernels_without_gpus_is_empty():
    assert device_kernels(jax.jit(lambda x: x + 1), (np.ones(4),)) == {}


def test_peer_bandwidth_is_not_measured_without_the_probe():
    """Without bench._probe (a CPU machine, or not built) the benchmark records no bandwidth
    rather than a made-up one."""
    if probe._probe is not None:
        pytest.skip("bench._probe is built here")
    assert harness.copy_engine_gbps(False) is None and harness.copy_engine_gbps(True) is None
    with pytest.raises(SystemExit, match="bench._probe"):
        probe.main()


def test_grouped_matmul_bench_records_every_case(tmp_path):
    """bench.grouped_matmul on tiny shapes: the XLA products and the decode MLP's batched einsum
    are timed, the Mosaic kernels and the worst-case buffer's kernels recorded as failed where
    they cannot run."""
    from bench import grouped_matmul

    grouped_matmul.main(
        "--ranks 2 --tokens 32 --experts 4 --hidden 128 --ffn 128 --alignment 8 --sweep= --buffer "
        f"--decode-tokens 8 --counts 1,2 --warm-s 0.01 --machine test --out {tmp_path}".split()
    )
    (path,) = tmp_path.glob("grouped-matmul-test-*.json")
    record = json.loads(path.read_text())
    assert record["counts"] == [1, 2] and record["warm_s"] == 0.01
    results = record["results"]
    timed = {(r["projection"], r["impl"]) for r in results if r["tflops"]}
    for projection in ("gate_up", "down"):
        assert {(projection, "dense"), (projection, "xla"), (projection, "batched_einsum")} <= timed
    decode = [r for r in results if r["distribution"] == "decode"]
    assert len(decode) == 6 and all(r["capacity"] == 16 for r in decode)
    buffer = [r for r in results if r["impl"].endswith("_buffer")]
    assert len(buffer) == 8 and all(r["buffer_rows"] == 2 * 32 * 8 for r in buffer)
    if jax.devices()[0].platform != "gpu":
        assert all(r["error"] and r["tflops"] is None for r in buffer)


def test_fp8_accuracy_bench_measures_each_variant_against_float32(tmp_path):
    """bench.fp8_accuracy: the bf16 layer within bf16 rounding of the float32 one, the FP8
    layer further (a few percent: e4m3 keeps 3 mantissa bits), both recorded."""
    argv = "--tokens 8 --hidden 256 --ffn 128 --experts 4 --topk 2 --variants bf16,fp8_dgrad"
    argv += " --inputs normal --machine test --out"
    fp8_accuracy.main(argv.split() + [str(tmp_path)])
    (path,) = tmp_path.glob("fp8-accuracy-test-*.json")
    record = json.loads(path.read_text())
    results = record["results"]["normal"]
    assert set(results) == {"bf16", "fp8_dgrad"}
    for name, error in results["bf16"]["vs_float32"].items():
        assert error < 0.02, (name, error)
        assert 0.01 < results["fp8_dgrad"]["vs_float32"][name] < 0.15, name


def test_call_cost_times_each_program_with_placed_and_unplaced_inputs(tmp_path):
    from bench import call_cost

    call_cost.main(["--calls", "3", "--repeats", "1", "--machine", "test", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("call-cost-test-*.json")
    with open(path) as f:
        record = json.load(f)
    assert record["config"] == "call_cost" and record["num_ranks"] == 2
    assert [r["inputs"] for r in record["results"]] == ["sharded on the mesh", "on one device"]
    for r in record["results"]:
        assert set(r["ms_per_call"]) == set(call_cost.PROGRAMS)
        assert all(math.isfinite(ms) and ms > 0 for ms in r["ms_per_call"].values())


# ---- bench.versus_deepep (DeepEP beside jax_ep, R processes on one GPU)

SMALL = dict(tokens=8, hidden=256, num_experts=16, num_topk=4, steps=(1, 2))


def test_deepep_comparison_routes_every_library_alike():
    """Each rank's inputs depend on the seed and the rank only (both libraries' workers call
    rank_routing and rank_tokens): distinct experts, weights summing to 1; the rows each rank
    receives are those bench.ep's wire_rows counts on every rank's routing."""
    idx, w = versus_deepep.rank_routing(SMALL, 1, 0)
    again, _ = versus_deepep.rank_routing(SMALL, 1, 0)
    other, _ = versus_deepep.rank_routing(SMALL, 2, 0)
    np.testing.assert_array_equal(idx, again)
    assert not np.array_equal(idx, other)
    assert idx.shape == (8, 4) and idx.dtype == np.int32 and w.dtype == np.float32
    assert all(len(set(row)) == 4 for row in idx.tolist()) and idx.min() >= 0 and idx.max() < 16
    np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)
    assert versus_deepep.rank_tokens(SMALL, 1, 0).shape == (8, 256)
    for num_ranks in (2, 4):
        every = np.concatenate(
            [versus_deepep.rank_routing(SMALL, r, 3)[0] for r in range(num_ranks)]
        )
        np.testing.assert_array_equal(
            versus_deepep.received_rows(SMALL, num_ranks, 3),
            ep.wire_rows(every, num_ranks, 16).sum(axis=0),
        )


def test_deepep_comparison_counts_bytes_as_deepep_does():
    """Logical bytes: received rows (own included) x an FP8 row (H bytes + H/128 float32
    scales) for dispatches, a BF16 row (2H bytes) for combine; GB/s per rank, then the mean;
    an op some rank did not report is left out."""
    assert versus_deepep.op_row_bytes("dispatch", 7168) == 7168 + 56 * 4
    assert versus_deepep.op_row_bytes("cached_dispatch", 7168) == 7392
    assert versus_deepep.op_row_bytes("combine", 7168) == 2 * 7168
    reports = [
        [dict(op="dispatch", time_us=10.0, kernel_us=5.0), dict(op="combine", time_us=4.0)],
        [dict(op="dispatch", time_us=20.0, kernel_us=10.0)],
    ]
    (r,) = versus_deepep.summarize("deepep", 2, "v3", dict(SMALL), reports, np.array([100, 300]))
    assert r["op"] == "dispatch" and r["time_us"] == 15.0 and r["kernel_us"] == 7.5
    row = 256 + 8
    assert r["bytes_per_rank"] == [100 * row, 300 * row]
    assert r["logical_gbps"] == pytest.approx((100 * row / 10 + 300 * row / 20) / 2 / 1e3)
    assert r["kernel_gbps"] == pytest.approx(2 * r["logical_gbps"])
    assert versus_deepep.kernel_times(
        [
            dict(
                cat="kernel", name="void deep_ep::intranode::combine<bf16, 2>(int*, float)", dur=30
            ),
            dict(
                cat="kernel", name="void deep_ep::intranode::combine<bf16, 2>(int*, float)", dur=10
            ),
            dict(cat="cpu_op", name="aten::empty", dur=99),
        ],
        calls=2,
    ) == {"deep_ep::intranode::combine<bf16, 2>": 20.0}


def test_deepep_comparison_records_both_sides_and_goes_on_after_a_failure(
    tmp_path, monkeypatch, capsys
):
    """The whole command on CPUs at a tiny shape, without MPS: jax_ep's 2-process group times
    every op (JAX's CPU devices, one per process), DeepEP's fails (no deep_ep here) and the run
    records its error, writes the record and prints the table with both columns."""
    monkeypatch.setitem(ep.CONFIGS, "ll", dict(ep.CONFIGS["ll"], **SMALL))
    monkeypatch.setattr(versus_deepep, "private_mps", lambda: contextlib.nullcontext({}))
    monkeypatch.setitem(versus_deepep.WORKER_ENV, "JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "").split()  # one CPU device per worker process
    monkeypatch.setenv("XLA_FLAGS", " ".join(f for f in flags if "device_count" not in f))
    code = versus_deepep.main(
        ["--processes", "2", "--config", "ll", "--deepep", str(tmp_path / "none"), "--no-kernels"]
        + ["--machine", "test", "--out", str(tmp_path), "--group-timeout", "400"]
    )
    assert code == 1  # DeepEP's group failed
    (path,) = tmp_path.glob("versus-deepep-test-*.json")
    with open(path) as f:
        record = json.load(f)
    assert "--processes 2" in record["command"] and record["shapes"]["ll"]["tokens"] == 8
    ours, theirs = record["groups"]
    assert ours["library"] == "jax_ep" and ours["error"] is None, ours
    assert ours["exit_codes"] == [0, 0] and ours["received_rows_as_routed"]
    assert theirs["library"] == "deepep" and "deep_ep" in theirs["error"], theirs
    results = record["results"]
    assert [(r["library"], r["op"]) for r in results] == [
        ("jax_ep", op) for op in ("dispatch", "combine", "cached_dispatch")
    ]
    assert all(len(r["ranks"]) == 2 and r["kernel_us"] is None for r in results)
    table_lines = capsys.readouterr().out.split("deepep/jax_ep time")[-1].splitlines()
    assert [line.split()[:3] for line in table_lines[1:4]] == [
        ["ll", "2", op] for op in ("dispatch", "combine", "cached_dispatch")
    ]


def test_deepep_comparison_refuses_what_it_cannot_run():
    for argv in (["--config", "v4"], ["--libraries", "nccl"], ["--processes", "3"]):
        with pytest.raises(SystemExit):
            versus_deepep.main(argv)


def test_deepep_comparison_needs_mps(monkeypatch, tmp_path):
    """Without MPS the ranks' spin-waiting kernels cannot meet on one GPU: the run stops at
    once, saying why, before any group starts."""
    monkeypatch.setattr(process_group.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="nvidia-cuda-mps-control is not on the PATH"):
        versus_deepep.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_process_group_waits_kills_the_late_and_cuts_a_failed_group_short():
    """finish(): a process that exits with an error leaves its peers `grace` seconds (not the
    whole timeout); one still running then is killed (None)."""
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]),
    ]
    assert process_group.finish(procs, timeout=60, grace=1) == [None, 3]
    assert time.monotonic() - start < 20
    assert process_group.finish([subprocess.Popen([sys.executable, "-c", ""])], 60) == [0]

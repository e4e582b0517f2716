"""The lab's programs that docs/PERFORMANCE.md and bench/results/ cite, on CPU devices at tiny
shapes: lab/expert_padded.py and lab/expert_rows.py record every case; lab/versus_deepgemm.py's
reading of its CUDA program's output, from a stand-in program."""

import json

import pytest

from lab import expert_padded, expert_rows, versus_deepgemm


def test_expert_padded_records_every_row_count(tmp_path):
    """lab.expert_padded runs the call at each row count (on CPUs: no kernel times)."""
    argv = "--rows 16,40 --hidden 256 --experts-per-rank 8 --topk 4 --capacity 8 --steps 2"
    expert_padded.main(argv.split() + ["--machine", "test", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("expert-padded-test-*.json")
    record = json.loads(path.read_text())
    assert [r["rows"] for r in record["results"]] == [16, 40]
    assert [r["expert_rows"] for r in record["results"]] == [64, 160]
    assert record["command"].startswith("python -m lab.expert_padded --rows 16,40")


def test_expert_rows_records_every_case(tmp_path):
    """lab.expert_rows runs each gather and adjoint (on CPUs: no kernel times)."""
    argv = "--tokens 16 --hidden 256 --experts 8 --topk 4 --machine test --out".split()
    expert_rows.main(argv + [str(tmp_path)])
    (path,) = tmp_path.glob("expert-rows-test-*.json")
    record = json.loads(path.read_text())
    assert len(record["cases"]) == 6
    assert record["command"].startswith("python -m lab.expert_rows --tokens 16")


# Stands in for lab/cuda/versus_deepgemm.cu's program, with 5 DeepGEMM configurations ($5: those
# to run, else all): tgmm fails in jax_ep's own call; gmm_t's configuration 3 fails; gmm_fp8's 3
# hangs; tgmm_fp8's 1 and 2 hang (then the bench gives up DeepGEMM at that product and shape).
_FAKE_VERSUS_DEEPGEMM = """#!/bin/sh
d="relative L2 distance from jax_ep's"
echo "$1 K $2 N $3, 32768 rows in 32 $4 groups"
if [ $1 = tgmm ]; then echo "jax_ep (cutlass): CUDA error: illegal memory access"; exit 1; fi
echo "jax_ep (cutlass): 600.0 TFLOP/s (best 650.0)"
echo "deepgemm configurations: 5"
wanted=",${5:-0,1,2,3,4},"
run() { case $wanted in *,$1,*) return 0;; esac; return 1; }
run 0 && echo "deepgemm[0] 128x128: 700.0 TFLOP/s (best 720.0), $d 1.00e-03"
if run 1 && [ $1 = tgmm_fp8 ]; then printf "deepgemm[1] 128x256: "; exec sleep 30; fi
run 1 && echo "deepgemm[1] 128x256: 900.0 TFLOP/s (best 950.0), $d 5.00e-01"
if run 2 && [ $1 = tgmm_fp8 ]; then printf "deepgemm[2] 128x192: "; exec sleep 30; fi
run 2 && echo "deepgemm[2] 128x192: 950.0 TFLOP/s (best 990.0), $d nan"
if run 3 && [ $1 = gmm_t ]; then echo "deepgemm[3] 64x256: CUDA error at line 9"; exit 1; fi
if run 3 && [ $1 = gmm_fp8 ]; then printf "deepgemm[3] 64x256: "; exec sleep 30; fi
run 3 && echo "deepgemm[3] 64x256: 500.0 TFLOP/s (best 510.0), $d 1.00e-03"
run 4 && echo "deepgemm[4] 256x128: 650.0 TFLOP/s (best 660.0), $d 2.00e-03"
exit 0
"""


def test_versus_deepgemm_records_every_case_and_never_counts_a_wrong_kernel(tmp_path):
    """lab.versus_deepgemm: each product, shape and group sizing is a case; the fastest
    DeepGEMM kernel counted is the fastest whose output is near jax_ep's (not one 50% off, not
    one that gave NaN); a configuration that fails or hangs is recorded and the next ones still
    run, one that hung is not run again at that shape, and after two hangs none is; a program
    that fails in jax_ep's own call leaves its error in the case."""
    program = tmp_path / "versus_deepgemm"
    program.write_text(_FAKE_VERSUS_DEEPGEMM)
    program.chmod(0o755)
    argv = ["--program", str(program), "--timeout-s", "0.5", "--machine", "test"]
    versus_deepgemm.main(argv + ["--out", str(tmp_path)])
    (path,) = tmp_path.glob("versus-deepgemm-test-*.json")
    cases = json.loads(path.read_text())["cases"]
    assert [(c["product"], c["k"], c["groups"]) for c in cases] == [
        (p, k, g)
        for p in versus_deepgemm.PRODUCTS
        for k in (7168, 2048)
        for g in ("uniform", "zipf")
    ]
    everything = {"jax_ep (cutlass)": False, "deepgemm[0] 128x128": False}
    everything.update({"deepgemm[1] 128x256": True, "deepgemm[2] 128x192": True})
    everything.update({"deepgemm[3] 64x256": False, "deepgemm[4] 256x128": False})
    for case in cases:
        kernels = {k["kernel"]: k["wrong"] for k in case["kernels"]}
        failed = [(f["kernel"][:11], f["returncode"]) for f in case["failed"]]
        if case["product"] == "tgmm":
            assert case["returncode"] == 1 and case["jax_ep_tflops"] is None
            assert any("illegal memory access" in note for note in case["notes"])
            continue
        assert case["jax_ep_tflops"] == 600.0
        if case["product"] == "tgmm_fp8":  # gave up after two hangs
            first = case["groups"] == "uniform"
            assert failed == (
                [("deepgemm[1]", "timeout"), ("deepgemm[2]", "timeout")] if first else []
            )
            assert set(kernels) == (
                {"jax_ep (cutlass)", "deepgemm[0] 128x128"} if first else {"jax_ep (cutlass)"}
            )
            continue
        assert case["deepgemm_best"] == "deepgemm[0] 128x128"
        assert case["deepgemm_over_jax_ep"] == pytest.approx(700 / 600)
        without_3 = {name: wrong for name, wrong in everything.items() if "[3]" not in name}
        hung_here = case["product"] == "gmm_fp8" and case["groups"] == "uniform"
        assert (
            failed
            == {
                "gmm": [],
                "gmm_t": [("deepgemm[3]", 1)],
                "gmm_fp8": [("deepgemm[3]", "timeout")] if hung_here else [],
            }[case["product"]]
        )
        assert kernels == (everything if case["product"] == "gmm" else without_3)

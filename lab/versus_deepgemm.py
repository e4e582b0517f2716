"""jax_ep's grouped matmuls against DeepGEMM's SM90 kernels: runs lab/cuda/versus_deepgemm.cu's
program (built beforehand, its header gives the build line) at each product, EP8's per-rank V3
shapes and group sizing, and records every kernel's rate and how far its output is from jax_ep's.
tgmm_fp8 is DeepGEMM's FP8 weight gradient, which jax_ep does not have: it is set against
jax_ep's bf16 tgmm, the product it would replace, on the same values.

    python -m lab.versus_deepgemm --program build/versus_deepgemm   # ~2 minutes on one H200

A DeepGEMM configuration whose output is further than --max-distance from jax_ep's is recorded as
wrong and never counted as the best; one that fails or hangs is recorded as failed, and a new run
of the program goes on from the next."""

from __future__ import annotations

import argparse
import re
import subprocess

from bench.harness import common_arguments, new_record, save_record

PRODUCTS = ("gmm", "gmm_t", "tgmm", "gmm_fp8", "tgmm_fp8")
SHAPES = ((7168, 2048), (2048, 7168))  # (K, N): gate/up and down
GROUPS = ("uniform", "zipf")
OURS = "jax_ep (cutlass)"
_RESULT = re.compile(
    r"^(?P<rate>[\d.]+) TFLOP/s \(best (?P<best>[\d.]+)\)"
    r"(?:, relative L2 distance from jax_ep's (?P<distance>[\w.+-]+))?$"
)
_KERNEL = re.compile(
    r"^(?P<kernel>jax_ep \(cutlass\)|deepgemm\[(?P<index>\d+)\][^:]*):\s*(?P<rest>.*)$"
)
_COUNT = re.compile(r"^deepgemm configurations: (?P<count>\d+)$")
HANGS_BEFORE_GIVING_UP = 2  # per product and shape: a hang costs the whole timeout


def parse(output, max_distance):
    """One run of the program: its kernels [{kernel, tflops, best_tflops, distance, wrong}] in the
    order printed, the kernel it started and did not finish (its line has no rate: it failed or
    hung), or None, the number of DeepGEMM configurations it has (None if not printed), and the
    other lines (the program's notes, errors)."""
    kernels, unfinished, count, notes = [], None, None, []
    for line in output.splitlines():
        named = _KERNEL.match(line.strip())
        result = named and _RESULT.match(named["rest"])
        if not result:
            if named:
                unfinished = dict(kernel=named["kernel"], index=named["index"], error=named["rest"])
            elif counted := _COUNT.match(line.strip()):
                count = int(counted["count"])
            notes.append(line)
            continue
        distance = result["distance"] and float(result["distance"])
        kernels.append(
            dict(
                kernel=named["kernel"],
                tflops=float(result["rate"]),
                best_tflops=float(result["best"]),
                distance=distance,
                wrong=distance is not None and not distance <= max_distance,
            )
        )
    return kernels, unfinished, count, notes


def summarize(kernels):
    """jax_ep's rate, the fastest right DeepGEMM kernel, and its rate over jax_ep's."""
    ours = next((k for k in kernels if k["kernel"] == OURS), None)
    right = [k for k in kernels if k["kernel"] != OURS and not k["wrong"]]
    best = max(right, key=lambda k: k["tflops"], default=None)
    ratio = best["tflops"] / ours["tflops"] if best and ours else None
    return dict(
        jax_ep_tflops=ours and ours["tflops"],
        deepgemm_best=best and best["kernel"],
        deepgemm_tflops=best and best["tflops"],
        deepgemm_over_jax_ep=ratio,
    )


def run_case(program, product, k, n, groups, max_distance, timeout_s, family):
    """Every kernel of one case. After a DeepGEMM configuration fails or hangs (recorded in
    `failed`), a new run goes on from the next one. `family`: what this product and shape's
    earlier cases learned, the number of configurations and those that hung, which are not run
    again (a hang costs the whole timeout); after HANGS_BEFORE_GIVING_UP of them, none are."""
    kernels, failed, notes, after, first_run = [], [], [], -1, True
    hung = family["hung"]
    while True:
        if len(hung) >= HANGS_BEFORE_GIVING_UP:
            wanted = []
        elif family["count"] is None:
            wanted = None  # all: their number is not known yet
        else:
            wanted = [i for i in range(after + 1, family["count"]) if i not in hung]
        if wanted == [] and not first_run:
            break
        first_run = False
        command = [program, product, str(k), str(n), groups]
        if wanted is not None:  # [-1]: none, jax_ep's kernel alone
            command.append(",".join(map(str, wanted or [-1])))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            output, returncode = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            output, returncode = _text(e.stdout) + _text(e.stderr), "timeout"
        got, unfinished, printed_count, lines = parse(output, max_distance)
        if printed_count is not None:
            family["count"] = printed_count
        kernels += [g for g in got if g["kernel"] != OURS or not kernels]
        notes += lines
        if returncode == 0 or unfinished is None or unfinished["index"] is None:
            break
        if int(unfinished["index"]) <= after:  # it ran what it was not asked to: no progress
            notes.append(f"stopped: configuration {unfinished['index']} ran again")
            break
        failed.append(dict(unfinished, returncode=returncode))
        after = int(unfinished["index"])
        if returncode == "timeout":
            hung.add(after)
    if len(hung) >= HANGS_BEFORE_GIVING_UP:
        notes.append(f"gave up DeepGEMM here: configurations {sorted(hung)} hung")
    case = dict(product=product, k=k, n=n, groups=groups, returncode=returncode)
    return dict(case, **summarize(kernels), kernels=kernels, failed=failed, notes=notes)


def _text(out):
    return out.decode() if isinstance(out, bytes) else out or ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, "grouped_matmul")
    parser.add_argument("--program", default="build/versus_deepgemm")
    parser.add_argument("--products", default=",".join(PRODUCTS))
    parser.add_argument("--max-distance", type=float, default=1e-2)
    parser.add_argument("--timeout-s", type=float, default=20)
    parser.add_argument(
        "--deepgemm-version", default="unknown", help="the DeepGEMM commit the program was built on"
    )
    args = parser.parse_args(argv)
    cases = []
    for product in args.products.split(","):
        for k, n in SHAPES:
            family = dict(count=None, hung=set())
            for groups in GROUPS:
                case = run_case(
                    args.program, product, k, n, groups, args.max_distance, args.timeout_s, family
                )
                cases.append(case)
                print(_row(case), flush=True)
    record = new_record(
        args,
        "lab.versus_deepgemm",
        argv,
        deepgemm=args.deepgemm_version,
        rows=32768,
        experts=32,
        cases=cases,
    )
    print(save_record(record, args.out, "versus-deepgemm") + ".json")


def _row(case):
    head = f"{case['product']:8s} K {case['k']:5d} N {case['n']:5d} {case['groups']:8s}"
    if case["jax_ep_tflops"] is None:
        return f"{head} no result (exit {case['returncode']}): {' | '.join(case['notes'][-3:])}"
    line = f"{head} jax_ep {case['jax_ep_tflops']:7.1f}"
    if case["deepgemm_tflops"] is not None:
        line += (
            f"  deepgemm {case['deepgemm_tflops']:7.1f} ({case['deepgemm_over_jax_ep']:.2f}x,"
            f" {case['deepgemm_best']})"
        )
    wrong = [k["kernel"] for k in case["kernels"] if k["wrong"]]
    failed = [f"{f['kernel']} ({f['error'] or f['returncode']})" for f in case["failed"]]
    line += f"  WRONG: {', '.join(wrong)}" if wrong else ""
    return line + (f"  FAILED: {', '.join(failed)}" if failed else "")


if __name__ == "__main__":
    main()

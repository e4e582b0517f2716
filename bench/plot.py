"""Time per op against tokens per rank, one line per implementation, from results JSON files.

python -m bench.plot bench/results/ops/v3-*.json -o bench/results/ops/v3.png
"""

from __future__ import annotations

import argparse
import json


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = records[0]
    ops = ("dispatch", "combine")
    fig, axes = plt.subplots(1, len(ops), figsize=(11, 4.2))
    for ax, op in zip(axes, ops):
        lines = {}
        for record in records:
            for r in record["results"]:
                if r["op"] == op:
                    lines.setdefault(r["impl"], []).append((r["tokens_per_rank"], r["time_us"]))
        for impl, points in sorted(lines.items()):
            ax.plot(*zip(*sorted(points)), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("time per op (us)")
        dtype = (
            "FP8"
            if op == "dispatch" and any(r.get("dtype") == "fp8" for r in first["results"])
            else "BF16"
        )
        ax.set_title(f"{op} ({dtype}), {first['num_ranks']} x {first.get('device', '')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{first['config']} config: H={first['hidden']}, {first['num_experts']} experts, "
        f"top-{first['num_topk']}, {first['machine']}, {first['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args()
    records = []
    for name in args.results:
        with open(name) as f:
            records.append(json.load(f))
    plot(records, args.out)


if __name__ == "__main__":
    main()

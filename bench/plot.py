"""Time per op against tokens per rank, one line per implementation, from a results JSON."""
from __future__ import annotations

import json
import sys


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ("dispatch", "combine")
    fig, axes = plt.subplots(1, len(ops), figsize=(11, 4.2))
    for ax, op in zip(axes, ops):
        impls = sorted({r["impl"] for r in record["results"] if r["op"] == op})
        for impl in impls:
            points = sorted((r["tokens_per_rank"], r["time_us"]) for r in record["results"]
                            if r["op"] == op and r["impl"] == impl)
            ax.plot(*zip(*points), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("time per op (us)")
        ax.set_title(f"{op}, {record['num_ranks']} x {record.get('device', '')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"jax_ep {record['config']} config, H={record['hidden']}, "
                 f"{record['num_experts']} experts, top-{record['num_topk']} ({record['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[1].replace(".json", ".png"))

"""How many SMs does a peer transfer need? Raw GPU0 -> GPU1 bandwidth of each mechanism from
a given number of SMs, and jax_ep's V3 dispatch/combine against num_sms.

    python -m bench.probe [--blocks 8,16,24,32,48,64,132] [--mib 29.4,256] [--modes 1,6,7] [--no-ep]

The transfers are the CUDA extension bench._probe (bench/cuda/), no part of jax_ep. Build it once
on the GPU machine, from the repository's root (it lands next to this file; needs nvcc, nanobind
and jax):

    cmake -S . -B build/probe -DJAX_EP_PROBES=ON -DPython_EXECUTABLE=$(which python3)
    cmake --build build/probe --target _probe -j

(or bench/run_gpu.sh probe, which builds it first).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.ep import CONFIGS, bench_size

try:
    from bench import _probe
except ImportError:  # not built (see above)
    _probe = None

MODES = {
    -1: "copy engine",
    0: "push bulk-copy",
    1: "push st.v4",
    2: "pull bulk-copy",
    3: "pull ld.v4",
    4: "push + local",
    5: "push rows",
    6: "send rows",
    7: "send rows peer",
    8: "staged 4 CE",
    9: "staged 8 CE",
    10: "combine rows",
    11: "quantise local",
    12: "lean local",
    13: "lean peer",
}
# 4: st.v4 to the peer amid a send's local traffic; 5: st.v4 a warp per 7168-byte row;
# 6: the dispatch's own row path (BF16 rows quantised to FP8, to a local and the peer's row);
# 7: the same, to the peer's row only; 8, 9: the same rows quantised into local staging in 4 or 8
# chunks, each chunk moved to the peer by the copy engine while the next is quantised; 10: the
# combine's row path (a BF16 row of the peer's and a local one summed into a local row), a pull;
# 11: mode 6 into local rows only (the quantisation's own rate); 12, 13: a row path specialised
# to V3 rows (all loads of half a row in flight), into local rows or the peer's


def main():
    if _probe is None:
        raise SystemExit(
            "bench.probe needs the extension bench._probe: build it with "
            "bench/run_gpu.sh probe, or the cmake commands atop bench/probe.py"
        )
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", default="8,16,24,32,48,64,132")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--mib", default="256", help="transfer sizes, MiB, comma-separated")
    parser.add_argument("--modes", default=",".join(map(str, MODES)))
    parser.add_argument("--no-ep", action="store_true", help="only the raw transfers")
    args = parser.parse_args()

    blocks = [int(b) for b in args.blocks.split(",")]
    modes = [int(m) for m in args.modes.split(",")]
    for mib in (float(m) for m in args.mib.split(",")):
        size = int(mib * (1 << 20)) // 7168 * 7168  # whole rows for modes 5-7
        for both in (False, True):
            print(
                f"\nGB/s per direction, {size / 1e6:.1f} MB, "
                f"{'both directions at once' if both else 'GPU0 -> GPU1'}; columns: SMs (blocks)"
            )
            print(f"{'':16s}" + "".join(f"{b:>8d}" for b in blocks))
            for mode in modes:
                row = [
                    _probe.peer_gbps(0, 1, size, b, mode, max(10, int(2e9 // size)), both)
                    for b in blocks
                ]
                print(f"{MODES[mode]:16s}" + "".join(f"{g:8.1f}" for g in row), flush=True)
    if args.no_ep:
        return

    # The same stores into memory XLA allocated (where the dispatch writes), one way.
    size = 256 << 20
    dst = jax.device_put(jnp.zeros((size,), jnp.uint8), jax.devices()[1]).block_until_ready()
    print(f"\n{'into XLA memory':16s}" + "".join(f"{b:>8d}" for b in blocks))
    for mode in (1, 5):
        row = [
            _probe.peer_gbps(0, 1, size, b, mode, 10, False, dst.unsafe_buffer_pointer())
            for b in blocks
        ]
        print(f"{MODES[mode]:16s}" + "".join(f"{g:8.1f}" for g in row), flush=True)
    del dst

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    print(f"\njax_ep V3, {args.tokens} tokens/rank: time us (physical GB/s)")
    for fp8 in (True, False):
        for b in blocks:
            res = bench_size(
                mesh,
                CONFIGS["v3"],
                args.tokens,
                ("jax_ep",),
                b,
                fp8,
                np.random.default_rng(0),
                check=False,
            )
            print(
                f"  num_sms {b:4d} {'fp8 ' if fp8 else 'bf16'} "
                + "  ".join(
                    f"{r['op']} {r['time_us']:7.1f} ({r['physical_gbps']:5.1f})" for r in res
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()

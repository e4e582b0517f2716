"""A small MoE step on whatever devices JAX sees: dispatch, grouped expert matmuls, combine.

    python -m jax_ep.demo            # 8 CPU devices when there is no accelerator

Runs the custom-call path and the jax.lax reference path on the same tokens, checks they agree
and prints the time of each step.
"""
from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.nn.grouped import grouped_matmul, resolve_impl  # noqa: E402


def main():
    devices = jax.devices()
    gpu = devices[0].platform == "gpu"
    ranks = len(devices)
    tokens, hidden, topk = (4096, 7168, 8) if gpu else (128, 256, 4)
    experts = 256 if gpu else 8 * ranks
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    print(f"{ranks} x {devices[0].device_kind}: {tokens} tokens/rank, hidden {hidden}, "
          f"{experts} experts, top-{topk}, FP8 dispatch {gpu}")

    rng = np.random.default_rng(0)
    shard = NamedSharding(mesh, P("ep"))
    x = jax.device_put(jnp.asarray(rng.standard_normal((ranks * tokens, hidden)), jnp.bfloat16),
                       shard)
    scores = rng.random((ranks * tokens, experts))
    idx = jax.device_put(jnp.asarray(np.argsort(-scores, 1)[:, :topk], jnp.int32), shard)
    w = jax.device_put(jnp.asarray(rng.random((ranks * tokens, topk)), jnp.float32), shard)
    expert_w = jax.device_put(
        jnp.asarray(rng.standard_normal((experts, hidden, 256)) / np.sqrt(hidden), jnp.bfloat16),
        shard)
    expert_v = jax.device_put(
        jnp.asarray(rng.standard_normal((experts, 256, hidden)) / 16, jnp.bfloat16), shard)

    outputs = {}
    for impl in ("ffi", "reference"):
        buf = jax_ep.Buffer(mesh, "ep", num_experts=experts, hidden=hidden, num_topk=topk,
                            max_tokens_per_rank=tokens, impl=impl)

        def step(x, idx, w, ew, ev, buf=buf):
            alignment = 128 if gpu else 8
            d = buf.dispatch(x, idx, w, layout="expert", expert_alignment=alignment, fp8=gpu)
            rows = jax_ep.dequantize_fp8(d.x, d.scales).astype(x.dtype) if gpu else d.x
            path = resolve_impl("auto", rows.shape, ew.shape, rows.dtype)
            print(f"  {impl:9s} grouped matmuls: {path}")  # when traced
            matmul = lambda a, b: grouped_matmul(a, b, d.group_sizes, group_alignment=alignment)
            h = jax.nn.gelu(matmul(rows, ew))
            out = matmul(h.astype(x.dtype), ev)
            return buf.combine(out.astype(x.dtype), d.handle, topk_weights=d.topk_weights)

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        args = (x, idx, w, expert_w, expert_v)
        outputs[impl] = jax.block_until_ready(fn(*args))  # compile
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            runs.append(time.perf_counter() - start)
        print(f"  {impl:9s} MoE step (dispatch + experts + combine): "
              f"{1e3 * min(runs):8.2f} ms (best of 5)")
    a, b = (np.asarray(outputs[k], np.float64) for k in ("ffi", "reference"))
    diff = 1 - 2 * (a * b).sum() / max((a * a + b * b).sum(), 1e-30)
    print(f"  ffi vs reference: calc_diff {diff:.2e} ({'OK' if diff < 1e-4 else 'MISMATCH'})")


if __name__ == "__main__":
    main()

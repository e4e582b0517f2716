"""The dropless MoE layer (MoEConfig(capacity_factor=..., dropless=True)) against the layer with
the worst case's capacity, on routings from uniform to one hot expert: the rounds taken, the rows
of each round on the most loaded rank, the expert buffer (memory_plan) and the time of a train
step (forward and backward, jitted) on 8 CPU devices.

    python -m lab.dropless [--tokens 256 --hidden 256 --experts 32 --topk 4 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import time

ROUTINGS = ("uniform", "zipf", "hot")


def routed_inputs(kind, rng, params, num_tokens, num_experts, num_topk):
    """(params with a new router, x [num_tokens, H]) whose tokens pick their top-k as `kind`
    says: "uniform" (any K experts alike), "zipf" (expert e with weight (e + 1) ** -1.1, drawn
    without replacement), "hot" (expert 0 and K - 1 uniform others). x's first E channels are
    the router's logits (the router is the identity there and small elsewhere), the chosen
    experts' well above the others', in slot order."""
    import jax.numpy as jnp
    import numpy as np

    hidden = params["router"].shape[0]
    if kind == "zipf":
        weights = np.arange(1, num_experts + 1) ** -1.1
    else:
        weights = np.ones(num_experts)
    logits = rng.uniform(-3.0, 0.0, (num_tokens, num_experts))
    for t in range(num_tokens):
        if kind == "hot":
            others = rng.choice(np.arange(1, num_experts), num_topk - 1, replace=False)
            chosen = np.concatenate([[0], others])
        else:
            chosen = rng.choice(num_experts, num_topk, replace=False, p=weights / weights.sum())
        logits[t, chosen] = 6.0 - 0.5 * np.arange(num_topk)
    x = rng.standard_normal((num_tokens, hidden))
    x[:, :num_experts] = logits
    router = 0.01 * rng.standard_normal((hidden, num_experts))
    router[:num_experts] = np.eye(num_experts)
    dtype = params["router"].dtype
    return dict(params, router=jnp.asarray(router, dtype)), jnp.asarray(x, dtype)


def rounds_of(topk_idx, num_ranks, capacity, alignment):
    """The rows of each round on the most loaded rank, from the routing ([R * T, K]): the rows of
    each receiving rank's expert layout without a capacity, cut every `capacity` places."""
    import numpy as np

    tokens, experts = topk_idx.shape[0], int(topk_idx.max()) + 1
    has = np.zeros((tokens, experts), bool)
    has[np.arange(tokens)[:, None], topk_idx] = True
    counts = has.sum(axis=0)
    counts = np.pad(counts, (0, -experts % num_ranks)).reshape(num_ranks, -1)
    blocks = -(-counts // alignment) * alignment
    hottest = blocks.sum(axis=1).max()
    return [min(capacity, hottest - r * capacity) for r in range(-(-hottest // capacity))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--factors", default="1.25,1.5")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.ranks}")
    import jax
    import numpy as np

    import jax_ep
    from jax_ep import nn
    from jax_ep.nn.routing import route

    mesh = jax.make_mesh((args.ranks,), ("ep",))
    shape = dict(
        num_experts=args.experts, num_topk=args.topk, hidden=args.hidden, ffn_hidden=args.ffn
    )
    plan = dict(
        num_experts=args.experts,
        hidden=args.hidden,
        num_topk=args.topk,
        max_tokens_per_rank=args.tokens,
    )
    layers = {"worst case": (nn.MoEConfig(**shape), {})}
    for f in map(float, args.factors.split(",")):
        modes = dict(capacity_factor=f, dropless=True)
        layers[f"dropless {f}"] = nn.MoEConfig(**shape, **modes), modes
    print(f"{args.ranks} CPU devices, {args.tokens} tokens per rank, {shape}")
    print(
        "| routing | layer | rounds | rows per round (most loaded rank) | expert buffer (KiB) "
        "| train step (ms) |"
    )
    print("|---|---|---:|---|---:|---:|")
    for kind in ROUTINGS:
        base = nn.init_params(jax.random.key(0), layers["worst case"][0])
        rng = np.random.default_rng(0)
        params, x = routed_inputs(
            kind, rng, base, args.ranks * args.tokens, args.experts, args.topk
        )
        for name, (cfg, modes) in layers.items():
            layer = nn.MoELayer(cfg, mesh, expert_axis="ep", tokens_per_rank=args.tokens)
            topk_idx = np.asarray(route(x, params["router"], cfg)[0])
            capacity = nn.expert_capacity(cfg, args.tokens, args.ranks)
            rows = rounds_of(topk_idx, args.ranks, capacity, 1) if capacity else ["all"]
            step = jax.jit(
                jax.value_and_grad(lambda p, x, layer=layer: layer(p, x)[0].sum(), (0, 1))
            )
            jax.block_until_ready(step(params, x))
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(step(params, x))
                times.append(time.perf_counter() - start)
            _, aux = layer(params, x)
            assert int(aux.num_dropped) == 0, (kind, name, aux.num_dropped)
            buffer = jax_ep.memory_plan((args.ranks,), **plan, **modes)["expert_buffer"]
            print(
                f"| {kind} | {name} | {len(rows) if capacity else 1} | "
                f"{', '.join(map(str, rows))} | {buffer / 1024:.0f} | "
                f"{1e3 * np.median(times):.1f} |"
            )
            layer.buffer.close()


if __name__ == "__main__":
    main()

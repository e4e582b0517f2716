"""Train a small MoE transformer with expert parallelism: a jitted optax step on every device.

    python examples/train_moe.py [--steps 200] [--impl ffi|reference]

Runs on the devices JAX sees (8 CPU devices when there is no accelerator), on a mesh
("dp", "ep"): sequences are split over both axes, the experts over "ep". On GPUs the MoE layers
compute in bfloat16 at widths of 128, so that Hopper GPUs take their grouped-matmul kernels. The
task is a fixed random next-token permutation, so the loss falls from log(vocab) towards zero.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from jax_ep import nn  # noqa: E402

GPU = jax.devices()[0].platform == "gpu"
VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 32, 128 if GPU else 64, 4, 2
MOE_DTYPE = jnp.bfloat16 if GPU else jnp.float32


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(p, x):
    b, s, d = x.shape
    q, k, v = (
        jnp.einsum("bsd,de->bse", x, p[n]).reshape(b, s, HEADS, d // HEADS)
        for n in ("wq", "wk", "wv")
    )
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(b, s, d) @ p["wo"]


def init(key, cfg):
    keys = jax.random.split(key, 2 + LAYERS)
    params = dict(
        embed=jax.random.normal(keys[0], (VOCAB, DIM)) * 0.1, final_norm=jnp.ones(DIM), layers=[]
    )
    for layer in range(LAYERS):
        k = jax.random.split(keys[2 + layer], 5)
        attn = {
            n: jax.random.normal(kk, (DIM, DIM)) / np.sqrt(DIM)
            for n, kk in zip(("wq", "wk", "wv", "wo"), k[:4])
        }
        params["layers"].append(
            dict(attn=attn, norm1=jnp.ones(DIM), norm2=jnp.ones(DIM), moe=nn.init_params(k[4], cfg))
        )
    return params


def forward(params, tokens, moe):
    x = params["embed"][tokens]
    aux = 0.0
    for p in params["layers"]:
        x = x + attention(p["attn"], rms_norm(x, p["norm1"]))
        y, layer_aux = moe(p["moe"], rms_norm(x, p["norm2"]).astype(MOE_DTYPE))
        x, aux = x + y.astype(x.dtype), aux + layer_aux.loss
    return rms_norm(x, params["final_norm"]) @ params["embed"].T, aux


def train(steps=200, impl="auto", batch_per_device=2, log_every=20, seed=0):
    devices = np.array(jax.devices())
    dp = 2 if len(devices) % 2 == 0 and len(devices) >= 4 else 1
    mesh = jax.sharding.Mesh(devices.reshape(dp, -1), ("dp", "ep"))
    batch = batch_per_device * mesh.size
    cfg = nn.MoEConfig(
        num_experts=4 * mesh.shape["ep"],
        num_topk=2,
        hidden=DIM,
        ffn_hidden=DIM,
        shared_ffn_hidden=64,
        expert_alignment=128 if GPU else 1,
    )
    moe = nn.MoELayer(
        cfg,
        mesh,
        data_axis="dp",
        expert_axis="ep",
        tokens_per_rank=batch_per_device * SEQ,
        impl=impl,
    )
    print(f"grouped matmuls: {moe.grouped_matmul_path(MOE_DTYPE)}")

    def sharding_of(path, _):
        expert = any(getattr(k, "key", None) in nn.EXPERT_WEIGHTS for k in path)
        return NamedSharding(mesh, P("ep") if expert else P())

    params = init(jax.random.key(seed), cfg)
    params = jax.device_put(params, jax.tree_util.tree_map_with_path(sharding_of, params))
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)
    rule = jax.random.permutation(jax.random.key(seed + 1), VOCAB)  # next token of each token

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(params):
            logits, aux = forward(params, tokens[:, :-1], moe)
            targets = tokens[:, 1:]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
            return ce + 0.01 * aux, ce

        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    data = NamedSharding(mesh, P(("dp", "ep")))
    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        start = rng.integers(0, VOCAB, batch)
        seq = [start]
        for _ in range(SEQ):
            seq.append(np.asarray(rule)[seq[-1]])
        tokens = jax.device_put(jnp.asarray(np.stack(seq, axis=1), jnp.int32), data)
        params, opt_state, ce = step(params, opt_state, tokens)
        losses.append(float(ce))
        if i % log_every == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--impl", default="auto", choices=("auto", "ffi", "reference"))
    args = parser.parse_args()
    print(f"devices: {jax.devices()}")
    losses = train(args.steps, args.impl)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()

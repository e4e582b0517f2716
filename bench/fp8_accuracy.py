"""How far the MoE layer's FP8 modes move its output and gradients, next to the bf16 layer:
each variant's y and its gradients against the float32 layer's on the same weights and tokens.

    python -m bench.fp8_accuracy [--tokens 64 --hidden 7168 --ffn 2048 --experts 4 --topk 2]

Variants (jax_ep.nn.MoEConfig): bf16 (no FP8); fp8 (FP8 dispatch, rows dequantized before the
bf16 matmuls); fp8_experts (the gate and up projections multiply the FP8 rows, weights in
128 x 128 blocks); fp8_down (the down projection too, its input quantized per row); fp8_dgrad
(the FP8 projections' row gradients FP8 products too). The weights and tokens are bf16 values
in every variant, the float32 layer computes on the same values, and the router reads the bf16
tokens: only the layer's rounding differs. The relative error is |a - b| / |b| (Frobenius) of
y, and of the loss sum(y * cotangent)'s gradient with respect to x, the router, w_gate, w_up
and w_down. Inputs: "normal" tokens, and "outliers" (tokens with 8 of the hidden channels 30x
larger, as the activations of large language models have).

The figures are the rounding of jax_ep's FP8 rule (jax_ep/fp8.py: e4m3, a float32 scale per
1 x 128 block of a row, per 128 x 128 block of a weight) and of bf16: every backend sums the
FP8 products in float32, so the CPU gives the GPU's figures up to the order of summation. The
products have DeepSeek-V3's depth (hidden, ffn) by default; the counts of experts and tokens
are kept small enough for a CPU (XLA:CPU multiplies every row by every expert's weights).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import common_arguments, new_record, relative_error, save_record
from jax_ep import nn

VARIANTS = {
    "bf16": {},
    "fp8": dict(fp8=True),
    "fp8_experts": dict(fp8=True, fp8_experts=True),
    "fp8_down": dict(fp8=True, fp8_experts=True, fp8_down=True),
    "fp8_dgrad": dict(fp8=True, fp8_experts=True, fp8_down=True, fp8_dgrad=True),
}
GRADIENTS = ("x", "router", "w_gate", "w_up", "w_down")
INPUTS = ("normal", "outliers")
OUTLIER_CHANNELS, OUTLIER_SCALE = 8, 30.0


def tokens(kind, shape):
    """bf16 tokens: standard normal, or with OUTLIER_CHANNELS channels OUTLIER_SCALE x larger."""
    x = jax.random.normal(jax.random.key(1), shape)
    if kind == "outliers":
        channels = jax.random.choice(jax.random.key(3), shape[1], (OUTLIER_CHANNELS,), False)
        x = x.at[:, channels].multiply(OUTLIER_SCALE)
    return x.astype(jnp.bfloat16)


def layer_results(cfg, params, x, cotangent):
    """(y, {name: gradient}) of the layer on one device, in float32."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("ep",))
    layer = nn.MoELayer(cfg, mesh, expert_axis="ep", tokens_per_rank=x.shape[0])

    def loss(params, x):
        y, _ = layer(params, x)
        return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), (d_params, d_x) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
    grads = dict(x=d_x, **{name: d_params[name] for name in GRADIENTS[1:]})
    return np.asarray(y, np.float32), {k: np.asarray(g, np.float32) for k, g in grads.items()}


def errors(got, want):
    """{"y": ..., name: ...} relative errors of one layer's results against another's."""
    (y, grads), (y_want, grads_want) = got, want
    return dict(
        y=relative_error(y, y_want),
        **{name: relative_error(grads[name], grads_want[name]) for name in GRADIENTS},
    )


def table(record):
    columns = ("y",) + GRADIENTS
    lines = []
    for kind in record["inputs"]:
        lines += [
            f"\n{kind} tokens: relative error against the float32 layer (and against bf16)",
            "| variant | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for variant, result in record["results"][kind].items():
            cells = []
            for c in columns:
                cell = f"{100 * result['vs_float32'][c]:.2f}%"
                if variant != "bf16" and "vs_bf16" in result:
                    cell += f" ({100 * result['vs_bf16'][c]:.2f}%)"
                cells.append(cell)
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--inputs", default=",".join(INPUTS))
    common_arguments(parser, "accuracy")
    args = parser.parse_args(argv)
    base = nn.MoEConfig(
        num_experts=args.experts,
        num_topk=args.topk,
        hidden=args.hidden,
        ffn_hidden=args.ffn,
        expert_alignment=1,
    )
    params = nn.init_params(jax.random.key(0), base, jnp.bfloat16)
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    cotangent = jax.random.normal(jax.random.key(2), (args.tokens, args.hidden))
    variants = args.variants.split(",")
    record = new_record(
        args,
        "bench.fp8_accuracy",
        argv,
        platform=jax.devices()[0].platform,
        shape=dict(
            tokens=args.tokens,
            hidden=args.hidden,
            ffn=args.ffn,
            experts=args.experts,
            topk=args.topk,
        ),
        inputs=args.inputs.split(","),
        results={},
    )
    for kind in record["inputs"]:
        x = tokens(kind, (args.tokens, args.hidden))
        want = layer_results(base, params32, x.astype(jnp.float32), cotangent)
        found = {
            v: layer_results(dataclasses.replace(base, **VARIANTS[v]), params, x, cotangent)
            for v in variants
        }
        record["results"][kind] = {
            v: dict(
                vs_float32=errors(found[v], want),
                **({} if "bf16" not in found else dict(vs_bf16=errors(found[v], found["bf16"]))),
            )
            for v in variants
        }
        print(table(dict(record, inputs=[kind])), flush=True)
    print("saved", save_record(record, args.out, "fp8-accuracy") + ".json")
    return record


if __name__ == "__main__":
    main()

"""jax_ep.memory_plan: the bytes a Buffer and its ops take, against what a Buffer allocates and
what XLA compiles (8 CPU devices), and by arithmetic at 32 and 64 ranks and the V3 shape."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import nn
from jax_ep.layout import align_up
from jax_ep.memory import default_capacity, dropless_rounds

T, H, E, K = 16, 256, 16, 4
V3 = dict(hidden=7168, num_topk=8, max_tokens_per_rank=4096)
GIB = 2**30


def plan(sizes, **modes):
    return jax_ep.memory_plan(
        sizes, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, **modes
    )


def mesh_of(sizes):
    names = ("ep",) if len(sizes) == 1 else ("node", "ep")
    devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
    return jax.sharding.Mesh(devices, names), names if len(names) > 1 else names[0]


# XLA's outputs are d.x, d.scales and y, the plan's to the byte but for a few words of XLA's
# own (the ordering token). Its temporaries are the plan's other XLA parts where XLA reuses
# some of their memory for others, and on CPUs also float32 copies of the bf16 rows it
# scatters (XLA:CPU scatters in float32) and the ids and weights of each row (2 K words):
# within [0.25, 1.25] x the parts' sum on jax 0.10.2, up to 1.72 x on 0.12.1 (its XLA:CPU keeps
# ~390 KB of temporaries for each of these programs, whatever their parts).
OUTPUT_SLACK, TEMP_RANGE = 64, (0.25, 2.0)

CASES = [  # axis sizes, layout, fp8, max_row_dtype
    ((8,), "rank", False, jnp.float32),
    ((8,), "rank", True, jnp.bfloat16),
    ((8,), "expert", False, jnp.bfloat16),
    ((8,), "expert", True, jnp.float32),
    ((8,), "expert_padded", False, jnp.float32),
    ((8,), "expert_padded", True, jnp.bfloat16),
    ((2, 4), "rank", False, jnp.bfloat16),
    ((2, 4), "expert", True, jnp.float32),
]


@pytest.mark.parametrize("sizes,layout,fp8,max_row_dtype", CASES)
def test_plan_is_what_the_buffer_and_xla_allocate(sizes, layout, fp8, max_row_dtype):
    mesh, axis = mesh_of(sizes)
    buf = jax_ep.Buffer(
        mesh,
        axis,
        num_experts=E,
        hidden=H,
        num_topk=K,
        max_tokens_per_rank=T,
        impl="ffi",
        max_row_dtype=max_row_dtype,
    )
    want = plan(sizes, layout=layout, fp8=fp8, max_row_dtype=max_row_dtype, x_dtype=jnp.bfloat16)
    assert buf.memory_bytes == want["window"] > want["window_control"] > 0
    weighted = layout != "rank"

    def step(x, topk_idx, topk_weights):
        d = buf.dispatch(x, topk_idx, topk_weights if weighted else None, layout=layout, fp8=fp8)
        rows = buf.dequantize(d, x) if fp8 else d.x
        expert_out = rows * 2  # the experts' output: an array of its own, as in a layer
        y = buf.combine(expert_out, d.handle, d.topk_weights if weighted else None)
        return d.x, d.scales, y

    spec = P(mesh.axis_names)
    program = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
    tokens = mesh.size * T
    memory = (
        program.lower(
            jax.ShapeDtypeStruct((tokens, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((tokens, K), jnp.int32),
            jax.ShapeDtypeStruct((tokens, K), jnp.float32),
        )
        .compile()
        .memory_analysis()
    )
    buf.close()
    outputs = want["expert_buffer"] + want["scales"] + want["combine_output"]
    assert 0 <= memory.output_size_in_bytes - outputs <= OUTPUT_SLACK, (memory, want)
    parts = sum(want[p] for p in ("received_rows", "node_leg", "combine_input", "combine_rows"))
    low, high = TEMP_RANGE
    assert low * parts <= memory.temp_size_in_bytes <= high * parts, (memory, want)


def test_default_capacity():
    assert default_capacity("rank", 4, 100, 8, 16, 1) == 400
    # expert layout: R*N*min(K, E_l) + (a-1)*E_l, aligned to a
    assert default_capacity("expert", 4, 100, 8, 16, 1) == 3200
    assert default_capacity("expert", 2, 10, 8, 4, 128) == align_up(2 * 10 * 4 + 127 * 4, 128)


def row_bytes(hidden, num_topk, element_bytes):
    """docs/ARCHITECTURE.md's row: payload, scales, ids and weights, flags, each to 16 bytes."""

    def a16(n):
        return -(-n // 16) * 16

    return (
        a16(hidden * element_bytes)
        + a16(hidden // 32)
        + a16(8 * num_topk)
        + a16(8 * -(-hidden // 1024))
    )


@pytest.mark.parametrize("sizes", [(32,), (4, 8), (64,), (8, 8)])
@pytest.mark.parametrize("max_row_dtype", [jnp.float32, jnp.bfloat16])
def test_the_plan_at_32_and_64_ranks(sizes, max_row_dtype):
    """What a job of 4 or 8 processes of 8 devices would hold per GPU, flat or ("node", "ep"):
    the same rows in the window as one axis of R ranks, and the default expert buffer of
    R * N * min(K, E_l) rows (processes do not enter: every part is per GPU)."""
    ranks, nodes = math.prod(sizes), math.prod(sizes[:-1])
    experts = 4 * ranks
    got = jax_ep.memory_plan(sizes, num_experts=experts, max_row_dtype=max_row_dtype, **V3)
    n, h, k = V3["max_tokens_per_rank"], V3["hidden"], V3["num_topk"]
    e = jnp.dtype(max_row_dtype).itemsize
    assert got["window"] - got["window_control"] == 2 * ranks * n * row_bytes(h, k, e)
    # docs/ARCHITECTURE.md's "about" (R ranks of N tokens; a tuple axis has fewer words per
    # source, L ranks of M * N tokens)
    control = 4 * n * ranks + 4 * experts + 80 * ranks + 32 * ranks * 4
    assert abs(got["window_control"] - control) <= 0.02 * control
    rows = ranks * n * min(k, 4)
    assert got["expert_buffer"] == got["combine_input"] == rows * h * e and got["scales"] == 0
    assert got["received_rows"] == (1 + (nodes > 1)) * ranks * n * h * e
    assert got["node_leg"] == (2 * nodes * n * (h * e + 4 * h) if nodes > 1 else 0)
    assert got["combine_output"] == n * h * e
    fp8 = jax_ep.memory_plan(
        sizes, num_experts=experts, max_row_dtype=max_row_dtype, fp8=True, **V3
    )
    assert fp8["window"] == got["window"]
    assert (fp8["expert_buffer"], fp8["scales"]) == (rows * h, rows * h // 128 * 4)


def test_the_window_at_the_issues_scales():
    """The V3 shape's window, float32 and bfloat16 rows: 1.8 / 0.9 GiB at EP 8, 15.9 / 8.1 at
    NVL72 (72 ranks, 4 experts each: 288 with redundant ones), 14.2 / 7.2 at 8 x 8 nodes, 56.7
    / 28.7 at 32 x 8 (bfloat16 rows are a little more than half: their scales, ids and flags
    keep their size)."""
    for sizes, experts, gib in (
        ((8,), 256, (1.8, 0.9)),
        ((72,), 288, (15.9, 8.1)),
        ((8, 8), 256, (14.2, 7.2)),
        ((32, 8), 256, (56.7, 28.7)),
    ):
        for dtype, want in zip((jnp.float32, jnp.bfloat16), gib):
            got = jax_ep.memory_plan(sizes, num_experts=experts, max_row_dtype=dtype, **V3)
            assert round(got["window"] / GIB, 1) == want, (sizes, dtype)


def test_the_layer_sizes_by_the_plan():
    """MoELayer's capacity_factor rows (nn.expert_capacity) are the plan's expert buffer."""
    cfg = nn.MoEConfig(
        num_experts=E, num_topk=K, hidden=H, ffn_hidden=64, expert_alignment=8, fp8=True
    )
    for factor, ranks in ((1.25, 8), (0.5, 2), (100.0, 4)):
        cfg = dataclasses.replace(cfg, capacity_factor=factor)
        got = plan(
            (ranks,), fp8=True, capacity_factor=factor, expert_alignment=cfg.expert_alignment
        )
        assert got["expert_buffer"] == nn.expert_capacity(cfg, T, ranks) * H
    worst = plan((8,), expert_alignment=8)["expert_buffer"]
    assert worst == plan((8,), capacity_factor=100.0, expert_alignment=8)["expert_buffer"]
    # Dropless: each round the capacity_factor's rows (80 of the worst case's 272 at 8 ranks),
    # and the later rounds' float32 sum.
    bounded = plan((8,), capacity_factor=1.25, expert_alignment=8)
    got = plan((8,), capacity_factor=1.25, dropless=True, expert_alignment=8)
    assert got["expert_buffer"] == bounded["expert_buffer"] == 80 * H * 4 and worst == 272 * H * 4
    assert got["overflow_sum"] == T * H * 4 and bounded["overflow_sum"] == 0
    assert dropless_rounds(80, 8, T, K, E // 8, 8) == 4  # 272 / 80, rounded up


@pytest.mark.parametrize(
    "sizes,modes,message",
    [
        ((3,), {}, "divisible by the 3 ranks"),
        (8, {}, "axis_sizes must be a tuple"),
        ((8,), dict(layout="rank", capacity_factor=1.0), "capacity_factor sizes the expert"),
        ((8,), dict(capacity=64, capacity_factor=1.0), "capacity_factor sizes the expert"),
        ((8,), dict(capacity_factor=0.0), "capacity_factor must be positive"),
        ((8,), dict(dropless=True), "dropless bounds each round at capacity_factor"),
        ((8,), dict(capacity=63, expert_alignment=2), "multiple of expert_alignment"),
        ((8,), dict(max_row_dtype=jnp.bfloat16, x_dtype=jnp.float32), "wider than"),
        ((8,), dict(layout="tokens"), "layout must be one of"),
    ],
)
def test_plan_refuses_what_a_buffer_refuses(sizes, modes, message):
    with pytest.raises(ValueError, match=message):
        plan(sizes, **modes)

"""A Buffer over ("node", "ep") in one process (jax_ep/hierarchical.py): both paths against the
numpy oracle and each other, gradients, the one-node case, memory, errors. Processes as nodes:
tests/test_processes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_bitwise_equal,
    assert_matches_oracle,
    buffers,
    layer_gradients,
    pipeline,
    random_inputs,
    relative_error,
    runner,
)

import jax_ep

T, H, E, K = 6, 256, 16, 4
NODES, LOCAL = 2, 4
AXIS = ("node", "ep")


def node_mesh(nodes=NODES, local=LOCAL):
    devices = np.array(jax.devices()[: nodes * local]).reshape(nodes, local)
    return jax.sharding.Mesh(devices, AXIS)


CONFIGS = [  # layout, alignment, fp8, round_scale, capacity, dtype, split, routing
    ("rank", 1, False, False, None, jnp.bfloat16, False, "random"),
    ("expert", 4, True, False, None, jnp.bfloat16, True, "one_expert"),
    ("rank", 1, True, True, 20, jnp.float32, True, "invalid"),
    ("expert", 2, False, False, 40, jnp.bfloat16, False, "duplicates"),
    ("expert_padded", 1, False, False, 5, jnp.float32, True, "sparse"),
]


@pytest.mark.parametrize("lay,alignment,fp8,round_scale,capacity,dtype,split,kind", CONFIGS)
def test_two_axis_mesh_matches_oracle(
    lay, alignment, fp8, round_scale, capacity, dtype, split, kind
):
    mesh = node_mesh()
    rng = np.random.default_rng(len(lay) + alignment)
    x, idx, w = random_inputs(
        rng, mesh.size, T, H, E, K, mesh.size, "random" if kind == "invalid" else kind, dtype
    )
    if kind == "invalid":  # excluded and counted on the rank that passed them
        idx = np.asarray(idx).copy()
        idx[3, 1], idx[-1, 0] = E, -9
    bias = jnp.asarray(rng.standard_normal(x.shape), dtype)
    bufs = buffers(mesh, AXIS, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    out = {}
    for impl, buf in bufs.items():
        step = pipeline(buf, lay, alignment, fp8, round_scale, capacity, split=split)
        out[impl] = runner(mesh, step)(x, idx, w, bias, x * 2)
        assert_matches_oracle(
            out[impl],
            (x, idx, w, bias),
            mesh.size,
            1,
            lay,
            alignment,
            fp8,
            round_scale,
            capacity,
            ranks_per_node=LOCAL,
        )
    for part in ("d", "handle", "cached_x", "cached_scales", "y", "between"):
        assert_bitwise_equal(out["ffi"][part], out["reference"][part], part)


def test_one_node_is_the_flat_buffer():
    """("node", "ep") of 1 x 4 gives what a Buffer over "ep" gives, bit for bit, in as much
    memory."""
    mesh = node_mesh(1, 4)
    flat = jax.sharding.Mesh(mesh.devices.reshape(-1), ("ep",))
    rng = np.random.default_rng(1)
    x, idx, w = random_inputs(rng, 4, T, H, E, K, 4, "random")
    bias = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    kwargs = dict(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    two = jax_ep.Buffer(mesh, AXIS, **kwargs)
    one = jax_ep.Buffer(flat, "ep", **kwargs)
    assert two.memory_bytes == one.memory_bytes and two.num_nodes == 1
    got = runner(mesh, pipeline(two, "expert", 2))(x, idx, w, bias, x)
    want = runner(flat, pipeline(one, "expert", 2))(x, idx, w, bias, x)
    assert_bitwise_equal(got, want, "1 x 4")


def test_memory_is_the_fast_legs_window_for_what_the_node_leg_brings():
    mesh = node_mesh()
    kwargs = dict(num_experts=E, hidden=H, num_topk=K)
    two = jax_ep.Buffer(mesh, AXIS, max_tokens_per_rank=T, **kwargs)
    one_node = jax.sharding.Mesh(mesh.devices[0], ("ep",))
    kwargs["num_experts"] = E // NODES
    window = jax_ep.Buffer(one_node, "ep", max_tokens_per_rank=NODES * T, **kwargs)
    assert two.memory_bytes == window.memory_bytes > 0
    assert (
        jax_ep.Buffer(mesh, AXIS, max_tokens_per_rank=T, impl="reference", **kwargs).memory_bytes
        == 0
    )


@pytest.mark.parametrize(
    "layout,remat,second_order,fp8",
    [("rank", False, False, True), ("expert", True, True, False)],
)
def test_gradients_match_the_reference_and_a_flat_buffer(layout, remat, second_order, fp8):
    mesh = node_mesh()
    flat = jax.sharding.Mesh(mesh.devices.reshape(-1), ("ep",))
    args = dict(layout=layout, second_order=second_order, fp8=fp8, hidden=H)
    ffi = layer_gradients(mesh, "ffi", remat, axis=AXIS, **args)
    reference = layer_gradients(mesh, "reference", remat, axis=AXIS, **args)
    assert np.isfinite(ffi).all() and np.abs(ffi).max() > 0
    assert relative_error(ffi, reference) < 1e-6  # XLA fuses the two paths' sums differently
    assert relative_error(ffi, layer_gradients(flat, "reference", remat, **args)) < 1e-6


@pytest.mark.parametrize(
    "axis,message",
    [(("node", "nope"), "axis_name must be an axis"), (("ep", "ep"), "distinct"), ((), "tuple")],
)
def test_bad_tuple_axes_are_refused(axis, message):
    with pytest.raises(ValueError, match=message):
        jax_ep.Buffer(node_mesh(), axis, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("layout,fp8", [("rank", True), ("expert", False), ("expert_padded", True)])
def test_no_tokens_on_any_rank(layout, fp8, impl):
    """T = 0 on every rank of both nodes: nothing dispatched or combined, the gradient zero."""
    mesh = node_mesh()
    buf = jax_ep.Buffer(
        mesh, AXIS, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
    )

    def fn(x, i, w):
        d = buf.dispatch(x, i, w, layout=layout, fp8=fp8)
        rows = buf.dequantize(d, x) if fp8 else d.x
        return buf.combine(
            rows, d.handle, topk_weights=None if layout == "rank" else d.topk_weights
        )

    step = runner(mesh, fn)
    x, i, w = jnp.zeros((0, H), jnp.float32), jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K))
    assert step(x, i, w).shape == (0, H)
    grad = jax.grad(lambda x: step(x, i, w).sum())(x)
    assert grad.shape == (0, H)


def test_called_over_one_axis_of_the_two_is_refused():
    mesh = node_mesh()
    buf = jax_ep.Buffer(
        mesh, AXIS, num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )
    step = jax.shard_map(
        lambda x, i: buf.dispatch(x, i).x,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("ep"),
        out_specs=jax.sharding.PartitionSpec("ep"),
        axis_names={"ep"},
    )
    with pytest.raises((ValueError, NameError)):
        jax.jit(step)(jnp.zeros((LOCAL * T, H), jnp.bfloat16), jnp.zeros((LOCAL * T, K), jnp.int32))

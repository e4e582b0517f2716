"""Gradients of dispatch and combine: custom-call path vs reference path vs a dense MoE computed
on one device without expert parallelism."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from helpers import layer_gradients, make_mesh, put, random_inputs, relative_error
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.fp8 import dequantize_fp8
from jax_ep.memory import default_capacity

T, H, E, K = 8, 128, 16, 4


def dense_moe(x, idx, w, experts, bias):
    """y[t] = bias[t] + sum_k w[t, k] * tanh(x[t] @ W[idx[t, k]]), no EP at all."""
    h = jnp.tanh(jnp.einsum("nh,ehf->nef", x, experts))
    mix = (jax.nn.one_hot(idx, experts.shape[0]) * w[..., None]).sum(axis=1)  # -1 -> no row
    return bias + jnp.einsum("nef,ne->nf", h, mix)


def ep_moe(buf, layout):
    def step(x, idx, w, experts, bias):
        d = buf.dispatch(x, idx, w, layout=layout, expert_alignment=4 if layout == "expert" else 1)
        if layout == "expert":
            out = jnp.tanh(jax.lax.ragged_dot(d.x, experts, d.group_sizes))
            return buf.combine(out, d.handle, topk_weights=d.topk_weights, bias=bias)
        h = jnp.tanh(jnp.einsum("ch,ehf->cef", d.x, experts))
        mix = (jax.nn.one_hot(d.topk_idx, experts.shape[0]) * d.topk_weights[..., None]).sum(1)
        return buf.combine(jnp.einsum("cef,ce->cf", h, mix), d.handle, bias=bias)

    return step


def loss_fn(mesh, step, cotangent):
    tokens = P(tuple(mesh.axis_names))
    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(tokens, tokens, tokens, P("ep"), tokens), out_specs=tokens
    )
    return lambda *args: jnp.vdot(sharded(*args), cotangent)


@pytest.mark.parametrize("num_ranks,dp", [(1, 1), (2, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_gradients_match_dense_moe(num_ranks, dp, layout):
    mesh = make_mesh(num_ranks, dp)
    rng = np.random.default_rng(num_ranks * 10 + dp)
    x, idx, w = random_inputs(rng, mesh.size, T, H, E, K, num_ranks, "sparse", jnp.float32)
    experts = jnp.asarray(rng.standard_normal((E, H, H)) / np.sqrt(H), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    args = (x, idx, w, experts, bias)
    want_loss, want = jax.value_and_grad(
        lambda x, w, e, b: jnp.vdot(dense_moe(x, idx, w, e, b), cotangent), argnums=(0, 1, 2, 3)
    )(x, w, experts, bias)
    tokens = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    args = (
        jax.device_put(x, tokens),
        jax.device_put(idx, tokens),
        jax.device_put(w, tokens),
        jax.device_put(experts, NamedSharding(mesh, P("ep"))),
        jax.device_put(bias, tokens),
    )
    grads = {}
    for impl in ("reference", "ffi"):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )
        f = loss_fn(mesh, ep_moe(buf, layout), cotangent)
        loss, grads[impl] = jax.jit(
            jax.value_and_grad(lambda x, w, e, b: f(x, args[1], w, e, b), argnums=(0, 1, 2, 3))
        )(args[0], args[2], args[3], args[4])
        np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
        for name, g, gw in zip(("x", "topk_weights", "experts", "bias"), grads[impl], want):
            assert relative_error(g, gw) < 1e-5, f"{impl} d/d{name}"
    for g_ffi, g_ref in zip(grads["ffi"], grads["reference"]):
        assert relative_error(g_ffi, g_ref) < 1e-6


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_fp8_dispatch_is_straight_through(layout):
    """The gradient of an fp8 dispatch w.r.t. x is the combine of the cotangent of d.x: with a
    cotangent of ones, the number of rows each token became."""
    mesh = make_mesh(4)
    rng = np.random.default_rng(7)
    x, idx, w = random_inputs(rng, 4, T, 256, E, K, 4, "random", jnp.bfloat16)
    grads = {}
    for impl in ("reference", "ffi"):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=256, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        def step(x, idx, w):
            d = buf.dispatch(x, idx, w, layout=layout, fp8=True)
            return jnp.sum(d.x.astype(jnp.float32))[None]

        spec = P("ep")
        f = jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        grads[impl] = jax.jit(jax.grad(lambda x: f(x, idx, w).sum()))(x)
    np.testing.assert_array_equal(
        np.asarray(grads["ffi"], np.float32), np.asarray(grads["reference"], np.float32)
    )
    owners = np.asarray(idx)[:, :, None] // (E // 4) == np.arange(4)
    rows_per_token = (
        owners.any(1).sum(1)
        if layout == "rank"
        else np.asarray([len(set(r) - {-1}) for r in np.asarray(idx)])
    )
    np.testing.assert_array_equal(
        np.asarray(grads["ffi"], np.float32), np.broadcast_to(rows_per_token[:, None], x.shape)
    )


def test_cached_dispatch_gradient():
    mesh = make_mesh(2)
    rng = np.random.default_rng(9)
    x, idx, w = random_inputs(rng, 2, T, H, E, K, 2, "random", jnp.float32)
    spec = P("ep")
    results = {}
    for impl in ("reference", "ffi"):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        def step(x, x2, idx):
            d = buf.dispatch(x, idx, layout="expert")
            again = buf.dispatch(x2, handle=d.handle)
            return buf.combine(jnp.sin(again.x), d.handle)

        f = jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        results[impl] = jax.jit(jax.grad(lambda x2: jnp.sum(f(x, x2, idx) ** 2)))(x)
    np.testing.assert_allclose(results["ffi"], results["reference"], rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(results["ffi"]).sum()) > 0


@pytest.mark.parametrize("case", ["no weights", "weights made inside", "replicated x"])
def test_gradients_of_inputs_that_do_not_vary(case):
    """Inputs the same on every rank (no topk_weights, weights made inside shard_map, a
    replicated x): the custom-call path's gradients equal the reference path's."""
    mesh = make_mesh(4)
    rng = np.random.default_rng(3)
    x, idx, _ = random_inputs(rng, 4, T, H, E, K, 4, "random", jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    x_spec = P() if case == "replicated x" else P("ep")
    x = x[:T] if case == "replicated x" else x

    def grads(impl):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        def step(x, idx):
            w = None if case == "no weights" else jnp.full(idx.shape, 0.5, jnp.float32)
            d = buf.dispatch(x, idx, w, layout="expert")
            return buf.combine(jnp.tanh(d.x), d.handle, topk_weights=d.topk_weights)

        f = jax.shard_map(step, mesh=mesh, in_specs=(x_spec, P("ep")), out_specs=P("ep"))
        return np.asarray(jax.jit(jax.grad(lambda x: jnp.vdot(f(x, idx), cotangent)))(x))

    want = grads("reference")
    assert relative_error(grads("ffi"), want) < 1e-6
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_dequantized_fp8_rows_pass_gradients_straight_through(layout):
    """Buffer.dequantize(d, x) of an fp8 dispatch: x's gradient is that of the same dispatch
    without fp8 (the combine of the rows' cotangents; bitwise in the rank layout, within bf16
    rounding in the expert layouts, whose unquantised backward rounds the expert rows' sums to
    bf16 once more), on both paths."""
    mesh = make_mesh(4)
    rng = np.random.default_rng(8)
    x, idx, w = random_inputs(rng, 4, T, 256, E, K, 4, "random", jnp.bfloat16)
    spec = P("ep")
    grads = {}
    for impl in ("reference", "ffi"):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=256, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        def step(x, idx, w, fp8):
            d = buf.dispatch(x, idx, w, layout=layout, fp8=fp8)
            rows = buf.dequantize(d, x) if fp8 else d.x
            weights = jnp.cos(jnp.arange(rows.size, dtype=jnp.float32)).reshape(rows.shape)
            return jnp.vdot(rows.astype(jnp.float32), weights)[None]

        for fp8 in (True, False):
            f = jax.shard_map(
                lambda x, idx, w: step(x, idx, w, fp8),
                mesh=mesh,
                in_specs=(spec, spec, spec),
                out_specs=spec,
            )
            grads[impl, fp8] = np.asarray(
                jax.jit(jax.grad(lambda x: f(x, idx, w).sum()))(x), np.float32
            )
    for impl in ("reference", "ffi"):
        if layout == "rank":
            np.testing.assert_array_equal(grads[impl, True], grads[impl, False], err_msg=impl)
        assert relative_error(grads[impl, True], grads[impl, False]) < 4e-3, impl
    assert relative_error(grads["ffi", True], grads["reference", True]) < 4e-3
    assert np.abs(grads["ffi", True]).max() > 0


@pytest.mark.parametrize("layout,fp8", [("rank", False), ("expert", False), ("rank", True)])
def test_gradients_under_remat(layout, fp8):
    """jax.checkpoint around a layer: the gradient is the reference path's. FP8: the rows are
    saved as float8_e4m3fn residuals, every block's largest element at 448 (JAX's residual
    rounding once made 256..448 NaN: jax_ep/_jax/remat.py)."""
    mesh = make_mesh(4)
    want = layer_gradients(mesh, "reference", False, layout, fp8=fp8)
    got = layer_gradients(mesh, "ffi", True, layout, fp8=fp8)
    assert np.isfinite(got).all() and relative_error(got, want) < 1e-6
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("layout,fp8", [("rank", False), ("expert", False), ("expert", True)])
def test_remat_keeps_what_crossed_the_links(layout, fp8):
    """jax.checkpoint with any policy (here the default, which saves nothing) sends nothing
    again: dispatch and combine are custom_vjp functions, whose residuals (the received rows,
    the handle) JAX saves, so the backward pass has as many communicating calls as without the
    checkpoint. What is recomputed is local: the expert layout's expansion of the rows."""
    mesh = make_mesh(4)
    x, idx, w = random_inputs(np.random.default_rng(3), 4, T, H, E, K, 4, "random", jnp.float32)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)

    def layer(x, idx, w):
        d = buf.dispatch(x, idx, w, layout=layout, fp8=fp8)
        rows = buf.dequantize(d, x) if fp8 else d.x
        weights = d.topk_weights if layout == "expert" else None
        return jnp.sin(buf.combine(jnp.tanh(rows), d.handle, topk_weights=weights))

    def calls(remat):
        body = jax.checkpoint(layer) if remat else layer
        f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        grad = jax.jit(jax.grad(lambda x, idx, w: jnp.sum(f(x, idx, w))))
        text = grad.lower(*put(mesh, x, idx, w)).as_text()
        return collections.Counter(re.findall(r"custom_call @(jax_ep_\w+)\(", text))

    plain, checkpointed = calls(False), calls(True)
    communicating = ("jax_ep_dispatch", "jax_ep_dispatch_cached", "jax_ep_combine")
    assert all(plain[name] >= 1 for name in communicating), plain
    for name in communicating + ("jax_ep_dispatch_adjoint",):
        assert checkpointed[name] == plain[name], (name, plain, checkpointed)
    if layout == "expert":  # the checkpoint is at work: the local layout op runs again
        assert checkpointed["jax_ep_expert_layout"] == plain["jax_ep_expert_layout"] + 1


@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_second_order_gradients(layout):
    """A Hessian-vector product through dispatch and combine: the custom-call path's forward
    rules are differentiable, and it matches the reference path's."""
    mesh = make_mesh(4)
    want = layer_gradients(mesh, "reference", False, layout, second_order=True)
    assert (
        relative_error(layer_gradients(mesh, "ffi", False, layout, second_order=True), want) < 1e-6
    )
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_expert_padded_padding_rows_reach_no_gradient(impl):
    """expert_padded's rows past tokens_per_expert are unspecified, and an expert function may
    turn them into anything: made NaN here, they reach neither the result nor any gradient
    (x's, the routing weights', and that of a scale applied to the dispatched weights, whose
    padding entries are 0: 0 * NaN would be NaN)."""
    mesh = make_mesh(4)
    x, idx, w = random_inputs(np.random.default_rng(12), 4, T, 64, E, K, 4, "random")
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=64, num_topk=K, max_tokens_per_rank=T, impl=impl
    )

    def layer(x, idx, w, scale):
        d = buf.dispatch(x, idx, w, layout="expert_padded")
        out = jnp.where((d.topk_idx >= 0)[..., None], jnp.tanh(d.x), jnp.nan)
        return buf.combine(out, d.handle, topk_weights=d.topk_weights * scale)

    f = jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 3 + (P(),), out_specs=P("ep"))
    loss = lambda x, w, scale: jnp.sum(f(x, idx, w, scale) ** 2)  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        *put(mesh, x, w), jnp.float32(1.5)
    )
    assert np.isfinite(float(value))
    for g in grads:
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0


@pytest.mark.parametrize("layout,combines", [("rank", 2), ("expert", 3)])
def test_fp8_backward_sends_no_zero_cotangents(layout, combines):
    """FP8 rows used only through Buffer.dequantize: the backward combines the dequantized rows'
    cotangents once, and the weights' where the layer uses them (expert layout), but not the
    zero cotangents of the float8 rows (counted in the lowered program: forward combine
    included)."""
    mesh = make_mesh(4)
    x, idx, w = random_inputs(np.random.default_rng(9), 4, T, 256, E, K, 4, "random", jnp.bfloat16)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=256, num_topk=K, max_tokens_per_rank=T)

    def layer(x, idx, w):
        d = buf.dispatch(x, idx, w, layout=layout, fp8=True)
        weights = d.topk_weights if layout == "expert" else None
        return buf.combine(jnp.tanh(buf.dequantize(d, x)), d.handle, topk_weights=weights)

    f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    grad = jax.jit(
        jax.grad(lambda x, w: jnp.sum(f(x, idx, w).astype(jnp.float32) ** 2), argnums=(0, 1))
    )
    text = grad.lower(*put(mesh, x, w)).as_text()
    assert text.count("custom_call @jax_ep_combine(") == combines


@pytest.mark.parametrize(
    "layout,through",
    [
        ("rank", "dequantize"),
        ("expert", "dequantize"),
        ("rank", "dequantize_fp8"),
        ("expert", "dequantize_fp8"),
    ],
)
@pytest.mark.parametrize("row_dtype", [jnp.bfloat16, jnp.float32])
def test_gradients_of_fp8_rows_of_float32_x(layout, through, row_dtype):
    """float32 x dispatched in FP8, also on a Buffer of bf16 rows (the FP8 rows fit): the
    backward sends the rows' cotangents in the Buffer's rows, and both paths agree, through
    Buffer.dequantize and through the float8 rows' own cotangent (dequantize_fp8)."""
    mesh = make_mesh(4)
    x, idx, w = random_inputs(np.random.default_rng(13), 4, T, 128, E, K, 4, "random", jnp.float32)
    grads = {}
    for impl in ("ffi", "reference"):
        buf = jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=E,
            hidden=128,
            num_topk=K,
            max_tokens_per_rank=T,
            impl=impl,
            max_row_dtype=row_dtype,
        )

        def layer(x, idx, w, buf=buf):
            d = buf.dispatch(x, idx, w, layout=layout, fp8=True)
            rows = dequantize_fp8(d.x, d.scales) if through == "dequantize_fp8" else None
            rows = buf.dequantize(d, x) if rows is None else rows
            weights = d.topk_weights if layout == "expert" else None
            return buf.combine(jnp.tanh(rows).astype(jnp.bfloat16), d.handle, topk_weights=weights)

        f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        loss = lambda x, w: jnp.sum(f(x, idx, w).astype(jnp.float32) ** 2)  # noqa: E731
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(*put(mesh, x, w))
    for name, got, want in zip(("x", "topk_weights"), grads["ffi"], grads["reference"]):
        if name == "x" or layout == "expert":  # the rank layout's combine takes no weights
            assert np.abs(np.asarray(want)).max() > 0, name
        assert relative_error(got, want) < 1e-6, name


@pytest.mark.parametrize(
    "ranks,impl",
    [(8, "ffi"), (8, "reference"), (1, "ffi")],
)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_gradients_are_the_closed_form(layout, fp8, ranks, impl):
    """d/dx and d/d topk_weights of combine(tanh(dispatch(x))) against their closed form
    (tests/oracle.py), not against the other path: every layout, FP8 straight through."""
    mesh = make_mesh(ranks)
    rng = np.random.default_rng(21)
    x, idx, w = (
        np.asarray(a) for a in random_inputs(rng, ranks, T, 256, E, K, ranks, "random", jnp.float32)
    )
    c = rng.standard_normal(x.shape).astype(np.float32)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=256, num_topk=K, max_tokens_per_rank=T, impl=impl
    )

    def layer(x, idx, w):
        d = buf.dispatch(x, idx, w, layout=layout, fp8=fp8)
        rows = buf.dequantize(d, x) if fp8 else d.x
        weights = d.topk_weights if layout != "rank" else None
        return buf.combine(jnp.tanh(rows), d.handle, topk_weights=weights)

    f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    loss = lambda x, w: jnp.vdot(f(x, idx, w), c)  # noqa: E731
    got_x, got_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(*put(mesh, x, w))
    want_x, want_w = oracle.layer_gradients(x, idx, w, c, layout, fp8, E, ranks)
    assert relative_error(got_x, want_x) < 1e-5
    if layout == "rank":
        assert not np.abs(np.asarray(got_w)).max()
    else:
        assert relative_error(got_w, want_w) < 1e-5


@pytest.mark.parametrize("row_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_narrowed_cotangents_are_the_same_bits_on_every_path(layout, row_dtype):
    """The cotangents a backward narrows or rounds: the float8 rows' own (dequantize_fp8 of d.x,
    of a fresh and of a cached dispatch, summed in float32 and rounded once to float8), and those
    of float32 expert outputs combined from a bf16-row Buffer (sent in bf16). The custom calls
    and the reference path, over one axis and over ("node", "ep"), give the same bits."""
    nodes = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("node", "ep"))
    flat = jax.sharding.Mesh(nodes.devices.reshape(-1), ("ep",))
    x, idx, w = random_inputs(np.random.default_rng(31), 8, T, H, E, K, 8, "random", jnp.float32)
    c = np.random.default_rng(32).standard_normal(x.shape).astype(np.float32)
    grads = {}
    for mesh, axis in ((flat, "ep"), (nodes, ("node", "ep"))):
        for impl in ("ffi", "reference"):
            buf = jax_ep.Buffer(
                mesh,
                axis,
                num_experts=E,
                hidden=H,
                num_topk=K,
                max_tokens_per_rank=T,
                impl=impl,
                max_row_dtype=row_dtype,
            )

            def layer(x, idx, w, c, buf=buf):
                d = buf.dispatch(x, idx, w, layout=layout, fp8=True)
                cached = buf.dispatch(x * x, handle=d.handle, fp8=True)
                rows = dequantize_fp8(d.x, d.scales) + dequantize_fp8(cached.x, cached.scales)
                weights = d.topk_weights if layout == "expert" else None
                if layout == "rank":  # rank rows travel as they are: no wider than the Buffer's
                    rows = rows.astype(row_dtype)
                y = buf.combine(jnp.tanh(rows), d.handle, topk_weights=weights)
                return jnp.vdot(y.astype(jnp.float32), c)[None]

            f = jax.shard_map(layer, mesh=mesh, in_specs=P(axis), out_specs=P(axis))
            loss = lambda x, w, f=f: f(x, idx, w, c).sum()  # noqa: E731
            key = (axis, impl)
            grads[key] = jax.jit(jax.grad(loss, argnums=(0, 1)))(*put(mesh, x, w))
    want = grads[("ep", "reference")]
    assert np.abs(np.asarray(want[0])).max() > 0
    for key, got in grads.items():
        for name, a, b in zip(("x", "topk_weights"), got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{key} {name}")


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("layout", ["expert", "expert_padded"])
def test_a_bias_gets_the_cotangent_of_y_unrounded(layout, impl):
    """The bias is added to y in float32 and never travels, so its gradient is y's cotangent as
    it is, also where the partial sums travel in bfloat16 (whose cotangent is sent back rounded
    to bfloat16: the custom calls gave the bias that rounded one)."""
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
    )
    x, idx, w = random_inputs(np.random.default_rng(41), 4, T, H, E, K, 4, "random", jnp.float32)
    rng = np.random.default_rng(42)
    bias = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    c = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def layer(x, idx, w, bias, c):
        d = buf.dispatch(x, idx, w, layout=layout)
        y = buf.combine(
            jnp.tanh(d.x), d.handle, d.topk_weights, bias=bias, partial_dtype=jnp.bfloat16
        )
        return jnp.vdot(y, c)[None]

    f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    grad = jax.jit(jax.grad(lambda bias: f(x, idx, w, bias, c).sum()))
    got = grad(*put(mesh, bias))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(c))


# ---------------------------------------------------------------- NaN in padding rows
# Padding rows (docs/API.md): the rank layout's rows past num_recv, the expert layout's
# alignment padding and rows past its groups, expert_padded's rows past tokens_per_expert
# (unspecified: the custom calls leave whatever bytes were there). An expert function may turn
# them into anything; none of it may reach y or a gradient.


def _valid_rows(d, layout):
    """[rows..., 1] bool: the rows of a dispatch that hold data."""
    if layout == "rank":
        return (jnp.arange(d.x.shape[0]) < d.num_recv)[:, None]
    return (d.topk_idx >= 0)[..., None]


def _nan_where_padding(rows, expert_src):
    if rows is None:
        return None
    keep = (expert_src >= 0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(keep, rows, jnp.asarray(jnp.nan, rows.dtype))


@pytest.fixture
def nan_padding(monkeypatch):
    """expert_padded's unspecified rows (x and scales) made NaN on both paths, as the custom
    calls may leave them (any bytes; float8 0x7f is NaN), where the reference path writes
    zeros."""
    from jax_ep import ffi_path, reference

    def poisoned(make):
        def expert_padded(self, *args, **kwargs):
            maps, weights, rows = make(self, *args, **kwargs)
            return maps, weights, tuple(_nan_where_padding(r, maps.expert_src) for r in rows)

        return expert_padded

    for cls in (reference.Reference, ffi_path.Ffi):
        monkeypatch.setattr(cls, "expert_padded", poisoned(cls.expert_padded))


def _routed_inputs(seed, devices, tokens, hidden, unused=0.1):
    """x, topk_idx (a share `unused` of the slots -1), topk_weights, and two [N, H] float32
    arrays (bias, cotangent)."""
    rng = np.random.default_rng(seed)
    x, idx, w = random_inputs(rng, devices, tokens, hidden, E, K, devices, "random", jnp.float32)
    idx = np.where(rng.random(idx.shape) < unused, -1, np.asarray(idx)).astype(np.int32)
    bias, c = (rng.standard_normal(x.shape).astype(np.float32) for _ in range(2))
    return np.asarray(x), idx, np.asarray(w), bias, c


def _fp8_values(x):
    """[N, H] float32 -> what FP8 rows of x hold, q * scale (tests/oracle.py's rule)."""
    return np.stack(
        [
            (q.astype(np.float32).reshape(-1, 128) * s[:, None]).reshape(-1)
            for q, s in (oracle.quantize(row, False) for row in x)
        ]
    )


def _tanh_layer_y(x, idx, w, bias, layout, fp8, ranks):
    """y of combine(tanh(rows), weights=d.topk_weights, bias) in closed form (see
    oracle.layer_gradients): bias + S * tanh(x'), S the token's destination ranks (rank layout)
    or its valid weights' sum."""
    xq = _fp8_values(x) if fp8 else x
    valid = idx >= 0
    if layout == "rank":
        owners = [len({e // (E // ranks) for e in row[ok]}) for row, ok in zip(idx, valid)]
        scale = np.array(owners, np.float32)
    else:
        scale = (w * valid).sum(1)
    return bias + scale[:, None] * np.tanh(xq)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_nan_in_padding_reaches_no_result_or_gradient(layout, fp8):
    check_nan_in_padding(layout, fp8)


def check_nan_in_padding(layout, fp8, devices=None):
    """expert_out NaN on every padding row (expert layout: alignment padding and the rows past
    the groups too), and the combine's weights NaN there: y and the gradients of x, topk_weights,
    expert_out and bias are finite; y, x's and topk_weights' are the closed form
    (tests/oracle.py), the bias's is y's cotangent, expert_out's is 0 on every padding row, and
    the two paths agree. One rank per device of `devices` (tests/test_gpu.py), else 2 CPU
    devices."""
    ranks, tokens, hidden = len(devices) if devices else 2, 4, 128
    mesh = make_mesh(ranks, devices=devices)
    x, idx, w, bias, c = _routed_inputs(51, ranks, tokens, hidden, unused=0.2)
    idx[0] = -1  # a token routed nowhere: padding in the rank layout at any rank count
    alignment = 4 if layout == "expert" else 1
    capacity = default_capacity(layout, ranks, tokens, K, E // ranks, alignment)
    blocks = (E // ranks, capacity) if layout == "expert_padded" else (capacity,)
    delta = np.zeros((ranks * blocks[0], *blocks[1:], hidden), np.float32)  # like expert_out
    want_y = _tanh_layer_y(x, idx, w, bias, layout, fp8, ranks)
    want_x, want_w = oracle.layer_gradients(x, idx, w, c, layout, fp8, E, ranks)
    names = ("y", "x", "topk_weights", "bias", "expert_out")
    results = {}
    for impl in ("reference", "ffi"):
        buf = jax_ep.Buffer(
            mesh,
            "ep",
            num_experts=E,
            hidden=hidden,
            num_topk=K,
            max_tokens_per_rank=tokens,
            impl=impl,
        )

        def layer(x, idx, w, bias, delta, buf=buf):
            d = buf.dispatch(x, idx, w, layout=layout, expert_alignment=alignment, fp8=fp8)
            valid = _valid_rows(d, layout)
            rows = buf.dequantize(d, x) if fp8 else d.x
            out = jnp.where(valid, jnp.tanh(rows), jnp.nan) + delta  # d/d delta: expert_out's
            weights = None
            if layout != "rank":  # the rank layout's combine takes no weights
                weights = jnp.where(valid[..., 0], d.topk_weights, jnp.nan)
            return buf.combine(out, d.handle, topk_weights=weights, bias=bias), valid

        f = jax.shard_map(layer, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        y, valid = jax.jit(f)(*put(mesh, x, idx, w, bias, delta))
        loss = lambda x, w, bias, delta, f=f: jnp.vdot(f(x, idx, w, bias, delta)[0], c)  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*put(mesh, x, w, bias, delta))
        results[impl] = got = dict(zip(names, (np.asarray(a) for a in (y, *grads))))
        for name, a in got.items():
            assert np.isfinite(a).all(), f"{impl}: {name} is not finite"
        assert relative_error(got["y"], want_y) < 1e-5, impl
        assert relative_error(got["x"], want_x) < 1e-5, impl
        if layout != "rank":
            assert relative_error(got["topk_weights"], want_w) < 1e-5, impl
        np.testing.assert_array_equal(got["bias"], c)
        padding = ~np.asarray(valid)[..., 0]
        assert padding.any() and not np.abs(got["expert_out"][padding]).max(), impl
        assert np.abs(got["expert_out"]).max() > 0, impl
    for name in names:  # tanh may differ by an ulp between two programs
        assert relative_error(results["ffi"][name], results["reference"][name]) < 1e-6, name


def _padded_layer(buf, fp8, axis, nan_weights=False):
    """The decode layer of the README over expert_padded, its expert function applied to every
    row (padding too, unmasked): tanh(h * a[e] + c[e]), a and c [E, H] sharded by expert.
    nan_weights: the combine's weights NaN on the padding rows too."""

    def layer(x, idx, w, bias, a, c):
        d = buf.dispatch(x, idx, w, layout="expert_padded", fp8=fp8)
        h = buf.dequantize(d, x) if fp8 else d.x
        out = jnp.tanh(h * a[:, None, :] + c[:, None, :])
        weights = d.topk_weights
        if nan_weights:
            weights = jnp.where(d.topk_idx >= 0, weights, jnp.nan)
        return buf.combine(out, d.handle, topk_weights=weights, bias=bias)

    spec = P(axis)
    return jax.shard_map(layer, mesh=buf.mesh, in_specs=spec, out_specs=spec)


def _dense_padded_layer(idx, a, c, x_fp8=None):
    """_padded_layer without expert parallelism: y[t] = bias[t] + sum over t's slots k with an
    expert of w[t, k] * tanh(x'[t] * a[e] + c[e]); x' = x, or x_fp8 (x's FP8 value) with x's
    gradient straight through."""

    def layer(x, w, bias):
        if x_fp8 is not None:
            x = x + jax.lax.stop_gradient(x_fp8 - x)
        e = np.maximum(idx, 0)
        out = jnp.tanh(x[:, None, :] * a[e] + c[e])  # [N, K, H]
        return bias + jnp.einsum("nkh,nk->nh", out, jnp.where(idx >= 0, w, 0.0))

    return layer


def _padded_layer_setup(impl, nodes, seed):
    ranks, tokens, hidden = 4, 8, 128
    if nodes > 1:
        grid = np.array(jax.devices()[:ranks]).reshape(nodes, ranks // nodes)
        mesh, axis = jax.sharding.Mesh(grid, ("node", "ep")), ("node", "ep")
    else:
        mesh, axis = make_mesh(ranks), "ep"
    x, idx, w, bias, cot = _routed_inputs(seed, ranks, tokens, hidden)
    rng = np.random.default_rng(seed + 1)
    a, c = (rng.standard_normal((E, hidden)).astype(np.float32) for _ in range(2))
    buf = jax_ep.Buffer(
        mesh,
        axis,
        num_experts=E,
        hidden=hidden,
        num_topk=K,
        max_tokens_per_rank=tokens,
        impl=impl,
    )
    return buf, axis, (x, idx, w, bias, a, c), cot


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("impl,nodes", [("ffi", 1), ("reference", 1), ("ffi", 2)])
def test_unmasked_expert_function_over_unspecified_padding(impl, nodes, fp8, nan_padding):
    """Issue 54: expert_padded rows dequantized, an elementwise expert function of every row
    (NaN on the padding rows, as the custom calls may leave them), a weighted combine with a
    bias, 10% of the slots -1: y and the gradients of x, topk_weights and bias are the dense
    layer's."""
    buf, axis, (x, idx, w, bias, a, c), cot = _padded_layer_setup(impl, nodes, 61)
    f = _padded_layer(buf, fp8, axis)
    loss = lambda x, w, bias: jnp.vdot(f(x, idx, w, bias, a, c), cot)  # noqa: E731
    y = jax.jit(f)(*put(buf.mesh, x, idx, w, bias, a, c))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put(buf.mesh, x, w, bias))
    dense = _dense_padded_layer(idx, a, c, _fp8_values(x) if fp8 else None)
    want_y = dense(x, w, bias)
    want = jax.grad(lambda *args: jnp.vdot(dense(*args), cot), argnums=(0, 1, 2))(x, w, bias)
    assert np.isfinite(np.asarray(y)).all() and relative_error(y, want_y) < 1e-5
    for name, got, expected in zip(("x", "topk_weights", "bias"), grads, want):
        assert np.isfinite(np.asarray(got)).all(), name
        assert relative_error(got, expected) < 1e-5, name


@pytest.mark.parametrize(
    "impl,nodes,nan_weights",
    [("ffi", 1, False), ("reference", 1, False), ("ffi", 1, True), ("ffi", 2, True)],
)
def test_hessian_vector_product_over_unspecified_padding(impl, nodes, nan_weights, nan_padding):
    """Reverse over reverse through an expert_padded dispatch and combine without FP8, the
    expert function over every row (NaN padding), the combine's weights d.topk_weights (0 on
    padding) or NaN on padding: the product with x's and the weights' Hessian is finite and the
    dense layer's."""
    buf, axis, (x, idx, w, bias, a, c), cot = _padded_layer_setup(impl, nodes, 71)
    f = _padded_layer(buf, False, axis, nan_weights)
    dense = _dense_padded_layer(idx, a, c)
    v = np.random.default_rng(72).standard_normal(x.shape).astype(np.float32)

    def hvp(layer):
        first = jax.grad(lambda x, w: jnp.vdot(jnp.tanh(layer(x, w)), cot), argnums=(0, 1))

        def along_v(x, w):
            gx, gw = first(x, w)
            return jnp.vdot(gx, v) + jnp.vdot(gw, w)

        return jax.grad(along_v, argnums=(0, 1))

    got = jax.jit(hvp(lambda x, w: f(x, idx, w, bias, a, c)))(*put(buf.mesh, x, w))
    want = hvp(lambda x, w: dense(x, w, bias))(x, w)
    for name, g, expected in zip(("x", "topk_weights"), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        assert relative_error(g, expected) < 1e-5, name

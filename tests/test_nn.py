"""jax_ep.nn: the expert-parallel MoE block equals a dense single-device MoE (same weights, same
tokens, no EP), forward and gradients, on both paths and through both adapters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_mesh
from jax_ep import nn

H, F, E, K = 64, 32, 16, 4
TOKENS = 16  # per rank


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_close_trees(got, want, tol, what):
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = jax.tree_util.tree_leaves_with_path(want)
        w = dict(w)[path]
        assert relative_error(g, w) < tol, f"{what} {jax.tree_util.keystr(path)}"


def loss(out, aux, cotangent):
    return jnp.vdot(out.astype(jnp.float32), cotangent) + 0.1 * aux


CONFIGS = {
    "softmax": nn.MoEConfig(num_experts=E, num_topk=K, hidden=H, ffn_hidden=F),
    "sigmoid-groups-shared": nn.MoEConfig(
        num_experts=E, num_topk=K, hidden=H, ffn_hidden=F, score="sigmoid", num_groups=4,
        topk_groups=2, routed_scaling=2.5, shared_ffn_hidden=48, expert_alignment=8),
}


@pytest.mark.parametrize("num_ranks,dp", [(1, 1), (2, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_layer_equals_dense_moe(num_ranks, dp, name, impl):
    cfg = CONFIGS[name]
    mesh = make_mesh(num_ranks, dp)
    params = nn.init_params(jax.random.key(num_ranks), cfg)
    x = jax.random.normal(jax.random.key(1), (mesh.size * TOKENS, H))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    layer = nn.MoELayer(cfg, mesh, expert_axis="ep", data_axis="dp" if dp > 1 else None,
                        tokens_per_rank=TOKENS, impl=impl)
    (y, aux), (y_dense, aux_dense) = jax.jit(layer)(params, x), nn.dense_moe(params, x, cfg)
    assert relative_error(y, y_dense) < 1e-5
    np.testing.assert_allclose(aux, aux_dense, rtol=1e-5)
    grads = jax.jit(jax.grad(lambda p, x: loss(*layer(p, x), cotangent), argnums=(0, 1)))(params, x)
    dense = jax.grad(lambda p, x: loss(*nn.dense_moe(p, x, cfg), cotangent), argnums=(0, 1))(
        params, x)
    assert_close_trees(grads, dense, 1e-5, "gradient")


def test_flax_nnx_adapter():
    from flax import nnx
    from jax_ep.nn.flax_nnx import MoE

    cfg = CONFIGS["sigmoid-groups-shared"]
    mesh = make_mesh(4, 2)
    model = MoE(cfg, mesh, expert_axis="ep", data_axis="dp", tokens_per_rank=TOKENS,
                rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8 * TOKENS, H))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    params = model.weights()

    @nnx.jit
    def step(model, x):
        def objective(model):
            y, sown = nnx.capture(model, nnx.Intermediate)(x)
            return loss(y, sown["aux_loss"][0], cotangent)
        return nnx.value_and_grad(objective)(model)

    value, grads = step(model, x)
    want, dense = jax.value_and_grad(lambda p: loss(*nn.dense_moe(p, x, cfg), cotangent))(params)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert_close_trees({k: grads[k][...] for k in model.names}, dense, 1e-5, "nnx gradient")


def test_equinox_adapter():
    import equinox as eqx
    from jax_ep.nn.eqx import MoE

    cfg = CONFIGS["softmax"]
    mesh = make_mesh(8)
    model = MoE(cfg, mesh, expert_axis="ep", tokens_per_rank=TOKENS, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(1), (8 * TOKENS, H))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(
        lambda m: loss(*m(x), cotangent)))(model)
    want, dense = jax.value_and_grad(lambda p: loss(*nn.dense_moe(p, x, cfg), cotangent))(
        model.weights)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert_close_trees(grads.weights, dense, 1e-5, "equinox gradient")


def test_config_errors():
    with pytest.raises(ValueError, match="score"):
        nn.MoEConfig(num_experts=E, num_topk=K, hidden=H, ffn_hidden=F, score="relu")
    with pytest.raises(ValueError, match="num_groups"):
        nn.MoEConfig(num_experts=E, num_topk=K, hidden=H, ffn_hidden=F, num_groups=3)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_fp8_layer_trains_like_the_unquantised_one(impl):
    """fp8=True quantises the experts' input, so outputs and gradients move by FP8 rounding
    (a few percent), no more: the gradient reaches x straight through the quantisation."""
    mesh = make_mesh(4)
    hidden = 128  # whole FP8 blocks
    x = jax.random.normal(jax.random.key(1), (mesh.size * TOKENS, hidden))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    results = {}
    for fp8 in (False, True):
        cfg = nn.MoEConfig(num_experts=E, num_topk=K, hidden=hidden, ffn_hidden=F, fp8=fp8)
        params = nn.init_params(jax.random.key(0), cfg)
        layer = nn.MoELayer(cfg, mesh, expert_axis="ep", tokens_per_rank=TOKENS, impl=impl)
        results[fp8] = jax.block_until_ready(jax.jit(jax.value_and_grad(
            lambda p, x: loss(*layer(p, x), cotangent), argnums=(0, 1)))(params, x))
    (_, (dp_fp8, dx_fp8)), (_, (dp, dx)) = results[True], results[False]
    assert relative_error(dx_fp8, dx) < 0.1
    assert relative_error(dp_fp8["w_gate"], dp["w_gate"]) < 0.1

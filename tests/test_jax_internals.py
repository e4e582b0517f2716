"""jax_ep/_jax/, the one package that uses JAX internals, on the jax this run has (CI runs the
oldest and the newest jax jax_ep supports): everything it takes from jax._src is there and does
what jax_ep relies on, and programs without a Buffer run JAX's own code."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import make_mesh
from jax.sharding import PartitionSpec as P

from jax_ep import _jax
from jax_ep._jax import order, remat


def test_a_buffer_order_is_an_ordered_effect_allowed_wherever_jax_ep_calls_go():
    from jax._src import effects

    buffer_order = _jax.BufferOrder(7)
    assert buffer_order == _jax.BufferOrder(7) and buffer_order != _jax.BufferOrder(8)
    for name in order._EFFECT_SETS:
        assert getattr(effects, name).contains(buffer_order), name


def test_a_missing_jax_internal_fails_the_import_naming_the_version_and_what_is_missing():
    from jax_ep._jax.require import require

    assert require("m", "jax._src.dispatch", "RuntimeTokenSet.get_token_input") is not None
    with pytest.raises(ImportError) as e:
        require("jax_ep._jax.m", "jax._src.dispatch", "RuntimeTokenSet.gone", "also_gone")
    message = str(e.value)
    assert f"jax {jax.__version__} lacks" in message and message.startswith("jax_ep._jax.m:")
    assert "jax._src.dispatch.RuntimeTokenSet.gone, jax._src.dispatch.also_gone" in message
    with pytest.raises(ImportError, match=r"lacks jax\._src\.no_such_module"):
        require("m", "jax._src.no_such_module")


def test_varying_axes_inside_and_outside_shard_map():
    mesh = make_mesh(2)
    seen = {}

    def body(x):
        seen["sharded"] = _jax.varying_axes(x)
        seen["replicated"] = _jax.varying_axes(jnp.zeros(()))
        return x

    jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(jnp.zeros(4))
    assert seen == {"sharded": frozenset({"ep"}), "replicated": frozenset()}


def test_distributed_client_says_what_to_do_when_jax_distributed_is_off():
    with pytest.raises(ValueError, match=r"jax.distributed.initialize\(\)"):
        _jax.distributed_client()


def test_importing_jax_ep_changes_nothing_in_jax_and_a_buffer_mends_it():
    """A process that imports jax_ep but makes no Buffer runs JAX's own functions (its fast path
    included); its first Buffer applies the mends (_jax.install)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import jax
        from jax._src import ad_checkpoint, dispatch
        from jax._src.interpreters import pxla
        owners = [(dispatch.RuntimeTokenSet, "get_token_input"),
                  (dispatch.RuntimeTokenSet, "set_token_result"),
                  (pxla.ExecuteReplicated, "__call__"),
                  (pxla.MeshExecutable, "create_cpp_call"),
                  (ad_checkpoint, "_insert_reduce_precision")]
        before = [getattr(o, n) for o, n in owners]
        import jax_ep, jax_ep.nn
        from jax_ep import _jax
        assert [getattr(o, n) for o, n in owners] == before and not _jax.installed()
        assert [m for _, _, m in _jax._MENDS] != before
        mesh = jax.sharding.Mesh(jax.devices()[:1], ("ep",))
        jax_ep.Buffer(mesh, "ep", num_experts=2, hidden=128, num_topk=1, max_tokens_per_rank=2,
                      impl="reference")
        assert _jax.installed() and [getattr(o, n) for o, n in owners] != before
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr[-3000:]


def test_a_float8_residual_of_a_buffer_program_saved_by_checkpoint_keeps_its_values():
    """float8_e4m3fn has no inf: 256..448 use the top exponent, and every FP8 row has its block
    maxima at 448. jax.checkpoint's rounding of saved residuals (XLA's reduce_precision) must leave
    a Buffer's FP8 rows finite: the gradient that reads the saved rows equals the one without
    checkpoint."""
    import numpy as np
    from helpers import put, random_inputs
    from jax.ad_checkpoint import checkpoint_name

    import jax_ep
    from jax_ep.fp8 import dequantize_fp8

    mesh = make_mesh(2)
    x, idx, w = random_inputs(np.random.default_rng(3), 2, 4, 128, 4, 2, 2, "random", jnp.float32)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)

    def loss(a, x, idx, w):
        d = buf.dispatch(x, idx, w, layout="rank", fp8=True)
        q = checkpoint_name(d.x, "q")
        return jnp.sum(dequantize_fp8(q, d.scales) * a[: q.shape[0]], keepdims=True)

    def total(per_rank):
        f = jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        return lambda a, *rest: jnp.sum(f(a, *rest))

    a = jnp.ones((2 * 2 * 4, 128), jnp.float32)  # a rank's rows: 2 sources x 4 tokens
    args = put(mesh, a, x, idx, w)
    saving_q = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names("q"))
    want = jax.jit(jax.grad(total(loss)))(*args)
    got = jax.jit(jax.grad(total(saving_q)))(*args)
    assert np.isfinite(np.asarray(want)).all() and np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_checkpoints_without_a_buffer_round_as_jax_does():
    """The float8 mend changes only checkpoints around a Buffer's calls: any other jaxpr gets
    JAX's own rounding, the same object."""
    from jax._src import ad_checkpoint

    _jax.install()  # as a process's first Buffer does

    def f(x):
        return (x * 300.0).astype(jnp.float8_e4m3fn)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr
    assert remat._remat_residual_rounding(jaxpr, 1) is remat._jax_insert_reduce_precision(jaxpr, 1)
    assert ad_checkpoint._insert_reduce_precision is remat._remat_residual_rounding


def _python_calls(fn, *args):
    """The Python functions a call of fn runs, as (file name, function name): none where JAX's
    C++ fast path serves the call whole."""
    calls = []

    def profile(frame, event, _):
        if event == "call":
            calls.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return calls


def test_a_program_without_a_buffer_keeps_jax_fast_path_once_a_buffer_was_made():
    """With the mends applied (a Buffer made in the process), a jitted program without a Buffer
    runs its later calls in JAX's C++ fast path, as without jax_ep: no Python function at all;
    an ahead-of-time compiled one only its Compiled object's __call__ (stages.py). A program
    that uses a Buffer takes JAX's Python path (pjit's cache_miss: its tokens), which the same
    observation sees."""
    import numpy as np
    from helpers import put, random_inputs

    import jax_ep

    mesh = make_mesh(2)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4)
    assert _jax.installed()

    plain = jax.jit(lambda x: jnp.tanh(x) * 2)
    x = jnp.ones((4, 128))
    plain(x)
    assert _python_calls(plain, x) == []
    compiled = jax.jit(lambda x: x * 3).lower(x).compile()
    compiled(x)
    assert {file for file, _ in _python_calls(compiled, x)} == {"stages.py"}

    def rows(x, idx, w):
        return buf.dispatch(x, idx, w).x

    step = jax.jit(jax.shard_map(rows, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = put(mesh, *random_inputs(np.random.default_rng(0), 2, 4, 128, 4, 2, 2, "random"))
    step(*args)
    assert ("pjit.py", "cache_miss") in _python_calls(step, *args)


def test_every_call_takes_its_operands_through_an_optimization_barrier():
    """XLA's GPU dynamic-slice fusion would fuse a loop's dynamic-slice of stacked residuals
    into a jax_ep call (under a gradient of a fori_loop) and abort compiling on the call's
    token (tests/test_gpu.py::test_cuda_inside_loops_and_gradients). _jax's lowering keeps
    them apart with a barrier; checked here in the lowered program, where CI can see it."""
    import re

    import numpy as np
    from helpers import put, random_inputs

    import jax_ep

    mesh = make_mesh(4)
    x, idx, w = random_inputs(np.random.default_rng(1), 4, 8, 128, 16, 4, 4, "random", jnp.float32)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=16, hidden=128, num_topk=4, max_tokens_per_rank=8)

    def body(x, idx, w):
        def one(_, x):
            d = buf.dispatch(x, idx, w, layout="expert")
            return buf.combine(jnp.tanh(d.x), d.handle, topk_weights=d.topk_weights) + x

        return jax.lax.fori_loop(0, 3, one, x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    loss = lambda x, idx, w: jnp.sum(f(x, idx, w) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss)).lower(*put(mesh, x, idx, w)).as_text()
    barriers = set(re.findall(r"(%[\w.]+)(?::\d+)? = stablehlo\.optimization_barrier", text))
    ordered = "dispatch|combine|dispatch_cached|dispatch_adjoint"  # the calls with the token
    calls = re.findall(rf"stablehlo\.custom_call @(jax_ep_(?:{ordered}))\(([^)]*)\)", text)
    assert len(calls) == 4, calls  # dispatch, combine and their backward passes
    for target, operands in calls:
        values = [v.strip().split("#")[0] for v in operands.split(",")][1:]  # after the token
        assert values and all(v in barriers for v in values), (target, operands)

"""The Buffer's ordering token in the lowered programs: every cross-rank custom call takes the
token of the one before it, so XLA cannot reorder or overlap them (forward, backward, halves,
nested functions)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import make_mesh, random_inputs

E, H, K, T = 16, 128, 4, 8
CALL = re.compile(r"^\s*(%[\w]+)(?::\d+)? = stablehlo\.custom_call @jax_ep_(\w+)\((.*?)\)")
DEF = re.compile(r"^\s*(%[\w]+)(?::\d+)? = (.*)$")
VALUE = re.compile(r"%[\w]+(?:#\d+)?")


def ordered_calls(text):
    """[(name, result, token operand)] of the cross-rank calls of `text`, in program order, and
    each value's operands (to follow a token back through the ops that join tokens)."""
    operands, calls = {}, []
    for line in text.splitlines():
        d = DEF.match(line)
        if d:
            operands[d.group(1)] = [v.split("#")[0] for v in VALUE.findall(d.group(2))]
        c = CALL.match(line)
        if c and c.group(2) != "expert_layout":
            calls.append((c.group(2), c.group(1), VALUE.findall(c.group(3))[0].split("#")[0]))
    return calls, operands


def depends_on(value, ancestor, operands, seen=None):
    seen = set() if seen is None else seen
    if value == ancestor:
        return True
    if value in seen:
        return False
    seen.add(value)
    return any(depends_on(v, ancestor, operands, seen) for v in operands.get(value, ()))


def assert_chained(text, expected):
    calls, operands = ordered_calls(text)
    assert [name for name, _, _ in calls] == expected
    for (_, before, _), (name, _, token) in zip(calls, calls[1:]):
        assert depends_on(token, before, operands), f"{name} does not follow {before}"


def setup():
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x, idx, w = random_inputs(np.random.default_rng(0), 4, T, H, E, K, 4, "random", jnp.float32)
    return mesh, buf, x, idx, w


def test_forward_and_backward_of_two_layers_form_one_chain():
    mesh, buf, x, idx, w = setup()

    def loss(x, idx, w):
        for _ in range(2):
            d = buf.dispatch(x, idx, w, layout="expert")
            x = buf.combine(jnp.tanh(d.x), d.handle, topk_weights=d.topk_weights) + x
        return jnp.sum(x ** 2)

    grads = jax.shard_map(jax.grad(loss, argnums=(0, 2)), mesh=mesh, in_specs=P("ep"),
                          out_specs=P("ep"))
    text = jax.jit(grads).lower(x, idx, w).as_text()
    # Each combine's backward is a cached dispatch; each dispatch's backward one adjoint call
    # that moves the rows' and the weights' cotangents together.
    assert_chained(text, ["dispatch", "combine"] * 2 + ["dispatch_cached", "dispatch_adjoint"] * 2)


def test_halves_and_work_between_them_stay_in_the_chain():
    mesh, buf, x, idx, w = setup()

    def step(x, idx, w):
        pending, _ = buf.dispatch_send(x, idx, w).run_between(lambda v: v * 2, x)
        other = buf.dispatch(x * 3, idx, w)  # a whole op while the first waits
        d = buf.dispatch_recv(pending)
        return buf.combine_recv(buf.combine_send(d.x + other.x, d.handle))

    text = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
        x, idx, w).as_text()
    assert_chained(text, ["dispatch_send", "dispatch", "dispatch_recv", "combine_send",
                          "combine_recv"])


def test_a_loop_body_starts_after_the_calls_before_the_loop():
    mesh, buf, x, idx, w = setup()

    def step(x, idx, w):
        first = buf.dispatch(x, idx, w)

        def body(i, x):
            d = buf.dispatch(x, idx, w)
            return buf.combine(d.x, d.handle)

        return jax.lax.fori_loop(0, 3, body, x) + first.x.sum()

    text = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
        x, idx, w).as_text()
    calls, operands = ordered_calls(text)
    assert [name for name, _, _ in calls] == ["dispatch", "dispatch", "combine"]
    # The loop's first call takes a token that the call before the loop produced (passed in).
    loop = next(line for line in text.splitlines() if "stablehlo.while" in line)
    carried = re.findall(r"= (%[\w]+(?:#\d+)?)", loop.split("stablehlo.while(", 1)[1])
    assert any(depends_on(v.split("#")[0], calls[0][1], operands) for v in carried)
    outputs = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        x, idx, w)
    assert np.isfinite(np.asarray(outputs)).all()


def test_gradient_of_a_loop_after_a_call_matches_the_reference():
    # The loop's backward calls follow their forward calls' tokens, not the call before the
    # loop: JAX cannot transpose a loop whose body captured a value of the trace around it.
    mesh, _, x, idx, w = setup()

    def grads(impl):
        buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K,
                            max_tokens_per_rank=T, impl=impl)

        def step(x, idx, w):
            def layer(i, x):
                d = buf.dispatch(x, idx, w)
                return x + buf.combine(jnp.tanh(d.x), d.handle)

            first = buf.dispatch(x, idx, w)
            loss = lambda x: jax.lax.fori_loop(0, 2, layer, x).sum()
            return jax.grad(loss)(x) + first.x.sum()

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x, idx, w)

    np.testing.assert_allclose(grads("ffi"), grads("reference"), rtol=1e-5, atol=1e-5)

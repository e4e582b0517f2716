"""The Buffer's order in the lowered and compiled programs: every cross-rank custom call takes the
XLA token of the one before it, so XLA cannot reorder or overlap them (forward, backward, halves,
nested functions, separate shard_maps of one jit), under every JAX construct."""

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, random_inputs
from jax.sharding import PartitionSpec as P

import jax_ep

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
        return jnp.sum(x**2)

    grads = jax.shard_map(
        jax.grad(loss, argnums=(0, 2)), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")
    )
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

    text = (
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        .lower(x, idx, w)
        .as_text()
    )
    assert_chained(
        text, ["dispatch_send", "dispatch", "dispatch_recv", "combine_send", "combine_recv"]
    )


def test_a_loop_body_starts_after_the_calls_before_the_loop():
    mesh, buf, x, idx, w = setup()

    def step(x, idx, w):
        first = buf.dispatch(x, idx, w)

        def body(i, x):
            d = buf.dispatch(x, idx, w)
            return buf.combine(d.x, d.handle)

        return jax.lax.fori_loop(0, 3, body, x) + first.x.sum()

    text = (
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        .lower(x, idx, w)
        .as_text()
    )
    calls, operands = ordered_calls(text)
    assert [name for name, _, _ in calls] == ["dispatch", "dispatch", "combine"]
    # The loop's first call takes a token that the call before the loop produced (passed in).
    loop = next(line for line in text.splitlines() if "stablehlo.while" in line)
    carried = re.findall(r"= (%[\w]+(?:#\d+)?)", loop.split("stablehlo.while(", 1)[1])
    assert any(depends_on(v.split("#")[0], calls[0][1], operands) for v in carried)
    outputs = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
        x, idx, w
    )
    assert np.isfinite(np.asarray(outputs)).all()


def test_gradient_of_a_loop_after_a_call_matches_the_reference():
    mesh, _, x, idx, w = setup()

    def grads(impl):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        def step(x, idx, w):
            def layer(i, x):
                d = buf.dispatch(x, idx, w)
                return x + buf.combine(jnp.tanh(d.x), d.handle)

            first = buf.dispatch(x, idx, w)
            loss = lambda x: jax.lax.fori_loop(0, 2, layer, x).sum()
            return jax.grad(loss)(x) + first.x.sum()

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x, idx, w
        )

    np.testing.assert_allclose(grads("ffi"), grads("reference"), rtol=1e-5, atol=1e-5)


# ---- the compiled program: XLA's own HLO after its passes

HLO = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([\w\-]+)\((.*)$")
HLO_VALUE = re.compile(r"%([\w.\-]+)")
TARGET = re.compile(r'custom_call_target="jax_ep_(\w+)"')


def compiled_calls(text, computation="ENTRY"):
    """[(name, instruction, operands)] of the Buffer's calls in one computation of compiled HLO
    text, in program order, and every instruction's operands there."""
    operands, calls, inside = {}, [], False
    for line in text.splitlines():
        if line.startswith(computation) or (
            computation != "ENTRY" and computation in line and line.rstrip().endswith("{")
        ):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        m = HLO.match(line) if inside else None
        if not m:
            continue
        name, args = m.group(1), m.group(3).split("), ")[0]
        operands[name] = HLO_VALUE.findall(args)
        target = TARGET.search(line)
        if target and target.group(1) != "expert_layout":
            calls.append((target.group(1), name, operands[name]))
    return calls, operands


def assert_one_chain(calls, operands):
    """Each call depends on the call before it (through its token or anything else)."""
    for (_, before, _), (name, call, _) in zip(calls, calls[1:]):
        assert depends_on(call, before, operands), f"{name} ({call}) does not follow {before}"


def test_two_shard_maps_of_one_jit_form_one_chain():
    # Independent data in two shard_maps: only the Buffer's token orders them.
    mesh, buf, x, idx, w = setup()
    first = jax.shard_map(
        lambda x, idx, w: buf.dispatch(x, idx, w).x, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")
    )
    second = jax.shard_map(
        lambda x, idx, w: buf.dispatch(x * 2, idx, w, fp8=False).x,
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    step = jax.jit(lambda x, idx, w: (first(x, idx, w), second(x, idx, w)))
    calls, operands = compiled_calls(step.lower(x, idx, w).compile().as_text())
    assert [name for name, _, _ in calls] == ["dispatch", "dispatch"]
    assert_one_chain(calls, operands)
    a, b = step(x, idx, w)
    np.testing.assert_array_equal(np.asarray(b), 2 * np.asarray(a))


def test_calls_inside_a_cond_follow_and_precede_the_calls_around_it():
    mesh, buf, x, idx, w = setup()
    ref = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )

    def program(b):
        def step(x, idx, w, flag):
            d = b.dispatch(x, idx, w)
            y = jax.lax.cond(
                flag[0] > 0,
                lambda v: b.combine(v, d.handle),
                lambda v: b.combine(2 * v, d.handle),
                d.x,
            )
            return b.dispatch(x + 1, idx, w).x.sum() + y

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    flag = jnp.ones((4,), jnp.int32)
    calls, operands = compiled_calls(program(buf).lower(x, idx, w, flag).compile().as_text())
    conditional = next(n for n in operands if n.startswith("conditional"))
    assert [name for name, _, _ in calls] == ["dispatch", "dispatch"]
    assert depends_on(conditional, calls[0][1], operands)
    assert depends_on(calls[1][1], conditional, operands)
    for f in (flag, -flag):
        np.testing.assert_allclose(
            program(buf)(x, idx, w, f), program(ref)(x, idx, w, f), rtol=1e-6
        )


def test_a_nested_jit_called_twice_and_the_calls_around_it_form_one_chain():
    mesh, buf, x, idx, w = setup()
    inner = jax.jit(lambda x, idx, w: buf.dispatch(x, idx, w).x)

    def step(x, idx, w):
        return inner(x, idx, w) + inner(x * 2, idx, w) + buf.dispatch(x * 3, idx, w).x

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    calls, operands = compiled_calls(fn.lower(x, idx, w).compile().as_text())
    assert [name for name, _, _ in calls] == ["dispatch"] * 3
    assert_one_chain(calls, operands)
    np.testing.assert_allclose(
        fn(x, idx, w), 6 * np.asarray(inner_reference(mesh, x, idx, w)), rtol=1e-6
    )


def dispatched_rows(mesh, buf):
    """jit(shard_map) of one dispatch, returning its rows."""
    return jax.jit(
        jax.shard_map(
            lambda x, idx, w: buf.dispatch(x, idx, w).x,
            mesh=mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
    )


def inner_reference(mesh, x, idx, w):
    ref = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )
    return dispatched_rows(mesh, ref)(x, idx, w)


def test_vmap_runs_whole_ops_one_after_another_and_refuses_halves():
    mesh, buf, x, idx, w = setup()
    ref = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl="reference"
    )

    def batched(b):
        def step(xs, idx, w):
            return jax.vmap(lambda v: b.dispatch(v, idx, w).x)(xs)

        return jax.jit(
            jax.shard_map(
                step, mesh=mesh, in_specs=(P(None, "ep"), P("ep"), P("ep")), out_specs=P(None, "ep")
            )
        )

    xs = jnp.stack([x, 2 * x, 3 * x])
    np.testing.assert_array_equal(
        np.asarray(batched(buf)(xs, idx, w)), np.asarray(batched(ref)(xs, idx, w))
    )

    def halves(xs, idx, w):
        return jax.vmap(lambda v: buf.dispatch_recv(buf.dispatch_send(v, idx, w)).x)(xs)

    with pytest.raises(ValueError, match="cannot be batched by vmap"):
        jax.jit(
            jax.shard_map(
                halves,
                mesh=mesh,
                in_specs=(P(None, "ep"), P("ep"), P("ep")),
                out_specs=P(None, "ep"),
            )
        ).lower(xs, idx, w)


def test_programs_launched_from_several_threads_all_match_the_reference():
    # A Buffer's runtime token is kept per process (JAX keeps them per thread) and its programs
    # are launched one at a time, so every device runs them in one order (_jax/tokens.py).
    from jax_ep._jax import tokens as runtime

    mesh, buf, x, idx, w = setup()
    step = dispatched_rows(mesh, buf)
    want = np.asarray(step(x, idx, w))
    order = buf._ops._cfg.order
    results, tokens = {}, {}

    def launch(s, xs):
        results[s] = [step(xs, idx, w) for _ in range(5)]
        tokens[s] = runtime._buffer_tokens[order]

    threads = [threading.Thread(target=launch, args=(s, x * s)) for s in (1.0, 2.0, 3.0, 4.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, outs in results.items():
        for out in outs:
            np.testing.assert_array_equal(np.asarray(out), s * want)
    # One chain: the last launch's token is the process's, whichever thread made it.
    assert runtime._buffer_tokens[order] in tokens.values()
    step(x, idx, w)  # and this thread's next launch continues it
    assert runtime._buffer_tokens[order] not in tokens.values()


def test_a_user_custom_vjp_and_a_scan_with_unroll_match_the_reference():
    mesh, _, x, idx, w = setup()

    def grads(impl):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )

        @jax.custom_vjp
        def moved(x, idx, w):  # a user's rule whose forward and backward both call the Buffer
            return buf.dispatch(x, idx, w).x.sum(0)

        def fwd(x, idx, w):
            d = buf.dispatch(x, idx, w)
            return d.x.sum(0), d.handle

        def bwd(handle, ct):
            rows = jnp.broadcast_to(ct, (handle.capacity, H))
            return buf.combine(rows, handle), None, None

        moved.defvjp(fwd, bwd)

        def step(x, idx, w):
            def layer(x, _):
                return x + jnp.tanh(moved(x, idx, w))[None], None

            loss = lambda x: jax.lax.scan(layer, x, None, length=4, unroll=2)[0].sum()
            return jax.grad(loss)(x)

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            x, idx, w
        )

    np.testing.assert_allclose(grads("ffi"), grads("reference"), rtol=1e-5, atol=1e-5)


def test_an_ahead_of_time_compiled_program_runs_again_and_again():
    # JAX's fast path for a compiled program's later calls passes no runtime token (_jax/aot.py).
    mesh, buf, x, idx, w = setup()
    step = dispatched_rows(mesh, buf)
    compiled = step.lower(x, idx, w).compile()
    want = np.asarray(step(x, idx, w))
    for s in (1.0, 2.0, 3.0):
        np.testing.assert_array_equal(np.asarray(compiled(x * s, idx, w)), s * want)

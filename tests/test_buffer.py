"""Buffer construction and the trace-time errors of docs/API.md (Errors): a ValueError naming
the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_axes, make_mesh, put, random_inputs, run
from jax.sharding import PartitionSpec as P

import jax_ep

T, H, E, K = 8, 256, 8, 2


@pytest.fixture(scope="module", params=["reference", "ffi"])
def setup(request):
    mesh = make_mesh(4, 2)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=request.param
    )
    x, idx, w = random_inputs(np.random.default_rng(0), 8, T, H, E, K, 4, "random")
    return mesh, buf, x, idx, w


def test_attributes():
    buf = jax_ep.Buffer(
        make_mesh(4, 2), "ep", num_experts=16, hidden=H, num_topk=K, max_tokens_per_rank=T
    )
    assert (buf.num_ranks, buf.num_local_experts, buf.impl) == (4, 4, "ffi")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(axis_name="tp"), "axis_name must be an axis of the mesh .*got 'tp'"),
        (dict(num_experts=6), "num_experts=6 must be divisible"),
        (dict(num_experts=0), "num_experts must be a positive integer"),
        (dict(num_experts=-4), "num_experts must be a positive integer"),
        (dict(num_experts=None), "num_experts must be a positive integer"),
        (dict(timeout_s=0), "timeout_s must be positive"),
        (dict(timeout_s=float("inf")), "timeout_s must be at most 1e"),
        (dict(max_tokens_per_rank=1 << 29), "the rows a rank can receive, 4 ranks x"),
        (dict(impl="nccl"), "impl"),
        (dict(hidden=0), "hidden"),
        (dict(max_tokens_per_rank=2.5), "max_tokens_per_rank"),
        (dict(low_latency_tokens=T + 1), "low_latency_tokens"),
        (dict(check_invalid="no"), "check_invalid must be True or False, got 'no'"),
        (dict(max_tokens_per_rank=True), "max_tokens_per_rank"),
    ],
)
def test_construction_errors(kwargs, match):
    args = dict(axis_name="ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        jax_ep.Buffer(make_mesh(4, 2), args.pop("axis_name"), **args)


def test_integral_floats_are_accepted():
    """num_experts=16.0 or expert_alignment=4.0 mean 16 and 4 (and say so in the attributes)."""
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=float(E), hidden=H, num_topk=K, max_tokens_per_rank=T
    )
    assert buf.num_experts == E and isinstance(buf.num_experts, int)
    x, idx, w = random_inputs(np.random.default_rng(0), 4, T, H, E, K, 4, "random")
    out = run(
        mesh,
        lambda x, idx, w: (
            buf.dispatch(x, idx, w, layout="expert", expert_alignment=4.0).group_sizes
        ),
        x,
        idx,
        w,
    )
    assert np.all(np.asarray(out) % 4 == 0)


def expect_error(setup, fn, match, *args):
    mesh, buf, x, idx, w = setup
    with pytest.raises(ValueError, match=match):
        run(mesh, lambda x, idx, w: fn(buf, x, idx, w), *(args or (x, idx, w)))


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda b, x, i, w: b.dispatch(x.astype(jnp.float16), i, w), "x must have dtype"),
        (lambda b, x, i, w: b.dispatch(x[:, :128], i, w), r"x must have shape \(\*, 256\)"),
        (lambda b, x, i, w: b.dispatch(x[None], i, w), "x must have shape"),
        (lambda b, x, i, w: b.dispatch(x, i[:, :1], w), r"topk_idx must have shape \(8, 2\)"),
        (
            lambda b, x, i, w: b.dispatch(x, i.astype(jnp.uint8), w),
            "topk_idx must have dtype int32",
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w.astype(jnp.bfloat16)),
            "topk_weights must have dtype",
        ),
        (lambda b, x, i, w: b.dispatch(x, None, w), "needs topk_idx"),
        (lambda b, x, i, w: b.dispatch(x, i, w, layout="token"), "layout must be"),
        (lambda b, x, i, w: b.dispatch(x, i, w, expert_alignment=0), "expert_alignment"),
        (lambda b, x, i, w: b.dispatch(x, i, w, capacity=0), "capacity must be a positive"),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, layout="expert", expert_alignment=4, capacity=6),
            "multiple of expert_alignment",
        ),
        (lambda b, x, i, w: b.dispatch(x, i, w, round_scale=True), "round_scale=True needs fp8"),
        (lambda b, x, i, w: b.dispatch(x, i, w, fp8="false"), "fp8 must be True or False"),
        (
            lambda b, x, i, w: b.combine(
                *jax.vmap(lambda x: (lambda d: (d.x, d.handle))(b.dispatch(x, i, w)))(
                    jnp.stack([x, x])
                )
            ),
            r"handle.send_pos must have shape \(\*, 4\), got \(2, 8, 4\): combine takes a",
        ),
        (lambda b, x, i, w: b.dispatch(x, i, w, capacity=True), "capacity must be a positive"),
        (lambda b, x, i, w: b.dispatch(x, handle=(1, 2)), "handle must be"),
        (
            lambda b, x, i, w: b.dispatch(x, i, handle=b.dispatch(x, i, w).handle),
            "topk_idx must not be given",
        ),
        (
            lambda b, x, i, w: b.dispatch(
                x, handle=b.dispatch(x, i, w).handle, layout="expert", capacity=4
            ),
            "layout, capacity must not be given",
        ),
        (
            lambda b, x, i, w: b.combine(b.dispatch(x, i, w).x[:-1], b.dispatch(x, i, w).handle),
            r"expert_out must have shape \(32, 256\)",
        ),
        (
            lambda b, x, i, w: b.combine(
                *(lambda d: (d.x, d.handle, d.topk_weights))(b.dispatch(x, i, w))
            ),
            "topk_weights must be None",
        ),
        (
            lambda b, x, i, w: b.combine(
                *(lambda d: (d.x, d.handle, None, d.x[:2]))(b.dispatch(x, i, w))
            ),
            "bias must have shape",
        ),
        (
            lambda b, x, i, w: b.combine(
                *(lambda d: (d.x, d.handle, d.topk_weights[:5]))(
                    b.dispatch(x, i, w, layout="expert")
                )
            ),
            "topk_weights must have shape",
        ),
        (
            lambda b, x, i, w: b.combine(
                b.dispatch(x, i, w).x.astype(jnp.int32), b.dispatch(x, i, w).handle
            ),
            "expert_out must have dtype",
        ),
        (lambda b, x, i, w: b.dispatch(x, i, w, mode="fast"), "mode must be"),
        (lambda b, x, i, w: b.dequantize(b.dispatch(x, i, w), x), "needs the result of an fp8"),
        (
            lambda b, x, i, w: b.dequantize(b.dispatch(x, i, w, fp8=True), x[:-1]),
            r"dequantize's x \(the x dispatched\) must have shape",
        ),
        (
            lambda b, x, i, w: b.dispatch(x, i, w, layout="expert_padded", expert_alignment=8),
            "expert_alignment must be 1 in the expert_padded",
        ),
        (
            lambda b, x, i, w: b.combine(
                *(lambda d: (d.x.reshape(-1, H), d.handle))(
                    b.dispatch(x, i, w, layout="expert_padded")
                )
            ),
            r"expert_out must have shape \(2, 32, 256\)",
        ),
        (
            lambda b, x, i, w: b.combine(
                *(lambda d: (d.x, d.handle, d.topk_weights[0]))(
                    b.dispatch(x, i, w, layout="expert_padded")
                )
            ),
            r"topk_weights must have shape \(2, 32\)",
        ),
        (
            lambda b, x, i, w: b.dispatch_recv(
                b.combine_send(*(lambda d: (d.x, d.handle))(b.dispatch(x, i, w)))
            ),
            "dispatch_recv needs the result of dispatch_send",
        ),
        (lambda b, x, i, w: b.combine_recv(b.dispatch(x, i, w)), "combine_recv needs the result"),
    ],
)
def test_trace_time_errors(setup, fn, match):
    expect_error(setup, fn, match)


def test_too_many_tokens(setup):
    mesh, buf, x, idx, w = setup
    big = jnp.concatenate([x, x])
    with pytest.raises(ValueError, match="max_tokens_per_rank=8"):
        run(
            mesh,
            lambda x, i, w: buf.dispatch(x, i, w),
            big,
            jnp.concatenate([idx, idx]),
            jnp.concatenate([w, w]),
        )


def test_layouts_past_the_rows_limit_are_refused():
    """Both paths index a rank's rows in 32 bits: a capacity past that is refused at trace
    time."""
    mesh = make_mesh(2)
    bufs = {
        impl: jax_ep.Buffer(
            mesh, "ep", num_experts=4, hidden=8, num_topk=1, max_tokens_per_rank=4, impl=impl
        )
        for impl in ("ffi", "reference")
    }
    x, idx = jnp.zeros((8, 8), jnp.float32), jnp.zeros((8, 1), jnp.int32)
    for layout, capacity, rows in (
        ("expert", 1 << 31, 1 << 31),
        ("expert_padded", 1 << 30, 1 << 31),
    ):
        steps = {
            impl: jax.jit(
                jax.shard_map(
                    lambda x, i, b=buf, c=capacity, lay=layout: (
                        b.dispatch(x, i, layout=lay, capacity=c).x
                    ),
                    mesh=mesh,
                    in_specs=P("ep"),
                    out_specs=P("ep"),
                )
            )
            for impl, buf in bufs.items()
        }
        for step in steps.values():
            with pytest.raises(ValueError, match=f"the {layout} layout's {rows} rows"):
                step.lower(x, idx)


def test_fp8_needs_hidden_multiple_of_128():
    mesh = make_mesh(2)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=4, hidden=96, num_topk=1, max_tokens_per_rank=4)
    x = jnp.zeros((8, 96), jnp.bfloat16)
    idx = jnp.zeros((8, 1), jnp.int32)
    with pytest.raises(ValueError, match="hidden % 128"):
        run(mesh, lambda x, i: buf.dispatch(x, i, fp8=True), x, idx)


def test_outside_shard_map(setup):
    _, buf, x, idx, w = setup
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jax.jit(lambda x, i: buf.dispatch(x, i))(x, idx)


def test_wrong_axis_size(setup):
    _, buf, x, idx, w = setup
    other = make_mesh(2)
    with pytest.raises(ValueError, match="has size 2 here but the Buffer was built for 4"):
        run(other, lambda x, i: buf.dispatch(x, i), x[: 2 * T], idx[: 2 * T])


def test_a_mesh_of_the_same_devices_in_another_order_is_refused():
    """The Buffer numbers its ranks by its mesh's device order: the same devices in another
    order would give each device another rank's rows."""
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
    x, idx, w = random_inputs(np.random.default_rng(0), 4, T, H, E, K, 4, "random")
    reordered = jax.sharding.Mesh(mesh.devices[::-1], mesh.axis_names)
    with pytest.raises(ValueError, match="the same devices in the same order"):
        run(reordered, lambda x, i: buf.dispatch(x, i).x, x, idx)
    # An abstract mesh names no devices: their order cannot be checked, so it is refused.
    abstract = jax.jit(
        jax.shard_map(
            lambda x, i: buf.dispatch(x, i).x,
            mesh=mesh.abstract_mesh,
            in_specs=P("ep"),
            out_specs=P("ep"),
        )
    )
    with pytest.raises(ValueError, match="not an abstract one"):
        abstract(*put(mesh, x, idx))
    assert run(mesh, lambda x, i: buf.dispatch(x, i).x, x, idx).shape[0] > 0  # still works


def test_a_partly_manual_shard_map_is_refused_on_the_custom_calls():
    mesh = make_mesh(4, dp=2)
    x, idx, w = random_inputs(np.random.default_rng(0), 8, T, H, E, K, 4, "random")
    for impl in ("ffi", "reference"):
        buf = jax_ep.Buffer(
            mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
        )
        step = jax.jit(
            jax.shard_map(
                lambda x, i, buf=buf: buf.combine(*(lambda d: (d.x, d.handle))(buf.dispatch(x, i))),
                mesh=mesh,
                in_specs=P("ep"),
                out_specs=P("ep"),
                axis_names={"ep"},
            )
        )
        if impl == "ffi":
            with pytest.raises(ValueError, match=r"axes \['dp'\] are automatic here"):
                step(x[: 4 * T], idx[: 4 * T])
        else:  # jax.lax's collectives take it
            assert step(x[: 4 * T], idx[: 4 * T]).shape == (4 * T, H)


def twice(recv, pending):
    recv(pending)
    return recv(pending)


@pytest.mark.parametrize(
    "fn,match",
    [
        (
            lambda b, o, x, i, w: b.combine(*(lambda d: (d.x, d.handle))(o.dispatch(x, i, w))),
            "handle belongs to another Buffer",
        ),
        (
            lambda b, o, x, i, w: b.dispatch(x, handle=o.dispatch(x, i, w).handle),
            "handle belongs to another Buffer",
        ),
        (
            lambda b, o, x, i, w: b.dispatch_recv(o.dispatch_send(x, i, w)),
            "pending is another Buffer's op",
        ),
        (
            lambda b, o, x, i, w: twice(b.dispatch_recv, b.dispatch_send(x, i, w)),
            "pending was received already",
        ),
        (
            lambda b, o, x, i, w: twice(
                b.combine_recv, b.combine_send(*(lambda d: (d.x, d.handle))(b.dispatch(x, i, w)))
            ),
            "pending was received already",
        ),
        (
            lambda b, o, x, i, w: (
                lambda p: (b.dispatch_recv(p.run_between(jnp.sin, x)[0]), b.dispatch_recv(p))
            )(b.dispatch_send(x, i, w)),
            "pending was received already",
        ),
    ],
)
def test_handles_and_pending_ops_of_another_buffer_or_used_twice(setup, fn, match):
    mesh, buf, x, idx, w = setup
    other = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=buf.impl
    )
    with pytest.raises(ValueError, match=match):
        run(mesh, lambda x, idx, w: fn(buf, other, x, idx, w), x, idx, w)
    # Nothing ran: the Buffer works on.
    out = run(mesh, lambda x, idx, w: buf.dispatch(x, idx, w).num_recv, x, idx, w)
    assert np.asarray(out).sum() > 0


def test_a_program_with_a_send_and_no_recv_is_refused(setup):
    """A send whose recv is not in its program (here a Pending carried out as outputs, for
    another program to receive): on the custom calls the program is refused when it is
    compiled. Run, its op kept its slot, and the Buffer's second op after it took its rows
    without an error. (The reference path's send half is the whole op: such a program runs.)
    The refused send is not open: a checking dispatch after it runs."""
    mesh, buf, x, idx, w = setup
    if buf.impl != "ffi":
        pytest.skip("the reference path's sends are whole ops")
    spec = P(tuple(mesh.axis_names))
    send = jax.jit(
        jax.shard_map(
            lambda x, i: jax.tree.map(lambda v: v[None], buf.dispatch_send(x, i)),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    with pytest.raises(ValueError, match="a dispatch_send has no dispatch_recv in its program"):
        send(x, idx)
    # Nothing ran: the Buffer's ops go on, a checking one too.
    whole = run(mesh, lambda x, i, w: buf.dispatch(x, i, w).x, x, idx, w)
    checking = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, check_invalid=True
    )
    again = run(
        mesh, lambda x, i, w: (buf.dispatch(x, i, w).x, checking.dispatch(x, i, w).x), x, idx, w
    )
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(again[0]))


def test_cached_dispatch_with_other_token_count(setup):
    mesh, buf, x, idx, w = setup

    def fn(x, i, w):
        d = buf.dispatch(x, i, w)
        return buf.dispatch(x[:4], handle=d.handle).x

    with pytest.raises(ValueError, match="x has 4 tokens but the handle routed 8"):
        run(mesh, fn, x, idx, w)


def test_run_between_ties_the_work_between_the_halves(setup):
    """Pending.run_between: the work's result, the op's result unchanged, and the two
    optimization barriers that tie the work after the send and the recv after the work."""
    mesh, buf, x, idx, w = setup

    def fn(x, i, w):
        pending, out = buf.dispatch_send(x, i, w).run_between(lambda v: (v * 2).sum(0), x)
        return buf.dispatch_recv(pending).x, out

    def whole(x, i, w):
        return buf.dispatch(x, i, w).x, (x * 2).sum(0)

    got, want = run(mesh, fn, x, idx, w), run(mesh, whole, x, idx, w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    spec = all_axes(mesh)
    text = str(
        jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(
            *put(mesh, x, idx, w)
        )
    )
    assert text.count("optimization_barrier") == 2, text


@pytest.mark.parametrize("impl", ["reference", "ffi"])
@pytest.mark.parametrize("layout", ["rank", "expert", "expert_padded"])
def test_no_tokens_on_any_rank(layout, impl):
    """T = 0 on every rank: nothing dispatched or combined, in every layout, on both paths (the
    custom-call path runs the reference path's ops then: XLA rejects custom calls whose operands
    are all empty)."""
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(
        mesh, "ep", num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, impl=impl
    )

    def fn(x, i, w):
        d = buf.dispatch(x, i, w, layout=layout)
        y = buf.combine(d.x, d.handle, topk_weights=None if layout == "rank" else d.topk_weights)
        return y, d.tokens_per_expert

    x = jnp.zeros((0, H), jnp.bfloat16)
    y, per_expert = run(mesh, fn, x, jnp.zeros((0, K), jnp.int32), jnp.zeros((0, K), jnp.float32))
    assert y.shape == (0, H) and not np.asarray(per_expert).any()


@pytest.mark.parametrize("impl", ["reference", "ffi"])
def test_no_tokens_with_check_invalid_under_a_gradient(impl):
    """check_invalid=True and T = 0: no ids to check, so no callback (XLA refused one whose
    operands did not vary over the mesh, under a gradient)."""
    mesh = make_mesh(4)
    buf = jax_ep.Buffer(
        mesh,
        "ep",
        num_experts=E,
        hidden=H,
        num_topk=K,
        max_tokens_per_rank=T,
        impl=impl,
        check_invalid=True,
    )
    i = jnp.zeros((0, K), jnp.int32)
    f = jax.shard_map(
        lambda x: buf.combine(*(lambda d: (d.x, d.handle))(buf.dispatch(x, i))),
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    grad = jax.jit(jax.grad(lambda x: f(x).sum()))(jnp.zeros((0, H), jnp.float32))
    assert grad.shape == (0, H)


def test_custom_calls_op_by_op_in_shard_map_say_to_jit():
    """JAX cannot run the custom calls' ops op by op inside shard_map (no jit around it): a
    clear error says what to do, instead of JAX's NotImplementedError; under jax.jit the same
    function runs."""
    mesh = make_mesh(2)
    x, idx, w = random_inputs(np.random.default_rng(0), 2, 4, 128, 8, 2, 2, "random", jnp.float32)
    buf = jax_ep.Buffer(mesh, "ep", num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=4)

    def step(x, idx, w):
        d = buf.dispatch(x, idx, w)
        return buf.combine(d.x, d.handle)

    f = jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    with pytest.raises(ValueError, match="wrap the shard_map that calls them in jax.jit"):
        f(x, idx, w)
    assert np.isfinite(np.asarray(jax.jit(f)(x, idx, w))).all()

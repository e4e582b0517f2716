"""Nodes of a tuple axis that run different ops (jax_ep/hierarchical.py): each op's signature
(kernels/signature.h, the words a flat Buffer's ranks compare at every op) crosses the node axes
in one small all_gather before the op's node leg. Every rank of the group sees every node's
signature, so all of them take the same branch: where nodes disagree, none runs the op's node-leg
collectives (XLA's collectives stay in step), the op's results are NaN (integers -1, counts 0),
and each rank stops its native side with both signatures (status() names both ops, the next op
raises)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._jax import varying_axes

DISPATCH, CACHED, COMBINE = 1, 2, 3  # kernels/signature.h OpKind
_DTYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1}  # kernels/dtype.h Dtype


def signature(kind, dtype, width, tokens, experts, *, columns=0, fp8=False, round_scale=False):
    """kernels/signature.h's three words (signature_words) as six int32 words, site included."""
    from jax_ep.ffi_path import call_site  # the extension's module: the check runs with it

    w0 = (
        kind
        | int(fp8) << 8
        | int(round_scale) << 9
        | _DTYPES[jnp.dtype(dtype)] << 10
        | (columns & 0xFFFF) << 16
        | experts << 32
    )
    words = np.array([w0, width | tokens << 32, call_site()], np.uint64)
    return words.view(np.int32)


class Check(NamedTuple):
    """An op's check (arrays: halves of a split op carry it): whether every node runs it, and
    if not, which node ran what."""

    ok: Any  # bool, the same on every rank of the group
    node: Any  # this rank's node
    other: Any  # the first node whose op differs
    mine: Any  # [6] int32: this node's signature
    theirs: Any  # [6] int32: the other's


def agree(outer, words, after):
    """`words` (from signature()) against every node's: a Check. `after`: an input of the op, so
    that the check follows what made it."""
    mine = jnp.asarray(words)
    mine, _ = jax.lax.optimization_barrier((mine, after))
    every = jax.lax.all_gather(mine, outer)  # [nodes, 6]
    differs = jnp.any(every != mine, axis=1)
    other = jnp.argmax(differs)
    return Check(~jnp.any(differs), jax.lax.axis_index(outer), other, mine, every[other])


def _stop(key, node, other, mine, theirs, *_):
    from jax_ep import _native

    as_words = lambda w: np.asarray(w, np.int32).view(np.uint64).tolist()  # noqa: E731
    _native.nodes_differ(key, int(node), int(other), as_words(mine), as_words(theirs))


def finish(key, check, outputs):
    """The op's outputs; where the nodes disagree, also stops Buffer `key`'s ranks here (a host
    callback, run only then) once `outputs` are made: the op itself ends with NaN (a stop before
    it would fail it), the next op raises."""
    if check is None:
        return outputs

    def stop():
        jax.debug.callback(functools.partial(_stop, key), *check[1:], *jax.tree.leaves(outputs))

    jax.lax.cond(check.ok, lambda: None, stop)
    return outputs


def _filled(x, value):
    return jnp.full(x.shape, value, x.dtype)


def failed(x):
    """What a failed op leaves in x's place: NaN (floats), -1 (integers), False."""
    if x.dtype == jnp.bool_:
        return _filled(x, False)
    return _filled(x, jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else -1)


def where_agree(check, run, *args, fill=failed):
    """run(*args) (an op's node-leg collectives) where the nodes agree, else fill of each result,
    on every rank alike: no rank runs a collective that the others skip."""
    if check is None:
        return run(*args)
    out_shapes = jax.eval_shape(run, *args)
    axes = frozenset().union(*(varying_axes(a) for a in jax.tree.leaves(args)))

    def vary(tree):
        def one(x):
            missing = tuple(sorted(axes - varying_axes(x)))
            return jax.lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(one, tree)

    def skipped(*_):
        return vary(jax.tree.map(fill, out_shapes))

    return jax.lax.cond(check.ok, lambda *a: vary(run(*a)), skipped, *args)


def mask(check, tree, fill=failed):
    """tree where the nodes agree, else what a failed op leaves."""
    if check is None:
        return tree
    return jax.tree.map(lambda x: jnp.where(check.ok, x, fill(x)), tree)

"""The rank-level operations a backend provides (its contract); Buffer builds dispatch and
combine from them.

Rank level (crosses ranks):
  dispatch(x, topk_idx, topk_weights)   -> RankRows, Routing   one row per (source rank, token)
  dispatch_cached(x, send_pos, ...)     -> x rows, scales      the same routes, new x
  combine(rows, send_pos, ..., bias)    -> [T, W]              bias + sum over ranks, float32
Receiver-local:
  expert_layout(topk_rows)              -> layout.ExpertMaps   rank-level rows -> expert rows
  expert_padded(topk_rows, w_rows, rows) -> maps, weights, rows a fresh dispatch's rows in the
                                                               expert_padded layout, in one step
  place_rows(rows, expert_rows, C)      -> [C, W]              rows into the expert_padded
                                                               layout (a cached dispatch)
Neither writes the rows of the expert_padded layout past an expert's count (unspecified).

The three cross-rank operations also come split, as X_send(...) -> (arrays, finish) with
finish(arrays) -> the result of X: the send half returns once the data is on its way, finish
waits for the peers. Backends that cannot split (Unsplit) do the whole op in the send half.
dispatch's low_latency picks the backend's single-kernel path where it has one (CUDA); results
are identical.

Backends: reference.Reference (jax.lax.all_to_all) and ffi_path.Ffi (custom calls), and
hierarchical.Hierarchical, which runs one of them inside a node after a node leg.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jax_ep._jax import varying_axes

Array = Any


def as_stored(x):
    """x as its dtype stores it, for a conversion to float32 in the program that computed x: XLA
    may fuse the two and skip the rounding to x's narrower dtype (excess precision, on by
    default), where a custom call reads the value stored. A barrier keeps the rounding."""
    return jax.lax.optimization_barrier(x) if x.dtype.itemsize < 4 else x


def varying_like(outputs, *inputs):
    """outputs varying over every mesh axis that one of inputs varies over: custom calls return
    values JAX sees as the same on every rank (shard_map's check_vma needs to know)."""
    axes = frozenset().union(*map(varying_axes, inputs))

    def vary(out):
        missing = tuple(sorted(axes - varying_axes(out)))
        return jax.lax.pcast(out, missing, to="varying") if missing else out

    return jax.tree.map(vary, outputs)


def all_varying(*args):
    """The arguments varying like the most varying of them: a custom_vjp's backward returns
    gradients that vary like the cotangents, so an input that does not vary (weights made
    inside shard_map, a replicated x) must become varying first; its gradient then gets the
    psum that the cast transposes into."""
    return varying_like(args, *(a for a in args if a is not None))


class RankRows(NamedTuple):
    x: Array  # [S, H] x dtype, or e4m3fn when fp8
    scales: Array | None  # [S, H / 128] float32 when fp8
    topk_idx: Array  # [S, K] local expert ids or -1
    topk_weights: Array  # [S, K] float32, 0 where -1


class Routing(NamedTuple):
    send_pos: Array  # [T, R]
    recv_counts: Array  # [R]
    tokens_per_expert: Array  # [E_l]
    num_recv: Array  # []
    num_dropped: Array  # []
    num_invalid: Array  # [] this rank's expert ids outside [-1, E)
    group_invalid: Array  # [] those of every rank of the EP group (check_invalid raises on it)


def done(result):
    """The finish of an op that was done whole in its send half."""
    return result


def start(split, whole, send, *args, **kwargs):
    """(arrays, finish) of a rank-level operation: its send half (split), or the whole op up
    front with nothing left to finish."""
    if split:
        return send(*args, **kwargs)
    return whole(*args, **kwargs), done


class Unsplit:
    """The split operations of a backend whose ops cannot be split: the send half does it all."""

    def dispatch_send(self, *args, **kwargs):
        return self.dispatch(*args, **kwargs), done

    def dispatch_cached_send(self, *args, **kwargs):
        return self.dispatch_cached(*args, **kwargs), done

    def combine_send(self, *args, **kwargs):
        return self.combine(*args, **kwargs), done

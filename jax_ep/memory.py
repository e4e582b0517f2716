"""Every size a Buffer and the MoE layer allocate, in one place: the window (laid out by
kernels/window.h, which this asks), the rows of a dispatch's output, and `memory_plan`, the
bytes per GPU of a configuration, computed without a machine of that size (docs/API.md,
"Planning memory"), and the backends' limits. Buffer and jax_ep.nn size themselves through
these functions, so the plan and what they allocate cannot drift apart."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from jax_ep.fp8 import FP8_BLOCK
from jax_ep.layout import MAX_RANK_ROWS, align_up

LAYOUTS = ("rank", "expert", "expert_padded")
FLOAT_ROWS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # what rows and sums may be


def fail(message):
    raise ValueError(f"jax_ep: {message}")


def is_integer(value):
    if isinstance(value, (bool, np.bool_)):  # True is 1 to Python, not a count
        return False
    try:
        return int(value) == value
    except (TypeError, ValueError):
        return False


def positive_integers(**values):
    """The values as ints, each checked to be a positive integer (the error names it)."""
    for name, value in values.items():
        if not is_integer(value) or value < 1:
            fail(f"{name} must be a positive integer, got {value!r}")
    return tuple(int(v) for v in values.values())


def check_group(num_ranks, num_experts, max_tokens_per_rank, axis):
    """What an EP group of num_ranks ranks (`axis` names them in errors) can hold."""
    if num_experts % num_ranks:
        fail(f"num_experts={num_experts} must be divisible by the {num_ranks} ranks of {axis}")
    if num_ranks * max_tokens_per_rank > MAX_RANK_ROWS:
        fail(
            f"the rows a rank can receive, {num_ranks} ranks x max_tokens_per_rank="
            f"{max_tokens_per_rank}, must be at most {MAX_RANK_ROWS}"
        )


def row_dtype(dtype, name):
    if jnp.dtype(dtype) not in FLOAT_ROWS:
        fail(f"{name} must be float32 or bfloat16, got {dtype!r}")
    return jnp.dtype(dtype)


def check_row_width(dtype, max_row_dtype, name):
    """Rows of `dtype` fit a Buffer whose rows hold max_row_dtype elements."""
    if jnp.dtype(dtype).itemsize > jnp.dtype(max_row_dtype).itemsize:
        fail(
            f"{name} is {jnp.dtype(dtype).name}, wider than this Buffer's rows "
            f"(max_row_dtype={jnp.dtype(max_row_dtype).name})"
        )


def check_capacity_factor(factor):
    if factor is not None and not 0 < factor < math.inf:
        raise ValueError(
            f"jax_ep.nn: capacity_factor must be positive and finite or None, got {factor!r}"
        )


# ---------------------------------------------------------------- what a Buffer allocates


@functools.cache
def limits():
    """The backends' limits (kernels/limits.h)."""
    from jax_ep import _native

    return _native.limits()


def window(
    num_nodes, ranks_per_node, num_experts, hidden, num_topk, max_tokens_per_rank, max_row_dtype
):
    """A rank's window (kernels/window.h's Window): the fast leg's, over the ranks of one node,
    sized for the num_nodes * N tokens the node leg can bring (one node: the whole group)."""
    from jax_ep import _native

    return _native.Window(
        ranks_per_node,
        num_experts // (num_nodes * ranks_per_node),
        hidden,
        num_topk,
        num_nodes * max_tokens_per_rank,
        jnp.dtype(max_row_dtype).itemsize,
    )


def default_capacity(layout, num_ranks, max_tokens, num_topk, experts_per_rank, alignment):
    """Output rows when the caller gives no capacity: the worst case, so nothing is dropped.
    (expert_padded: rows per expert.)"""
    if layout in ("rank", "expert_padded"):
        return num_ranks * max_tokens
    worst = num_ranks * max_tokens * min(num_topk, experts_per_rank)
    return align_up(worst + (alignment - 1) * experts_per_rank, alignment)


def factor_capacity(factor, num_ranks, tokens, num_topk, experts_per_rank, alignment):
    """The MoE layer's expert-layout rows for its capacity_factor: each local expert's share of
    the balanced T * K rows, times the factor, aligned; at most the default (every row)."""
    balanced = tokens * num_topk / experts_per_rank
    rows = experts_per_rank * align_up(math.ceil(factor * balanced), alignment)
    default = default_capacity("expert", num_ranks, tokens, num_topk, experts_per_rank, alignment)
    return min(rows, default)


def dropless_rounds(capacity, num_ranks, tokens, num_topk, experts_per_rank, alignment):
    """The most dispatch rounds a dropless layer of `capacity` expert rows may need: the worst
    case's rows (default_capacity), `capacity` a round."""
    worst = default_capacity("expert", num_ranks, tokens, num_topk, experts_per_rank, alignment)
    return -(-worst // capacity)


def output_capacity(layout, alignment, capacity, num_ranks, max_tokens, num_topk, experts_per_rank):
    """A dispatch's `capacity` (None: the default), checked against its layout: the output's
    rows (expert_padded: rows per expert)."""
    if capacity is None:
        capacity = default_capacity(
            layout, num_ranks, max_tokens, num_topk, experts_per_rank, alignment
        )
    if not is_integer(capacity) or capacity < 1:
        fail(f"capacity must be a positive integer, got {capacity!r}")
    if layout == "expert" and capacity % alignment:
        fail(
            f"capacity={capacity} must be a multiple of expert_alignment={alignment} in the "
            f"expert layout"
        )
    rows = capacity * (experts_per_rank if layout == "expert_padded" else 1)
    if rows > MAX_RANK_ROWS:
        fail(
            f"the {layout} layout's {rows} rows (capacity={capacity}) exceed "
            f"{MAX_RANK_ROWS}: give a smaller capacity"
        )
    return int(capacity)


def check_layout(layout, alignment):
    """A dispatch's layout and expert_alignment -> the alignment as an int."""
    if layout not in LAYOUTS:
        fail(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if not is_integer(alignment) or alignment < 1:
        fail(f"expert_alignment must be a positive integer, got {alignment!r}")
    if layout == "expert_padded" and alignment != 1:
        fail(
            f"expert_alignment must be 1 in the expert_padded layout (every expert's block "
            f"has `capacity` rows), got {alignment!r}"
        )
    return int(alignment)


# ---------------------------------------------------------------- the plan


def memory_plan(
    axis_sizes,
    *,
    num_experts,
    hidden,
    num_topk,
    max_tokens_per_rank,
    max_row_dtype=jnp.float32,
    x_dtype=None,
    layout="expert",
    expert_alignment=1,
    fp8=False,
    capacity=None,
    capacity_factor=None,
    dropless=False,
    partial_dtype=None,
):
    """Bytes per GPU of a Buffer and of one dispatch and combine at max_tokens_per_rank tokens
    per rank, from sizes alone (no devices, no Buffer): what Buffer.memory_bytes and the MoE
    layer compute, through the same functions.

    Arguments (counts are integers; sizes in elements):
        axis_sizes: the sizes of the Buffer's axis_name, outer first: (72,) for one axis of 72
            ranks, (8, 8) for ("node", "ep") of 8 nodes of 8 GPUs.
        num_experts, hidden, num_topk, max_tokens_per_rank: the Buffer's (E, H, K, N).
        max_row_dtype: the Buffer's, float32 or bfloat16: the width of the window's rows.
        x_dtype: the tokens' dtype (and expert_out's, and combine's output); default
            max_row_dtype.
        layout, expert_alignment, fp8, capacity: the dispatch's (capacity in rows, per expert
            in expert_padded; None: the worst case, nothing dropped). layout defaults to
            "expert", the MoE layer's.
        capacity_factor: the layer's (MoEConfig.capacity_factor; expert layout, no capacity).
        dropless: the layer's (MoEConfig.dropless, with capacity_factor): rows past the
            capacity go in further rounds of the same size, which need overflow_sum too.
        partial_dtype: the combine's (the expert layouts' partial sums); default
            max_row_dtype.

    Returns {part: bytes} (ints):
        window: the communication window each rank holds outside XLA (Buffer.memory_bytes);
            on a tuple axis the fast leg's, sized for the M * N tokens the node leg brings.
        window_control: the control words of the window (included in window).
        expert_buffer: the dispatch's rows, d.x: [capacity, H] (expert_padded [E_l, capacity,
            H]) of x_dtype, or float8 with fp8.
        scales: d.scales with fp8 ([rows, H/128] float32), else 0.
        received_rows: the R * N rank-level rows (x and scales) the exchange delivers before
            the receiver lays them out (expert layouts), and on a tuple axis the fast leg's
            before they are put in rank order; 0 in the rank layout on one axis, whose output
            they are.
        node_leg: on a tuple axis, the blocks XLA's all_to_all sends and receives across
            nodes: M * N rows of x's payload each way (dispatch) and M * N float32 partial
            sums each way (combine); 0 on one axis.
        combine_input: expert_out, the experts' output rows combine reads (x_dtype, the shape
            of expert_buffer).
        combine_rows: the R * N rank-level rows combine sends (expert layouts: each token's
            partial sum in partial_dtype; the rank layout sends expert_out itself), and on a
            tuple axis their copy in the fast leg's order.
        combine_output: y, [N, H] of x_dtype.
        overflow_sum: with dropless, the float32 [N, H] sum of the later rounds' combines;
            else 0.

    The XLA parts are the arrays of H-wide rows (the few words of ids and weights per row are
    left out); XLA allocates them per op and may reuse one's memory for another, so their sum
    bounds a step's peak from above. The window is allocated once per Buffer. This is today's
    design: every whole op's rows land in the window at once, in a block of N rows per source
    in each of two slots, so the window grows with R * N. Other modes (windows that stream a
    fixed number of rows per source) add their own arguments and parts.
    """
    sizes = tuple(axis_sizes) if isinstance(axis_sizes, (tuple, list)) else None
    if not sizes or not all(is_integer(s) and s > 0 for s in sizes):
        fail(f"axis_sizes must be a tuple of positive axis sizes, outer first, got {axis_sizes!r}")
    num_nodes, ranks_per_node = math.prod(sizes[:-1]), int(sizes[-1])
    num_ranks = num_nodes * ranks_per_node
    num_experts, hidden, num_topk, tokens = positive_integers(
        num_experts=num_experts,
        hidden=hidden,
        num_topk=num_topk,
        max_tokens_per_rank=max_tokens_per_rank,
    )
    check_group(num_ranks, num_experts, tokens, f"axis_sizes {sizes}")
    max_row = row_dtype(max_row_dtype, "max_row_dtype")
    x_dtype = max_row if x_dtype is None else row_dtype(x_dtype, "x_dtype")
    partial = max_row if partial_dtype is None else row_dtype(partial_dtype, "partial_dtype")
    if fp8 and hidden % FP8_BLOCK:
        fail(f"fp8 needs hidden % 128 == 0, got hidden={hidden}")
    if not fp8:
        check_row_width(x_dtype, max_row, "x_dtype")
    check_row_width(partial, max_row, "partial_dtype")
    alignment = check_layout(layout, expert_alignment)
    experts_per_rank = num_experts // num_ranks
    if capacity_factor is not None:
        check_capacity_factor(capacity_factor)
        if layout != "expert" or capacity is not None:
            fail("capacity_factor sizes the expert layout's rows, instead of a capacity")
        capacity = factor_capacity(
            capacity_factor, num_ranks, tokens, num_topk, experts_per_rank, alignment
        )
    if dropless and capacity_factor is None:
        fail("dropless bounds each round at capacity_factor: give one")
    rows = output_capacity(
        layout, alignment, capacity, num_ranks, tokens, num_topk, experts_per_rank
    )
    if layout == "expert_padded":
        rows *= experts_per_rank
    width = hidden * (1 if fp8 else x_dtype.itemsize)  # a row's payload
    scale_bytes = 4 * (hidden // FP8_BLOCK) if fp8 else 0
    received = num_ranks * tokens
    # Copies of the R * N rank-level rows: the expert layouts lay them out anew, a tuple axis
    # reorders the fast leg's.
    copies = (layout != "rank") + (num_nodes > 1)
    sent_bytes = partial.itemsize if layout != "rank" else x_dtype.itemsize
    node_rows = 2 * num_nodes * tokens if num_nodes > 1 else 0  # sent and received
    w = window(num_nodes, ranks_per_node, num_experts, hidden, num_topk, tokens, max_row)
    return dict(
        window=w.total_bytes(),
        window_control=w.rows_at(),
        expert_buffer=rows * width,
        scales=rows * scale_bytes,
        received_rows=copies * received * (width + scale_bytes),
        node_leg=node_rows * (width + scale_bytes + 4 * hidden),
        combine_input=rows * hidden * x_dtype.itemsize,
        combine_rows=copies * received * hidden * sent_bytes,
        combine_output=tokens * hidden * x_dtype.itemsize,
        overflow_sum=tokens * hidden * 4 if dropless else 0,
    )

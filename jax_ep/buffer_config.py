"""A Buffer's arguments, checked once, and the counts derived from them (BufferConfig)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from typing import Any

import jax
import numpy as np

from jax_ep import memory
from jax_ep.checks import check_flag
from jax_ep.memory import fail, is_integer


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """What a Buffer was asked for (docs/API.md, "Buffer"), checked, with its counts."""

    mesh: jax.sharding.Mesh
    axis_name: Any  # as given: a mesh axis, or a tuple of them, outer first
    axes: tuple  # axis_name as a tuple of mesh axes, outer first
    num_nodes: int  # M: the outer axes' product (1 on one axis)
    ranks_per_node: int  # the last axis's size: the ranks of the fast leg
    num_ranks: int  # R = M * ranks_per_node
    num_experts: int  # E
    num_local_experts: int  # E_l = E / R
    hidden: int  # H
    num_topk: int  # K
    max_tokens_per_rank: int  # N
    max_row_dtype: np.dtype
    impl: str  # "ffi" or "reference"
    num_sms: int
    timeout_s: float
    low_latency_tokens: Any  # the single-kernel path's bound (checked for impl="ffi" only)
    check_invalid: bool

    @property
    def fast_axis(self):
        return self.axes[-1]

    @property
    def outer_axes(self):
        return self.axes[:-1]

    @classmethod
    def checked(
        cls,
        mesh,
        axis_name,
        *,
        num_experts,
        hidden,
        num_topk,
        max_tokens_per_rank,
        impl,
        num_sms,
        timeout_s,
        low_latency_tokens,
        check_invalid,
        max_row_dtype,
    ):
        """The config of Buffer(...)'s arguments; raises ValueError naming a wrong one."""
        axes = _axes(mesh, axis_name)
        num_nodes = math.prod(mesh.shape[a] for a in axes[:-1])
        ranks_per_node = mesh.shape[axes[-1]]
        num_ranks = num_nodes * ranks_per_node
        num_experts, hidden, num_topk, max_tokens_per_rank, num_sms = memory.positive_integers(
            num_experts=num_experts,
            hidden=hidden,
            num_topk=num_topk,
            max_tokens_per_rank=max_tokens_per_rank,
            num_sms=num_sms,
        )
        memory.check_group(num_ranks, num_experts, max_tokens_per_rank, f"axis {axis_name!r}")
        if low_latency_tokens is None:
            low_latency_tokens = min(num_nodes * max_tokens_per_rank, 256)
        if impl not in ("auto", "ffi", "reference"):
            fail(f"impl must be 'auto', 'ffi' or 'reference', got {impl!r}")
        if not timeout_s > 0:
            fail(f"timeout_s must be positive, got {timeout_s!r}")
        max_row_dtype = memory.row_dtype(max_row_dtype, "max_row_dtype")
        impl = _resolve_impl(impl)
        check_flag(check_invalid, "check_invalid")
        if check_invalid:
            try:
                jax.devices("cpu")
            except RuntimeError:
                fail(
                    "check_invalid=True raises through a host callback, which needs JAX's CPU "
                    "platform: list cpu in JAX_PLATFORMS (e.g. JAX_PLATFORMS=cuda,cpu)"
                )
        if impl == "ffi":
            _check_custom_calls(
                float(timeout_s), low_latency_tokens, num_nodes, max_tokens_per_rank
            )
        return cls(
            mesh=mesh,
            axis_name=axis_name,
            axes=axes,
            num_nodes=num_nodes,
            ranks_per_node=ranks_per_node,
            num_ranks=num_ranks,
            num_experts=num_experts,
            num_local_experts=num_experts // num_ranks,
            hidden=hidden,
            num_topk=num_topk,
            max_tokens_per_rank=max_tokens_per_rank,
            max_row_dtype=max_row_dtype,
            impl=impl,
            num_sms=num_sms,
            timeout_s=float(timeout_s),
            low_latency_tokens=low_latency_tokens,
            check_invalid=bool(check_invalid),
        )

    def fast_tokens(self, tokens):
        """Tokens per rank in the fast leg: what the node leg brings from every node."""
        return self.num_nodes * tokens

    def window(self):
        """A rank's communication window (memory.window: kernels/window.h's Window)."""
        return memory.window(
            self.num_nodes,
            self.ranks_per_node,
            self.num_experts,
            self.hidden,
            self.num_topk,
            self.max_tokens_per_rank,
            self.max_row_dtype,
        )

    def capacity(self, layout, alignment, capacity):
        """A dispatch's output rows (expert_padded: per expert) for its `capacity` (None: the
        worst case), checked against its layout."""
        return memory.output_capacity(
            layout,
            alignment,
            capacity,
            self.num_ranks,
            self.max_tokens_per_rank,
            self.num_topk,
            self.num_local_experts,
        )

    def held_by(self, process):
        """The nodes (a tuple axis) or ranks of the Buffer that `process`'s devices hold."""
        names, shape = self.mesh.axis_names, self.mesh.devices.shape
        coords = [i for i, d in np.ndenumerate(self.mesh.devices) if d.process_index == process]
        if self.num_nodes > 1:
            outer = [names.index(a) for a in self.outer_axes]
            nodes = {
                np.ravel_multi_index([c[a] for a in outer], [shape[a] for a in outer])
                for c in coords
            }
            return f"node {', '.join(map(str, sorted(nodes)))} of {self.axis_name!r}"
        fast = names.index(self.fast_axis)
        ranks = sorted({c[fast] for c in coords})
        return f"rank {', '.join(map(str, ranks))} of {self.axis_name!r}"


def _axes(mesh, axis_name):
    """axis_name as a tuple of mesh axes, outer first (one name: a tuple of one)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown or len(set(axes)) != len(axes):
        fail(
            f"axis_name must be an axis of the mesh {tuple(mesh.axis_names)}, or a tuple of "
            f"distinct ones (outer first), got {axis_name!r}"
        )
    return axes


def _resolve_impl(impl):
    """impl="auto": the custom calls where the compiled extension is installed, else the
    reference path, with a warning naming what to install."""
    if impl != "auto":
        return impl
    if importlib.util.find_spec("jax_ep._native") is not None:
        return "ffi"
    warnings.warn(
        "jax_ep: the compiled extension is not installed (pip install . from jax_ep's source "
        "builds it), so this Buffer runs the reference path (jax.lax collectives)",
        stacklevel=4,  # Buffer(...)'s caller
    )
    return "reference"


def _check_custom_calls(timeout_s, low_latency_tokens, num_nodes, max_tokens_per_rank):
    """The arguments that the custom calls bound (kernels/limits.h)."""
    try:
        bounds = memory.limits()
    except ImportError as e:
        raise ValueError(
            "jax_ep: the custom calls need jax_ep's compiled extension, which "
            "this installation lacks (pip install . builds it); "
            "impl='reference' runs without it"
        ) from e
    fast_tokens = num_nodes * max_tokens_per_rank
    nodes = f"{num_nodes} nodes x " if num_nodes > 1 else ""
    if timeout_s > bounds["max_timeout_s"]:
        fail(f"timeout_s must be at most {bounds['max_timeout_s']:g}, got {timeout_s!r}")
    if not is_integer(low_latency_tokens) or not 0 <= low_latency_tokens <= min(
        fast_tokens, bounds["max_in_block_tokens"]
    ):
        fail(
            f"low_latency_tokens must be an integer in [0, min({nodes}max_tokens_per_rank, "
            f"{bounds['max_in_block_tokens']})], got {low_latency_tokens!r}"
        )

"""jax_ep.Buffer: dispatch and combine (docs/API.md), built from the primitives of a backend."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _jax, bootstrap, memory
from jax_ep import layout as layouts
from jax_ep.fp8 import FP8_BLOCK, dequantize_fp8
from jax_ep.hierarchical import Hierarchical
from jax_ep.memory import FLOAT_ROWS, is_integer
from jax_ep.rank_ops import all_varying, as_stored, start
from jax_ep.reference import Reference
from jax_ep.results import DispatchResult, Handle, Pending, Receipt

_MODES = ("auto", "normal", "low_latency")


_SERIALS = itertools.count(1)


@functools.cache
def limits():
    """The backends' limits (kernels/limits.h)."""
    from jax_ep import _native

    return _native.limits()


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
        stacklevel=3,
    )
    return "reference"


def _raise_if_invalid(here, everywhere, num_experts):
    if int(everywhere):
        raise ValueError(
            f"jax_ep: topk_idx holds {int(everywhere)} expert id(s) outside "
            f"[-1, {num_experts}) ({int(here)} on this rank); they were excluded "
            f"from the dispatch"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dequantize_with_combined_grad(combine, x, q, scales, handle):
    """q * scales as x.dtype; x's gradient is the combine of the rows' cotangents."""
    return dequantize_fp8(q, scales).astype(x.dtype)


def _dequantize_with_combined_grad_fwd(combine, x, q, scales, handle):
    return _dequantize_with_combined_grad(combine, x, q, scales, handle), handle


def _dequantize_with_combined_grad_bwd(combine, handle, ct):
    # q and scales get zeros that JAX sees as zeros: the dispatch's backward skips them.
    return combine(ct, handle), None, None, None


_dequantize_with_combined_grad.defvjp(
    _dequantize_with_combined_grad_fwd, _dequantize_with_combined_grad_bwd
)


@dataclasses.dataclass(frozen=True)
class DispatchSpec:
    """A fresh dispatch's checked arguments, as Buffer._dispatch_start built them."""

    x: jax.Array  # [T, H] the tokens
    topk_idx: jax.Array  # [T, K] int32 expert ids
    topk_weights: jax.Array  # [T, K] float32 (zeros when the caller gave none)
    has_weights: bool  # the caller gave topk_weights (the result carries them)
    layout: str  # "rank", "expert" or "expert_padded"
    alignment: int  # expert_alignment
    capacity: int  # output rows (expert_padded: rows per expert)
    fp8: bool
    round_scale: bool
    low_latency: bool  # the backend's single-kernel path
    split: bool  # dispatch_send/dispatch_recv halves, or the whole op up front


_fail = memory.fail


def _check_flag(value, name):
    """A static flag: True or False (numpy's, or a concrete boolean array of no dimensions), not
    a string, a number or a traced value."""
    concrete = isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer)
    if not (
        isinstance(value, (bool, np.bool_))
        or (concrete and value.shape == () and value.dtype == np.bool_)
    ):
        _fail(f"{name} must be True or False, got {value!r}")


def _axes(mesh, axis_name):
    """axis_name as a tuple of mesh axes, outer first (one name: a tuple of one)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown or len(set(axes)) != len(axes):
        _fail(
            f"axis_name must be an axis of the mesh {tuple(mesh.axis_names)}, or a tuple of "
            f"distinct ones (outer first), got {axis_name!r}"
        )
    return axes


def _check(array, name, shape, dtypes, why=""):
    """Shape and dtype of an argument; None in `shape` matches any size; `why` ends a wrong
    shape's message."""
    if (
        not hasattr(array, "shape")
        or len(array.shape) != len(shape)
        or any(want is not None and got != want for got, want in zip(array.shape, shape))
    ):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        _fail(
            f"{name} must have shape ({want}), got "
            f"{getattr(array, 'shape', type(array).__name__)}{why}"
        )
    if jnp.dtype(array.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        _fail(
            f"{name} must have dtype {' or '.join(jnp.dtype(d).name for d in dtypes)}, "
            f"got {jnp.dtype(array.dtype).name}"
        )


class Buffer:
    """Communication memory and routing state of every EP group of `axis_name` in `mesh`.

    Create it outside jit, on every process of the mesh alike (jax.distributed: one process per
    GPU or per host); call dispatch/combine inside jax.shard_map(..., mesh=mesh) on the per-rank
    shards. axis_name may be a tuple of mesh axes, outer first (("node", "ep")): one EP group of
    their product, ranks row-major, the outer axes crossed by lax.all_to_all, the last by the
    custom calls (jax_ep/hierarchical.py; combine sums per node, then the nodes in order).
    impl: "auto" / "ffi" (custom calls) or "reference" (jax.lax collectives).
    timeout_s bounds every wait for a peer (then an error naming it, never a hang; a peer whose
    process has ended stops the waits at once: docs/API.md, "When a process dies"). num_sms:
    blocks of the CUDA kernels. low_latency_tokens (default min(N, 256), at most 1024, 0 =
    never): batches up to this size take the CUDA backend's single-kernel path.
    max_row_dtype: the widest element the Buffer's rows carry (float32; bfloat16 halves the
    memory, then float32 rows are refused). memory_bytes: the window each rank holds (see
    docs/ARCHITECTURE.md for the formula). direct_local: on GPUs, rows a rank sends itself skip
    the window in whole ops (False: they go through it like a peer's, e.g. for tests).
    check_invalid: every fresh dispatch also raises (at run time, through a host callback, on
    every rank) when topk_idx holds ids outside [-1, E) (refused between another op's halves);
    they are always excluded and counted in num_invalid.
    engine: what makes the windows reachable: "nccl" or "cuda_ipc" on GPUs ($JAX_EP_ENGINE,
    docs/API.md says when each applies), "shm" on CPUs, None for impl="reference".
    """

    def __init__(
        self,
        mesh,
        axis_name,
        *,
        num_experts,
        hidden,
        num_topk,
        max_tokens_per_rank,
        impl="auto",
        num_sms=24,
        timeout_s=30.0,
        low_latency_tokens=None,
        check_invalid=False,
        max_row_dtype=jnp.float32,
        direct_local=True,
    ):
        _jax.install()  # the process's first Buffer mends JAX (jax_ep/_jax.py)
        self._axes = axes = _axes(mesh, axis_name)
        fast_axis, outer_axes = axes[-1], axes[:-1]
        num_nodes = math.prod(mesh.shape[a] for a in outer_axes)
        ranks_per_node = mesh.shape[fast_axis]
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
            _fail(f"impl must be 'auto', 'ffi' or 'reference', got {impl!r}")
        if not timeout_s > 0:
            _fail(f"timeout_s must be positive, got {timeout_s!r}")
        self.mesh, self.axis_name = mesh, axis_name
        self.num_ranks, self.num_nodes = num_ranks, num_nodes
        self._fast_axis, self._ranks_per_node = fast_axis, ranks_per_node
        self.num_experts = num_experts
        self.num_local_experts = num_experts // num_ranks
        self.hidden, self.num_topk = hidden, num_topk
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_row_dtype = memory.row_dtype(max_row_dtype, "max_row_dtype")
        self.impl = _resolve_impl(impl)
        _check_flag(check_invalid, "check_invalid")
        self.check_invalid = bool(check_invalid)
        if self.check_invalid:
            try:
                jax.devices("cpu")
            except RuntimeError:
                _fail(
                    "check_invalid=True raises through a host callback, which needs JAX's CPU "
                    "platform: list cpu in JAX_PLATFORMS (e.g. JAX_PLATFORMS=cuda,cpu)"
                )
        self._serial = next(_SERIALS)  # tells this Buffer's handles and pending ops apart
        self._native = None
        self.engine = None  # what makes the windows reachable (set by _connect)
        self._low_latency_tokens = None  # the single-kernel routing is the CUDA backend's
        self._plan = None  # how the Buffer came up on the processes (set by _connect)
        # The fast leg: the last axis, with the experts of one node and the tokens the node
        # leg can bring (all of it when there is one node).
        reference = Reference(fast_axis, ranks_per_node, num_experts // num_nodes)
        fast = reference
        if self.impl == "ffi":
            fast = self._connect(num_sms, float(timeout_s), low_latency_tokens, bool(direct_local))
        if num_nodes > 1:
            reference, fast = (
                Hierarchical(
                    ops,
                    outer_axes,
                    num_nodes,
                    fast_axis,
                    ranks_per_node,
                    num_experts,
                    self.max_row_dtype,
                )
                for ops in (reference, fast)
            )
        self._reference, self._ops = reference, fast

    def _window(self):
        return memory.window(
            self.num_nodes,
            self._ranks_per_node,
            self.num_experts,
            self.hidden,
            self.num_topk,
            self.max_tokens_per_rank,
            self.max_row_dtype,
        )

    def _fast_tokens(self, tokens):
        """Tokens per rank in the fast leg: what the node leg brings from every node."""
        return self.num_nodes * tokens

    @property
    def memory_bytes(self):
        """The communication window each rank of the Buffer holds, in bytes (on a tuple axis
        the fast leg's, sized for the M * max_tokens_per_rank tokens the node leg brings):
        jax_ep.memory_plan's "window", computed by the same function (jax_ep/memory.py)."""
        return self._window().total_bytes() if self.impl == "ffi" else 0

    def _connect(self, num_sms, timeout_s, low_latency_tokens, direct_local):
        try:
            from jax_ep import ffi_path
        except ImportError as e:
            raise ValueError(
                "jax_ep: the custom calls need jax_ep's compiled extension, which "
                "this installation lacks (pip install . builds it); "
                "impl='reference' runs without it"
            ) from e
        bounds = limits()
        fast_tokens = self._fast_tokens(self.max_tokens_per_rank)
        nodes = f"{self.num_nodes} nodes x " if self.num_nodes > 1 else ""
        if timeout_s > bounds["max_timeout_s"]:
            _fail(f"timeout_s must be at most {bounds['max_timeout_s']:g}, got {timeout_s!r}")
        if not is_integer(low_latency_tokens) or not 0 <= low_latency_tokens <= min(
            fast_tokens, bounds["max_in_block_tokens"]
        ):
            _fail(
                f"low_latency_tokens must be an integer in [0, min({nodes}max_tokens_per_rank, "
                f"{bounds['max_in_block_tokens']})], got {low_latency_tokens!r}"
            )
        with bootstrap.creating:  # one at a time in this process: keys count the Buffers
            return self._create(num_sms, timeout_s, low_latency_tokens, direct_local, ffi_path)

    def _create(self, num_sms, timeout_s, low_latency_tokens, direct_local, ffi_path):
        bounds = limits()
        plan = bootstrap.plan(self.mesh, self._fast_axis)
        if plan.platform is None:
            _fail(
                f"the custom calls run on CPU and CUDA devices, not on "
                f"{self.mesh.devices.flat[0].platform}: use impl='reference' there"
            )
        bound = bounds["max_gpu_ranks" if plan.platform == "cuda" else "max_cpu_ranks"]
        if self._ranks_per_node > bound:
            _fail(
                f"axis {self._fast_axis!r} has {self._ranks_per_node} ranks; the {plan.platform} "
                f"backend takes at most {bound} in one group"
            )
        if plan.platform == "cuda":
            self._low_latency_tokens = int(low_latency_tokens)
        arguments = dict(
            num_experts=self.num_experts,
            hidden=self.hidden,
            num_topk=self.num_topk,
            max_tokens_per_rank=self.max_tokens_per_rank,
            max_row_dtype=self.max_row_dtype.name,
            num_sms=num_sms,
            low_latency_tokens=low_latency_tokens,
            timeout_s=timeout_s,
            direct_local=direct_local,
            axis_name=list(_axes(self.mesh, self.axis_name)),
            check_invalid=self.check_invalid,
            mesh=dict(
                axis_names=list(self.mesh.axis_names),
                shape=list(self.mesh.devices.shape),
                device_ids=[d.id for d in self.mesh.devices.flat],
            ),
        )
        arguments["first_op"] = bootstrap.first_op()
        bootstrap.commit(plan)
        bootstrap.check_same_arguments(plan, arguments, timeout_s)
        self._native = bootstrap.connect(
            plan, self._window(), timeout_s=timeout_s, num_sms=num_sms, direct_local=direct_local
        )
        self._key, self._plan = plan.key, plan
        self.engine = bootstrap.engines[plan.key]  # "nccl", "cuda_ipc" or "shm" (CPUs)
        ffi_path.register_targets()
        return ffi_path.Ffi(
            plan.key,
            self._ranks_per_node,
            self.num_experts // self.num_nodes,
            self.mesh,
            self.max_row_dtype,
        )

    def status(self):
        """The error that stopped this Buffer on this process (a wait that timed out, a peer
        that gave up, ranks that ran different ops), or None. Where the mesh spans processes,
        also the processes that have ended or do not answer, with the nodes or ranks they
        held: what to ask when a step fails with only a lost connection in XLA's own error
        (a node leg's collective, say). Reads what the ops recorded without waiting for them
        or for the devices: an op still running is not in it yet."""
        if self._native is None:
            return None
        found = [self._native.status()]
        for process, why in bootstrap.stopped_processes(self._plan).items():
            found.append(f"jax_ep: process {process} ({self._held_by(process)}) stopped: {why}")
        return "\n".join(filter(None, found)) or None

    def _held_by(self, process):
        """The nodes (a tuple axis) or ranks of the Buffer that `process`'s devices hold."""
        names, shape = self.mesh.axis_names, self.mesh.devices.shape
        coords = [i for i, d in np.ndenumerate(self.mesh.devices) if d.process_index == process]
        if self.num_nodes > 1:
            outer = [names.index(a) for a in self._axes[:-1]]
            nodes = {
                np.ravel_multi_index([c[a] for a in outer], [shape[a] for a in outer])
                for c in coords
            }
            return f"node {', '.join(map(str, sorted(nodes)))} of {self.axis_name!r}"
        fast = names.index(self._axes[-1])
        ranks = sorted({c[fast] for c in coords})
        return f"rank {', '.join(map(str, ranks))} of {self.axis_name!r}"

    def close(self):
        """Drops this Buffer's communication memory: it is freed once no compiled program that
        uses the Buffer remains (JAX keeps compiled programs in its caches; jax.clear_caches()
        drops them). Programs compiled before close() keep working; a program compiled after
        it fails when it runs. Closing a Buffer whose last program failed (an error that stopped
        it, or check_invalid's) also drops that error, which JAX keeps with the program's
        tokens and would raise again at the interpreter's exit."""
        if self._native is not None:
            self._native = None
            bootstrap.forget(self._key)

    def __del__(self):
        # A finalizer may run on any thread, inside any other work: it only hands the key over;
        # the next Buffer created or closed (or the interpreter's exit) lets the memory go.
        if getattr(self, "_native", None) is not None:
            self._native = None
            try:
                bootstrap.forget_later(self._key)
            except Exception:  # interpreter shutdown: the registry goes at exit anyway
                pass

    # ------------------------------------------------------------ dispatch

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        *,
        handle=None,
        layout=None,
        expert_alignment=None,
        fp8=False,
        round_scale=False,
        capacity=None,
        mode=None,
    ):
        """Sends every token to the ranks of its experts (docs/API.md has every field).

        layout: "rank" (default), "expert" or "expert_padded" (x [E_l, capacity, H], capacity
        rows per expert, default R*N, rows by (source rank, token)). expert_alignment: default
        1. mode: "auto" (default: the CUDA backend's single-kernel path when T <=
        low_latency_tokens), "normal" or "low_latency". handle=: the routes, layout and capacity
        of an earlier dispatch (then only x, fp8 and round_scale may be given).
        """
        arrays, finish = self._dispatch_start(
            False,
            x,
            topk_idx,
            topk_weights,
            handle,
            layout,
            expert_alignment,
            fp8,
            round_scale,
            capacity,
            mode,
        )
        return finish(arrays)

    def dispatch_send(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        *,
        handle=None,
        layout=None,
        expert_alignment=None,
        fp8=False,
        round_scale=False,
        capacity=None,
        mode=None,
    ):
        """The first half of dispatch: returns once the tokens are on their way. Run other work
        (`pending, out = pending.run_between(work, *args)` makes XLA put it between the halves),
        then dispatch_recv(pending), in the same program (jit). On GPUs the work runs beside the
        send under command buffers whose commands XLA orders only by the buffers they share
        (--xla_gpu_command_buffer_scheduling_mode=CONCURRENT); on one stream it follows it.
        Not differentiable (use dispatch under grad). At most two sent ops of a Buffer (dispatch
        or combine) may await their recv at once (their two slots), in either order; a third
        send would wait for the first recv and end in the timeout error. The Buffer's ordered
        effect keeps its calls in program order (docs/ARCHITECTURE.md)."""
        return self._pending(
            "dispatch",
            lambda: self._dispatch_start(
                True,
                x,
                topk_idx,
                topk_weights,
                handle,
                layout,
                expert_alignment,
                fp8,
                round_scale,
                capacity,
                mode,
            ),
        )

    def dispatch_recv(self, pending):
        """Waits for the tokens of dispatch_send(...) and returns its DispatchResult."""
        return self._finish(pending, "dispatch")

    def _dispatch_start(
        self,
        split,
        x,
        topk_idx,
        topk_weights,
        handle,
        layout_name,
        alignment,
        fp8,
        round_scale,
        capacity,
        mode,
    ):
        self._require_shard_map()
        tokens = self._check_x(x, fp8, round_scale)
        if handle is not None:
            given = [
                name
                for name, value in (
                    ("topk_idx", topk_idx),
                    ("topk_weights", topk_weights),
                    ("layout", layout_name),
                    ("expert_alignment", alignment),
                    ("capacity", capacity),
                    ("mode", mode),
                )
                if value is not None
            ]
            if given:
                _fail(
                    f"dispatch with handle= follows the handle's routes, layout and capacity: "
                    f"{', '.join(given)} must not be given"
                )
            return self._dispatch_cached(split, x, handle, fp8, round_scale, tokens)
        layout_name = "rank" if layout_name is None else layout_name
        alignment = 1 if alignment is None else alignment
        low_latency = self._low_latency("auto" if mode is None else mode, tokens)
        if topk_idx is None:
            _fail("dispatch needs topk_idx (or handle= for a cached dispatch)")
        _check(topk_idx, "topk_idx", (tokens, self.num_topk), (jnp.int32,))
        has_weights = topk_weights is not None
        if has_weights:
            _check(topk_weights, "topk_weights", (tokens, self.num_topk), (jnp.float32,))
        else:
            topk_weights = jnp.zeros(topk_idx.shape, jnp.float32)
        alignment = memory.check_layout(layout_name, alignment)
        spec = DispatchSpec(
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            has_weights=has_weights,
            layout=layout_name,
            alignment=alignment,
            capacity=memory.output_capacity(
                layout_name,
                alignment,
                capacity,
                self.num_ranks,
                self.max_tokens_per_rank,
                self.num_topk,
                self.num_local_experts,
            ),
            fp8=fp8,
            round_scale=round_scale,
            low_latency=low_latency,
            split=split,
        )
        if layout_name == "rank":
            return self._dispatch_rank(spec)
        return self._dispatch_expert(spec)

    def _ops_for(self, tokens):
        """The primitives for an op of `tokens` rows per rank (the same on every rank): with none,
        the reference path's, whose results are the same (XLA rejects custom calls whose
        operands are all empty)."""
        return self._ops if tokens else self._reference

    def _send_tokens(self, spec, rows):
        """The rank-level dispatch of spec's tokens into `rows` rows per rank: (arrays, finish)."""
        ops = self._ops_for(spec.x.shape[0])
        return start(
            spec.split,
            ops.dispatch,
            ops.dispatch_send,
            spec.x,
            spec.topk_idx,
            spec.topk_weights,
            rows=rows,
            fp8=spec.fp8,
            round_scale=spec.round_scale,
            low_latency=spec.low_latency,
        )

    def _dispatch_rank(self, spec):
        capacity = spec.capacity
        arrays, moved = self._send_tokens(spec, capacity)

        def finish(arrays):
            rows, routing = self._checked(spec, *moved(arrays))
            result = (
                rows.topk_idx,
                rows.topk_weights if spec.has_weights else None,
                routing.tokens_per_expert,
                layouts.align_up(routing.tokens_per_expert, spec.alignment),
                routing.num_recv,
                routing.num_dropped,
                routing.num_invalid,
            )
            handle = Handle(
                routing.send_pos,
                routing.recv_counts,
                routing.num_recv,
                None,
                None,
                result,
                layout="rank",
                rows=capacity,
                capacity=capacity,
                buffer=self._serial,
            )
            return DispatchResult(rows.x, rows.scales, *result, handle)

        return arrays, finish

    def _dispatch_expert(self, spec):
        layout_name, alignment, capacity = spec.layout, spec.alignment, spec.capacity
        # On the wire a token goes once per rank; the receiver expands it to its experts' rows.
        staging = self.num_ranks * spec.x.shape[0]
        arrays, moved = self._send_tokens(spec, staging)
        padded = layout_name == "expert_padded"
        rows_out = capacity * self.num_local_experts if padded else capacity
        ops = self._ops_for(staging)

        def finish(arrays):
            rows, routing = self._checked(spec, *moved(arrays))
            if padded:  # one call: the maps, the weights and the rows in their places
                maps, weights, (x, scales) = layouts.padded_rows(
                    ops.expert_padded,
                    self.num_local_experts,
                    capacity,
                    rows.topk_idx,
                    rows.topk_weights,
                    (rows.x, rows.scales),
                )
                x, scales = self._blocks(layout_name, x), self._blocks(layout_name, scales)
            else:
                maps = ops.expert_layout(
                    rows.topk_idx,
                    experts_per_rank=self.num_local_experts,
                    alignment=alignment,
                    capacity=rows_out,
                )
                weights = layouts.expert_weights(
                    rows.topk_weights, rows.topk_idx, maps.expert_src, maps.expert_of_row
                )
            # A failed op's rank-level rows are NaN, but it leaves no rows to expand: its weights
            # say so (NaN) in the same step, and the expert layout's rows (the gather that makes
            # them takes the select; expert_padded's are all unspecified with no rows).
            failed = layouts.failed_dispatch(rows.topk_idx, rows.topk_weights)
            weights = jnp.where(failed, jnp.nan, weights) if spec.has_weights else None
            group_sizes = layouts.align_up(maps.tokens_per_expert, alignment)
            result = (
                self._blocks(layout_name, maps.expert_of_row),
                self._blocks(layout_name, weights),
                maps.tokens_per_expert,
                group_sizes,
                group_sizes.sum(dtype=jnp.int32),
                routing.num_dropped + maps.num_dropped,
                routing.num_invalid,
            )
            handle = Handle(
                routing.send_pos,
                routing.recv_counts,
                routing.num_recv,
                maps.expert_src,
                maps.expert_rows,
                result,
                layout=layout_name,
                rows=staging,
                capacity=rows_out,
                buffer=self._serial,
            )
            if not padded:
                x, scales = (
                    None if a is None else jnp.where(failed, jnp.nan, a)
                    for a in self._expand(rows.x, rows.scales, handle)
                )
            return DispatchResult(x, scales, *result, handle)

        return arrays, finish

    def _checked(self, spec, rows, routing):
        if not self.check_invalid or spec.topk_idx.shape[0] == 0:  # no tokens, no invalid ids
            return rows, routing
        if Receipt.open():
            _fail(
                "check_invalid=True: this dispatch would raise while another op's halves are "
                "open (a *_send whose *_recv has not been traced yet); the raise would stop the "
                "program before that recv and strand its op. Call it before the send or after "
                "the recv, or use check_invalid=False and read num_invalid"
            )
        # Every rank raises (a rank left running would wait for the rest): each learns its EP
        # group's invalid ids with the op's counts, and the other groups of the mesh sum theirs.
        # After the op's own collectives (the reference path's), so that no rank stops while the
        # others are still in one of them.
        rows, routing = jax.lax.optimization_barrier((rows, routing))
        everywhere = routing.group_invalid
        others = tuple(a for a in self._bound_axes() if a not in self._axes)
        if others:
            everywhere = jax.lax.psum(everywhere, others)
        jax.debug.callback(_raise_if_invalid, routing.num_invalid, everywhere, self.num_experts)
        return rows, routing

    def _bound_axes(self):
        """The mesh axes the enclosing shard_map maps over."""
        bound = []
        for name in self.mesh.axis_names:
            try:
                jax.lax.axis_size(name)
                bound.append(name)
            except NameError:
                pass
        return tuple(bound)

    def _blocks(self, layout_name, rows):
        """expert_padded: [E_l * B, ...] expert rows -> [E_l, B, ...]."""
        if rows is None or layout_name != "expert_padded":
            return rows
        return rows.reshape((self.num_local_experts, -1) + rows.shape[1:])

    def _expand(self, x_rows, scales, handle):
        if handle.layout == "rank":
            return x_rows, scales
        if handle.layout == "expert":  # padding rows are zeros
            expand = layouts.expand_rows
        else:  # expert_padded: only the valid rows are written (E_l * C rows could be many)
            expand = functools.partial(layouts.placed_rows, self._ops_for(handle.rows).place_rows)
        if scales is not None:
            scales = expand(scales, handle.expert_src, handle.expert_rows)
        x = expand(x_rows, handle.expert_src, handle.expert_rows)
        return self._blocks(handle.layout, x), self._blocks(handle.layout, scales)

    def _dispatch_cached(self, split, x, handle, fp8, round_scale, tokens):
        self._check_handle(handle, "cached dispatch")
        if handle.num_tokens != tokens:
            _fail(f"x has {tokens} tokens but the handle routed {handle.num_tokens}")
        ops = self._ops_for(tokens)
        arrays, moved = start(
            split,
            ops.dispatch_cached,
            ops.dispatch_cached_send,
            x,
            handle.send_pos,
            handle.num_rows,
            handle.recv_counts,
            rows=handle.rows,
            fp8=fp8,
            round_scale=round_scale,
        )

        def finish(arrays):
            x_rows, scales = moved(arrays)
            return DispatchResult(*self._expand(x_rows, scales, handle), *handle.result, handle)

        return arrays, finish

    # ------------------------------------------------------------ combine

    def combine(self, expert_out, handle, topk_weights=None, bias=None, *, partial_dtype=None):
        """y[t] = bias[t] + sum over the rows from token t of w * expert_out[row] -> [T, H],
        summed in float32 in a fixed order and rounded once. In the expert layouts each rank
        first sums a token's rows of its own experts and sends that partial sum in
        partial_dtype (float32, or bfloat16 when the Buffer's rows are: half the bytes)."""
        arrays, finish = self._combine_start(
            False, expert_out, handle, topk_weights, bias, partial_dtype
        )
        return finish(arrays)

    def dequantize(self, d, x):
        """An FP8 dispatch's rows (d of dispatch(x, ..., fp8=True), any layout) as x.dtype values,
        q * scale, whose gradient goes straight through to x: the combine of the rows'
        cotangents, as if x had been dispatched unquantised. (A cotangent of d.x itself is
        float8 like d.x: dequantize_fp8(d.x, d.scales) would send x only a rounded, scaled one.)"""
        if d.scales is None:
            _fail("dequantize needs the result of an fp8 dispatch")
        _check(
            x, "dequantize's x (the x dispatched)", (d.handle.num_tokens, self.hidden), FLOAT_ROWS
        )
        return _dequantize_with_combined_grad(
            self._combine_cotangent, *all_varying(x, d.x, d.scales), d.handle
        )

    def _combine_cotangent(self, ct, handle):
        """x's gradient from its rows' cotangents: one combine, the rows sent in x's dtype or
        the Buffer's where those are narrower (float32 x in FP8 on a bf16-row Buffer)."""
        rows = ct.astype(layouts.travel_dtype(ct.dtype, self.max_row_dtype))
        return self.combine(rows, handle).astype(ct.dtype)

    def combine_send(self, expert_out, handle, topk_weights=None, bias=None, *, partial_dtype=None):
        """The first half of combine: returns once the rows are on their way back. Run other
        work (pending.run_between), then combine_recv(pending); as for dispatch_send. Not
        differentiable (use combine under grad). At most two sent combines may await their recv
        at once, in either order."""
        return self._pending(
            "combine",
            lambda: self._combine_start(
                True, expert_out, handle, topk_weights, bias, partial_dtype
            ),
        )

    def combine_recv(self, pending):
        """Waits for the rows of combine_send(...) and returns y [T, H]."""
        return self._finish(pending, "combine")

    def _combine_start(self, split, expert_out, handle, topk_weights, bias, partial_dtype):
        self._require_shard_map()
        self._check_handle(handle, "combine")
        tokens = handle.num_tokens
        rows_shape = (handle.capacity,)
        if handle.layout == "expert_padded":
            rows_shape = (self.num_local_experts, handle.capacity // self.num_local_experts)
        _check(expert_out, "expert_out", rows_shape + (self.hidden,), FLOAT_ROWS)
        if bias is not None:
            _check(bias, "bias", (tokens, self.hidden), FLOAT_ROWS)
            bias = as_stored(bias)  # rounded as the custom calls read it, on every backend
        if handle.layout == "rank":
            if topk_weights is not None:
                _fail(
                    "combine in the rank layout is unweighted (the caller mixes its local "
                    "experts): topk_weights must be None"
                )
            if partial_dtype is not None:
                _fail(
                    "partial_dtype applies to the expert layouts (the rank layout sends "
                    "expert_out as it is)"
                )
            self._check_row_dtype(expert_out, "expert_out")
            row_data = expert_out
        else:
            if topk_weights is not None:
                _check(topk_weights, "topk_weights", rows_shape, (jnp.float32,))
                topk_weights = topk_weights.reshape(-1)
            if partial_dtype is None:
                partial_dtype = self.max_row_dtype
            memory.row_dtype(partial_dtype, "partial_dtype")
            row_data = layouts.reduce_expert_rows(
                expert_out.reshape(-1, self.hidden),
                topk_weights,
                handle.expert_src,
                handle.expert_rows,
            )
            row_data = row_data.astype(partial_dtype)
            self._check_row_dtype(row_data, "partial_dtype")
        ops = self._ops_for(tokens)
        return start(
            split,
            ops.combine,
            ops.combine_send,
            row_data,
            handle.send_pos,
            handle.num_rows,
            handle.recv_counts,
            bias,
            out_dtype=expert_out.dtype,
        )

    def _pending(self, kind, start):
        """The Pending of the send half start() traces."""
        receipt = Receipt()
        with _jax.sending(receipt.mark):
            started = start()
        return Pending(*started, kind=kind, buffer=self._serial, receipt=receipt)

    def _finish(self, pending, kind):
        if not isinstance(pending, Pending) or pending.kind != kind:
            _fail(f"{kind}_recv needs the result of {kind}_send, got {type(pending).__name__}")
        if pending.buffer != self._serial:
            _fail(
                f"{kind}_recv: pending is another Buffer's op (Buffer {pending.buffer}, this "
                f"is Buffer {self._serial})"
            )
        if pending.receipt.received:
            _fail(f"{kind}_recv: pending was received already (each send has one recv)")
        pending.receipt.receive()
        return pending.finish(pending.arrays)

    def _check_handle(self, handle, op):
        if not isinstance(handle, Handle):
            _fail(
                f"handle must be the handle of an earlier dispatch ({op}), got "
                f"{type(handle).__name__}"
            )
        if handle.buffer != self._serial:
            _fail(
                f"handle belongs to another Buffer (Buffer {handle.buffer}, this is Buffer "
                f"{self._serial}): {op} follows the routes of this Buffer's dispatches only"
            )
        if self.num_nodes > 1:  # a tuple axis's routes are hierarchical.NodeRoutes
            return
        ranks = self.num_ranks
        for name, want in (
            ("send_pos", (None, ranks)),
            ("recv_counts", (ranks,)),
            ("num_rows", ()),
            ("expert_src", (None,)),
            ("expert_rows", (handle.rows, None)),
        ):
            if getattr(handle, name) is not None or not name.startswith("expert"):
                _check(
                    getattr(handle, name),
                    f"handle.{name}",
                    want,
                    (jnp.int32,),
                    f": {op} takes a handle as its dispatch returned it, inside the same "
                    "shard_map (not one made under jax.vmap)",
                )

    # ------------------------------------------------------------ checks

    def _require_shard_map(self):
        try:
            size = jax.lax.axis_size(self.axis_name)
        except NameError:
            size = None
        if size is None:
            _fail(
                f"dispatch and combine must be called inside jax.shard_map(..., mesh=mesh) "
                f"over the axis {self.axis_name!r}"
            )
        if size != self.num_ranks:
            _fail(
                f"axis {self.axis_name!r} has size {size} here but the Buffer was built for "
                f"{self.num_ranks} ranks"
            )
        if self.impl == "ffi" and _jax.in_eager_shard_map():
            _fail(
                "the custom calls run under jax.jit: wrap the shard_map that calls them in "
                "jax.jit (JAX cannot run them op by op inside shard_map), or use "
                "impl='reference'"
            )
        # XLA's partitioner cannot place an ordered custom call among automatic axes.
        automatic = set(self.mesh.axis_names) - set(
            getattr(jax.sharding.get_abstract_mesh(), "manual_axes", self.mesh.axis_names)
        )
        if self.impl == "ffi" and automatic:
            _fail(
                f"the custom calls run in a shard_map manual over every axis of the Buffer's "
                f"mesh; axes {sorted(automatic)} are automatic here (leave shard_map's "
                f"axis_names out, or use impl='reference')"
            )

    def _check_row_dtype(self, rows, name):
        memory.check_row_width(rows.dtype, self.max_row_dtype, name)

    def _check_x(self, x, fp8, round_scale):
        _check_flag(fp8, "fp8")
        _check_flag(round_scale, "round_scale")
        _check(x, "x", (None, self.hidden), FLOAT_ROWS)
        if not fp8:
            self._check_row_dtype(x, "x")
        tokens = x.shape[0]
        if tokens > self.max_tokens_per_rank:
            _fail(
                f"x has {tokens} tokens per rank, more than max_tokens_per_rank="
                f"{self.max_tokens_per_rank}"
            )
        if fp8 and self.hidden % FP8_BLOCK:
            _fail(f"fp8 needs hidden % 128 == 0, got hidden={self.hidden}")
        if fp8 and self._plan is not None and self._plan.platform == "cuda":
            widest = limits()["max_scales_per_row"] * FP8_BLOCK  # the dispatch stages the scales
            if self.hidden > widest:
                _fail(f"fp8 rows on GPUs take hidden up to {widest}, got hidden={self.hidden}")
        if round_scale and not fp8:
            _fail("round_scale=True needs fp8=True")
        return tokens

    def _low_latency(self, mode, tokens):
        if mode not in _MODES:
            _fail(f"mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
        if self._low_latency_tokens is None:  # no single-kernel path: every mode is the same
            return False
        fast_tokens = self._fast_tokens(tokens)  # what the fast leg's kernels route
        if mode == "low_latency" and fast_tokens > self._low_latency_tokens:
            nodes = f" ({self.num_nodes} nodes x {tokens})" if self.num_nodes > 1 else ""
            _fail(
                f"mode='low_latency' takes at most low_latency_tokens="
                f"{self._low_latency_tokens} tokens per rank, x has {fast_tokens}{nodes}"
            )
        return mode != "normal" and fast_tokens <= self._low_latency_tokens

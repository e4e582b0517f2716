"""jax_ep.Buffer: dispatch and combine (docs/API.md), built from the rank-level operations of a
backend (jax_ep/rank_ops.py)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp

from jax_ep import _jax, bootstrap, checks, halves, liveness
from jax_ep.buffer_config import BufferConfig
from jax_ep.checks import check_array
from jax_ep.dispatch_layouts import BY_NAME, DispatchSpec
from jax_ep.fp8 import dequantize_with_gradient
from jax_ep.hierarchical import Hierarchical
from jax_ep.layout import travel_dtype
from jax_ep.memory import FLOAT_ROWS, check_layout, fail
from jax_ep.rank_ops import all_varying, as_stored, start
from jax_ep.reference import Reference
from jax_ep.results import DispatchResult, Handle

_SERIALS = itertools.count(1)

# The public attributes (docs/API.md), as the Buffer's config holds them.
_ATTRIBUTES = (
    "mesh",
    "axis_name",
    "num_ranks",
    "num_nodes",
    "num_experts",
    "num_local_experts",
    "hidden",
    "num_topk",
    "max_tokens_per_rank",
    "max_row_dtype",
    "impl",
    "check_invalid",
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
    docs/ARCHITECTURE.md for the formula).
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
    ):
        _jax.install()  # the process's first Buffer mends JAX (jax_ep/_jax/)
        self._config = config = BufferConfig.checked(
            mesh,
            axis_name,
            num_experts=num_experts,
            hidden=hidden,
            num_topk=num_topk,
            max_tokens_per_rank=max_tokens_per_rank,
            impl=impl,
            num_sms=num_sms,
            timeout_s=timeout_s,
            low_latency_tokens=low_latency_tokens,
            check_invalid=check_invalid,
            max_row_dtype=max_row_dtype,
        )
        for name in _ATTRIBUTES:
            setattr(self, name, getattr(config, name))
        self._serial = next(_SERIALS)  # tells this Buffer's handles and pending ops apart
        self._native = None
        self.engine = None  # what makes the windows reachable (set by _connect)
        self._low_latency_tokens = None  # the single-kernel routing is the CUDA backend's
        self._plan = None  # how the Buffer came up on the processes (set by _connect)
        # The fast leg: the last axis, with the experts of one node and the tokens the node
        # leg can bring (all of it when there is one node).
        experts_per_node = config.num_experts // config.num_nodes
        reference = Reference(config.fast_axis, config.ranks_per_node, experts_per_node)
        fast = self._connect() if config.impl == "ffi" else reference
        if config.num_nodes > 1:
            reference, fast = (
                Hierarchical(
                    ops,
                    config.outer_axes,
                    config.num_nodes,
                    config.fast_axis,
                    config.ranks_per_node,
                    config.num_experts,
                    config.max_row_dtype,
                )
                for ops in (reference, fast)
            )
        self._reference, self._ops = reference, fast

    @property
    def memory_bytes(self):
        """The communication window each rank of the Buffer holds, in bytes (on a tuple axis
        the fast leg's, sized for the M * max_tokens_per_rank tokens the node leg brings):
        jax_ep.memory_plan's "window", computed by the same function (jax_ep/memory.py)."""
        return self._config.window().total_bytes() if self.impl == "ffi" else 0

    def _connect(self):
        """Brings the native side up on every process; returns the custom calls' operations."""
        from jax_ep import ffi_path

        config = self._config
        with bootstrap.creating:  # one at a time in this process: keys count the Buffers
            self._native, self._plan = bootstrap.create(config)
        self._key = self._plan.key
        self.engine = bootstrap.engines[self._key]  # "nccl", "cuda_ipc" or "shm" (CPUs)
        if self._plan.platform == "cuda":
            self._low_latency_tokens = int(config.low_latency_tokens)
        ffi_path.register_targets()
        return ffi_path.Ffi(
            self._key,
            config.ranks_per_node,
            config.num_experts // config.num_nodes,
            config.mesh,
            config.max_row_dtype,
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
        for process, why in liveness.stopped_processes(self._plan).items():
            found.append(
                f"jax_ep: process {process} ({self._config.held_by(process)}) stopped: {why}"
            )
        return "\n".join(filter(None, found)) or None

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
        return halves.send(
            "dispatch",
            self._serial,
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
        return halves.receive(pending, "dispatch", self._serial)

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
        config = self._config
        checks.require_shard_map(config)
        platform = None if self._plan is None else self._plan.platform
        tokens = checks.check_x(config, platform, x, fp8, round_scale)
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
                fail(
                    f"dispatch with handle= follows the handle's routes, layout and capacity: "
                    f"{', '.join(given)} must not be given"
                )
            return self._dispatch_cached(split, x, handle, fp8, round_scale, tokens)
        layout_name = "rank" if layout_name is None else layout_name
        alignment = 1 if alignment is None else alignment
        mode = "auto" if mode is None else mode
        low_latency = checks.low_latency(config, self._low_latency_tokens, mode, tokens)
        if topk_idx is None:
            fail("dispatch needs topk_idx (or handle= for a cached dispatch)")
        check_array(topk_idx, "topk_idx", (tokens, self.num_topk), (jnp.int32,))
        has_weights = topk_weights is not None
        if has_weights:
            check_array(topk_weights, "topk_weights", (tokens, self.num_topk), (jnp.float32,))
        else:
            topk_weights = jnp.zeros(topk_idx.shape, jnp.float32)
        alignment = check_layout(layout_name, alignment)
        spec = DispatchSpec(
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            has_weights=has_weights,
            layout=BY_NAME[layout_name],
            alignment=alignment,
            capacity=config.capacity(layout_name, alignment, capacity),
            fp8=fp8,
            round_scale=round_scale,
            low_latency=low_latency,
            split=split,
        )
        return self._dispatch_fresh(spec)

    def _ops_for(self, tokens):
        """The operations for an op of `tokens` rows per rank (the same on every rank): with
        none, the reference path's, whose results are the same (XLA rejects custom calls whose
        operands are all empty)."""
        return self._ops if tokens else self._reference

    def _dispatch_fresh(self, spec):
        """Routes spec's tokens, then lays the rows out in spec's layout: (arrays, finish)."""
        lay, tokens = spec.layout, spec.x.shape[0]
        staging = lay.staging_rows(self._config, spec)
        ops = self._ops_for(tokens)
        arrays, moved = start(
            spec.split,
            ops.dispatch,
            ops.dispatch_send,
            spec.x,
            spec.topk_idx,
            spec.topk_weights,
            rows=staging,
            fp8=spec.fp8,
            round_scale=spec.round_scale,
            low_latency=spec.low_latency,
        )
        local_ops = self._ops_for(staging)

        def finish(arrays):
            rows, routing = checks.raising_on_invalid(self._config, tokens, *moved(arrays))
            x, scales, result, expert_src, expert_rows = lay.lay_out(
                self._config, local_ops, spec, rows, routing
            )
            handle = Handle(
                routing.send_pos,
                routing.recv_counts,
                routing.num_recv,
                expert_src,
                expert_rows,
                result,
                layout=lay.name,
                rows=staging,
                capacity=lay.output_rows(self._config, spec.capacity),
                buffer=self._serial,
            )
            return DispatchResult(x, scales, *result, handle)

        return arrays, finish

    def _dispatch_cached(self, split, x, handle, fp8, round_scale, tokens):
        checks.check_handle(self._config, self._serial, handle, "cached dispatch")
        if handle.num_tokens != tokens:
            fail(f"x has {tokens} tokens but the handle routed {handle.num_tokens}")
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
            x, scales = BY_NAME[handle.layout].expand(
                self._config,
                self._ops_for(handle.rows),
                x_rows,
                scales,
                handle.expert_src,
                handle.expert_rows,
            )
            return DispatchResult(x, scales, *handle.result, handle)

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
            fail("dequantize needs the result of an fp8 dispatch")
        check_array(
            x, "dequantize's x (the x dispatched)", (d.handle.num_tokens, self.hidden), FLOAT_ROWS
        )
        return dequantize_with_gradient(
            self._combine_cotangent, *all_varying(x, d.x, d.scales), d.handle
        )

    def _combine_cotangent(self, ct, handle):
        """x's gradient from its rows' cotangents: one combine, the rows sent in x's dtype or
        the Buffer's where those are narrower (float32 x in FP8 on a bf16-row Buffer)."""
        rows = ct.astype(travel_dtype(ct.dtype, self.max_row_dtype))
        return self.combine(rows, handle).astype(ct.dtype)

    def combine_send(self, expert_out, handle, topk_weights=None, bias=None, *, partial_dtype=None):
        """The first half of combine: returns once the rows are on their way back. Run other
        work (pending.run_between), then combine_recv(pending); as for dispatch_send. Not
        differentiable (use combine under grad). At most two sent combines may await their recv
        at once, in either order."""
        return halves.send(
            "combine",
            self._serial,
            lambda: self._combine_start(
                True, expert_out, handle, topk_weights, bias, partial_dtype
            ),
        )

    def combine_recv(self, pending):
        """Waits for the rows of combine_send(...) and returns y [T, H]."""
        return halves.receive(pending, "combine", self._serial)

    def _combine_start(self, split, expert_out, handle, topk_weights, bias, partial_dtype):
        config = self._config
        checks.require_shard_map(config)
        checks.check_handle(config, self._serial, handle, "combine")
        lay = BY_NAME[handle.layout]
        rows_shape = lay.rows_shape(config, handle.capacity)
        check_array(expert_out, "expert_out", rows_shape + (self.hidden,), FLOAT_ROWS)
        if bias is not None:
            check_array(bias, "bias", (handle.num_tokens, self.hidden), FLOAT_ROWS)
            bias = as_stored(bias)  # rounded as the custom calls read it, on every backend
        row_data = lay.combine_rows(config, expert_out, handle, topk_weights, partial_dtype)
        ops = self._ops_for(handle.num_tokens)
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

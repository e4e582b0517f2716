"""The Mosaic GPU (Pallas) kernels of jax_ep.nn.grouped, for Hopper: persistent grouped matmuls
over row groups whose sizes are multiples of a block (aligned_gmm, aligned_tgmm, and
aligned_gmm_fp8 for the FP8 forward), the same forward over the expert_padded layout's blocks
of rows (masked_gmm), and jax's own ragged_dot_mgpu kernels (jax_kernels) for the rest.
grouped.py chooses between them and makes them differentiable; its module docstring describes
each kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def jax_kernels():
    """jax's ragged_dot_mgpu kernels: (ragged_dot, transposed_ragged_dot)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _row_blocks(group_sizes, m, bm):
    """For kernels over row blocks of bm rows in groups whose sizes are multiples of bm: the
    group of each of the m // bm blocks (the first group whose end is past the block's first
    row) and [1] the number of blocks the groups fill."""
    ends = jnp.cumsum(group_sizes)
    block_group = (ends[None, :] <= jnp.arange(m // bm, dtype=jnp.int32)[:, None] * bm).sum(
        axis=1, dtype=jnp.int32
    )
    return (jnp.minimum(block_group, group_sizes.shape[0] - 1), (ends[-1:] // bm).astype(jnp.int32))


def _masked_row_blocks(rows_per_group, capacity, bm):
    """For kernels over [G, capacity] rows of which group g's first rows_per_group[g] hold data:
    the row blocks that hold any (block j of group g is row block g * capacity / bm + j), first
    in order, their groups, and [1] their number."""
    groups, per_group = rows_per_group.shape[0], capacity // bm
    used = jnp.arange(per_group)[None, :] * bm < rows_per_group[:, None]  # [G, per_group]
    order = jnp.cumsum(used.reshape(-1), dtype=jnp.int32) - 1
    slot = jnp.where(used.reshape(-1), order, groups * per_group)  # past the end: unused
    block = jnp.arange(groups * per_group, dtype=jnp.int32)
    place = lambda values: jnp.zeros_like(block).at[slot].set(values, mode="drop")  # noqa: E731
    return place(block // per_group), place(block), used.sum(dtype=jnp.int32)[None]


def _over_tiles(body, out_type, tiles, *operands):
    """A persistent Mosaic GPU kernel: tiles.programs_per_sm programs per SM, each running
    body(*operand refs, out_ref, store). store(acc, dst, mi, ni) writes the [bm, bn] float32
    tile acc into dst's rows mi * bm, columns ni * bn through one shared-memory buffer and one
    bulk copy that runs on while the program goes on to its next tile (the buffer is reused once
    the copy has read it; the program waits for its copies at the end)."""
    bm, bn = tiles.block_m, tiles.block_n

    def kernel(*refs):
        *operand_refs, out_ref, out_smem = refs

        def store(acc, dst, mi, ni):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's copy read it
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, dst.at[pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

        body(*operand_refs, out_ref, store)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=[plgpu.SMEM((bm, bn), out_type.dtype)],
        grid=(tiles.programs_per_sm * jax.devices()[0].core_count,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*operands)


def aligned_gmm(lhs, rhs, group_sizes, tiles, transpose_rhs):
    """lhs [M, K] @ rhs[g] ([G, K, N], or [G, N, K] transposed) for groups whose sizes are
    multiples of tiles.block_m: the SMs share the output tiles of the row blocks in groups
    (a grid sized on the device), n fastest within grid_block_n columns so that neighbouring
    SMs read the same rows; each tile is a pipeline of block_k steps. Rows past the groups are
    not written."""
    block_group, row_blocks = _row_blocks(group_sizes, lhs.shape[0], tiles.block_m)
    return _gmm_over_blocks(lhs, rhs, block_group, None, row_blocks, tiles, transpose_rhs)


def masked_gmm(lhs, rhs, rows_per_group, tiles):
    """lhs [G, C, K] @ rhs[g] ([G, K, N]) -> [G, C, N] over group g's first rows_per_group[g]
    rows only (the expert_padded layout's x and tokens_per_expert; C a multiple of
    tiles.block_m): only the row blocks holding such rows are computed and written, so the
    other rows of the result are unspecified, like the layout's own padding rows."""
    groups, capacity, k = lhs.shape
    block_group, block_row, row_blocks = _masked_row_blocks(rows_per_group, capacity, tiles.block_m)
    out = _gmm_over_blocks(
        lhs.reshape(groups * capacity, k), rhs, block_group, block_row, row_blocks, tiles, False
    )
    return out.reshape(groups, capacity, -1)


def _gmm_over_blocks(lhs, rhs, block_group, block_row, row_blocks, tiles, transpose_rhs):
    """The output tiles of the first row_blocks[0] row blocks of the list: block i is lhs's
    row block block_row[i] (None: i) times rhs[block_group[i]]."""
    bm, bn, bk, steps, columns_together = tiles[:5]
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    column_blocks = n // bn
    operands = (block_group,) + (() if block_row is None else (block_row,))

    def body(*refs):
        *index_refs, row_blocks_ref, lhs_ref, rhs_ref, out_ref, store = refs
        block_group_ref = index_refs[0]
        used_row_blocks = row_blocks_ref[0]

        @plgpu.nd_loop((used_row_blocks * column_blocks,), collective_axes="sm")
        def tile(loop):
            bi, ni = plgpu.planar_snake(
                loop.index[0], (used_row_blocks, column_blocks), 1, columns_together
            )
            mi = bi if block_row is None else index_refs[1][bi]
            weights = rhs_ref.at[block_group_ref[bi]]

            def multiply(_, lhs_smem, rhs_smem, acc_ref):
                plgpu.wgmma(
                    acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
                )

            def accumulate(acc_ref):
                plgpu.emit_pipeline(
                    functools.partial(multiply, acc_ref=acc_ref),
                    grid=(k // bk,),
                    in_specs=[
                        plgpu.BlockSpec((bm, bk), lambda ki: (mi, ki), delay_release=1),
                        plgpu.BlockSpec((bn, bk), lambda ki: (ni, ki), delay_release=1)
                        if transpose_rhs
                        else plgpu.BlockSpec((bk, bn), lambda ki: (ki, ni), delay_release=1),
                    ],
                    max_concurrent_steps=steps,
                )(lhs_ref, weights)
                return acc_ref[...]

            store(pl.run_scoped(accumulate, plgpu.ACC((bm, bn))), out_ref, mi, ni)

    return _over_tiles(
        body, jax.ShapeDtypeStruct((m, n), lhs.dtype), tiles, *operands, row_blocks, lhs, rhs
    )


def aligned_tgmm(lhs, rhs, group_sizes, tiles):
    """out[g] = lhs[rows of g]^T @ rhs[rows of g] ([M, K], [M, N] -> [G, K, N]) for groups
    whose sizes are multiples of tiles.block_k: every block_k rows lie in one group, so each
    output tile is a pipeline over its group's row blocks alone (none masked; an empty group's
    tiles have no steps and store zeros). Tiles go group by group, n fastest within
    grid_block_n columns, so that neighbouring SMs read the same rows."""
    bm, bn, bk, steps, columns_together = tiles[:5]
    (_, k), n, num_groups = lhs.shape, rhs.shape[1], group_sizes.shape[0]
    first_block = (jnp.cumsum(group_sizes) - group_sizes) // bk
    num_blocks = group_sizes // bk
    row_tiles, column_tiles = k // bm, n // bn

    def body(first_block_ref, num_blocks_ref, lhs_ref, rhs_ref, out_ref, store):
        @plgpu.nd_loop((num_groups * row_tiles * column_tiles,), collective_axes="sm")
        def tile(loop):
            group = loop.index[0] // (row_tiles * column_tiles)
            mi, ni = plgpu.planar_snake(
                loop.index[0] % (row_tiles * column_tiles),
                (row_tiles, column_tiles),
                1,
                columns_together,
            )
            first = first_block_ref[group]

            def multiply(_, lhs_smem, rhs_smem, acc_ref):
                plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)

            def accumulate(acc_ref):
                @pl.when(num_blocks_ref[group] > 0)  # an empty group: no pipeline, zeros
                def _():
                    plgpu.emit_pipeline(
                        functools.partial(multiply, acc_ref=acc_ref),
                        grid=(num_blocks_ref[group],),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda ki: (first + ki, mi), delay_release=1),
                            plgpu.BlockSpec((bk, bn), lambda ki: (first + ki, ni), delay_release=1),
                        ],
                        max_concurrent_steps=steps,
                    )(lhs_ref, rhs_ref)

                return acc_ref[...]

            store(pl.run_scoped(accumulate, plgpu.ACC((bm, bn))), out_ref.at[group], mi, ni)

    return _over_tiles(
        body,
        jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype),
        tiles,
        first_block.astype(jnp.int32),
        num_blocks.astype(jnp.int32),
        lhs,
        rhs,
    )


def aligned_gmm_fp8(lhs_q, lhs_scales, rhs_q, rhs_scales, group_sizes, tiles, out_dtype):
    """aligned_gmm's tiles from FP8 operands -> [M, N] out_dtype: lhs_q [M, K] with scales
    [M, K/128], rhs_q [G, N, K] with scales [G, N/128, K/128], group sizes multiples of
    tiles.block_m. Each block_k (= 128) step's product is a fresh tensor-core sum, scaled by its
    rows' scales times the weight block's scale and added to the tile's float32 running sum
    (carried through the pipeline): the block scales apply at full precision."""
    bm, bn, bk, steps, columns_together = tiles[:5]
    (m, k), n = lhs_q.shape, rhs_q.shape[1]
    block_group, row_blocks = _row_blocks(group_sizes, m, bm)
    column_blocks = n // bn
    scales_by_step = lhs_scales.T  # [K/128, M]: one step's scales of a row block side by side

    def body(
        block_group_ref,
        row_blocks_ref,
        lhs_ref,
        scales_ref,
        rhs_ref,
        rhs_scales_ref,
        out_ref,
        store,
    ):
        used_row_blocks = row_blocks_ref[0]

        @plgpu.nd_loop((used_row_blocks * column_blocks,), collective_axes="sm")
        def tile(loop):
            mi, ni = plgpu.planar_snake(
                loop.index[0], (used_row_blocks, column_blocks), 1, columns_together
            )
            group = block_group_ref[mi]

            def step(indices, lhs_smem, rhs_smem, scale_smem, acc):
                def product(part_ref):
                    plgpu.wgmma(part_ref, lhs_smem, rhs_smem.transpose((1, 0)))
                    return part_ref[...]

                part = pl.run_scoped(product, plgpu.ACC((bm, bn)))
                row_scale = scale_smem[...] * rhs_scales_ref[group, ni, indices[0]]
                return acc + part * jax.lax.broadcast_in_dim(row_scale, (bm, bn), [0])

            acc = plgpu.emit_pipeline(
                step,
                grid=(k // bk,),
                in_specs=[
                    plgpu.BlockSpec((bm, bk), lambda ki: (mi, ki)),
                    plgpu.BlockSpec((bn, bk), lambda ki: (ni, ki)),
                    plgpu.BlockSpec((None, bm), lambda ki: (ki, mi)),
                ],
                max_concurrent_steps=steps,
                init_carry=jnp.zeros((bm, bn), jnp.float32),
            )(lhs_ref, rhs_ref.at[group], scales_ref)
            store(acc, out_ref, mi, ni)

    return _over_tiles(
        body,
        jax.ShapeDtypeStruct((m, n), out_dtype),
        tiles,
        block_group,
        row_blocks,
        lhs_q,
        scales_by_step,
        rhs_q,
        rhs_scales,
    )

"""docs/API.md (dispatch, FP8, combine) written as plain numpy loops over all ranks at once:
an oracle independent of both jax_ep paths (no jax, no shared code)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize(x, round_scale):
    """[H] float32 -> (e4m3 bytes [H], scales [H/128])."""
    q = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    scales = np.zeros(x.shape[0] // 128, np.float32)
    for g in range(len(scales)):
        block = x[g * 128 : (g + 1) * 128].astype(np.float32)
        amax = np.float32(max(np.abs(block).max(), np.float32(1e-4)))
        scale = np.float32(amax * np.float32(1 / 448))
        if round_scale:
            scale = np.float32(2.0 ** np.ceil(np.log2(np.float64(scale))))
            q[g * 128 : (g + 1) * 128] = (block / scale).astype(ml_dtypes.float8_e4m3fn)
        else:
            q[g * 128 : (g + 1) * 128] = (block * (np.float32(448) / amax)).astype(
                ml_dtypes.float8_e4m3fn
            )
        scales[g] = scale
    return q, scales


def dispatch_rank(x, idx, w, num_experts, rows, fp8=False, round_scale=False):
    """Per-rank inputs [R, T, ...] -> per-rank rank-layout outputs (dict of [R, ...] arrays)."""
    num_ranks, num_tokens, hidden = x.shape
    k = idx.shape[2]
    el = num_experts // num_ranks
    out = dict(
        x=np.zeros((num_ranks, rows, hidden), ml_dtypes.float8_e4m3fn if fp8 else x.dtype),
        scales=np.zeros((num_ranks, rows, hidden // 128), np.float32),
        topk_idx=np.full((num_ranks, rows, k), -1, np.int32),
        topk_weights=np.zeros((num_ranks, rows, k), np.float32),
        tokens_per_expert=np.zeros((num_ranks, el), np.int32),
        num_recv=np.zeros(num_ranks, np.int32),
        num_dropped=np.zeros(num_ranks, np.int32),
        num_invalid=np.array([((i < -1) | (i >= num_experts)).sum() for i in idx], np.int32),
        send_pos=np.full((num_ranks, num_tokens, num_ranks), -1, np.int32),
        recv_counts=np.zeros((num_ranks, num_ranks), np.int32),
    )
    for d in range(num_ranks):
        p = 0
        for s in range(num_ranks):
            for t in range(num_tokens):
                local = [
                    e - d * el if 0 <= e < num_experts and e // el == d else -1 for e in idx[s, t]
                ]
                if all(l < 0 for l in local):
                    continue
                out["recv_counts"][d, s] += 1
                if p >= rows:
                    out["num_dropped"][d] += 1
                    continue
                if fp8:
                    out["x"][d, p], out["scales"][d, p] = quantize(
                        x[s, t].astype(np.float32), round_scale
                    )
                else:
                    out["x"][d, p] = x[s, t]
                out["topk_idx"][d, p] = local
                out["topk_weights"][d, p] = [
                    w[s, t, j] if l >= 0 else 0 for j, l in enumerate(local)
                ]
                for e in set(local) - {-1}:
                    out["tokens_per_expert"][d, e] += 1
                out["send_pos"][s, t, d] = p
                p += 1
        out["num_recv"][d] = p
    return out


def expert_layout(topk_rows, w_rows, num_local, alignment, capacity, block_rows=0):
    """One rank's rank-layout rows -> expert rows: (src row, expert, weight) per expert row.
    block_rows > 0: expert e owns rows [e * block_rows, (e + 1) * block_rows) (expert_padded)."""
    items = {e: [r for r in range(len(topk_rows)) if e in topk_rows[r]] for e in range(num_local)}
    src = np.full(capacity, -1, np.int32)
    expert = np.full(capacity, -1, np.int32)
    weight = np.zeros(capacity, np.float32)
    present = np.zeros(num_local, np.int32)
    dropped, start = 0, 0
    for e in range(num_local):
        if block_rows:
            start = e * block_rows
        for j, r in enumerate(items[e]):
            if start + j >= (start + block_rows if block_rows else capacity):
                dropped += 1
                continue
            src[start + j], expert[start + j] = r, e
            weight[start + j] = np.float32(
                sum(w_rows[r][k] for k in range(len(topk_rows[r])) if topk_rows[r][k] == e)
            )
            present[e] += 1
        start += -(-len(items[e]) // alignment) * alignment
    return src, expert, weight, present, dropped


def combine(expert_out_per_rank, send_pos, bias=None, ranks_per_node=None):
    """y[s, t] = bias + sum over d (in order) of rows_d[send_pos[s, t, d]], float32.
    ranks_per_node (a tuple axis): each node's rows summed first, from zero in rank order,
    then the nodes' sums added onto the bias in node order."""
    num_ranks, num_tokens, _ = send_pos.shape
    width = expert_out_per_rank[0].shape[1]
    group = ranks_per_node or 1  # flat: every rank its own "node", added straight on
    y = np.zeros((num_ranks, num_tokens, width), np.float32)
    for s in range(num_ranks):
        for t in range(num_tokens):
            acc = np.zeros(width, np.float32) if bias is None else bias[s, t].astype(np.float32)
            for node in range(0, num_ranks, group):
                sent = [d for d in range(node, node + group) if send_pos[s, t, d] >= 0]
                if not sent:
                    continue
                partial = np.zeros(width, np.float32)
                for d in sent:
                    partial = partial + expert_out_per_rank[d][send_pos[s, t, d]].astype(np.float32)
                acc = acc + partial
            y[s, t] = acc
    return y


def layer_gradients(x, idx, w, c, layout, fp8, num_experts, num_ranks):
    """d/dx and d/dw of vdot(combine(tanh(dispatch(x))), c) in closed form, for [R * T, ...]
    inputs: every token's rows come back unchanged but for tanh, so y = S * tanh(x') with S its
    destination ranks (rank layout: the combine takes no weights) or its valid weights' sum
    (the expert layouts), x' = x (FP8: its dequantized value; the gradient straight through)."""
    E, R = num_experts, num_ranks
    xq = x  # what the rows hold
    if fp8:
        xq = np.stack(
            [
                (q.astype(np.float32).reshape(-1, 128) * s[:, None]).reshape(-1)
                for q, s in (quantize(row, False) for row in x)
            ]
        )
    valid = (idx >= 0) & (idx < E)
    if layout == "rank":
        scale = np.array(
            [len({e // (E // R) for e in row[ok]}) for row, ok in zip(idx, valid)], np.float32
        )
        want_w = np.zeros_like(w)
    else:
        scale = (w * valid).sum(1)
        want_w = valid * (c * np.tanh(xq)).sum(1, keepdims=True)
    return c * scale[:, None] * (1 - np.tanh(xq) ** 2), want_w

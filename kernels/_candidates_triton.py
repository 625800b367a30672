"""Triton kernel behind :func:`dartree.kernels.candidates.topk_candidates` (imported only for the Triton backend).

One program per row selects the K candidates one after another in (value desc, id asc) order: pass j finds
the largest entry strictly after the (value, id) chosen in pass j-1 in that order, scanning V in blocks.
K passes over V; exact and deterministic (no floating-point reduction order involved in the selection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_kernel(x_ptr, ids_ptr, vals_ptr, lse_ptr, V, K, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row * V
    prev_v = float("inf")
    prev_i = -1
    top = 0.0
    acc = 0.0
    for j in range(0, K):
        best_v = -float("inf")
        best_i = V
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            m = offs < V
            x = tl.load(base + offs, mask=m, other=-float("inf")).to(tl.float32)
            ok = m & ((x < prev_v) | ((x == prev_v) & (offs > prev_i)))
            xe = tl.where(ok, x, -float("inf"))
            cmax = tl.max(xe, axis=0)
            cid = tl.min(tl.where(ok & (xe == cmax), offs, V), axis=0)
            better = (cmax > best_v) | ((cmax == best_v) & (cid < best_i))
            best_v = tl.where(better, cmax, best_v)
            best_i = tl.where(better, cid, best_i)
        tl.store(ids_ptr + row * K + j, best_i.to(tl.int64))
        tl.store(vals_ptr + row * K + j, best_v)
        if j == 0:
            top = best_v
        acc += tl.exp(best_v - top)
        prev_v = best_v
        prev_i = best_i
    tl.store(lse_ptr + row, top + tl.log(acc))


def launch(logits: torch.Tensor, k: int):
    """logits [P, V] -> (ids [P, K] int64, vals [P, K] fp32, lse [P] fp32); k already clamped to V."""
    p, v = logits.shape
    x = logits.float().contiguous()
    ids = torch.empty(p, k, dtype=torch.long, device=x.device)
    vals = torch.empty(p, k, dtype=torch.float32, device=x.device)
    lse = torch.empty(p, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(v), 1024)
    _topk_kernel[(p,)](x, ids, vals, lse, v, k, BLOCK=block)
    return ids, vals, lse

"""Triton kernel behind :func:`dartree.kernels.frontier.frontier_topk` (imported only for the Triton backend).

One program holds the whole [F, K] frontier tile: the low-rank correction A · W^T accumulates over R in
chunks (fp32 ``tl.dot`` with IEEE precision), each row is normalised by its log-sum-exp over K, the parent
score is added, and the top-Q pairs are taken one by one (max value, then lowest flat index), so the order
and tie-breaking equal the torch twin's stable sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dartree.kernels._backend import next_pow2


@triton.jit
def _frontier_kernel(base_ptr, s_ptr, act_ptr, rows_ptr, pick_ptr, path_ptr, F, K, R, Q,
                     HAS_ACT: tl.constexpr, BF: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    fo = tl.arange(0, BF)
    ko = tl.arange(0, BK)
    mf = fo < F
    mk = ko < K
    valid = mf[:, None] & mk[None, :]
    g = tl.zeros([BF, BK], dtype=tl.float32)
    g += tl.load(base_ptr + ko, mask=mk, other=0.0).to(tl.float32)[None, :]
    if HAS_ACT:
        for r0 in range(0, R, BR):
            ro = r0 + tl.arange(0, BR)
            mr = ro < R
            a = tl.load(act_ptr + fo[:, None] * R + ro[None, :], mask=mf[:, None] & mr[None, :], other=0.0)
            w = tl.load(rows_ptr + ko[None, :] * R + ro[:, None], mask=mk[None, :] & mr[:, None], other=0.0)
            g += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    g = tl.where(valid, g, -float("inf"))
    mx = tl.max(g, axis=1)
    mx = tl.where(mf, mx, 0.0)
    ssum = tl.sum(tl.where(valid, tl.exp(g - mx[:, None]), 0.0), axis=1)
    lse = mx + tl.log(tl.where(mf, ssum, 1.0))
    s = tl.load(s_ptr + fo, mask=mf, other=0.0).to(tl.float32)
    path = s[:, None] + (g - lse[:, None])
    flat = fo[:, None] * K + ko[None, :]
    big = BF * BK + K
    taken = flat < 0  # all False
    for q in range(0, Q):
        ok = valid & (taken == 0)
        pv = tl.where(ok, path, -float("inf"))
        best = tl.max(tl.max(pv, axis=1), axis=0)
        hit = ok & (pv == best)
        idx = tl.min(tl.min(tl.where(hit, flat, big), axis=1), axis=0)
        tl.store(pick_ptr + q, idx.to(tl.int64))
        tl.store(path_ptr + q, best)
        taken = taken | (flat == idx)


def launch(base, parent_scores, q, act, rows):
    """Launch one program over the padded [F, K] tile; returns (pick [q] int64, path [q] fp32)."""
    f, k = parent_scores.numel(), base.numel()
    dev = base.device
    pick = torch.empty(q, dtype=torch.long, device=dev)
    path = torch.empty(q, dtype=torch.float32, device=dev)
    has = act is not None
    r = act.shape[1] if has else 0
    a = act.float().contiguous() if has else base.new_zeros(1).float()
    w = rows.float().contiguous() if has else base.new_zeros(1).float()
    _frontier_kernel[(1,)](base.float().contiguous(), parent_scores.float().contiguous(), a, w, pick, path,
                           f, k, r, q, HAS_ACT=has, BF=next_pow2(f), BK=next_pow2(k),
                           BR=min(next_pow2(max(r, 1)), 32))
    return pick, path

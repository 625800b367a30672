"""Per-depth candidate selection: top-K of the base logits plus log-sum-exp over the K candidates.

DARTree (ANCHORS.md 5e, step 3; section 8): every depth d restricts drafting to C_d = top-K(U_d) and
normalises scores over C_d, so the log-sum-exp over the K selected base logits is returned with them.

Order and ties: candidates are ordered by (logit descending, token id ascending); ties at the K-th value go
to the lower token id, so the selected set and its order are deterministic on every backend.
Shapes: P rows (depths), V vocabulary, K candidates (clamped to V). Logits are fp32 (cast inside).
"""

from __future__ import annotations

import torch

from dartree.kernels._backend import resolve


def _check(logits: torch.Tensor, k: int) -> int:
    if logits.dim() != 2:
        raise ValueError(f"topk_candidates expects logits [P, V], got shape {tuple(logits.shape)}")
    if int(k) < 1:
        raise ValueError(f"candidate count K must be >= 1, got {k}")
    return min(int(k), logits.shape[1])


def topk_candidates_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch twin (defines the meaning).

    Args:
        logits: [P, V] float.
        k: K >= 1 (clamped to V).
    Returns:
        ids [P, K] int64, vals [P, K] fp32 (base logits of ids, descending), lse [P] fp32 = logsumexp(vals).
    Raises:
        ValueError: a non-2-D input or k < 1.
    """
    k = _check(logits, k)
    x = logits.float()
    p, v = x.shape
    if p == 0:
        return (torch.zeros(0, k, dtype=torch.long, device=x.device), x.new_zeros(0, k), x.new_zeros(0))
    kth = torch.topk(x, k, dim=-1).values[:, -1:]  # [P, 1]
    gt = x > kth
    eq = x == kth
    need = k - gt.sum(-1, keepdim=True)
    sel = gt | (eq & (torch.cumsum(eq, dim=-1) <= need))  # exactly k per row: every larger one + lowest-id ties
    ids = sel.nonzero()[:, 1].view(p, k)  # ascending ids per row
    vals = x.gather(-1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    ids, vals = ids.gather(-1, order), vals.gather(-1, order)
    return ids, vals, torch.logsumexp(vals, dim=-1)


def topk_candidates(logits: torch.Tensor, k: int, backend: str = "auto", *, with_lse: bool = True):
    """Top-K candidates per row with their log-sum-exp; Triton on CUDA (``auto``); on CPU one ``torch.topk`` of
    K+1 values: without ties topk's order is the ref's; with ties inside the K they are re-sorted by (value desc,
    id asc); with a tie at the K-th value a top-(2K) window is re-sorted so and cut to K, which is exact while the
    K-th value's tie group ends inside the window. bf16 logits (8 bits of mantissa) tie at the K-th value in most
    rows, where the full-row ref took 2.8 ms per 15 x 8192 block and the two topk calls 1.6 ms; only a tie group reaching
    the window's end falls back to the ref itself. The results equal the ref's exactly (tested).

    Same contract as :func:`topk_candidates_ref`; ``with_lse=False`` lets the CPU path skip the log-sum-exp (lse is
    then None there; callers that only select candidates save ~0.1 ms per block on a 2-core CPU).
    Raises:
        ValueError: bad shape, k < 1 or an unknown backend; RuntimeError: ``backend="triton"`` where it cannot run.
    """
    kk = _check(logits, k)
    if logits.shape[0] == 0:
        return topk_candidates_ref(logits, k)
    if resolve(backend, logits.device) == "torch":
        v = logits.shape[1]
        if kk < v:  # one top-(K+1): the set is the ref's unless the K-th value ties the next
            x = logits.float()
            vals, ids = torch.topk(x, kk + 1, dim=-1)
            if not bool((vals[:, kk - 1] == vals[:, kk]).any()):  # no tie at the boundary: topk's K are the ref's
                vals, ids = vals[:, :kk], ids[:, :kk]
                if not bool((vals[:, 1:] == vals[:, :-1]).any()):  # no ties inside: topk's order is the ref's
                    return ids, vals, torch.logsumexp(vals, dim=-1) if with_lse else None
            else:  # a tie at the boundary: a top-(2K) window holds the whole tie group unless it reaches its end
                w = min(2 * kk, v)
                vals, ids = torch.topk(x, w, dim=-1)
                if w < v and bool((vals[:, w - 1] == vals[:, kk - 1]).any()):
                    return topk_candidates_ref(logits, k)  # the tie group may go on past the window
            # every value >= the K-th is inside the window (bf16 logits tie often: the common case there); the
            # ref's K are the first K of the window in (value desc, id asc) order
            by_id = torch.sort(ids, dim=-1).indices
            ids, vals = ids.gather(-1, by_id), vals.gather(-1, by_id)
            order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[:, :kk]
            ids, vals = ids.gather(-1, order), vals.gather(-1, order)
            return ids, vals, torch.logsumexp(vals, dim=-1)
        return topk_candidates_ref(logits, k)
    from dartree.kernels import _candidates_triton

    return _candidates_triton.launch(logits, kk)

"""Per-depth candidate selection: top-K of the base logits plus log-sum-exp over the K candidates.

DARTree (arXiv 2608.13524, Algorithm 1, line 4; ``magneto0124/DARTree`` ``eval_dartree.py``): every depth d
restricts drafting to C_d = top-K(U_d) and normalises scores over C_d, so the log-sum-exp over the K selected
base logits is returned with them.

Order and ties: candidates are ordered by (logit descending, token id ascending); ties at the K-th value go
to the lower token id, so the selected set and its order are deterministic on every backend.
Shapes: P rows (depths), V vocabulary, K candidates (clamped to V). Logits are fp32 (cast inside).
"""

from __future__ import annotations

import numpy as np
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


# bf16 logits keyed for one exact top-K (below): the token id lives in the 16 low bits of an fp32 key
_BF16_KEY_VOCAB = 1 << 16
_KEY_LOW: dict = {}


def _top_desc(keys: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries of each row of ``keys`` [P, V] (1 <= k < V), descending: one ``np.partition`` (an
    O(V) selection, faster than ``torch.topk`` on the CPU: docs/performance.md, "Candidate selection") and a sort of
    the k. NaNs count as the largest values (NumPy's sort order)."""
    v = keys.shape[1]
    return np.sort(np.partition(keys, v - k, axis=1)[:, v - k:], axis=1)[:, ::-1]


def _bf16_keyed_topk(logits: torch.Tensor, k: int, *, bf16_values: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Exact (value desc, id asc) top-K of bf16-valued CPU logits from one selection over fp32 keys, or None where it
    cannot decide (or the logits are not bf16 values).

    A bf16 value is the top half of an fp32 bit pattern, so its 16 low bits are free: the key puts ``0xFFFF - id``
    there for values >= +0 and ``id`` for negative ones (whose magnitude grows with the bits). Every key then lies
    strictly between its value and the next bf16 value, and among equal values the lower id has the larger key:
    the keys are distinct, their order is the ref's order, ties included, and the values are the keys with the low
    bits cleared. The first pass keys every value as a non-negative one (one OR); only when a negative value is
    selected are the negative ones re-keyed. Two cases are left to the caller (None): a NaN key (an infinite or NaN
    logit, whose key is NaN and which the selection ranks first) and a selected zero (-0.0 and +0.0 tie as values
    but not as keys). The selection is :func:`_top_desc` (NumPy).

    Args:
        logits: [P, V] bfloat16, or fp32 holding bf16 values (a bf16 matmul's output cast up, as the drafter's base
            logits in bf16 mode; checked unless ``bf16_values``: fp32 logits with any of the 16 low bits set give
            None), V <= 65,536, on the CPU.
        k: 1 <= K < V.
        bf16_values: the caller vouches that fp32 logits hold bf16 values (the drafter's flag,
            ``DraftBlock.bf16_values``), which skips the check (a pass over the logits).
    Returns:
        (ids [P, K] int64, vals [P, K] fp32) as :func:`topk_candidates_ref` gives them, or None.
    """
    v = logits.shape[1]
    if logits.dtype == torch.bfloat16:
        bits = logits.detach().float().numpy().view(np.int32)
    elif logits.dtype == torch.float32:
        bits = logits.detach().contiguous().numpy().view(np.int32)
        if not bf16_values and ((bits[0] & 0xFFFF).any() or (bits & 0xFFFF).any()):  # row 0 first: true fp32 leaves
            return None
    else:
        return None
    low = _KEY_LOW.get(v)
    if low is None:
        low = _KEY_LOW[v] = 0xFFFF - np.arange(v, dtype=np.int32)  # = 0xFFFF ^ id
    top = _top_desc(np.bitwise_or(bits, low).view(np.float32), k)
    if np.isnan(top).any():
        return None
    tb = top.view(np.int32)
    if (tb < 0).any():  # a negative value selected: negative keys carry the id itself (low ^ 0xFFFF)
        keys = (bits >> 31) & 0xFFFF
        keys ^= low
        keys |= bits
        top = _top_desc(keys.view(np.float32), k)
        if np.isnan(top).any():
            return None
        tb = top.view(np.int32)
    vals = (tb & ~0xFFFF).view(np.float32)
    if (vals == 0).any():
        return None
    lo = tb & 0xFFFF
    ids = np.where(tb < 0, lo, 0xFFFF - lo)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(np.ascontiguousarray(vals))


def topk_candidates(logits: torch.Tensor, k: int, backend: str = "auto", *, with_lse: bool = True,
                    bf16_values: bool = False):
    """Top-K candidates per row with their log-sum-exp; Triton on CUDA (``auto``). On CPU:

    - bf16 logits, and fp32 logits holding bf16 values (a bf16 drafter's base logits), take one selection of fp32
      keys that carry the token id in their low bits (:func:`_bf16_keyed_topk`; exact with ties).
    - Other logits take one ``torch.topk`` of K+1 values (for true fp32 faster than an ``np.argpartition`` route):
      without ties topk's order is the ref's; with ties inside the K they are re-sorted by (value desc, id asc); with
      a tie at the K-th value a top-(2K) window is re-sorted so and cut to K, which is exact while the K-th value's
      tie group ends inside the window. Only a tie group reaching the window's end falls back to the ref itself
      (the full-row ref, several times slower).

    The timings of each route are in docs/performance.md, "Candidate selection". The results equal the ref's
    exactly (tested).

    Same contract as :func:`topk_candidates_ref`; ``bf16_values=True`` says fp32 logits hold bf16 values (the
    drafter's ``DraftBlock.bf16_values``; see :func:`_bf16_keyed_topk`); ``with_lse=False`` lets the CPU path skip the log-sum-exp (lse is
    then None on the paths that can skip it and a tensor where it was computed anyway, so callers that only select
    candidates skip a pass over the logits).
    Raises:
        ValueError: bad shape, k < 1 or an unknown backend; RuntimeError: ``backend="triton"`` where it cannot run.
    """
    kk = _check(logits, k)
    if logits.shape[0] == 0:
        return topk_candidates_ref(logits, k)
    if resolve(backend, logits.device) == "torch":
        v = logits.shape[1]
        out = None
        if logits.device.type == "cpu" and kk < v:
            if logits.dtype in (torch.bfloat16, torch.float32) and v <= _BF16_KEY_VOCAB:
                out = _bf16_keyed_topk(logits, kk, bf16_values=bf16_values)
        if out is not None:
            ids, vals = out
            return ids, vals, torch.logsumexp(vals, dim=-1) if with_lse else None
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
    # lazy: triton is optional (CUDA only): the Triton kernel module loads on the first GPU call
    from dartree.kernels import _candidates_triton

    return _candidates_triton.launch(logits, kk)

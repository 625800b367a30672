"""Frontier scoring: one depth of DARTree's depth-wise batched expansion in one call
(DARTree, arXiv 2608.13524, Algorithm 1, lines 5-9).

For the F parents of the frontier at depth d, all sharing the candidate set C_d (K tokens, base logits
``base`` = U_d[C_d]):

    g[p, c]    = base[c] + A[p] · W[c]          (the low-rank form of every head: W = out_rows(C_d), A = factors)
    logq[p, c] = g[p, c] - logsumexp_c g[p, :]  (normalised over the K candidates, as DARTree does)
    path[p, c] = S[p] + logq[p, c]

and the global top-Q of the F*K path scores is selected (flat index p*K + c; ties go to the lower flat index,
i.e. the earlier parent, then the better-ranked candidate). The identity head passes A = W = None (g = base).
Shapes: F parents, K candidates, R head rank, Q quota. All math in fp32.
"""

from __future__ import annotations

import torch

from dartree.kernels._backend import next_pow2, resolve

MAX_TILE = 16384  # F*K entries one Triton program holds (padded to powers of two)


def _check(base, parent_scores, quota, act, rows) -> None:
    if base.dim() != 1 or parent_scores.dim() != 1:
        raise ValueError(f"frontier_topk expects base [K] and parent_scores [F], got {tuple(base.shape)} and "
                         f"{tuple(parent_scores.shape)}")
    if (act is None) != (rows is None):
        raise ValueError("frontier_topk needs both act [F, R] and rows [K, R], or neither (identity head)")
    if act is not None:
        f, k = parent_scores.numel(), base.numel()
        if act.dim() != 2 or rows.dim() != 2 or act.shape[0] != f or rows.shape[0] != k or act.shape[1] != rows.shape[1]:
            raise ValueError(f"frontier_topk shapes disagree: act {tuple(act.shape)} must be [F={f}, R] and rows "
                             f"{tuple(rows.shape)} [K={k}, R]")
    if int(quota) < 0:
        raise ValueError(f"quota must be >= 0, got {quota}")


def frontier_scores_ref(base, parent_scores, act=None, rows=None) -> torch.Tensor:
    """All path scores path [F, K] fp32 (see the module docstring); no selection."""
    g = base.float()[None, :].expand(parent_scores.numel(), -1)
    if act is not None:
        g = g + act.float() @ rows.float().t()
    return parent_scores.float()[:, None] + torch.log_softmax(g, dim=-1)


def frontier_topk_ref(base: torch.Tensor, parent_scores: torch.Tensor, quota: int,
                      act: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """Plain-torch twin (defines the meaning).

    Args:
        base: [K] base logits of the shared candidates.
        parent_scores: [F] path scores S of the parents (nats).
        quota: Q >= 0 pairs to select (clamped to F*K).
        act: [F, R] per-parent head activation, or None. rows: [K, R] head output rows of C_d, or None.
    Returns:
        pick [Q'] int64 flat indices p*K + c in selection order, path [Q'] fp32 their path scores (descending).
    Raises:
        ValueError: shapes that disagree or a negative quota.
    """
    _check(base, parent_scores, quota, act, rows)
    path = frontier_scores_ref(base, parent_scores, act, rows).reshape(-1)
    q = min(int(quota), path.numel())
    pick = torch.sort(path, descending=True, stable=True).indices[:q]
    return pick, path[pick]


def frontier_topk(base, parent_scores, quota, act=None, rows=None, backend: str = "auto"):
    """Scores the frontier and selects the top-Q pairs in one Triton launch on CUDA (``auto``), the ref on CPU
    or when F*K exceeds one program's tile (``MAX_TILE``). Same contract as :func:`frontier_topk_ref`.

    Raises:
        ValueError: as the ref, or ``backend="triton"`` with F*K over ``MAX_TILE``.
        RuntimeError: ``backend="triton"`` where it cannot run.
    """
    _check(base, parent_scores, quota, act, rows)
    f, k = parent_scores.numel(), base.numel()
    chosen = resolve(backend, base.device)
    too_big = next_pow2(f) * next_pow2(k) > MAX_TILE
    if chosen == "triton" and too_big and backend == "triton":
        raise ValueError(f"frontier_topk: F*K = {f}x{k} exceeds one Triton tile ({MAX_TILE} padded entries); "
                         "use backend='auto' (falls back to torch) or a smaller frontier")
    if chosen == "torch" or too_big or f == 0 or k == 0 or int(quota) == 0:
        return frontier_topk_ref(base, parent_scores, quota, act, rows)
    # lazy: triton is optional (CUDA only): the Triton kernel module loads on the first GPU call
    from dartree.kernels import _frontier_triton

    return _frontier_triton.launch(base, parent_scores, min(int(quota), f * k), act, rows)

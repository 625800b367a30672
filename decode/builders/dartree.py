"""DARTree's two builders (arXiv 2608.13524; DARTree ``run_dartree.py``): ``pruned`` and ``fixed``, the papers'
DARTree-pruned and DARTree-fixed.

:func:`build_dartree_pruned` expands a supertree of width W per depth, then keeps the global top-B nodes by
score + beta * depth, a prefix-closed set for beta <= 0 (DARTree Lemma 1). :func:`build_dartree_fixed` expands with a
fixed quota of ceil(remaining budget / remaining depths) nodes per depth, beta = 0. Both run the depth-wise batched
expansion of :mod:`dartree.decode.builders.supertree`.
"""

from __future__ import annotations

from dartree.decode.builders.supertree import build_supertree
from dartree.decode.trees import (DraftBlock, Tree, _check_beta, _check_k, _check_params, check_build_args,
                                  select_top_b)
from dartree.models.heads import CorrectionHead


def build_dartree_pruned(
    block: DraftBlock,
    head: CorrectionHead,
    root_id: int,
    budget: int,
    *,
    k: int = 64,
    width: int = 12,
    beta: float = -0.2,
    backend: str = "auto",
    **extra,
) -> Tree:
    """DARTree-pruned: supertree of width W per depth, then global top-B by score + beta*depth.

    Defaults K=64, W=12, beta=-0.2 are the published ones (DARTree ``run_dartree.py``); budget B = nodes kept.
    Raises:
        ValueError: k < 1, width < 1 or beta > 0 (prefix closure needs beta <= 0).
        TypeError: an unknown parameter.
    """
    _check_params("pruned", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    if int(width) < 1:
        raise ValueError(f"supertree width W must be >= 1, got {width}")
    _check_beta(beta)
    if budget <= 0:
        return Tree.empty()
    sup = build_supertree(block, head, root_id, k=k, quota=lambda d, avail: min(int(width), avail), backend=backend,
                          prune=(int(budget), float(beta)))
    return select_top_b(sup, int(budget), float(beta))


def build_dartree_fixed(
    block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64, backend: str = "auto",
    **extra,
) -> Tree:
    """DARTree-fixed: depth-wise batched expansion with a fixed quota of ceil(remaining budget / remaining
    depths) nodes per depth (64 over 16 depths = 4 per depth), beta = 0 (DARTree ``run_dartree.py``).

    Raises:
        ValueError: k < 1. TypeError: an unknown parameter (``width``/``beta``/``children`` are accepted and
            ignored).
    """
    _check_params("fixed", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    budget = int(budget)
    if budget <= 0:
        return Tree.empty()
    p_len = block.base_logits.shape[0]
    used = [0]

    def quota(d: int, avail: int) -> int:
        q = min(-(-(budget - used[0]) // (p_len - d)), avail)
        used[0] += q
        return q

    return build_supertree(block, head, root_id, k=k, quota=quota, backend=backend)

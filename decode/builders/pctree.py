"""PCTree (arXiv 2608.02123): parent-conditioned drafting for Markov-style heads (:func:`build_pctree`).

Depth by depth every kept parent gets its top-k children conditioned on its own token, and the layer keeps the k best
of those by path score (the paper's within-layer top-k pruning), until the budget's N nodes exist; k = 1 is the DSpark
chain. It runs DARTree's depth-wise expansion (:mod:`dartree.decode.builders.supertree`) with a quota of k nodes per
depth (the reading of the paper is in :func:`build_pctree`).
"""

from __future__ import annotations

from dartree.decode.builders.supertree import build_supertree
from dartree.decode.trees import DraftBlock, Tree, _check_k, _check_params, check_build_args
from dartree.models.heads import CorrectionHead


def build_pctree(
    block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64, children: int = 4,
    backend: str = "auto", **extra,
) -> Tree:
    """PCTree (arXiv 2608.02123): parent-conditioned drafting for Markov-style heads.

    Depth by depth, every kept parent gets its top-``children`` (k) children from g(C_d, H_d, r_parent), i.e.
    conditioned on that parent's own token, and the layer keeps the ``children`` best of those by path score
    (the paper's within-layer top-k pruning), until ``budget`` (N) nodes exist. k = 1 is the DSpark chain.
    Reading of the paper (its code is not public): the kept set per layer is k nodes, because the reported
    acceptance lengths (tau 11.16 at block 16 with N = 64, k = 4) need trees about N / k deep; a full k-ary
    tree would stop at depth 3. Candidates are the top-K of the base logits, normalised over the K (as DARTree
    does, arXiv 2608.13524, Algorithm 1, line 4), so per-parent top-k then layer top-k equals one global top-k
    over the layer's parents x K (a test pins that equivalence); the last layer is cut to the remaining budget by
    path score.
    Defaults k = 4, N = 32 (the paper's); this project passes N as ``budget``.

    Raises:
        ValueError: k < 1 or children < 1. TypeError: an unknown parameter.
    """
    _check_params("pctree", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    if int(children) < 1:
        raise ValueError(f"PCTree children per parent must be >= 1, got {children}")
    budget = int(budget)
    if budget <= 0:
        return Tree.empty()
    used = [0]

    def quota(d: int, avail: int) -> int:
        q = max(0, min(int(children), budget - used[0], avail))
        used[0] += q
        return q

    return build_supertree(block, head, root_id, k=k, quota=quota, backend=backend)

"""DDTree (arXiv 2604.12989; DDTree ``build_ddtree_tree``): the draft tree from the factorised per-depth marginals
(:func:`build_ddtree`).

A best-first heap over log_softmax(U_d) of the drafter's base logits returns exactly the top-B prefixes by summed
log-probability, with K = min(B, V) candidates per depth. The correction head is not used: DDTree drafts from the
marginals alone.
"""

from __future__ import annotations

import torch

from dartree.decode.trees import DraftBlock, Tree, _check_params, block_candidates, check_build_args
from dartree.models.heads import CorrectionHead


@torch.no_grad()
def build_ddtree(block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, **extra) -> Tree:
    """DDTree: best-first heap over the factorised per-depth marginals log_softmax(U_d) (DDTree
    ``build_ddtree_tree``, arXiv 2604.12989): returns exactly the top-B prefixes by summed log-probability,
    with K = min(B, V) candidates per depth. The correction head is not used (DDTree drafts from marginals).
    Ties go to the shallower, earlier-pushed entry.

    Raises:
        TypeError: an unknown parameter (``k``/``width``/``beta``/``children`` are accepted and ignored).
    """
    import heapq

    _check_params("ddtree", extra)
    budget = check_build_args(block, root_id, budget, head)
    p_len, v = block.base_logits.shape
    if budget <= 0 or p_len == 0:
        return Tree.empty()
    kk = min(budget, v)
    ids, lp = block_candidates(block, kk, backend=extra.get("backend", "auto"),
                               logits=torch.log_softmax(block.base_logits.float(), dim=-1))
    lp_l, ids_l = lp.tolist(), ids.tolist()
    counter = 0
    heap = [(-lp_l[0][0], 1, counter, 0, 0, lp_l[0][0])]  # (-logw, depth, order, parent, rank, logw)
    toks, pars, deps, scs = [], [], [], []
    while heap and len(toks) < budget:
        _, depth, _, parent, rank, logw = heapq.heappop(heap)
        toks.append(ids_l[depth - 1][rank])
        pars.append(parent)
        deps.append(depth)
        scs.append(logw)
        node = len(toks)
        if rank + 1 < kk:
            counter += 1
            w = logw - lp_l[depth - 1][rank] + lp_l[depth - 1][rank + 1]
            heapq.heappush(heap, (-w, depth, counter, parent, rank + 1, w))
        if depth < p_len:
            counter += 1
            w = logw + lp_l[depth][0]
            heapq.heappush(heap, (-w, depth + 1, counter, node, 0, w))
    return Tree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long),
                torch.tensor(deps, dtype=torch.long), torch.tensor(scs, dtype=torch.float32))

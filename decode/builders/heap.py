"""The heap-sequential builder (:func:`build_heap_sequential`): the exact sequential alternative DARTree ablates
(DARTree arXiv 2608.13524, Table 2, "heap-sequential correction").

One global best-first heap over the corrected tree, one correction-head call per node: every pop creates a node and
scores its K children. With priority path log q~ + beta * depth (beta <= 0) it returns exactly the top-B nodes of the
whole K-ary corrected tree, the set DARTree-pruned returns with W >= B (DARTree Lemma 1). Slow by design: the
reference DARTree's batched expansion is measured against.
"""

from __future__ import annotations

import torch

from dartree.decode.trees import (DraftBlock, Tree, _check_beta, _check_k, _check_params, block_candidates,
                                  check_build_args, expand_frontier, head_k)
from dartree.models.heads import CorrectionHead


@torch.no_grad()
def build_heap_sequential(
    block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64, beta: float = -0.2,
    backend: str = "auto", **extra,
) -> Tree:
    """The exact sequential alternative DARTree ablates (DARTree Table 2, "heap-sequential correction").

    One global best-first heap over the corrected tree: every pop creates one node, advances its state and
    runs the correction g(C_{d+1}, H_{d+1}, r_node) for that node alone, then pushes its best child and the
    popped node's next sibling. Priority = path log q~ + beta * depth (q~ normalised over the K candidates, as
    in ``pruned``). With beta <= 0 priorities never increase along a path, so the result is exactly the
    top-B nodes of the whole K-ary corrected tree, prefix-closed; ``pruned`` with W >= B returns the
    same set (DARTree Lemma 1). Slow by design: one head call per node instead of one per depth.
    Ties go to the shallower, earlier-pushed entry.

    Raises:
        ValueError: k < 1 or beta > 0. TypeError: an unknown parameter.
    """
    import heapq

    _check_params("heap-sequential", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    _check_beta(beta)
    budget = int(budget)
    p_len = block.base_logits.shape[0]
    if budget <= 0 or p_len == 0:
        return Tree.empty()
    ids, vals = block_candidates(block, head_k(k, head), backend=backend)
    kk = ids.shape[1]
    dev = ids.device

    def children_of(state, score: float, d: int):
        # correction for one node: its K children at depth d + 1, best first
        _, col, path = expand_frontier(head, block.hidden[d], state, ids[d], vals[d],
                                       torch.tensor([score], device=dev), kk, backend)
        return ids[d, col].tolist(), path.tolist()

    root_state = head.init_state(torch.tensor([root_id], device=dev))
    kids = {0: children_of(root_state, 0.0, 0)}
    states = {0: root_state}
    node_depth = [0]
    counter = 0
    heap = [(-(kids[0][1][0] + beta), 1, counter, 0, 0)]  # (-priority, depth, order, parent, rank)
    toks, pars, deps, scs = [], [], [], []
    while heap and len(toks) < budget:
        _, depth, _, parent, rank = heapq.heappop(heap)
        tok, score = kids[parent][0][rank], kids[parent][1][rank]
        toks.append(tok)
        pars.append(parent)
        deps.append(depth)
        scs.append(score)
        node = len(toks)
        node_depth.append(depth)
        if rank + 1 < len(kids[parent][0]):
            counter += 1
            heapq.heappush(heap, (-(kids[parent][1][rank + 1] + beta * depth), depth, counter, parent, rank + 1))
        if depth < p_len and len(toks) < budget:
            st = head.advance(states[parent], torch.tensor([tok], device=dev), block.hidden[depth - 1][None])
            states[node] = st
            kids[node] = children_of(st, score, depth)
            counter += 1
            heapq.heappush(heap, (-(kids[node][1][0] + beta * (depth + 1)), depth + 1, counter, node, 0))
    return Tree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long),
                torch.tensor(deps, dtype=torch.long), torch.tensor(scs, dtype=torch.float32))

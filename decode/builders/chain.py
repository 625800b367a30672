"""The chain builder (:func:`build_chain`): one node per depth, the greedy path through the corrected head.

Depth d takes the argmax over the top-K candidates C_d of g(C_d, H_d, r) and the head state r advances along it: the
DFlash chain for the identity head, DSpark/Domino chain drafting otherwise (Domino arXiv 2605.29707, DSpark arXiv
2607.05147). A ``first_order`` head on the torch backend walks the chain in NumPy over one teacher-forced factor call
(:func:`_chain_first_order`), the identity head from one ``torch.topk`` (:func:`_chain_identity`); any other head runs
DARTree's expansion (:mod:`dartree.decode.builders.supertree`) with a quota of one node per depth.
"""

from __future__ import annotations

import numpy as np
import torch

from dartree.decode.builders.supertree import _pair_factors, build_supertree
from dartree.decode.trees import DraftBlock, Tree, _check_k, _check_params, block_candidates, check_build_args, head_k
from dartree.kernels._backend import resolve
from dartree.models.heads import CorrectionHead


@torch.no_grad()
def build_chain(block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64,
                backend: str = "auto", **extra) -> Tree:
    """Greedy path through the corrected head: depth d takes argmax over C_d of g(C_d, H_d, r), r advances.

    The DFlash chain for the identity head, DSpark/Domino chain drafting otherwise (Domino arXiv 2605.29707,
    DSpark arXiv 2607.05147).
    Args:
        budget: maximum number of nodes (depths); the chain has min(budget, P) nodes.
        k: candidate count per depth (the argmax is taken over the top-K of the base logits).
    Raises:
        ValueError: k < 1; TypeError: an unknown parameter (``width``, ``beta`` and ``children`` are accepted and
            ignored, so one parameter set serves every builder).
    """
    _check_params("chain", extra)
    budget = check_build_args(block, root_id, budget, head)
    _check_k(k)
    p = block.base_logits.shape[0]
    m = max(0, min(int(budget), p))
    if m == 0:
        return Tree.empty()
    block = block.first(m)
    if head.first_order and resolve(backend, block.base_logits.device) == "torch":  # one factor call, a NumPy walk
        if not head.corrects:  # DFlash's own chain (g = U): the argmax row by row, K values for the normalizer
            fast = _chain_identity(block, head_k(k, head))
            if fast is not None:
                return fast
        ids, vals = block_candidates(block, head_k(k, head), backend=backend)
        return _chain_first_order(block, head, root_id, ids, vals)
    return build_supertree(block, head, root_id, k=k,
                           quota=lambda d, avail: 1, backend=backend)


def _chain_first_order(block: DraftBlock, head: CorrectionHead, root_id: int, ids: torch.Tensor,
                       vals: torch.Tensor) -> Tree:
    """:func:`build_chain` for a ``first_order`` head: depth d scores only its parent's row, g = U[C_d] +
    A(parent) · W[C_d]^T with the factors of one teacher-forced ``head.block_factors`` call (the rows of
    :func:`pair_scores`), and takes its first argmax (ties to the better-ranked candidate, as the frontier
    selection); the P chosen rows are normalised together at the end. NumPy, two small ops per depth."""
    p_len, kk = ids.shape
    u = vals.detach().float().cpu().numpy()
    fac = _pair_factors(block, head, root_id, ids)
    cols = np.zeros(p_len + 1, dtype=np.int64)  # cols[d] = the parent's row at depth d (root: row 0)
    if fac is None:  # identity: the base logits alone
        g = u
        cols[1:] = g.argmax(axis=1)
    else:
        a = fac[0].detach().float().transpose(0, 1).cpu().numpy()  # [P, K, R]: row j = parent ids[d-1, j]
        w = fac[1].detach().float().reshape(p_len, kk, -1).cpu().numpy()  # [P, K, R]: W[C_d]
        g = np.empty_like(u)
        for d in range(p_len):
            g[d] = u[d] + w[d] @ a[d, cols[d]]
            cols[d + 1] = g[d].argmax()
    m = g.max(axis=1, keepdims=True)
    logq = g - (m + np.log(np.exp(g - m).sum(axis=1, keepdims=True)))
    depth = np.arange(p_len)
    scs = np.cumsum(logq[depth, cols[1:]], dtype=np.float32)
    dev = ids.device
    toks = torch.from_numpy(ids.detach().cpu().numpy()[depth, cols[1:]]).to(dev)
    parents = torch.arange(p_len, dtype=torch.long, device=dev)  # node d + 1's parent is node d (the root: 0)
    return Tree(toks, parents, parents + 1, torch.from_numpy(scs).to(dev))


def _chain_identity(block: DraftBlock, k: int) -> Tree | None:
    """:func:`build_chain` for the identity head on CPU from one ``torch.topk`` of the base logits: depth d takes the
    row's largest logit (the lowest id among equal ones, as the candidate order puts it first) and scores it
    against the log-sum-exp of the row's K largest values, which are the same values in the same order as
    :func:`block_candidates` gives whatever the ties (so the tree equals :func:`_chain_first_order`'s exactly).
    It skips the exact tie order of all K candidates, which only the argmax needs, and a full-vocabulary block's
    selection keys (the time it saves: docs/trees.md, "Measured").
    Returns None when the row maximum ties more than K values (the caller then takes the general path)."""
    x = block.base_logits.float()
    kk = min(int(k), x.shape[1])
    top = torch.topk(x, kk, dim=-1)
    tied = top.values == top.values[:, :1]
    if kk < x.shape[1] and bool(tied[:, -1].any()):
        return None
    col = torch.where(tied, top.indices, x.shape[1]).min(dim=-1).values  # [P] lowest column of each row's maximum
    u = top.values.detach().cpu().numpy()
    mx = u[:, :1]
    logq0 = u[:, 0] - (mx[:, 0] + np.log(np.exp(u - mx).sum(axis=1)))
    scs = np.cumsum(logq0, dtype=np.float32)
    toks = col if block.vocab is None else torch.index_select(block.vocab.to(col.device), 0, col)
    dev = block.base_logits.device
    p_len = x.shape[0]
    parents = torch.arange(p_len, dtype=torch.long, device=dev)
    return Tree(toks.to(dev), parents, parents + 1, torch.from_numpy(scs).to(dev))

"""DARTree's depth-wise batched expansion (arXiv 2608.13524, Algorithm 1; DARTree ``build_dartree_supertree``), which
the DARTree, PCTree and chain builders run with their own per-depth quotas.

At depth d every frontier parent scores the K candidates of the base logits with the correction head, normalised over
them, and the global top-``quota`` (parent, candidate) pairs by path score become the next frontier
(:func:`build_supertree`). For a ``first_order`` head (its state a function of the parent's token alone) the scores of
every (parent token, candidate) pair of a round come from one batched matmul (:func:`pair_scores`,
:func:`pair_log_probs`), and the depth loop runs over those tables compiled (``dartree.kernels.tree_expand``), with
:func:`_expand_first_order_np` as its NumPy twin.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from dartree.decode.trees import (DraftBlock, Tree, _check_k, _top_q_stable, block_candidates, expand_frontier,
                                  head_k)
from dartree.kernels._backend import resolve
from dartree.models.heads import CorrectionHead


@torch.no_grad()
def build_supertree(
    block: DraftBlock, head: CorrectionHead, root_id: int, *, k: int, quota: Callable[[int, int], int],
    backend: str = "auto", prune: tuple[int, float] | None = None,
) -> Tree:
    """DARTree depth-wise batched expansion (arXiv 2608.13524, Algorithm 1; ``build_dartree_supertree``).

    At depth d every frontier parent p scores the K candidates C_d of the base logits with g(C_d, H_d, r_p),
    normalised over C_d: log q~(c | p) = g - logsumexp_C(g). Path scores S(p, c) = S(p) + log q~(c | p) form a
    [|F|, K] matrix, from which the global top-``quota(d, |F|*K)`` pairs become depth-d nodes (the new frontier);
    their states are advanced in one batched call. Candidate selection and frontier scoring run through
    ``dartree.kernels`` (``backend``).

    Args:
        prune: (B, beta) when the caller keeps only the top-B nodes by ``score + beta * depth`` (beta <= 0):
            expansion stops at the first depth after which no deeper node can enter that top-B, i.e. once B
            nodes already score at least max(frontier score) + beta * (next depth) (path scores never increase
            along a path, and ties go to the shallower node), so the top-B of the returned tree is unchanged.
    Returns:
        The supertree, depth-major (so topologically ordered), scores = path log q~ (nats).
    """
    _check_k(k)
    p_len = block.base_logits.shape[0]
    ids, vals = block_candidates(block, head_k(k, head), backend=backend)  # [P, K]
    kk = ids.shape[1]
    if head.first_order and resolve(backend, ids.device) == "torch":
        return _expand_first_order(pair_log_probs(block, head, root_id, ids, vals), ids, quota, prune)
    state = head.init_state(torch.tensor([root_id], device=ids.device))
    f_score = torch.zeros(1, device=ids.device)
    f_index = torch.zeros(1, dtype=torch.long, device=ids.device)  # node index of frontier entries (root = 0)
    toks, pars, deps, scs = [], [], [], []
    next_index = 1
    adj_sorted = None  # prune: the best B adjusted scores so far, descending
    for d in range(p_len):
        n_f = f_score.numel()
        q = quota(d, n_f * kk)
        if q <= 0 or n_f == 0:
            break
        hid = block.hidden[d]
        par_row, cand_col, path = expand_frontier(head, hid, state, ids[d], vals[d], f_score, q, backend)
        new_tok = ids[d, cand_col]
        toks.append(new_tok)
        pars.append(f_index[par_row])
        deps.append(torch.full((par_row.numel(),), d + 1, dtype=torch.long, device=ids.device))
        scs.append(path)
        f_score = path
        f_index = torch.arange(next_index, next_index + par_row.numel(), device=ids.device)
        next_index += par_row.numel()
        parent_state = None if state is None else state[par_row]
        state = head.advance(parent_state, new_tok, hid.expand(par_row.numel(), -1))
        if prune is not None and d + 1 < p_len:
            b_keep, beta = prune
            adj = path.float() + beta * (d + 1)
            adj_sorted = adj if adj_sorted is None else torch.cat([adj_sorted, adj])
            if adj_sorted.numel() > b_keep:
                adj_sorted = torch.topk(adj_sorted, b_keep).values
            if adj_sorted.numel() >= b_keep and float(adj_sorted.min()) >= float(path.max()) + beta * (d + 2):
                break
    if not toks:
        return Tree.empty()
    return Tree(torch.cat(toks), torch.cat(pars), torch.cat(deps), torch.cat(scs).float())


def _pair_factors(block: DraftBlock, head: CorrectionHead, root_id: int, ids: torch.Tensor):
    """The head's teacher-forced factors for every possible parent of a round: (A [K, P, R], W[C] [P*K, R]) from one
    ``block_factors`` call, where column d of A is the parent token ``ids[d-1, j]`` in row j (the root at d = 0) and W
    is restricted to the round's candidates (no [V, R] copy); None for a head that adds nothing (identity).

    Raises:
        ValueError: the head is not ``first_order``.
    """
    if not head.first_order:
        raise ValueError(f"pair tables need a first-order head; {type(head).__name__}'s state follows the path")
    kk = ids.shape[1]
    prev = torch.cat([torch.full((kk, 1), int(root_id), dtype=torch.long, device=ids.device), ids[:-1].t()], dim=1)
    return head.block_factors(prev, block.hidden[None].expand(kk, -1, -1), ids.reshape(-1))


@torch.no_grad()
def pair_scores(block: DraftBlock, head: CorrectionHead, root_id: int, ids: torch.Tensor, vals: torch.Tensor
                ) -> torch.Tensor:
    """Corrected scores g(C_d, H_d, r(parent token)) of every (parent token, candidate) pair of a round, before
    normalisation, for a ``first_order`` head (one whose state is a function of the parent's token alone).

    At depth d a parent's token is the root (d = 0) or one of the K candidates of depth d - 1, so the scores take
    K x K values per depth. They come from the head's teacher-forced low-rank form (``block_factors``) and one
    batched matmul, which replaces the per-depth frontier scoring (same values up to float rounding of the matmul).
    Args:
        block: the round's DraftBlock (hidden [P, D]).
        ids, vals: [P, K] candidate ids and base logits (:func:`block_candidates`).
    Returns:
        [P, K, K] fp32: row j of depth d is the parent whose token is ``ids[d-1, j]``; at depth 0 every row is
        the root's.
    Raises:
        ValueError: the head is not ``first_order``.
    """
    p_len, kk = ids.shape
    fac = _pair_factors(block, head, root_id, ids)
    g = vals.float()[:, None, :]
    if fac is None:
        return g.expand(p_len, kk, kk)
    rows = fac[1].view(p_len, kk, -1)  # [P, K, R]
    return torch.baddbmm(g, fac[0].transpose(0, 1), rows.transpose(1, 2))


def pair_log_probs(block: DraftBlock, head: CorrectionHead, root_id: int, ids: torch.Tensor, vals: torch.Tensor
                   ) -> torch.Tensor:
    """Normalised corrected log-probabilities of every (parent token, candidate) pair of a round:
    log q~(c | parent) = log_softmax over C_d of :func:`pair_scores` (same arguments and errors).

    Returns:
        [P, K, K] fp32, rows as :func:`pair_scores`.
    """
    return torch.log_softmax(pair_scores(block, head, root_id, ids, vals), dim=-1)


def _expand_first_order(logq: torch.Tensor, ids: torch.Tensor, quota: Callable[[int, int], int],
                        prune: tuple[int, float] | None) -> Tree:
    """:func:`build_supertree`'s depth loop over precomputed pair tables ``logq`` [P, K, K]: the same frontier
    selection (global top-``quota`` of parent score + log q~, ties to the earlier parent, then the better-ranked
    candidate) and the same early stop, compiled (``dartree.kernels.tree_expand.expand_first_order``; its twin is
    :func:`_expand_first_order_np`). The quotas are evaluated first, in depth order, with the frontier sizes the loop
    will see (``quota`` may keep state, as DARTree-fixed's and PCTree's do).

    Raises:
        ValueError: a NaN log-probability (a broken head or drafter output; named, instead of a short tree).
    """
    # lazy: a numba kernel module: numba loads and compiles on first use, not when this module is imported
    from dartree.kernels.tree_expand import expand_first_order

    lq = logq.detach().cpu().numpy()
    id_np = ids.detach().cpu().numpy()
    p_len, kk = id_np.shape
    quotas, n_f = np.zeros(p_len, dtype=np.int64), 1
    for d in range(p_len):
        q = min(int(quota(d, n_f * kk)), n_f * kk)
        if q <= 0:
            break
        quotas[d] = n_f = q
    out = expand_first_order(lq, id_np, quotas, prune)
    if out is None:
        raise ValueError("the round's corrected log-probabilities hold NaN: the head or the drafter's base logits "
                         "produced NaN (a broken checkpoint, or an overflow in this dtype); check the drafter's "
                         "output on this prompt, or load it in float32")
    toks, pars, deps, scs = out
    if toks.size == 0:
        return Tree.empty()
    dev = ids.device
    return Tree(torch.from_numpy(toks).to(dev), torch.from_numpy(pars).to(dev), torch.from_numpy(deps).to(dev),
                torch.from_numpy(scs).to(dev))


def _expand_first_order_np(logq: torch.Tensor, ids: torch.Tensor, quota: Callable[[int, int], int],
                           prune: tuple[int, float] | None) -> Tree:
    """:func:`_expand_first_order` on NumPy arrays, a dozen calls per depth (the compiled kernel's twin)."""
    lq = logq.detach().cpu().numpy()
    id_np = ids.detach().cpu().numpy()
    p_len, kk = id_np.shape
    f_score = np.zeros(1, dtype=np.float32)
    f_col = np.zeros(1, dtype=np.int64)  # the frontier's row in the next depth's table (root: row 0)
    f_start = 0  # node index of the frontier's first entry (frontier entries are numbered consecutively)
    toks, pars, scs, counts = [], [], [], []
    next_index, adj_kept = 1, np.zeros(0, dtype=np.float32)
    for d in range(p_len):
        n_f = f_score.size
        q = min(int(quota(d, n_f * kk)), n_f * kk)
        if q <= 0 or n_f == 0:
            break
        path = (f_score[:, None] + lq[d][f_col]).reshape(-1)
        # best first; ties to the lower flat index (earlier parent, then better-ranked candidate)
        pick = np.array([path.argmax()]) if q == 1 else _top_q_stable(path, q)
        par_row, cand_col = np.divmod(pick, kk)
        f_score = path[pick]
        toks.append(id_np[d, cand_col])
        pars.append(par_row + f_start)
        scs.append(f_score)
        counts.append(q)
        f_col, f_start, next_index = cand_col, next_index, next_index + q
        if prune is not None and d + 1 < p_len:
            b_keep, beta = prune
            adj_kept = np.sort(np.concatenate([adj_kept, f_score + np.float32(beta * (d + 1))]))[-b_keep:]
            if adj_kept.size >= b_keep and float(adj_kept[0]) >= float(f_score.max()) + beta * (d + 2):
                break
    if not toks:
        return Tree.empty()
    dev = ids.device
    deps = np.repeat(np.arange(1, len(counts) + 1, dtype=np.int64), counts)
    return Tree(torch.from_numpy(np.concatenate(toks)).to(dev), torch.from_numpy(np.concatenate(pars)).to(dev),
                torch.from_numpy(deps).to(dev), torch.from_numpy(np.concatenate(scs)).float().to(dev))

"""Draft-tree builders behind one signature, registered by name.

``build(block, head, root_id, budget, **params) -> Tree`` where ``block`` holds the drafter's hidden states
H [P, D] and base logits U [P, V] for the P proposals of one round. Builders never touch the target.

Node numbering: the root (the anchor / bonus token, already committed) is node 0 and is not stored; tree
nodes are 1..M in topological order (every parent index < its child's). ``Tree.parents[i]`` is the parent of
node i+1 (0 = the root); ``Tree.depth[i]`` is its depth (children of the root have depth 1) and the token it
proposes sits at position ``start + depth``.

Determinism: candidate ties are broken toward the lower token id, selection ties toward the earlier
(parent, candidate) pair, and top-B ties toward the shallower / earlier node, so equal scores always give
the same tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dartree.models.heads import CorrectionHead


@dataclass
class DraftBlock:
    """Drafter output for one round: hidden [P, D] (any float dtype) and base logits [P, V] fp32."""

    hidden: torch.Tensor
    base_logits: torch.Tensor


@dataclass
class Tree:
    """A draft tree without its root.

    Attributes:
        tokens: [M] int64 proposed token ids.
        parents: [M] int64 parent node index (0 = root, else 1..M), always lower than the node's own index.
        depth: [M] int64 depth >= 1.
        score: [M] fp32 path log-score used for selection (nats; builder-specific surrogate).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def empty() -> "Tree":
        z = torch.zeros(0, dtype=torch.long)
        return Tree(z, z.clone(), z.clone(), torch.zeros(0))


def candidates(base_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-K of the base logits, ordered by (logit desc, token id asc); ties at the K-th value are
    resolved toward the lower token id, so the selected set is deterministic too.

    Args:
        base_logits: [P, V] fp32.
        k: K >= 1 (clamped to V).
    Returns:
        (ids [P, K] int64, logits [P, K] fp32).
    Raises:
        ValueError: k < 1.
    """
    if int(k) < 1:
        raise ValueError(f"candidate count K must be >= 1, got {k}")
    p, v = base_logits.shape
    k = min(int(k), v)
    kth = torch.topk(base_logits, k, dim=-1).values[:, -1:]  # [P, 1]
    gt = base_logits > kth
    eq = base_logits == kth
    need = k - gt.sum(-1, keepdim=True)
    sel = gt | (eq & (torch.cumsum(eq, dim=-1) <= need))  # exactly k per row, lowest ids among the ties
    ids = sel.nonzero()[:, 1].view(p, k)  # ascending ids per row
    vals = base_logits.gather(-1, ids)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order), vals.gather(-1, order)


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor; ties go to the lower index."""
    k = min(int(k), scores.numel())
    return torch.sort(scores, descending=True, stable=True).indices[:k]


COMMON_PARAMS = {"k", "width", "beta"}


def _check_params(name: str, extra: dict) -> None:
    unknown = sorted(set(extra) - COMMON_PARAMS)
    if unknown:
        raise TypeError(f"tree builder {name!r} got unknown parameter(s) {unknown}; known: {sorted(COMMON_PARAMS)}")


TreeBuilder = Callable[..., Tree]
BUILDERS: dict[str, TreeBuilder] = {}


def register_builder(*names: str):
    """Decorator registering a builder under one or more names.

    Raises:
        ValueError: a name is taken.
    """

    def wrap(fn: TreeBuilder) -> TreeBuilder:
        for n in names:
            if n in BUILDERS:
                raise ValueError(f"tree builder {n!r} is already registered")
            BUILDERS[n] = fn
        return fn

    return wrap


def get_builder(name: str) -> TreeBuilder:
    """Look a builder up by name.

    Raises:
        KeyError: unknown name; the message lists the registered names.
    """
    if name not in BUILDERS:
        raise KeyError(f"unknown tree builder {name!r}; available: {sorted(BUILDERS)}")
    return BUILDERS[name]


@register_builder("chain")
@torch.no_grad()
def build_chain(block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64, **extra) -> Tree:
    """Greedy path through the corrected head: depth d takes argmax over C_d of g(C_d, H_d, r), r advances.

    The DFlash chain for the identity head, DSpark/Domino chain drafting otherwise (ANCHORS.md 5a, 5b).
    Args:
        budget: maximum number of nodes (depths); the chain has min(budget, P) nodes.
        k: candidate count per depth (the argmax is taken over the top-K of the base logits).
    Raises:
        ValueError: k < 1; TypeError: an unknown parameter (``width`` and ``beta`` are accepted and ignored,
            so one parameter set serves every builder).
    """
    _check_params("chain", extra)
    if int(k) < 1:
        raise ValueError(f"candidate count K must be >= 1, got {k}")
    p = block.base_logits.shape[0]
    m = max(0, min(int(budget), p))
    if m == 0:
        return Tree.empty()
    ids, vals = candidates(block.base_logits[:m], k)
    state = head.init_state(torch.tensor([root_id]))
    toks, scores, total = [], [], 0.0
    for d in range(m):
        g = head.score(ids[d : d + 1], block.hidden[d : d + 1], state, vals[d : d + 1])[0]
        logq = torch.log_softmax(g, dim=-1)
        j = int(_stable_topk(g, 1)[0])
        tok = int(ids[d, j])
        total += float(logq[j])
        toks.append(tok)
        scores.append(total)
        state = head.advance(state, torch.tensor([tok]), block.hidden[d : d + 1])
    return Tree(
        tokens=torch.tensor(toks, dtype=torch.long),
        parents=torch.arange(m, dtype=torch.long),
        depth=torch.arange(1, m + 1, dtype=torch.long),
        score=torch.tensor(scores, dtype=torch.float32),
    )


@torch.no_grad()
def build_supertree(
    block: DraftBlock, head: CorrectionHead, root_id: int, *, k: int, quota: Callable[[int, int], int]
) -> Tree:
    """DARTree depth-wise batched expansion (DARTree ``build_dartree_supertree``, ANCHORS.md 5e).

    At depth d every frontier parent p scores the K candidates C_d of the base logits with g(C_d, H_d, r_p),
    normalised over C_d: log q~(c | p) = g - logsumexp_C(g). Path scores S(p, c) = S(p) + log q~(c | p) form a
    [|F|, K] matrix, from which the global top-``quota(d, |F|*K)`` pairs become depth-d nodes (the new frontier);
    their states are advanced in one batched call.

    Returns:
        The supertree, depth-major (so topologically ordered), scores = path log q~ (nats).
    """
    p_len = block.base_logits.shape[0]
    ids, vals = candidates(block.base_logits, k)  # [P, K]
    kk = ids.shape[1]
    state = head.init_state(torch.tensor([root_id]))
    f_score = torch.zeros(1)
    f_index = torch.zeros(1, dtype=torch.long)  # node index of frontier entries (root = 0)
    toks, pars, deps, scs = [], [], [], []
    next_index = 1
    for d in range(p_len):
        n_f = f_score.numel()
        q = quota(d, n_f * kk)
        if q <= 0 or n_f == 0:
            break
        cand = ids[d].expand(n_f, kk)
        hid = block.hidden[d].expand(n_f, -1)
        g = head.score(cand, hid, state, vals[d].expand(n_f, kk))  # [F, K]
        logq = torch.log_softmax(g.float(), dim=-1)
        path = (f_score[:, None] + logq).reshape(-1)
        pick = _stable_topk(path, q)
        par_row, cand_col = pick // kk, pick % kk
        new_tok = ids[d, cand_col]
        toks.append(new_tok)
        pars.append(f_index[par_row])
        deps.append(torch.full((pick.numel(),), d + 1, dtype=torch.long))
        scs.append(path[pick])
        f_score = path[pick]
        f_index = torch.arange(next_index, next_index + pick.numel())
        next_index += pick.numel()
        parent_state = None if state is None else state[par_row]
        state = head.advance(parent_state, new_tok, hid[par_row])
    if not toks:
        return Tree.empty()
    return Tree(torch.cat(toks), torch.cat(pars), torch.cat(deps), torch.cat(scs).float())


def select_top_b(tree: Tree, budget: int, beta: float) -> Tree:
    """Keep the top-``budget`` nodes by ``score + beta * depth`` and re-index them topologically.

    With beta <= 0 and log q~ <= 0, scores never increase along a path, so the kept set is prefix-closed
    (DARTree Lemma 1; ties go to the shallower, earlier node, i.e. to the parent).

    Raises:
        ValueError: beta > 0 (the prefix-closure guarantee does not hold); use beta <= 0.
    """
    if beta > 0:
        raise ValueError(f"depth bonus beta={beta} > 0 breaks DARTree's prefix-closure guarantee; use beta <= 0")
    m = tree.size
    if budget >= m:
        return tree
    if budget <= 0:
        return Tree.empty()
    adj = tree.score + beta * tree.depth.float()
    keep = _stable_topk(adj, budget).sort().values  # original order is topological
    remap = torch.full((m + 1,), -1, dtype=torch.long)
    remap[0] = 0
    remap[keep + 1] = torch.arange(1, keep.numel() + 1)
    parents = remap[tree.parents[keep]]
    if bool((parents < 0).any()):  # pragma: no cover - excluded by the lemma above
        raise RuntimeError("select_top_b: kept set is not prefix-closed")
    return Tree(tree.tokens[keep], parents, tree.depth[keep], tree.score[keep])


@register_builder("dartree-pruned", "pruned")
def build_dartree_pruned(
    block: DraftBlock,
    head: CorrectionHead,
    root_id: int,
    budget: int,
    *,
    k: int = 64,
    width: int = 12,
    beta: float = -0.2,
    **extra,
) -> Tree:
    """DARTree-pruned: supertree of width W per depth, then global top-B by score + beta*depth.

    Defaults K=64, W=12, beta=-0.2 are the published ones (DARTree ``run_dartree.py``); budget B = nodes kept.
    Raises:
        ValueError: k < 1, width < 1 or beta > 0 (prefix closure needs beta <= 0).
        TypeError: an unknown parameter.
    """
    _check_params("dartree-pruned", extra)
    if int(width) < 1:
        raise ValueError(f"supertree width W must be >= 1, got {width}")
    if beta > 0:
        raise ValueError(f"depth bonus beta={beta} > 0 breaks DARTree's prefix-closure guarantee; use beta <= 0")
    if budget <= 0:
        return Tree.empty()
    sup = build_supertree(block, head, root_id, k=k, quota=lambda d, avail: min(int(width), avail))
    return select_top_b(sup, int(budget), float(beta))


@register_builder("dartree-fixed", "fixed")
def build_dartree_fixed(
    block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, *, k: int = 64, **extra
) -> Tree:
    """DARTree-fixed: depth-wise batched expansion with a fixed quota of ceil(remaining budget / remaining
    depths) nodes per depth (64 over 16 depths = 4 per depth), beta = 0 (DARTree ``run_dartree.py``).

    Raises:
        ValueError: k < 1. TypeError: an unknown parameter (``width``/``beta`` are accepted and ignored).
    """
    _check_params("dartree-fixed", extra)
    budget = int(budget)
    if budget <= 0:
        return Tree.empty()
    p_len = block.base_logits.shape[0]
    used = [0]

    def quota(d: int, avail: int) -> int:
        q = min(-(-(budget - used[0]) // (p_len - d)), avail)
        used[0] += q
        return q

    return build_supertree(block, head, root_id, k=k, quota=quota)


@register_builder("ddtree")
@torch.no_grad()
def build_ddtree(block: DraftBlock, head: CorrectionHead, root_id: int, budget: int, **extra) -> Tree:
    """DDTree: best-first heap over the factorised per-depth marginals log_softmax(U_d) (DDTree
    ``build_ddtree_tree``, arXiv 2604.12989): returns exactly the top-B prefixes by summed log-probability,
    with K = min(B, V) candidates per depth. The correction head is not used (DDTree drafts from marginals).
    Ties go to the shallower, earlier-pushed entry.

    Raises:
        TypeError: an unknown parameter (``k``/``width``/``beta`` are accepted and ignored).
    """
    import heapq

    _check_params("ddtree", extra)
    budget = int(budget)
    p_len, v = block.base_logits.shape
    if budget <= 0 or p_len == 0:
        return Tree.empty()
    kk = min(budget, v)
    ids, lp = candidates(torch.log_softmax(block.base_logits.float(), dim=-1), kk)
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

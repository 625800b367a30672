"""The shared core of the draft-tree builders: the types, candidate selection, top-B selection and argument checks.

The builders themselves, one module each, and their registry by name are in :mod:`dartree.decode.builders`; they all
have one signature, ``build(block, head, root_id, budget, **params) -> Tree`` where ``block`` holds the drafter's
hidden states H [P, D] and base logits U [P, V] for the P proposals of one round. Builders never touch the target.
Every builder first checks its arguments (:func:`check_build_args`): a block whose shapes do not fit, a root id
outside [0, V) or a non-integer budget raises TypeError / ValueError naming it; a budget of 0 gives the empty tree
and a negative one is a ValueError.

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

import numpy as np
import torch

from dartree.base.fields import describe, is_int
from dartree.kernels.candidates import topk_candidates
from dartree.kernels.frontier import frontier_topk
from dartree.models.heads import CorrectionHead


@dataclass
class DraftBlock:
    """Drafter output for one round: hidden [P, D] (any float dtype) and base logits [P, V] fp32.

    With a reduced draft vocabulary, ``vocab`` [V'] holds its token ids in ascending order and ``base_logits``
    is [P, V'] over those ids only (column j scores token ``vocab[j]``; every other token is out of the
    draft, i.e. -inf); builders map candidate columns to token ids through :func:`block_candidates`.
    ``bf16_values`` is True when the fp32 base logits are a bf16 matmul's output cast up (the drafter in bf16,
    :func:`dartree.decode.draft.draft_block`): candidate selection then keys them without checking their low bits
    (``dartree.kernels.candidates``). Leave it False for logits of any other origin.
    """

    hidden: torch.Tensor
    base_logits: torch.Tensor
    vocab: torch.Tensor | None = None
    bf16_values: bool = False

    def first(self, m: int) -> "DraftBlock":
        """The first ``m`` proposals (a shorter block; same vocabulary and flag)."""
        return DraftBlock(self.hidden[:m], self.base_logits[:m], self.vocab, self.bf16_values)


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


def candidates(base_logits: torch.Tensor, k: int, backend: str = "auto", *, bf16_values: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-K of the base logits, ordered by (logit desc, token id asc); ties at the K-th value are
    resolved toward the lower token id, so the selected set is deterministic too
    (``dartree.kernels.candidates.topk_candidates``).

    Args:
        base_logits: [P, V] fp32.
        k: K >= 1 (clamped to V).
        backend: kernel backend (``auto``: Triton on CUDA, torch on CPU).
        bf16_values: the fp32 logits hold bf16 values (``DraftBlock.bf16_values``): selection skips the check.
    Returns:
        (ids [P, K] int64, logits [P, K] fp32).
    Raises:
        ValueError: k < 1.
    """
    ids, vals, _ = topk_candidates(base_logits, k, backend=backend, with_lse=False, bf16_values=bf16_values)
    return ids, vals


def block_candidates(block: DraftBlock, k: int, backend: str = "auto", logits: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`candidates` of a block as token ids: per depth the top-K of ``logits`` (default the block's base
    logits) with column indices mapped through ``block.vocab`` when the block has a draft vocabulary (ascending
    ids, so ties still go to the lower token id).

    Returns:
        (ids [P, K] int64 token ids, values [P, K] fp32).
    Raises:
        ValueError: k < 1.
    """
    if logits is None:
        cols, vals = candidates(block.base_logits, k, backend=backend, bf16_values=block.bf16_values)
    else:
        cols, vals = candidates(logits, k, backend=backend)
    if block.vocab is None:
        return cols, vals
    return torch.index_select(block.vocab.to(cols.device), 0, cols.reshape(-1)).view(cols.shape), vals


def _top_q_stable(x: np.ndarray, q: int) -> np.ndarray:
    """Indices of the q largest entries of a 1-D array, best first, ties to the lower index (as a stable sort of
    -x, :func:`_stable_topk`): a partition finds the q-th value, only the selected ones are sorted."""
    n = x.size
    if q >= n:
        return np.argsort(-x, kind="stable")
    if q <= 0:
        return np.zeros(0, dtype=np.int64)
    thr = np.partition(x, n - q)[n - q]  # the q-th largest value
    above = np.flatnonzero(x > thr)
    pick = np.concatenate([above, np.flatnonzero(x == thr)[: q - above.size]])
    return pick[np.lexsort((pick, -x[pick]))]


def _stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of a 1-D tensor; ties go to the lower index."""
    k = min(int(k), scores.numel())
    return torch.sort(scores, descending=True, stable=True).indices[:k]


# Where a builder's check of its ``**extra`` finds the parameters the registered builders declare: the registry
# (dartree.decode.builders) installs its ``declared_params`` here when it is imported, and importing any builder
# module imports it first. This module sits below the registry and does not import it.
_declared_params: Callable[[], dict] = dict


def use_declared_params(lookup: Callable[[], dict]) -> None:
    """Install ``lookup`` (the registry's :func:`dartree.decode.builders.declared_params`: {name: parameter} of every
    registered builder) as what :func:`_check_params` accepts; the registry calls it once, when it is imported."""
    global _declared_params
    _declared_params = lookup


def _check_params(name: str, extra: dict) -> None:
    known = _declared_params()
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise TypeError(f"tree builder {name!r} got unknown parameter(s) {unknown}; known: {sorted(known)}")


def _check_k(k: int) -> None:
    if int(k) < 1:
        raise ValueError(f"candidate count K must be >= 1, got {k}")


def _kary_nodes(k: int, depth: int) -> int:
    """K + K^2 + ... + K^depth: the nodes of a full K-ary tree of that depth (root excluded), the most any tree of
    K candidates per position has."""
    return sum(k ** d for d in range(1, depth + 1))


def head_k(k: int, head: CorrectionHead) -> int:
    """The candidate count K a builder uses with ``head``: ``k``, capped at ``head.max_candidates`` for a head whose
    distribution is defined over the top-k of U only (DFlash 2's selector: ``selector_top_k``)."""
    cap = getattr(head, "max_candidates", None)
    return int(k) if cap is None else min(int(k), int(cap))


def _check_beta(beta: float) -> None:
    if beta > 0:
        raise ValueError(f"depth bonus beta={beta} > 0 breaks DARTree's prefix-closure guarantee; use beta <= 0")


def check_build_args(block, root_id: int, budget: int, head=None) -> int:
    """Check a tree builder's positional arguments; returns the budget as an int.

    Args:
        block: a DraftBlock with ``hidden`` [P, D] float and ``base_logits`` [P, V] float (same P, V >= 1).
        root_id: the root token, an integer in [0, V).
        budget: an integer >= 0 (nodes to keep).
        head: the correction head, if any: its ``vocab_size`` (when it has one) must be >= V and its
            ``hidden_size`` D.
    Raises:
        TypeError: block without ``hidden`` / ``base_logits`` tensors, or a non-integer root_id / budget.
        ValueError: shapes that do not fit ([P, D] and [P, V]), a head of another vocabulary or width, a root id
            outside [0, V) or a negative budget.
    """
    hid, base = getattr(block, "hidden", None), getattr(block, "base_logits", None)
    if not isinstance(hid, torch.Tensor) or not isinstance(base, torch.Tensor):
        raise TypeError(f"block is {describe(block)}; give a DraftBlock(hidden [P, D], base_logits [P, V])")
    if base.dim() != 2 or hid.dim() != 2 or hid.shape[0] != base.shape[0] or base.shape[1] < 1:
        raise ValueError(f"block.hidden {list(hid.shape)} and block.base_logits {list(base.shape)} must be [P, D] "
                         "and [P, V] with the same P and V >= 1")
    if not base.is_floating_point() or not hid.is_floating_point():
        raise TypeError(f"block tensors must be floating point, got hidden {hid.dtype} and base_logits {base.dtype}")
    vocab = getattr(block, "vocab", None)  # a reduced draft vocabulary: base_logits columns are these token ids
    if vocab is not None and (not isinstance(vocab, torch.Tensor) or vocab.dim() != 1 or vocab.numel() != base.shape[1]):
        raise ValueError(f"block.vocab must be [V'] token ids, one per base_logits column ({base.shape[1]}), got "
                         f"{describe(vocab)}")
    n_vocab = base.shape[1] if vocab is None else int(vocab[-1]) + 1  # ascending ids: the last is the largest
    hv, hd = getattr(head, "vocab_size", None), getattr(head, "hidden_size", None)
    if hv is not None and hv < n_vocab:
        raise ValueError(f"head vocab_size {hv} < block.base_logits vocabulary {n_vocab}: candidate ids would "
                         "fall outside the head's tables; use the head trained with this drafter and target")
    if hd is not None and hd != hid.shape[1]:
        raise ValueError(f"head hidden_size {hd} != block.hidden width {hid.shape[1]}")
    if not is_int(root_id):
        raise TypeError(f"root_id={root_id!r} must be an integer token id")
    upper = hv if hv is not None else (n_vocab if vocab is None else None)  # a draft vocabulary does not bound it
    if root_id < 0 or (upper is not None and root_id >= upper):
        raise ValueError(f"root_id={root_id} is outside the vocabulary [0, {upper})")
    if not is_int(budget):
        raise TypeError(f"budget={budget!r} must be an integer >= 0")
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0 (tree nodes to keep)")
    return int(budget)


def select_top_b(tree: Tree, budget: int, beta: float) -> Tree:
    """Keep the top-``budget`` nodes by ``score + beta * depth`` and re-index them topologically.

    With beta <= 0 and log q~ <= 0, scores never increase along a path, so the kept set is prefix-closed
    (DARTree Lemma 1; ties go to the shallower, earlier node, i.e. to the parent).

    Raises:
        ValueError: beta > 0 (the prefix-closure guarantee does not hold); use beta <= 0.
    """
    return select_top_b_keep(tree, budget, beta)[0]


def select_top_b_keep(tree: Tree, budget: int, beta: float) -> tuple[Tree, torch.Tensor]:
    """:func:`select_top_b` that also returns the kept original node indices [B'] int64 (ascending), so
    per-node side data can follow the selection."""
    _check_beta(beta)
    m = tree.size
    dev = tree.parents.device
    if budget >= m:
        return tree, torch.arange(m, device=dev)
    if budget <= 0:
        return Tree.empty(), torch.zeros(0, dtype=torch.long)
    if tree.score.device.type == "cpu" and tree.score.dtype == torch.float32:  # compiled, same result (tested)
        # lazy: a numba kernel module: numba loads and compiles on first use, not when this module is imported
        from dartree.kernels.tree_expand import top_b_keep

        out = top_b_keep(tree.score.numpy(), tree.depth.numpy(), tree.parents.numpy(), int(budget), float(beta))
        if out is not None:
            keep, parents = (torch.from_numpy(a) for a in out)
            return Tree(tree.tokens[keep], parents, tree.depth[keep], tree.score[keep]), keep
    adj = tree.score + beta * tree.depth.float()
    if adj.device.type == "cpu":  # the same selection by partition (a full stable sort costs more on a small CPU)
        keep = torch.from_numpy(np.sort(_top_q_stable(adj.numpy(), int(budget))))
    else:
        keep = _stable_topk(adj, budget).sort().values  # original order is topological
    keep = keep.to(dev)  # a tree on CUDA keeps its nodes there (the remap indexes its parents)
    remap = torch.full((m + 1,), -1, dtype=torch.long, device=dev)
    remap[0] = 0
    remap[keep + 1] = torch.arange(1, keep.numel() + 1, device=dev)
    parents = remap[tree.parents[keep]]
    if bool((parents < 0).any()):  # pragma: no cover - excluded by the lemma above
        raise RuntimeError("select_top_b: kept set is not prefix-closed")
    return Tree(tree.tokens[keep], parents, tree.depth[keep], tree.score[keep]), keep


def expand_frontier(head: CorrectionHead, hidden: torch.Tensor, state, cand: torch.Tensor, base: torch.Tensor,
                    parent_scores: torch.Tensor, quota: int, backend: str = "auto"):
    """One depth of batched expansion: g over the shared candidates for every frontier parent, normalised
    over the K candidates, path scores, and the global top-``quota`` (DARTree ``build_dartree_supertree``).

    Uses the fused frontier kernel (``dartree.kernels.frontier``) through the head's low-rank form
    g = U[C] + factors(H, r) · out_rows(C)^T; a head without that form is scored with ``head.score``.
    Args:
        hidden: [D] H at this depth. state: [F, S] parents' states (or None). cand/base: [K] ids / base logits.
        parent_scores: [F] fp32. quota: pairs to select.
    Returns:
        (parent row [Q] int64, candidate column [Q] int64, path score [Q] fp32), best first; ties go to the
        earlier parent, then the better-ranked candidate.
    """
    n_f, kk = parent_scores.numel(), cand.numel()
    hid = hidden.expand(n_f, -1)
    try:
        act = head.factors(hid, state)
    except NotImplementedError:
        g = head.score(cand.expand(n_f, kk), hid, state, base.expand(n_f, kk))
        path = (parent_scores[:, None] + torch.log_softmax(g.float(), dim=-1)).reshape(-1)
        pick = _stable_topk(path, quota)
        path = path[pick]
    else:
        rows = None if act is None else head.out_rows(cand)
        pick, path = frontier_topk(base, parent_scores, quota, act, rows, backend=backend)
    return pick // kk, pick % kk, path

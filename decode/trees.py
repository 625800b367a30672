"""Draft-tree builders behind one signature, registered by name.

``build(block, head, root_id, budget, **params) -> Tree`` where ``block`` holds the drafter's hidden states
H [P, D] and base logits U [P, V] for the P proposals of one round. Builders never touch the target. Every
builder first checks its arguments (:func:`check_build_args`): a block whose shapes do
not fit, a root id outside [0, V) or a non-integer budget raises TypeError / ValueError naming it; a budget of
0 gives the empty tree and a negative one is a ValueError.

Node numbering: the root (the anchor / bonus token, already committed) is node 0 and is not stored; tree
nodes are 1..M in topological order (every parent index < its child's). ``Tree.parents[i]`` is the parent of
node i+1 (0 = the root); ``Tree.depth[i]`` is its depth (children of the root have depth 1) and the token it
proposes sits at position ``start + depth``.

Determinism: candidate ties are broken toward the lower token id, selection ties toward the earlier
(parent, candidate) pair, and top-B ties toward the shallower / earlier node, so equal scores always give
the same tree.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dartree.base.fields import describe, is_int, is_real
from dartree.kernels._backend import resolve
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


def _check_params(name: str, extra: dict) -> None:
    known = declared_params()
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


@dataclass(frozen=True)
class BuilderParam:
    """One keyword parameter of a tree builder, as the builder declares it in :func:`register_builder`.

    A parameter name means one thing in every builder that declares it (same kind, default, range and help), so one
    ``builder_params`` dict and one set of command-line flags serve every builder of a run; a builder ignores a
    declared parameter it does not take (``chain`` accepts ``width``).

    Attributes:
        name: the keyword in ``builder_params`` (``k``, ``width``, ...).
        kind: ``"int"`` (an integer), ``"real"`` (a finite real number) or ``"choice"`` (one of ``choices``).
        default: the value a builder uses when the keyword is absent (the published setting).
        help: what the value means, with its unit, for ``--help``.
        minimum, maximum: inclusive bounds of an ``int`` / ``real`` (None: unbounded).
        choices: the accepted values of a ``"choice"``.
        flag: the command-line flag of ``dartree-eval`` (``--candidates`` for ``k``); ``""``: not on the command line.
        reason: why the bounds hold, appended to the range error (``beta > 0 breaks prefix closure``).
    """

    name: str
    kind: str
    default: object
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    flag: str = ""
    reason: str = ""

    @property
    def dest(self) -> str:
        """The argparse attribute of :attr:`flag` (``--candidates`` -> ``candidates``); "" without a flag."""
        return self.flag.lstrip("-").replace("-", "_")

    def range_text(self) -> str:
        """The accepted values in words (``an integer >= 1``, ``a finite number <= 0``, ``'auto', 'torch' or ...``)."""
        if self.kind == "choice":
            return ", ".join(repr(c) for c in self.choices[:-1]) + f" or {self.choices[-1]!r}"
        words = "an integer" if self.kind == "int" else "a finite number"
        bounds = [f">= {self.minimum}"] * (self.minimum is not None) + [f"<= {self.maximum}"] * (self.maximum is not None)
        return " ".join([words, *bounds])

    def problem(self, value) -> tuple[type, str] | None:
        """(exception class, what is wrong) when ``value`` is not an accepted value, else None."""
        if self.kind == "choice":
            return None if value in self.choices else (ValueError, f"must be {self.range_text()}")
        if self.kind == "int" and not is_int(value) or self.kind == "real" and not is_real(value):
            return TypeError, f"must be {self.range_text()}"
        if self.kind == "real" and not math.isfinite(float(value)) or \
                self.minimum is not None and value < self.minimum or self.maximum is not None and value > self.maximum:
            return ValueError, f"must be {self.range_text()}" + (f" ({self.reason})" if self.reason else "")
        return None


# The parameters the registered builders declare (one object per name, shared by the builders that take it).
PARAM_K = BuilderParam("k", "int", 64, "candidate count K per depth (top-K of the base logits)", minimum=1,
                       flag="--candidates")
PARAM_WIDTH = BuilderParam("width", "int", 12, "supertree width W per depth", minimum=1, flag="--width")
PARAM_BETA = BuilderParam("beta", "real", -0.2, "depth bonus beta of the ranking score + beta * depth (<= 0)",
                          maximum=0, flag="--beta", reason="beta > 0 breaks DARTree's prefix closure")
PARAM_CHILDREN = BuilderParam("children", "int", 4, "children per kept parent k", minimum=1, flag="--children")
PARAM_BACKEND = BuilderParam("backend", "choice", "auto", "kernel backend of candidate selection and frontier scoring",
                             choices=("auto", "torch", "triton"))


@dataclass(frozen=True)
class TreeBuilder:
    """A registered tree builder: ``build(block, head, root_id, budget, **params) -> Tree``, with the parameters it
    declares and whether it ranks its nodes by ``score + beta * depth``. Calling it calls ``build``.

    Attributes:
        name: its registered name.
        build: the function (arguments and errors in its own docstring).
        params: the :class:`BuilderParam` objects it takes.
        ranks_by_beta: True when its top-B keeps the best nodes by ``score + beta * depth`` (DARTree-pruned,
            heap-sequential); the ``budget="auto"`` policy then cuts its trees by the same rank.
        size: ``(P, params) -> int``, the most nodes its tree can have for P proposals whatever the budget (params:
            its parameters, declared defaults filled in, ``k`` capped by the head's candidates); None: the budget.
    """

    name: str
    build: Callable[..., Tree]
    params: tuple = ()
    ranks_by_beta: bool = False
    size: Callable[[int, dict], int] | None = None

    def __call__(self, *args, **kwargs) -> Tree:
        return self.build(*args, **kwargs)

    def max_nodes(self, budget: int, proposals: int, builder_params: dict | None = None,
                  head: CorrectionHead | None = None) -> int:
        """The most nodes it returns with ``budget`` for a drafter of ``proposals`` (P) proposals: ``budget``
        capped by :attr:`size` (a chain: P whatever the budget). ``builder_params`` as the builder takes them
        (declared defaults where absent); ``head`` caps ``k`` at its candidates (:func:`head_k`)."""
        if self.size is None:
            return int(budget)
        values = {p.name: p.default for p in self.params} | dict(builder_params or {})
        if head is not None and "k" in values:
            values["k"] = head_k(int(values["k"]), head)
        return min(int(budget), int(self.size(int(proposals), values)))

    def beta(self, builder_params: dict | None) -> float:
        """The depth bonus its ranking uses with ``builder_params`` (the declared default when absent), 0.0 for a
        builder that does not rank by beta."""
        if not self.ranks_by_beta:
            return 0.0
        default = next(p.default for p in self.params if p.name == "beta")
        return float((builder_params or {}).get("beta", default))


BUILDERS: dict[str, TreeBuilder] = {}


# the names the papers use for DARTree's two builders, accepted wherever a builder is named
BUILDER_ALIASES: dict[str, str] = {"dartree-pruned": "pruned", "dartree-fixed": "fixed"}


def register_builder(name: str, *, params: tuple = (), ranks_by_beta: bool = False,
                     size: Callable[[int, dict], int] | None = None):
    """Decorator registering a builder function in :data:`BUILDERS` under its one name, with the parameters it
    declares (:class:`BuilderParam`), whether it ranks by beta and the most nodes its tree can have
    (:attr:`TreeBuilder.size`; the warm-up prepares verify sizes up to it); the decorated function is returned
    unchanged.

    Raises:
        ValueError: the name is taken (by a builder or an alias of :data:`BUILDER_ALIASES`), a parameter name is
            declared by another builder with another meaning (kind, default, range or help), ``ranks_by_beta``
            without a ``beta`` parameter, or the function cannot be called as every builder is
            (:func:`builder_signature_problem`: the builder, the function and the parameter named).
    """

    def wrap(fn: Callable[..., Tree]) -> Callable[..., Tree]:
        if name in BUILDERS or name in BUILDER_ALIASES:
            raise ValueError(f"tree builder {name!r} is already registered")
        known = declared_params()
        for p in params:
            if p.name in known and known[p.name] != p:
                raise ValueError(f"tree builder {name!r} declares parameter {p.name!r} unlike the registered builders "
                                 f"({p} vs {known[p.name]}); reuse their BuilderParam or pick another name")
        if ranks_by_beta and "beta" not in {p.name for p in params}:
            raise ValueError(f"tree builder {name!r} ranks by beta but declares no 'beta' parameter")
        problem = builder_signature_problem(name, fn, tuple(params))
        if problem:
            raise ValueError(problem)
        BUILDERS[name] = TreeBuilder(name, fn, tuple(params), ranks_by_beta, size)
        return fn

    return wrap


def builder_signature_problem(name: str, fn: Callable, params: tuple) -> str:
    """What stops ``fn`` being called as every builder is, ``fn(block, head, root_id, budget, **params)`` with the
    parameters all builders declare (docs/trees.md), as one line naming the builder, the function and the parameter;
    "" when nothing does (or its signature cannot be read). Refused: fewer than the four positional arguments; a
    further argument without a default; no ``**extra`` (the parameters other builders declare arrive too); one of
    its declared ``params`` it takes positionally only, or with a default other than the declared one."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    kinds = inspect.Parameter
    args = list(sig.parameters.values())
    who = f"tree builder {name!r} ({getattr(fn, '__qualname__', type(fn).__name__)})"
    positional = [a for a in args if a.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 4 and not any(a.kind is kinds.VAR_POSITIONAL for a in args):
        return (f"{who} takes {len(positional)} positional argument(s); a builder is called as build(block, head, "
                "root_id, budget, **params)")
    for a in positional[4:] + [a for a in args if a.kind is kinds.KEYWORD_ONLY]:
        if a.default is a.empty:
            return f"{who} requires argument {a.name!r}, which no call passes; give it a default (the declared one)"
    if not any(a.kind is kinds.VAR_KEYWORD for a in args):
        return (f"{who} takes no **extra: every builder is called with the parameters all builders declare "
                f"({sorted(set(declared_params()) | {p.name for p in params})}); add **extra and ignore the others")
    for p in params:
        a = sig.parameters.get(p.name)
        if a is not None and a.kind is kinds.POSITIONAL_ONLY:
            return f"{who} takes its declared parameter {p.name!r} positionally only; it is passed by keyword"
        if a is not None and a.default is not a.empty and a.default != p.default:
            return (f"{who}: its argument {p.name}={a.default!r} differs from the declared default {p.default!r}; "
                    "make them equal (a call without that parameter must mean the declared default)")
    return ""


def declared_params() -> dict[str, BuilderParam]:
    """Every parameter some registered builder declares, by name, in registration order (a builder stored in
    :data:`BUILDERS` as a bare function, as tests do, declares none)."""
    out: dict[str, BuilderParam] = {}
    for spec in BUILDERS.values():
        for p in getattr(spec, "params", ()):
            out.setdefault(p.name, p)
    return out


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


def check_builder_params(params) -> None:
    """Check tree-builder parameters before the first round (the builders check again when called): every key is a
    parameter some registered builder declares (:func:`declared_params`), every value in its declared range.

    Args:
        params: None or a dict such as ``{"k": 64, "width": 12, "beta": -0.2}``.
    Raises:
        TypeError: not a dict, an unknown key (lists the known ones), or a value of the wrong type.
        ValueError: a value out of range (names the range).
    """
    if params is None:
        return
    known = declared_params()
    if not isinstance(params, dict):
        raise TypeError(f"builder_params is {type(params).__name__}; give a dict such as {{'k': 64, 'width': 12}}")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise TypeError(f"builder_params has unknown key(s) {unknown}; known: {sorted(known)}")
    for key, value in params.items():
        bad = known[key].problem(value)
        if bad is not None:
            raise bad[0](f"builder_params[{key!r}]={value!r} {bad[1]}")


def ranks_by_beta(name: str) -> bool:
    """Whether the builder called ``name`` (or its alias) ranks nodes by ``score + beta * depth``.

    Raises:
        ValueError: unknown name (:func:`builder_name`).
    """
    return bool(getattr(get_builder(name), "ranks_by_beta", False))


def builder_beta(name: str, builder_params: dict | None = None) -> float:
    """The depth bonus the builder called ``name`` ranks by with ``builder_params`` (its declared default when absent;
    0.0 for a builder that does not rank by beta).

    Raises:
        ValueError: unknown name (:func:`builder_name`).
    """
    spec = get_builder(name)
    return spec.beta(builder_params) if isinstance(spec, TreeBuilder) else 0.0


def builder_name(name: str) -> str:
    """The registered name of a builder called ``name`` (itself, or what its alias in :data:`BUILDER_ALIASES`
    stands for: ``dartree-pruned`` -> ``pruned``).

    Raises:
        ValueError: unknown name; the message lists the registered names and the aliases.
    """
    name = BUILDER_ALIASES.get(name, name)
    if name not in BUILDERS:
        raise ValueError(f"unknown tree builder {name!r}; available: {sorted(BUILDERS)} (aliases: "
                       + ", ".join(f"{a} = {b}" for a, b in sorted(BUILDER_ALIASES.items())) + ")")
    return name


def get_builder(name: str) -> TreeBuilder:
    """Look a builder up by its name or an alias (:func:`builder_name`).

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    return BUILDERS[builder_name(name)]


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


@register_builder("chain", params=(PARAM_K, PARAM_BACKEND), size=lambda p, v: p)
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


@register_builder("pruned", params=(PARAM_K, PARAM_WIDTH, PARAM_BETA, PARAM_BACKEND), ranks_by_beta=True,
                  size=lambda p, v: p * int(v["width"]))  # at most W nodes per depth
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


@register_builder("fixed", params=(PARAM_K, PARAM_BACKEND), size=lambda p, v: _kary_nodes(int(v["k"]), p))
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


@register_builder("pctree", params=(PARAM_K, PARAM_CHILDREN, PARAM_BACKEND),
                  size=lambda p, v: p * int(v["children"]))  # ``children`` nodes kept per depth
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


@register_builder("heap-sequential", params=(PARAM_K, PARAM_BETA, PARAM_BACKEND), ranks_by_beta=True,
                  size=lambda p, v: _kary_nodes(int(v["k"]), p))
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


@register_builder("ddtree", params=(PARAM_BACKEND,))
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

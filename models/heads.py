"""Causal-correction heads behind one interface, g(C, H, r) (docs/design.md, "Interfaces").

A head corrects the drafter's per-position base logits U = lm_head(H) using the tokens drafted before:

- ``init_state(anchor_ids [N]) -> r [N, S]`` (None for stateless heads): the state at depth 0 (the root).
- ``score(C [N, K], H [N, D], r, base [N, K]) -> [N, K]``: corrected logits of candidates C, i.e. g(C, H, r);
  ``base`` = U[C], the base logits of the same candidates. Callers normalise over C (log-softmax over K).
- ``advance(r [N, S], tokens [N], hidden [N, D] | None) -> r' [N, S]``: the state of a child from its parent's
  state and token; ``hidden`` is H at the child's own depth (needed by the DSpark RNN head, whose next state
  mixes in h_k; the others ignore it).
- ``factors(hidden [N, D], r) -> A [N, R]`` and ``out_rows(C [K]) -> W [K, R]``: the low-rank form that every
  published head shares, g(C, H, r) = U[C] + A · W[C]^T (``None`` for the identity head). Builders hand these
  to the fused frontier-scoring kernel (``dartree.kernels.frontier``); ``score`` is the plain form.
- ``bind_embeddings(weight [V, D])``: heads that read the target's frozen input embeddings (Domino's GRU)
  receive them here after loading; a no-op for the others. ``bind_models(drafter, lm_head_weight)``: the same for
  a head that acts between the drafter's layers or scores with the target's lm_head rows (DSpine).
- ``block_logits(prev_ids [N, P], H [N, P, D], U [N, P, V], vocab=None) -> [N, P, V]``: the teacher-forced form
  for training, where prev_ids[:, j] is the token before proposal j (the anchor for j = 0); with ``vocab`` [N']
  (a draft vocabulary) U holds only those columns and the result is restricted the same way. It is
  U + A · W^T with ``block_factors(prev_ids, H, vocab) -> (A [N, P, R], W [V', R])`` (None for identity), the
  form the fused training loss (``dartree.training.fused_loss.fused_block_loss``) consumes without materialising
  the [N, P, V'] logits.

Unrolling ``score``/``advance`` along prev_ids equals ``block_logits`` (pinned by a test). Each head class lists its
hyper-parameters and their allowed values as ``fields``. Logits are fp32.

This module holds the interface, the ``identity`` head (no correction: plain DFlash) and the head table
(:data:`HEADS`, filled by :func:`register_head`); it imports no family. Every other head lives in the module of the
drafter family that trains it (:mod:`dartree.models.families`, docs/families.md): ``markov`` / ``gated_markov`` /
``rnn`` in :mod:`~dartree.models.families.dspark`, ``gru`` in :mod:`~dartree.models.families.domino`, ``selector`` in
:mod:`~dartree.models.families.dflash2`; registering a family registers its heads, and the lookup by name
(:func:`dartree.models.families.build_head`, :func:`~dartree.models.families.head_fields`) lives with the families.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dartree.base.fields import Range

# Checkpoint-config rules of hyper-parameters several heads share (config ``head`` besides ``type``); each head class
# lists its own as ``fields`` (checked at construction and when a checkpoint loads).
VOCAB_RULE = Range(1, optional=True, note="V, the target's vocabulary")
RANK_RULE = Range(1, note="the head's rank R; a head without a Markov part is head type identity")
HIDDEN_RULE = Range(1, optional=True, note="D, the drafter's hidden size")


class CorrectionHead(nn.Module):
    """Base class; see the module docstring for the interface. ``type_name`` keys the registry."""

    type_name = "base"
    # the hyper-parameters of hparams() and their allowed values (dartree.base.fields rules)
    fields: dict = {}
    max_candidates: int | None = None  # a head defined over the top-k of U only (DFlash 2's selector) caps K
    # True for a head that reads the target's frozen token embeddings (bound by bind_embeddings; Domino's GRU)
    reads_embeddings: bool = False
    # True when a node's state is a function of its own token alone (r = W1[x] or none), so g at depth d depends
    # only on (H_d, the parent's token): builders then score every (previous candidate, candidate) pair of a round
    # at once (dartree.decode.builders.supertree.pair_log_probs). False for recurrent heads (DSpark RNN, Domino GRU).
    first_order: bool = False
    # False for a head that leaves the base logits as they are (g(C, H, r) = U[C]: the identity head, plain DFlash):
    # it has nothing to train or load, so training's init_from gives such a checkpoint a fresh head of the recipe's type
    corrects: bool = True

    def hparams(self) -> dict:
        """Hyper-parameters stored as ``head`` in checkpoint configs (besides ``type``)."""
        return {}

    def init_state(self, anchor_ids: torch.Tensor):
        """State at the root. anchor_ids [N] int64 -> r [N, S] fp32, or None for stateless heads."""
        raise NotImplementedError

    def score(self, cand: torch.Tensor, hidden: torch.Tensor, state, base: torch.Tensor) -> torch.Tensor:
        """g(C, H, r): cand [N, K] int64, hidden [N, D], state [N, S] or None, base = U[C] [N, K]
        -> corrected logits [N, K] fp32 (unnormalised; callers log-softmax over the K candidates)."""
        raise NotImplementedError

    def advance(self, state, tokens: torch.Tensor, hidden: torch.Tensor | None = None):
        """Child state from the parent's state [N, S], the child's token [N] int64 and H at the child's depth
        [N, D] (optional; only heads whose state reads H need it) -> [N, S]."""
        raise NotImplementedError

    def factors(self, hidden: torch.Tensor, state) -> torch.Tensor | None:
        """Per-parent activation A [N, R] fp32 with g(C, H, r) = U[C] + A · out_rows(C)^T; None when the head
        adds nothing (identity). hidden [N, D], state [N, S]."""
        raise NotImplementedError

    def out_rows(self, cand: torch.Tensor) -> torch.Tensor | None:
        """Output rows W[C] [..., R] fp32 for candidate ids C [...] int64 (the head's rank-R output matrix)."""
        raise NotImplementedError

    def bind_embeddings(self, weight: torch.Tensor) -> None:
        """Receive the target's frozen input-embedding matrix [V, D]; no-op unless the head reads it."""
        return None

    def bind_models(self, drafter, lm_head_weight: torch.Tensor | None = None) -> None:
        """Receive the drafter it corrects and the target's frozen lm_head weight [V, D] (None: no target yet), for
        a head that acts between the drafter's layers (it attaches itself:
        :meth:`dartree.models.drafter.DFlashDrafter.attach`) or scores with the target's output rows;
        ``load_dartree`` calls it. A no-op for the others."""
        return None

    def block_states(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """Teacher-forced states along the true previous tokens: r_0 = init_state(prev[:, 0]), r_j =
        advance(r_{j-1}, prev[:, j], H[:, j-1]); prev_ids [N, P] int64, hidden [N, P, D] -> [N, P, S] fp32 (None
        for stateless heads). Heads whose state is a function of the previous token alone override it with one
        batched lookup."""
        st = self.init_state(prev_ids[:, 0])
        if st is None:
            return None
        out = [st]
        for j in range(1, prev_ids.shape[1]):
            st = self.advance(st, prev_ids[:, j], hidden[:, j - 1])
            out.append(st)
        return torch.stack(out, dim=1)

    def block_factors(self, prev_ids: torch.Tensor, hidden: torch.Tensor, vocab: torch.Tensor | None = None):
        """Teacher-forced low-rank form: prev_ids [N, P] int64 (the token before each proposal; the anchor for
        proposal 0), hidden [N, P, D] -> (A [N, P, R] fp32, W [V', R] fp32) with block logits U + A · W^T, where
        V' = V, or the N' ids of ``vocab`` [N'] int64; None for a head that adds nothing (identity).
        Differentiable in the head's parameters and in ``hidden``."""
        raise NotImplementedError

    def block_logits(self, prev_ids: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor,
                     vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced logits: prev_ids [N, P] int64, hidden [N, P, D], base [N, P, V'] -> [N, P, V'] fp32, where
        V' = V, or the N' ids of ``vocab`` [N'] int64 when given (equal to the full result's ``[..., vocab]``);
        U + A · W^T from :meth:`block_factors`."""
        f = self.block_factors(prev_ids, hidden, vocab)
        if f is None:
            return base_logits.float()
        return base_logits.float() + F.linear(f[0], f[1])


class IdentityHead(CorrectionHead):
    """No correction: g(C, H, r) = U[C]; plain DFlash drafting. Stateless (r is None)."""

    type_name = "identity"
    first_order = True
    corrects = False
    fields = {"vocab_size": VOCAB_RULE}

    def __init__(self, vocab_size: int | None = None):
        super().__init__()

    def init_state(self, anchor_ids):
        return None

    def score(self, cand, hidden, state, base):
        return base.float()

    def advance(self, state, tokens, hidden=None):
        return None

    def factors(self, hidden, state):
        return None

    def out_rows(self, cand):
        return None

    def block_factors(self, prev_ids, hidden, vocab=None):
        return None


HEADS: dict[str, type[CorrectionHead]] = {}

# What a head class must define, checked when it registers (the base class's versions raise NotImplementedError):
# decoding calls init_state / score / advance, training block_factors. The low-rank form (factors, out_rows) comes
# whole or not at all: without it the builders score candidates with score() (dartree.decode.trees.expand_frontier).
REQUIRED_HEAD_METHODS = ("init_state", "score", "advance", "block_factors")
LOW_RANK_METHODS = ("factors", "out_rows")


def check_head_class(cls) -> None:
    """Refuse a head class that cannot serve as one, before it registers: not a :class:`CorrectionHead` subclass,
    no ``type_name`` of its own, a method of :data:`REQUIRED_HEAD_METHODS` it does not define, or half of the
    low-rank form (:data:`LOW_RANK_METHODS`).

    Raises:
        ValueError: one line naming the class and what it lacks.
    """
    if not (isinstance(cls, type) and issubclass(cls, CorrectionHead)) or cls is CorrectionHead:
        raise ValueError(f"{cls!r} is not a head class; derive it from dartree.models.heads.CorrectionHead")
    name = f"head class {cls.__name__} (type {cls.type_name!r})"
    if cls.type_name == CorrectionHead.type_name:
        raise ValueError(f"head class {cls.__name__} has no type_name of its own; set type_name (its checkpoints' "
                         "head.type)")
    missing = [m for m in REQUIRED_HEAD_METHODS if getattr(cls, m) is getattr(CorrectionHead, m)]
    if missing:
        raise ValueError(f"{name} does not define {', '.join(m + '()' for m in missing)}: every correction head "
                         f"must (dartree.models.heads.CorrectionHead says what each returns); define "
                         f"{'it' if len(missing) == 1 else 'them'}")
    low = [m for m in LOW_RANK_METHODS if getattr(cls, m) is not getattr(CorrectionHead, m)]
    if len(low) == 1:
        other = next(m for m in LOW_RANK_METHODS if m not in low)
        raise ValueError(f"{name} defines {low[0]}() but not {other}(): the low-rank form U[C] + factors · "
                         f"out_rows^T needs both; define {other}() or neither (then score() alone is used)")


def register_head(cls: type[CorrectionHead]) -> type[CorrectionHead]:
    """Add a head class to the registry under ``cls.type_name``, once :func:`check_head_class` accepts it.

    Raises:
        ValueError: the name is already registered, or the class lacks what every head defines (the class and the
            method named).
    """
    check_head_class(cls)
    if cls.type_name in HEADS:
        raise ValueError(f"head type {cls.type_name!r} is already registered")
    HEADS[cls.type_name] = cls
    return cls


register_head(IdentityHead)

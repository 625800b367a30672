"""Causal-correction heads behind one interface, g(C, H, r) (DESIGN.md "Key interfaces").

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
  receive them here after loading; a no-op for the others.
- ``block_logits(prev_ids [N, P], H [N, P, D], U [N, P, V]) -> [N, P, V]``: the teacher-forced form for
  training, where prev_ids[:, j] is the token before proposal j (the anchor for j = 0).

Unrolling ``score``/``advance`` along prev_ids equals ``block_logits`` (pinned by a test).
Heads here: ``identity`` (plain DFlash) and ``markov`` (DSpark vanilla Markov head). Logits are fp32.
"""

from __future__ import annotations

import torch
from torch import nn


class CorrectionHead(nn.Module):
    """Base class; see the module docstring for the interface. ``type_name`` keys the registry."""

    type_name = "base"

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

    def block_logits(self, prev_ids: torch.Tensor, hidden: torch.Tensor, base_logits: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits: prev_ids [N, P] int64, hidden [N, P, D], base [N, P, V] -> [N, P, V] fp32."""
        raise NotImplementedError


class IdentityHead(CorrectionHead):
    """No correction: g(C, H, r) = U[C]; plain DFlash drafting. Stateless (r is None)."""

    type_name = "identity"

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

    def block_logits(self, prev_ids, hidden, base_logits):
        return base_logits.float()


class MarkovHead(CorrectionHead):
    """DSpark vanilla Markov head: logits_k = U_k + W2 · W1[x_{k-1}] (DSpark paper section 3, ANCHORS.md 5b).

    Parameters: ``w1.weight`` [V, R] (an embedding, DSpark ``markov_w1``), ``w2.weight`` [V, R] (a bias-free
    linear R -> V, DSpark ``markov_w2``). The state r is W1[x_prev] [N, R]; the first position's previous token
    is the anchor. H is unused. ``w2`` starts at zero, so an untrained head is the identity.

    Args:
        vocab_size: V.
        rank: R (DSpark default 256; the default target's recipe uses less to fit the 32 MB checkpoint cap).
    """

    type_name = "markov"

    def __init__(self, vocab_size: int, rank: int = 256):
        super().__init__()
        self.vocab_size, self.rank = int(vocab_size), int(rank)
        self.w1 = nn.Embedding(self.vocab_size, self.rank)
        self.w2 = nn.Linear(self.rank, self.vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)

    def hparams(self) -> dict:
        return {"vocab_size": self.vocab_size, "rank": self.rank}

    def init_state(self, anchor_ids):
        return self.w1(anchor_ids).float()

    def score(self, cand, hidden, state, base):
        rows = self.w2.weight[cand].float()  # [N, K, R]
        return base.float() + torch.einsum("nkr,nr->nk", rows, state.float())

    def advance(self, state, tokens, hidden=None):
        return self.w1(tokens).float()

    def factors(self, hidden, state):
        return state.float()

    def out_rows(self, cand):
        return self.w2.weight[cand].float()

    def block_logits(self, prev_ids, hidden, base_logits):
        return base_logits.float() + self.w2(self.w1(prev_ids)).float()


HEADS: dict[str, type[CorrectionHead]] = {}


def register_head(cls: type[CorrectionHead]) -> type[CorrectionHead]:
    """Add a head class to the registry under ``cls.type_name``.

    Raises:
        ValueError: the name is already registered.
    """
    if cls.type_name in HEADS:
        raise ValueError(f"head type {cls.type_name!r} is already registered")
    HEADS[cls.type_name] = cls
    return cls


for _cls in (IdentityHead, MarkovHead):
    register_head(_cls)


def build_head(type_name: str, **params) -> CorrectionHead:
    """Construct a head by registered name.

    Raises:
        KeyError: unknown name; the message lists the registered ones.
    """
    if type_name not in HEADS:
        raise KeyError(f"unknown head type {type_name!r}; available: {sorted(HEADS)}")
    return HEADS[type_name](**params)

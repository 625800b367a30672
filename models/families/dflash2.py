"""DFlash 2 (z-lab/dflash ``dflash/model.py``; vLLM speculators ``dflash2``): the candidate selector ``selector``,
trained by the CE of the selector-corrected logits beside the CE of the unary (base) logits, equally weighted.
Recipe ``loss.type=dflash2``."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import HIDDEN_RULE, RANK_RULE, VOCAB_RULE, CorrectionHead
from dartree.base.fields import Range, check_fields

# weight of the base (unary) CE beside the selector-corrected CE, (1 - w) CE(U + A W^T) + w CE(U); 0.5 weights them
# equally, as speculators' DFlash 2 trainer does (selector_loss_alpha 1.0 beside the unary loss)
DFLASH2_BASE_WEIGHT = 0.5


class SelectorHead(CorrectionHead):
    """DFlash 2's candidate selector (z-lab ``CandidateSelector``, speculators ``dflash2``) as a correction head.

    g(C, H, r) = U[C] + <P1[x_prev] ⊙ (Wh · h), P2[C]> over the top-``top_k`` candidates of U; every other token is
    out of the distribution (builders cap the candidate count K at ``top_k``: :attr:`max_candidates`). This is
    the shared low-rank form with A = P1[x_prev] ⊙ Wh h (the previous token's predecessor code, gated by the
    projected hidden state) and W = P2 (successor codes). Source: z-lab/dflash ``dflash/model.py``
    (``CandidateSelector.select``: score = unary + einsum(pred[prev] * proj(h), succ[C])); the anchor is the
    first proposal's previous token.

    Parameters: ``w1.weight`` [V, R] (predecessor codebook), ``w2.weight`` [V, R] (successor codebook),
    ``proj.weight`` [R, D] (hidden projection). State r = P1[x_prev] [N, R] fp32.

    Args:
        vocab_size: V. rank: R (z-lab ``selector_rank``, default 256). hidden_size: D (required).
        top_k: candidates reranked per position (``selector_top_k``, default 16).
    Raises:
        ValueError: a hyper-parameter of the wrong type or out of range (:attr:`fields`), named.
    """

    type_name = "selector"
    first_order = True
    fields = {"vocab_size": VOCAB_RULE, "rank": RANK_RULE, "hidden_size": HIDDEN_RULE,
              "top_k": Range(1, note="DFlash 2 selector: candidates reranked per position (selector_top_k)")}

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None, top_k: int = 16):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "rank": rank, "hidden_size": hidden_size, "top_k": top_k},
                     self.fields, "selector head: ")
        if hidden_size is None:
            raise ValueError("selector head needs hidden_size (the drafter's D) for its hidden projection")
        self.vocab_size, self.rank, self.hidden_size = int(vocab_size), int(rank), int(hidden_size)
        self.top_k = int(top_k)
        self.max_candidates = self.top_k
        self.w1 = nn.Embedding(self.vocab_size, self.rank)
        self.w2 = nn.Linear(self.rank, self.vocab_size, bias=False)
        self.proj = nn.Linear(self.hidden_size, self.rank, bias=False)
        for w in (self.w1.weight, self.w2.weight, self.proj.weight):  # the publishers' initialisation
            nn.init.normal_(w, std=0.02)

    def hparams(self) -> dict:
        return {"vocab_size": self.vocab_size, "rank": self.rank, "hidden_size": self.hidden_size,
                "top_k": self.top_k}

    def start_uncorrected(self) -> None:
        """Zero the successor codebook ``w2`` so that g(C, H, r) = U[C] until training moves it (a warm start's
        "no correction" head, as SpecForge starts its Markov heads with a zero ``w2``); the codebook ``w1`` and the
        projection keep their initialisation, so the first step's gradient reaches ``w2``."""
        with torch.no_grad():
            self.w2.weight.zero_()

    def init_state(self, anchor_ids):
        return self.w1(anchor_ids).float()

    def advance(self, state, tokens, hidden=None):
        return self.w1(tokens).float()

    def factors(self, hidden, state):
        if hidden is None:
            raise ValueError("selector head needs the proposal's hidden state H; got None")
        return state.float() * F.linear(hidden.float(), self.proj.weight.float())

    def out_rows(self, cand):
        return self.w2.weight[cand].float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_states(self, prev_ids, hidden):
        return self.w1(prev_ids).float()

    def block_factors(self, prev_ids, hidden, vocab=None):
        w2 = self.w2.weight.float() if vocab is None else self.w2.weight[vocab].float()
        return self.w1(prev_ids).float() * F.linear(hidden.float(), self.proj.weight.float()), w2


class DFlash2Family(Family):
    """DFlash 2's selector (:class:`SelectorHead`) and its unary + selector CE."""

    name = "dflash2"
    heads = (SelectorHead,)
    # z-lab/dflash dflash/model.py (DFlash2DraftModel's CandidateSelector) and speculators dflash2: the codebooks are
    # published without .weight (z-lab's from_pretrained maps that spelling; speculators stores plain Parameters)
    published = {"w1.weight": "candidate_selector.predecessor_codebook",
                 "w2.weight": "candidate_selector.successor_codebook",
                 "proj.weight": "candidate_selector.hidden_projection.weight"}
    speculators_type, speculators_architecture = "dflash2", "DFlash2DraftModel"
    export_to = ("zlab-dflash2", "speculators")

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``rank`` (``head.rank``), ``top_k`` (``head.top_k``, default 16), ``hidden_size`` D, ``vocab_size`` V."""
        return {"vocab_size": vocab_size, "rank": head["rank"], "hidden_size": hidden_size,
                "top_k": int(head.get("top_k", 16))}

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """CE(U) and CE(corrected) at :data:`DFLASH2_BASE_WEIGHT` each."""
        return Objective(gamma=loss["gamma"], base_weight=DFLASH2_BASE_WEIGHT)


register_family(DFlash2Family())

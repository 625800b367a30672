"""DSpark (arXiv 2607.05147): Markov correction heads ``markov``, ``gated_markov`` and ``rnn``, optionally with
DSpark's confidence head, trained by ``ce_weight CE + l1_weight L1(p_d, p_t) + conf_weight BCE`` (Sec. 3.3; DeepSpec
``config/dspark``), plus the total variation and KL(p_t || p_d) terms (``loss.tv_weight``, ``loss.kl_weight``) and
the LK loss (LK losses, arXiv 2602.23881: ``loss.lk_weight``, ``loss.lk_lambda``, ``loss.lk_eta``).
Recipe ``loss.type=dspark``.

The heads' concat and split orders follow the public code (SpecForge ``specforge/modeling/draft/dspark_heads.py``,
DeepSpec ``deepspec/modeling/dspark/qwen3/modeling.py``): the gated head's ``gate_proj`` reads ``[h ; W1[x]]``; the
RNN head's ``joint_proj`` reads ``[s ; W1[x] ; h]`` and its output splits as (gate, candidate, output); the
confidence head reads ``[h ; W1[x]]``. The confidence head is stored and converted, not used by the decoders.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import HIDDEN_RULE, RANK_RULE, VOCAB_RULE, CorrectionHead
from dartree.base.fields import Flag, check_fields

_CONFIDENCE = {"confidence_head": Flag(), "confidence_with_markov": Flag()}


class _ConfidenceMixin:
    """DSpark's optional confidence head (``AcceptRatePredictor``; DSpark, arXiv 2607.05147, Sec. 3.3).

    ``confidence.weight`` [1, D + R] and ``confidence.bias`` [1] when ``confidence_with_markov`` (input
    ``[h_k ; W1[x_{k-1}]]``, hidden first), else [1, D] (input h_k). It predicts the acceptance probability of
    each proposal, c_k = sigmoid(w^T x + b); it is stored and converted but the decoders do not use it.
    """

    def _init_confidence(self, confidence_head: bool, confidence_with_markov: bool, hidden_size: int | None):
        self.confidence_head = bool(confidence_head)
        self.confidence_with_markov = bool(confidence_with_markov)
        if self.confidence_head:
            if hidden_size is None:
                raise ValueError(f"{self.type_name} head: confidence_head=True needs hidden_size (the drafter's D)")
            self.confidence = nn.Linear(int(hidden_size) + (self.rank if self.confidence_with_markov else 0), 1)

    def _confidence_hparams(self) -> dict:
        if not self.confidence_head:
            return {}
        return {"confidence_head": True, "confidence_with_markov": self.confidence_with_markov}

    def _prev_embedding(self, state: torch.Tensor) -> torch.Tensor:
        """W1[x_prev] [N, R] from a state [N, S]."""
        return state[:, : self.rank]

    def confidence_logits(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Confidence logit (pre-sigmoid) per row: hidden [N, D], state [N, S] -> [N] fp32.

        Raises:
            RuntimeError: the head was built without a confidence head.
        """
        if not self.confidence_head:
            raise RuntimeError(f"this {self.type_name} head has no confidence head (confidence_head=False)")
        x = hidden.float()
        if self.confidence_with_markov:
            x = torch.cat([x, self._prev_embedding(state).float()], dim=-1)
        return F.linear(x, self.confidence.weight.float(), self.confidence.bias.float())[:, 0]


class MarkovHead(_ConfidenceMixin, CorrectionHead):
    """DSpark vanilla Markov head: logits_k = U_k + W2 · W1[x_{k-1}] (DSpark, arXiv 2607.05147, Sec. 3).

    Parameters: ``w1.weight`` [V, R] (an embedding, DSpark ``markov_w1``), ``w2.weight`` [V, R] (a bias-free
    linear R -> V, DSpark ``markov_w2``), optionally ``confidence.{weight,bias}`` (see :class:`_ConfidenceMixin`).
    The state r is W1[x_prev] [N, R]; the first position's previous token is the anchor. H is unused.
    ``w2`` starts at zero, so an untrained head is the identity.

    Args:
        vocab_size: V.
        rank: R (DSpark default 256; the default target's recipe uses less to fit the 32 MB checkpoint cap).
        hidden_size: D, needed only with ``confidence_head``.
        confidence_head, confidence_with_markov: carry DSpark's confidence head (input [h ; W1[x_prev]] or h).
    Raises:
        ValueError: ``confidence_head`` without ``hidden_size``, or a hyper-parameter of the wrong type or out of
            range (``rank`` >= 1, ``vocab_size`` >= 1; :attr:`fields`), named.
    """

    type_name = "markov"
    first_order = True
    fields = {"vocab_size": VOCAB_RULE, "rank": RANK_RULE, "hidden_size": HIDDEN_RULE, **_CONFIDENCE}

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        super().__init__()
        check_fields({"vocab_size": vocab_size, "rank": rank, "hidden_size": hidden_size,
                      "confidence_head": confidence_head, "confidence_with_markov": confidence_with_markov},
                     self.fields, f"{self.type_name} head: ")
        self.vocab_size, self.rank = int(vocab_size), int(rank)
        self.hidden_size = None if hidden_size is None else int(hidden_size)
        self.w1 = nn.Embedding(self.vocab_size, self.rank)
        self.w2 = nn.Linear(self.rank, self.vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)
        self._init_confidence(confidence_head, confidence_with_markov, hidden_size)

    def hparams(self) -> dict:
        out = {"vocab_size": self.vocab_size, "rank": self.rank}
        if self.hidden_size is not None:
            out["hidden_size"] = self.hidden_size
        return {**out, **self._confidence_hparams()}

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

    def _w2(self, vocab):
        return self.w2.weight.float() if vocab is None else torch.index_select(self.w2.weight, 0, vocab).float()

    def block_states(self, prev_ids, hidden):
        return self.w1(prev_ids).float()  # r = W1[x_prev]: one lookup (and one sparse-to-dense gradient)

    def block_factors(self, prev_ids, hidden, vocab=None):
        return self.w1(prev_ids).float(), self._w2(vocab)


class GatedMarkovHead(MarkovHead):
    """DSpark gated Markov head (arXiv 2607.05147; SpecForge ``GatedMarkovHead``, DeepSpec
    ``markov_head_type="gated"``).

    logits_k = U_k + W2 · (gate_k ⊙ W1[x_{k-1}]), gate_k = sigmoid(gate_proj([h_k ; W1[x_{k-1}]])).
    Parameters: ``w1.weight`` [V, R], ``w2.weight`` [V, R], ``gate_proj.weight`` [R, D + R] and
    ``gate_proj.bias`` [R] (input order: hidden first), optionally ``confidence.*``. State r = W1[x_prev] [N, R].
    ``score``/``factors`` need H (the proposal's hidden state).

    Args:
        vocab_size: V. rank: R. hidden_size: D (required).
        confidence_head, confidence_with_markov: as :class:`MarkovHead`.
    """

    type_name = "gated_markov"

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        if hidden_size is None:
            raise ValueError("gated_markov head needs hidden_size (the drafter's D) for gate_proj")
        super().__init__(vocab_size, rank, hidden_size, confidence_head, confidence_with_markov)
        self.gate_proj = nn.Linear(self.hidden_size + self.rank, self.rank)

    def _gate(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if hidden is None:
            raise ValueError("gated_markov head needs the proposal's hidden state H; got None")
        x = torch.cat([hidden.float(), emb.float()], dim=-1)
        return torch.sigmoid(F.linear(x, self.gate_proj.weight.float(), self.gate_proj.bias.float()))

    def factors(self, hidden, state):
        return self._gate(hidden, state) * state.float()

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def block_factors(self, prev_ids, hidden, vocab=None):
        emb = self.w1(prev_ids).float()  # [N, P, R]
        return self._gate(hidden, emb) * emb, self._w2(vocab)


class RNNHead(MarkovHead):
    """DSpark RNN head (arXiv 2607.05147, Sec. 4.3.2; SpecForge ``RNNMarkovHead``, DeepSpec ``markov_head_type="rnn"``).

    With e_k = W1[x_{k-1}] and (a, c, o) = joint_proj([s_{k-1} ; e_k ; h_k]) split in that order:
    s_k = sigmoid(a) ⊙ s_{k-1} + (1 - sigmoid(a)) ⊙ tanh(c), logits_k = U_k + W2 · tanh(o), s_{-1} = 0.
    Parameters: ``w1.weight`` [V, R], ``w2.weight`` [V, R], ``joint_proj.weight`` [3R, 2R + D],
    ``joint_proj.bias`` [3R], optionally ``confidence.*``.

    dartree state r = [s_{k-1} ; e_k] [N, 2R] (the recurrent state before proposal k and the previous token's
    embedding). ``advance(r, x_k, h_k)`` needs H at the child's own proposal index (the row scored with r).

    Args:
        vocab_size: V. rank: R. hidden_size: D (required).
        confidence_head, confidence_with_markov: as :class:`MarkovHead`.
    """

    type_name = "rnn"
    first_order = False  # s_k follows the recurrence over the whole path

    def __init__(self, vocab_size: int, rank: int = 256, hidden_size: int | None = None,
                 confidence_head: bool = False, confidence_with_markov: bool = True):
        if hidden_size is None:
            raise ValueError("rnn head needs hidden_size (the drafter's D) for joint_proj")
        super().__init__(vocab_size, rank, hidden_size, confidence_head, confidence_with_markov)
        self.joint_proj = nn.Linear(2 * self.rank + self.hidden_size, 3 * self.rank)

    def _prev_embedding(self, state):
        return state[:, self.rank :]

    block_states = CorrectionHead.block_states  # r = [s ; e] follows the recurrence

    def _step(self, s: torch.Tensor, e: torch.Tensor, hidden: torch.Tensor):
        """One RNN step: s [.., R], e [.., R], hidden [.., D] -> (s' [.., R], tanh(o) [.., R]) fp32."""
        if hidden is None:
            raise ValueError("rnn head needs the proposal's hidden state H; got None")
        x = torch.cat([s.float(), e.float(), hidden.float()], dim=-1)
        a, c, o = F.linear(x, self.joint_proj.weight.float(), self.joint_proj.bias.float()).chunk(3, dim=-1)
        gate = torch.sigmoid(a)
        return gate * s.float() + (1 - gate) * torch.tanh(c), torch.tanh(o)

    def init_state(self, anchor_ids):
        e = self.w1(anchor_ids).float()
        return torch.cat([torch.zeros_like(e), e], dim=-1)

    def factors(self, hidden, state):
        return self._step(state[:, : self.rank], state[:, self.rank :], hidden)[1]

    def score(self, cand, hidden, state, base):
        return base.float() + torch.einsum("nkr,nr->nk", self.out_rows(cand), self.factors(hidden, state))

    def advance(self, state, tokens, hidden=None):
        s_new = self._step(state[:, : self.rank], state[:, self.rank :], hidden)[0]
        return torch.cat([s_new, self.w1(tokens).float()], dim=-1)

    def block_factors(self, prev_ids, hidden, vocab=None):
        emb = self.w1(prev_ids).float()  # [N, P, R]
        s = emb.new_zeros(emb.shape[0], self.rank)
        outs = []
        for j in range(prev_ids.shape[1]):
            s, out = self._step(s, emb[:, j], hidden[:, j])
            outs.append(out)
        return torch.stack(outs, dim=1), self._w2(vocab)



class DSparkFamily(Family):
    """DSpark's Markov heads (:class:`MarkovHead`, :class:`GatedMarkovHead`, :class:`RNNHead`) and their
    distribution-matching loss."""

    name = "dspark"
    heads = (MarkovHead, GatedMarkovHead, RNNHead)
    confidence = True
    distribution = True
    # the publishers' names (SpecForge specforge/modeling/draft/dspark_heads.py; DeepSpec
    # deepspec/modeling/dspark/qwen3/modeling.py and speculators dspark name them alike): the Markov head under
    # markov_head (gate_proj: gated, joint_proj: rnn), the confidence head under confidence_head
    published = {"w1.weight": "markov_head.markov_w1.weight", "w2.weight": "markov_head.markov_w2.weight",
                 "gate_proj.weight": "markov_head.gate_proj.weight", "gate_proj.bias": "markov_head.gate_proj.bias",
                 "joint_proj.weight": "markov_head.joint_proj.weight", "joint_proj.bias": "markov_head.joint_proj.bias",
                 "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}
    published_types = {"markov": "vanilla", "gated_markov": "gated", "rnn": "rnn"}  # config markov_head_type
    speculators_type, speculators_architecture = "dspark", "DSparkSpeculator"
    export_to = ("specforge-dspark",)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``vocab_size``, ``rank`` (``head.rank``); ``hidden_size`` for the gated and RNN heads and with a confidence
        head; ``confidence_head`` / ``confidence_with_markov`` (default true) when ``head.confidence_head``."""
        conf = bool(head.get("confidence_head", False))
        params = {"vocab_size": vocab_size, "rank": head["rank"]}
        if head["type"] != "markov" or conf:
            params["hidden_size"] = hidden_size
        if conf:
            params.update(confidence_head=True, confidence_with_markov=bool(head.get("confidence_with_markov", True)))
        return params

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """The DSpark weights of the recipe (``loss.tv_weight`` / ``loss.kl_weight`` read 0 in recipes written
        before them); the confidence BCE where ``head.confidence_head``."""
        kl = float(loss.get("kl_weight", 0.0) or 0.0)
        lk = float(loss.get("lk_weight", 0.0) or 0.0)
        lk_lambda = loss.get("lk_lambda", None)
        return Objective(gamma=loss["gamma"], ce_weight=loss["ce_weight"], l1_weight=loss["l1_weight"],
                         tv_weight=float(loss.get("tv_weight", 0.0) or 0.0), kl_weight=kl,
                         conf_weight=loss["conf_weight"], confidence=bool(head.get("confidence_head", False)),
                         lk_weight=lk, lk_lambda=None if lk_lambda is None else float(lk_lambda),
                         lk_eta=float(loss.get("lk_eta", 3.0)), logged=("l1", "kl") if kl or lk else ("l1",))

    def recipe_problems(self, recipe: Mapping[str, Any]) -> list[str]:
        """A loss that weights nothing: every one of ``loss.ce_weight``, ``l1_weight``, ``tv_weight``, ``kl_weight``
        is 0."""
        lo = recipe["loss"]
        if (lo["ce_weight"] == 0 and lo["l1_weight"] == 0 and not lo.get("tv_weight", 0) and not lo.get("kl_weight", 0)
                and not lo.get("lk_weight", 0)):
            return ["loss.ce_weight=0 and loss.l1_weight=0 (and loss.tv_weight, kl_weight, lk_weight 0): the DSpark loss "
                    "would not train the drafter or its Markov head; give one of them a positive weight"]
        return []


register_family(DSparkFamily())

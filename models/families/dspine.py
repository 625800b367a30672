"""DSpine (Tencent, 2026): a DFlash backbone whose block positions talk to their left neighbour after every draft
layer, read by predecessor-conditioned transition scores. Head ``dspine``; recipe ``loss.type=dspine``.

Facts from SpecForge's public code (``specforge/modeling/draft/dspine.py``, ``specforge/algorithms/dspine/model.py``,
``configs/qwen3-8b-dspine.json`` in sgl-project/SpecForge); the code here is dartree's own.

- Adjacent causal injection, after every draft layer l, into block positions i >= 1 from position i - 1: features
  f = sqrt(r) normalize(R_l h) (rank-r readout ``injection.readouts.{l}``); gate = sigmoid(G_r f_i + G_p f_{i-1} +
  b); h_i += rms(h_i) W_l (gate * M f_{i-1}) with rms(h) = ||h|| / sqrt(D). Position 1's predecessor is the anchor's
  token code sqrt(r) c[anchor]; the anchor itself is never written. ``writes`` and the predecessor gate start at 0,
  so an untrained DSpine drafter computes its DFlash backbone. The backbone attends causally inside the block
  (``drafter.causal_block``); the anchor sits at block position 0 and positions 1..L-1 propose
  (``proposal_offset`` 1).
- Token codes c [V, r] (buffer ``transfer_codes``, fixed; ``transfer_ready`` says they are set): a whitened PCA of
  the target's lm_head rows (rows normalised, the mean removed, the top-r eigenvectors of their covariance, each
  coordinate divided by the square root of its eigenvalue, the code renormalised); the readouts start on the same
  directions (:func:`transfer_space`). r <= min(D, V - 1).
- Transition scores g(C, H, r): the last layer's pre-injection state H of a proposal, written once more with the
  predecessor token's code in place of the neighbour's feature and normed by the drafter's final norm, dotted with
  the candidate's lm_head row (:meth:`DSpineHead.transition_scores`). They replace the base logits (which only
  choose the candidates), so the head has no low-rank form U[C] + A W[C]^T; its state is the predecessor's code.
- Loss (gamma 7 decay over the proposals): ce_weight CE + (1 - ce_weight) L1 to the target's distribution; the
  same split over the top_k candidates of the backbone logits, scored by the transition scores with the true
  predecessor, against the target's mass renormalised over them (the L1 only where that mass > threshold); the
  cosine distance of every layer's (post-injection) feature to the true token's code, weighted by beta times the
  step's mean backbone CE, beta ramped 0 -> alignment_weight over alignment_warmup_steps; and, per anchor with
  probability p, the first replacement_layers layers take the true token's code as predecessor (p held for the
  first replacement_hold_ratio of training, then falling to 0 at replacement_end_ratio) (:func:`dspine_loss`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dartree.base.fields import Range, check_fields
from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import CorrectionHead

# SpecForge's DSpineConfig defaults (dspine_config); transfer_rank 1024 assumes a target of hidden size >= 1024
SPECFORGE_DEFAULTS = {"transfer_rank": 1024, "message_size": 512, "top_k": 16, "ce_weight": 0.1,
                      "alignment_weight": 0.5, "alignment_warmup_steps": 146, "replacement_layers": 3,
                      "replacement_probability": 0.5, "replacement_hold_ratio": 1 / 6, "replacement_end_ratio": 1 / 3,
                      "candidate_mass_threshold": 1e-4}
# the recipe's transfer_rank for the default target (hidden size 576: r <= 576 must hold; the largest power of two)
RECIPE_TRANSFER_RANK = 512
MAX_LAYERS = 256  # per-layer tensors named for drafters of up to this many layers (the published-name table)

_REAL01 = dict(integer=False, lo=0, hi=1)
FIELDS = {
    "vocab_size": Range(2, note="V, the target's vocabulary"),
    "hidden_size": Range(1, note="D, the drafter's hidden size"),
    "num_layers": Range(1, note="the drafter's layers (one readout and one write each)"),
    "transfer_rank": Range(1, note="r, the token codes' rank; at most min(hidden_size, vocab_size - 1)"),
    "message_size": Range(1, note="m, the width of the message and of the gates"),
    "top_k": Range(1, note="candidates of the backbone logits the refinement loss ranks"),
    "ce_weight": Range(**_REAL01, note="CE share of the CE / L1 split, backbone and refinement"),
    "alignment_weight": Range(0, integer=False, note="beta after the warm-up"),
    "alignment_warmup_steps": Range(0, note="optimiser steps over which beta ramps up from 0"),
    "replacement_layers": Range(0, note="first layers that may get the true predecessor's code"),
    "replacement_probability": Range(**_REAL01, note="share of anchors with the true predecessor at first"),
    "replacement_hold_ratio": Range(**_REAL01, note="share of training at the full probability"),
    "replacement_end_ratio": Range(**_REAL01, note="share of training after which no anchor is replaced"),
    "candidate_mass_threshold": Range(0, 1, integer=False, hi_open=True,
                                      note="target mass on the candidates below which their L1 is dropped"),
}


def schedule(step: int, total: int | None, alignment_weight: float, warmup: int, probability: float,
             hold: float, end: float) -> tuple[float, float]:
    """(beta, p) at optimiser ``step`` of ``total`` (SpecForge ``DSpineConfig.schedule``): beta = alignment_weight *
    min(step / warmup, 1) (warmup 0: the full weight); p = probability * clamp((end - step / total) / (end - hold),
    0, 1), and 0 without a total (held-out evaluation)."""
    step = max(int(step), 0)
    beta = alignment_weight * (min(step / warmup, 1.0) if warmup else 1.0)
    if not total or total <= 0:
        return beta, 0.0
    frac = (end - step / total) / (end - hold)
    return beta, probability * min(max(frac, 0.0), 1.0)


@torch.no_grad()
def transfer_space(head_weight: torch.Tensor, rank: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitened PCA token codes of a target's lm_head (SpecForge ``initialize_transfer_space``).

    Args:
        head_weight: [V, D] the target's lm_head rows (any float dtype; computed in fp32, ``chunk`` rows at a time).
        rank: r <= min(D, V - 1).
    Returns:
        (codes [V, r] fp32 unit rows: (n(w_v) - mean) E diag(lambda)^-1/2 renormalised, directions E [D, r] fp32: the
        top-r eigenvectors of the covariance of the normalised rows n(w_v), in ascending eigenvalue order).
    Raises:
        ValueError: a rank the head cannot give (fewer than r positive principal directions).
    """
    v, d = head_weight.shape
    cov = torch.zeros(d, d, dtype=torch.float32, device=head_weight.device)
    total = cov.new_zeros(d)
    for rows in head_weight.split(chunk):
        n = F.normalize(rows.float(), dim=-1)
        total += n.sum(0)
        cov += n.T @ n
    mean = total / v
    cov -= v * torch.outer(mean, mean)
    values, vectors = torch.linalg.eigh(cov)
    values, vectors = values[-rank:], vectors[:, -rank:]
    if not bool(torch.isfinite(values).all()) or bool((values <= 0).any()):
        raise ValueError(f"the target's lm_head has fewer than transfer_rank={rank} positive principal directions; "
                         "choose a smaller head.transfer_rank")
    codes = torch.cat([F.normalize((F.normalize(rows.float(), dim=-1) - mean) @ vectors / values.sqrt(), dim=-1)
                       for rows in head_weight.split(chunk)])
    return codes, vectors


class AdjacentInjection(nn.Module):
    """The injection's parameters (published under ``injection.``): ``readouts.{l}.weight`` [r, D],
    ``writes.{l}.weight`` [D, m] (zero at start), ``message.weight``, ``receiver_gate.weight`` and
    ``predecessor_gate.weight`` [m, r] (the predecessor gate zero at start), ``bias`` [m] (zero)."""

    def __init__(self, hidden: int, layers: int, rank: int, message: int):
        super().__init__()
        self.readouts = nn.ModuleList(nn.Linear(hidden, rank, bias=False) for _ in range(layers))
        self.writes = nn.ModuleList(nn.Linear(message, hidden, bias=False) for _ in range(layers))
        self.message = nn.Linear(rank, message, bias=False)
        self.receiver_gate = nn.Linear(rank, message, bias=False)
        self.predecessor_gate = nn.Linear(rank, message, bias=False)
        self.bias = nn.Parameter(torch.zeros(message))
        for w in [*self.writes, self.predecessor_gate]:
            nn.init.zeros_(w.weight)


class _InjectionHook:
    """One forward's per-layer action (:meth:`dartree.models.drafter.DFlashDrafter.layer_hook`): the injection after
    every layer; ``head_hidden`` [N, A*L, D] the last layer's pre-injection states; ``features`` (when asked) every
    layer's post-injection features [N, A, L, r]."""

    def __init__(self, head: "DSpineHead", block_ids: torch.Tensor, replace, features: bool):
        self.head, self.ids, self.replace = head, block_ids, replace
        self.head_hidden = None
        self.features = [] if features else None

    def __call__(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        n, q, d = h.shape
        a, L = self.ids.shape[-2:]
        if q != a * L:
            raise ValueError(f"dspine: the drafter runs {q} block tokens but block_ids holds {a} blocks of {L}")
        out = self.head.inject(h.view(n, a, L, d), layer, self.ids, self.replace)
        if layer == self.head.num_layers - 1:
            self.head_hidden = h
        if self.features is not None:
            self.features.append(self.head.feature(out, layer))
        return out.reshape(n, q, d)


class DSpineHead(CorrectionHead):
    """DSpine's adjacent injection, token codes and transition scores as a correction head (module docstring).

    Tensors: ``injection.*`` (:class:`AdjacentInjection`), buffers ``transfer_codes`` [V, r] and ``transfer_ready``
    (bool scalar). The decoders read it through g(C, H, r): H is the last layer's pre-injection state of the proposal
    (the drafter's hook records it: ``decode.draft.draft_block`` hands it on as the block's hidden), the state r is
    sqrt(r) c[predecessor] [N, r] fp32 (the anchor's code at the root), and g is the transition score, which
    replaces U[C]. ``first_order`` is False: its state is the parent token's code, but g is not U[C] + A W[C]^T, so
    the builders score each depth with :meth:`score` instead of pair tables.

    Args:
        vocab_size: V. hidden_size: D. num_layers: the drafter's layers.
        transfer_rank, message_size, top_k, ce_weight, alignment_weight, alignment_warmup_steps, replacement_layers,
            replacement_probability, replacement_hold_ratio, replacement_end_ratio, candidate_mass_threshold:
            SpecForge's ``dspine_config`` (defaults :data:`SPECFORGE_DEFAULTS`); the training ones are kept so a
            conversion writes them back.
    Raises:
        ValueError: a field of the wrong type or out of range (:data:`FIELDS`), transfer_rank above min(D, V - 1),
            top_k above V, or replacement_hold_ratio >= replacement_end_ratio (one line each).
    """

    type_name = "dspine"
    first_order = False
    fields = FIELDS

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, transfer_rank: int = 1024,
                 message_size: int = 512, top_k: int = 16, ce_weight: float = 0.1, alignment_weight: float = 0.5,
                 alignment_warmup_steps: int = 146, replacement_layers: int = 3,
                 replacement_probability: float = 0.5, replacement_hold_ratio: float = 1 / 6,
                 replacement_end_ratio: float = 1 / 3, candidate_mass_threshold: float = 1e-4):
        super().__init__()
        hp = {k: v for k, v in locals().items() if k in FIELDS}
        check_fields(hp, FIELDS, "dspine head: ")
        if transfer_rank > min(hidden_size, vocab_size - 1):
            raise ValueError(f"dspine head: transfer_rank={transfer_rank} exceeds min(hidden_size {hidden_size}, "
                             f"vocab_size - 1 = {vocab_size - 1}); choose head.transfer_rank <= "
                             f"{min(hidden_size, vocab_size - 1)}")
        if top_k > vocab_size:
            raise ValueError(f"dspine head: top_k={top_k} exceeds the vocabulary ({vocab_size}); choose <= {vocab_size}")
        if replacement_hold_ratio >= replacement_end_ratio:
            raise ValueError(f"dspine head: replacement_hold_ratio={replacement_hold_ratio} must be below "
                             f"replacement_end_ratio={replacement_end_ratio}")
        self._hp = {k: (float(v) if isinstance(FIELDS[k], Range) and not FIELDS[k].integer else int(v))
                    for k, v in hp.items()}
        for k, v in self._hp.items():
            setattr(self, k, v)
        self.rank = self.transfer_rank
        self.injection = AdjacentInjection(hidden_size, num_layers, transfer_rank, message_size)
        self.register_buffer("transfer_codes", torch.zeros(vocab_size, transfer_rank))
        self.register_buffer("transfer_ready", torch.tensor(False))
        self.__dict__["_bound"] = None  # (drafter, lm_head weight): references, never tensors of this head

    def hparams(self) -> dict:
        return dict(self._hp)

    # ----------------------------------------------------------------------------------------- binding, codes
    def bind_models(self, drafter, lm_head_weight: torch.Tensor | None = None) -> None:
        """Bind the drafter (its final norm; this head attaches itself as its per-layer hook) and the target's
        lm_head weight [V, D] (None: only the drafter).

        Raises:
            ValueError: a drafter that is not causal in the block, does not propose from block position 1, or has
                another layer count or width; an lm_head of another vocabulary or width (each named, with the fix).
        """
        c = drafter.cfg
        bad = [f"{k} {got} (needs {want})" for k, got, want in
               (("drafter.causal_block", c.causal_block, True), ("drafter.proposal_offset", c.proposal_offset, 1),
                ("drafter.num_layers", c.num_layers, self.num_layers),
                ("drafter.hidden_size", c.hidden_size, self.hidden_size)) if got != want]
        if bad:
            raise ValueError(f"dspine head does not fit this drafter: {'; '.join(bad)}; use the drafter it was trained "
                             "with")
        if lm_head_weight is not None and tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"dspine head: the target's lm_head is {list(lm_head_weight.shape)}, not [vocab_size "
                             f"{self.vocab_size}, hidden_size {self.hidden_size}]; use the target it was trained for")
        self.__dict__["_bound"] = (drafter, lm_head_weight)
        drafter.attach(self)

    @torch.no_grad()
    def init_codes(self, head_weight: torch.Tensor) -> None:
        """Set the token codes and start every readout on their directions from the target's lm_head [V, D]
        (:func:`transfer_space`); marks them ready.

        Raises:
            ValueError: a head of another vocabulary or width, or too few principal directions.
        """
        if tuple(head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"dspine token codes need the target's lm_head [vocab_size {self.vocab_size}, hidden_size "
                             f"{self.hidden_size}], got {list(head_weight.shape)}; give the target it drafts for")
        codes, vectors = transfer_space(head_weight, self.rank)
        self.transfer_codes.copy_(codes.to(self.transfer_codes))
        for r in self.injection.readouts:
            r.weight.copy_(vectors.T.to(r.weight))
        self.transfer_ready.fill_(True)

    def _ready(self) -> None:
        if not bool(self.transfer_ready):
            raise RuntimeError("dspine token codes are not initialised: training sets them from the target's lm_head "
                               "(head.init_codes(target.lm_head.weight)); a converted checkpoint carries them")

    def _models(self):
        if self.__dict__["_bound"] is None or self.__dict__["_bound"][1] is None:
            raise RuntimeError("dspine head is not bound to its drafter and target: call head.bind_models(drafter, "
                               "target.lm_head.weight) (load_dartree(..., target=target) does it)")
        return self.__dict__["_bound"]

    # ----------------------------------------------------------------------------------------- the injection
    def code(self, ids: torch.Tensor) -> torch.Tensor:
        """sqrt(r) c[ids]: token ids [...] -> [..., r] in the codes' dtype."""
        return math.sqrt(self.rank) * F.embedding(ids, self.transfer_codes)

    def feature(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """f = sqrt(r) normalize(R_layer h) (normalised in fp32): [..., D] -> [..., r] in h's dtype."""
        p = F.linear(h, self.injection.readouts[layer].weight)
        return (math.sqrt(self.rank) * F.normalize(p.float(), dim=-1)).to(h.dtype)

    def write(self, h: torch.Tensor, receiver: torch.Tensor, pred: torch.Tensor, layer: int) -> torch.Tensor:
        """h + rms(h) W_layer (sigmoid(G_r receiver + G_p pred + b) * M pred): h [..., D], receiver / pred [..., r]."""
        inj = self.injection
        pred = pred.to(receiver.dtype)
        gate = torch.sigmoid(F.linear(receiver, inj.receiver_gate.weight) + F.linear(pred, inj.predecessor_gate.weight)
                             + inj.bias)
        delta = F.linear(gate * F.linear(pred, inj.message.weight), inj.writes[layer].weight)
        scale = (torch.linalg.vector_norm(h.float(), dim=-1, keepdim=True) / math.sqrt(h.shape[-1])).to(h.dtype)
        return h + scale * delta

    def inject(self, h: torch.Tensor, layer: int, ids: torch.Tensor, replace=None) -> torch.Tensor:
        """One layer's injection: h [N, A, L, D] after layer ``layer``, ids [N, A, L] the blocks' tokens (anchor
        first; with ``replace`` [N, A] bool also the true tokens, whose codes are the predecessors of the replaced
        anchors in the first ``replacement_layers`` layers) -> [N, A, L, D]."""
        self._ready()
        f = self.feature(h, layer)
        pred = torch.cat([self.code(ids[..., :1]).to(f.dtype), f[..., 1:-1, :]], dim=-2)
        if replace is not None and layer < self.replacement_layers:
            pred = torch.where(replace[..., None, None], self.code(ids[..., :-1]).to(pred.dtype), pred)
        return torch.cat([h[..., :1, :], self.write(h[..., 1:, :], f[..., 1:, :], pred, layer)], dim=-2)

    def layer_hook(self, block_ids: torch.Tensor, *, replace=None, features: bool = False) -> _InjectionHook:
        """The hook of one drafter forward over blocks ``block_ids`` [N, A, L] int64 (anchor first; at decode
        [1, 1, L] = anchor then MASK ids). ``replace`` [N, A] bool: anchors whose first layers get the true
        predecessors (training); ``features``: record each layer's features for the alignment loss."""
        return _InjectionHook(self, block_ids, replace, features)

    def refine(self, hidden: torch.Tensor, pred_code: torch.Tensor) -> torch.Tensor:
        """norm(write(H, f(H), pred, last layer)): the last layer's pre-injection state written with a predecessor
        code ([..., r], from :meth:`code`) and normed by the drafter's final norm -> [..., D]."""
        self._ready()
        drafter = self.__dict__["_bound"][0] if self.__dict__["_bound"] is not None else None
        if drafter is None:
            raise RuntimeError("dspine head is not bound to its drafter: call head.bind_models(drafter, ...)")
        last = self.num_layers - 1
        return drafter.norm(self.write(hidden, self.feature(hidden, last), pred_code, last))

    def transition_scores(self, pre: torch.Tensor, cand: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Every (predecessor, candidate) pair of adjacent proposals (SpecForge ``transition_scores``).

        Args:
            pre: [..., P, D] the last layer's pre-injection states. cand: [..., P, K] candidate ids per proposal.
            anchor: [...] the anchor ids (the first proposal's predecessor).
        Returns:
            [..., P, K, K] fp32: [p, j, k] scores candidate k of proposal p after candidate j of proposal p - 1
            (after the anchor, for every j, at p = 0).
        """
        lm = self._models()[1]
        kk = cand.shape[-1]
        prev = torch.cat([anchor[..., None, None].expand(*anchor.shape, 1, kk), cand[..., :-1, :]], dim=-2)
        hidden = pre.unsqueeze(-2).expand(*pre.shape[:-1], kk, pre.shape[-1])
        refined = self.refine(hidden, self.code(prev))
        return torch.einsum("...ikh,...ijh->...ikj", refined, F.embedding(cand, lm).to(refined.dtype)).float()

    # ----------------------------------------------------------------------------------------- g(C, H, r)
    def init_state(self, anchor_ids):
        return self.code(anchor_ids).float()

    def advance(self, state, tokens, hidden=None):
        return self.code(tokens).float()

    def score(self, cand, hidden, state, base):
        lm = self._models()[1]
        refined = self.refine(hidden, state.to(hidden.dtype))
        return torch.einsum("nkd,nd->nk", F.embedding(cand, lm).float(), refined.float())

    def block_factors(self, prev_ids, hidden, vocab=None):
        raise ValueError("dspine head: its transition scores replace the base logits (no U + A W^T form); it trains "
                         "with its family's own loss (loss.type=dspine)")


def dspine_loss(drafter, head: DSpineHead, w_out: torch.Tensor, x, q_pos, feats, mask, block_ids, t_hidden, valid, *,
                gamma: float | None = 7.0, progress: tuple = (0, None), replace=None, denom: float | None = None) -> dict:
    """DSpine's training loss over A blocks of one sequence (SpecForge ``OnlineDSpineModel``; module docstring).

    Args:
        drafter: the DFlash backbone (``causal_block``, proposal offset 1). head: bound here to it and ``w_out``;
            its token codes are set from ``w_out`` first when they are not (as SpecForge does when training starts).
        w_out: [V, D] the target's lm_head rows. x: [1, A*L, D] embedded blocks [anchor, MASK, ...]. q_pos: [1, A*L]
            positions. feats: [1, T, nL*D] context features of positions 0..T-1. mask: the blocks'
            :class:`~dartree.models.drafter.BlockAttention`. block_ids: [A, L] the true tokens t[a .. a+L-1].
        t_hidden: [A, P, D] the target's final states before each label (teacher p_t = softmax(w_out h)).
        valid: [A, P] bool predictions with a loss. gamma: decay length of the weights exp(-k / gamma) (None: 1).
        progress: (optimiser step, planned steps or None) for beta and p (:func:`schedule`). replace: [A] bool
            anchors given the true predecessors (None: none). denom: None: the weight sum clamped to >= 1
            (SpecForge); else the shared batch denominator.
    Returns:
        {"loss", "ce", "l1" (backbone, over the denominator; detached), "hit" [A, P] bool (backbone argmax is the
        label, valid only), and the weighted sums "ce_sum", "l1_sum", "refinement", "alignment", "den", "beta"}.
    """
    head.bind_models(drafter, w_out)
    if not bool(head.transfer_ready):
        head.init_codes(w_out)
    a, L = block_ids.shape
    hook = head.layer_hook(block_ids[None], replace=None if replace is None else replace[None], features=True)
    hidden = drafter(x, q_pos, feats, torch.arange(feats.shape[1], device=x.device)[None], mask=mask, hook=hook)
    hidden, pre = hidden.view(a, L, -1)[:, 1:], hook.head_hidden.view(a, L, -1)[:, 1:]
    labels, prev = block_ids[:, 1:], block_ids[:, :-1]
    w = valid.float()
    if gamma is not None and gamma > 0:
        w = w * torch.exp(-torch.arange(L - 1, dtype=torch.float32, device=w.device) / gamma)
    den = w.sum().clamp_min(1.0) if denom is None else denom
    logits = F.linear(hidden, w_out.to(hidden.dtype)).float()
    logp = logits.log_softmax(-1)
    with torch.no_grad():
        teacher = F.linear(t_hidden.to(w_out.dtype), w_out).float().softmax(-1)
    ce = -logp.gather(-1, labels[..., None])[..., 0]
    l1 = (logp.exp() - teacher).abs().sum(-1)
    # the refinement: the transition scores of the top-k backbone candidates after the true predecessor
    cand = logits.detach().topk(head.top_k, dim=-1).indices
    refined = head.refine(pre, head.code(prev))
    rlogp = torch.einsum("apd,apkd->apk", refined, F.embedding(cand, w_out).to(refined.dtype)).float().log_softmax(-1)
    t_c = teacher.gather(-1, cand)
    mass = t_c.sum(-1)
    t_c = t_c / mass[..., None].clamp_min(1e-30)
    r_ce = -(rlogp * (cand == labels[..., None])).sum(-1)
    r_l1 = (rlogp.exp() - t_c).abs().sum(-1) * (mass > head.candidate_mass_threshold)
    # the alignment of every layer's feature with the true token's code
    feats_l = torch.stack(hook.features)[:, 0].reshape(head.num_layers, a, L, -1)[:, :, 1:]
    align = 1 - F.cosine_similarity(feats_l.float(), F.embedding(labels, head.transfer_codes).float()[None], dim=-1)
    cw = head.ce_weight
    ce_sum, l1_sum = (ce * w).sum(), (l1 * w).sum()
    refinement = ((cw * r_ce + (1 - cw) * r_l1) * w).sum()
    alignment = (align * w[None]).sum()
    beta = schedule(progress[0], progress[1], head.alignment_weight, head.alignment_warmup_steps,
                    head.replacement_probability, head.replacement_hold_ratio, head.replacement_end_ratio)[0]
    mean_ce = ce_sum.detach() / w.sum().clamp_min(1e-8)  # the alignment's scale: this sequence's mean backbone CE
    num = cw * ce_sum + (1 - cw) * l1_sum + refinement + beta * mean_ce * alignment
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
    return {"loss": num / den, "ce": (ce_sum / den).detach(), "l1": (l1_sum / den).detach(), "hit": hit,
            "ce_sum": ce_sum, "l1_sum": l1_sum, "refinement": refinement, "alignment": alignment, "den": den,
            "beta": beta}


def _block_loss(drafter, head: DSpineHead, b, *, gen: torch.Generator, progress=None, denom=None,
                gamma: float | None = 7.0) -> dict:
    """:func:`dspine_loss` of one training sequence's step tensors ``b`` (``dartree.training.step.StepBlocks``): the
    blocks' true tokens [t[a], labels...], the teacher states ``final[lp - 1]``, and per anchor the replacement draw
    (``gen``, the sequence's anchor generator, so every device draws the same) while gradients are on."""
    s = b.final.shape[0]
    step, total = progress if progress is not None else (0, None)
    p = schedule(step, total, head.alignment_weight, head.alignment_warmup_steps, head.replacement_probability,
                 head.replacement_hold_ratio, head.replacement_end_ratio)[1]
    replace = None
    if p > 0 and torch.is_grad_enabled():
        replace = (torch.rand(b.valid.shape[0], generator=gen) < p).to(b.valid.device)
    block_ids = torch.cat([b.prev[:, :1], b.labels], dim=1)
    return dspine_loss(drafter, head, b.w_out, b.x, b.q_pos, b.feats, b.mask, block_ids,
                       b.final[(b.lp - 1).clamp(max=s - 1)], b.valid, gamma=gamma, progress=(step, total),
                       replace=replace, denom=denom)


class DSpineFamily(Family):
    """DSpine's injection head (:class:`DSpineHead`) and its loss (:func:`dspine_loss`). Its recipe keys are
    SpecForge's ``dspine_config`` names under ``head.`` with SpecForge's defaults, except ``head.transfer_rank``,
    :data:`RECIPE_TRANSFER_RANK` for the default target (SpecForge's 1024 needs a hidden size >= 1024); ``head.top_k``
    is the shared key (16, as SpecForge). SpecForge trains it 6 epochs, lr 6e-4 cosine, 512 anchors, sequences up to
    3072 tokens."""

    name = "dspine"
    heads = (DSpineHead,)
    recipe_fields = {k: (RECIPE_TRANSFER_RANK if k == "transfer_rank" else v, FIELDS[k])
                     for k, v in SPECFORGE_DEFAULTS.items() if k != "top_k"}
    # SpecForge's names are dartree's without ``head.``: the injection per layer (MAX_LAYERS named) and the codes
    published = {n: n for n in
                 [f"injection.{w}.{i}.weight" for w in ("readouts", "writes") for i in range(MAX_LAYERS)]
                 + [f"injection.{w}.weight" for w in ("message", "receiver_gate", "predecessor_gate")]
                 + ["injection.bias", "transfer_codes", "transfer_ready"]}
    export_to = ("specforge-dspine",)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """V, D and the recipe's ``head.`` DSpine keys (``top_k`` the shared one); the layer count comes from the
        drafter (``num_layers``, passed by :meth:`~dartree.models.families.base.Family.build_head`)."""
        out = {"vocab_size": vocab_size, "hidden_size": hidden_size, "top_k": int(head.get("top_k", 16))}
        out.update({k: head.get(k, default) for k, (default, _) in self.recipe_fields.items()})
        return out

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """The whole loss is the family's own (:func:`dspine_loss` through ``Objective.block_loss``), decay
        ``loss.gamma``."""
        gamma = loss["gamma"]
        return Objective(gamma=gamma, logged=("l1",), block_loss=partial(_block_loss, gamma=gamma))

    def recipe_problems(self, recipe: Mapping[str, Any]) -> list[str]:
        """DSpine's backbone: causal in the block, proposing from block position 1, over the full vocabulary; its
        CE / L1 split is ``head.ce_weight`` (DSpark's ``loss.ce_weight`` / ``l1_weight`` do not apply)."""
        d, h, lo = recipe["drafter"], recipe["head"], recipe["loss"]
        out = []
        if not d.get("causal_block", False):
            out.append("loss.type=dspine trains a drafter causal in the block: set drafter.causal_block=true")
        if d["proposal_offset"] != 1:
            out.append(f"drafter.proposal_offset={d['proposal_offset']}: DSpine proposes from block position 1 (the "
                       "anchor at 0); set drafter.proposal_offset=1")
        if d.get("draft_vocab_size", 0):
            out.append("drafter.draft_vocab_size > 0: DSpine scores the full vocabulary; set drafter.draft_vocab_size=0")
        if h["replacement_hold_ratio"] >= h["replacement_end_ratio"]:
            out.append(f"head.replacement_hold_ratio={h['replacement_hold_ratio']} must be below "
                       f"head.replacement_end_ratio={h['replacement_end_ratio']}")
        if lo["ce_weight"] != 0.1 or lo["l1_weight"] != 0.9:
            out.append(f"loss.ce_weight={lo['ce_weight']} / loss.l1_weight={lo['l1_weight']} are DSpark's; DSpine's "
                       "CE / L1 split is head.ce_weight (leave the loss ones at 0.1 / 0.9)")
        return out


register_family(DSpineFamily())

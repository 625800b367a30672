"""Block construction and losses for DFlash-family drafter training.

``block_attention_mask`` is the DFlash training mask (SpecForge ``OnlineDFlashModel``,
``specforge/algorithms/common/dflash_family_model.py``): a query of block n sees context keys strictly before its
anchor and every key of its own block; blocks are isolated from one another. The three published losses,
each over the P proposals of every block with position k weighted by ``exp(-k / gamma)`` (k = 0 for the first
prediction; ``gamma=None``: weight 1, SpecForge's default) and normalised by the weight sum of the sequence
(``per_sequence``) or, given ``denom``, by a denominator shared by the whole step (``batch``: the caller passes
the step's weight sum over all processes, :func:`weight_sum`, as SpecForge pools its losses):

- ``dflash``: CE of the base logits (DFlash / SpecForge ``OnlineDFlashModel``);
- ``domino``: ``(1 - lambda) CE(corrected) + lambda CE(base)`` with the base-anchored linear curriculum for
  lambda (Domino, arXiv 2605.29707; SpecForge ``OnlineDominoModel``);
- ``dspark``: ``alpha_ce CE + alpha_tv ||p_d - p_t||_1 + alpha_conf BCE(c, 1 - ||p_d - p_t||_1 / 2)``
  (DSpark, arXiv 2607.05147, Sec. 3.3), the BCE only when the head has a confidence head. Its distribution term
  ``alpha_tv`` multiplies the L1 distance sum_v |p_d - p_t| (SpecForge / DeepSpec / NeMo AutoModel
  ``l1_loss_alpha``, called "TVD" there), twice the total variation. Two more distribution terms, over the same
  decay weights: ``tv_weight`` times the total variation TV = 0.5 sum_v |p_t - p_d| (the same term at half the
  scale), and ``kl_weight`` times KL(p_t || p_d) (forward KL to the target's distribution: DistillSpec's distillation
  objective, arXiv 2310.08461; EAGLE's soft-label classification loss, arXiv 2401.15077, is it plus the target's
  entropy). ``lk_weight`` adds the LK loss (LK losses, arXiv 2602.23881, Eq. for LK^lambda): lambda KL(p_t || p_d)
+ (1 - lambda) TV(p_t, p_d) per prediction, with lambda fixed (``lk_lambda``) or adaptive, lambda = exp(-eta
sg[alpha]) where alpha = 1 - TV is the prediction's acceptance probability (``lk_lambda=None``, ``lk_eta``): KL
while the draft is poor, TV (the acceptance rate itself) once it is good.

On a draft vocabulary (the drafter scores V' < V tokens) the L1 / TV add the target's mass outside V' (the drafter
puts none there), from the target's full-vocabulary log-sum-exp; the KL is to the target's distribution
renormalised over V' (p_t restricted to V', over its sum: the distribution the drafter can match; the full-vocabulary
KL is infinite there), so it needs only the target's logits on the V' columns, no log-sum-exp.

Which predictions carry a loss is :func:`label_mask`: the label lies inside the sequence and, with a loss mask
(assistant tokens only, multi-turn data), is a supervised token; DSpark's cumulative form drops every later label of
a block after the first masked one. These losses on materialised logits define the terms; training computes them
chunk by chunk without the [N, P, V] logits (:func:`dartree.training.fused_loss.fused_block_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, dtype=torch.float32) -> torch.Tensor:
    """Additive training mask over [context ; all blocks] keys.

    Args:
        anchors: [A] int64 anchor positions (block n occupies positions anchors[n] + arange(L)).
        ctx_len: S, number of context keys (positions 0..S-1).
        block_size: L.
    Returns:
        [1, 1, A*L, S + A*L] float: 0 where visible, ``finfo(dtype).min`` elsewhere.
    """
    a = anchors.numel()
    q_block = torch.arange(a).repeat_interleave(block_size)  # [A*L] block index of each query
    ctx_vis = torch.arange(ctx_len)[None, :] < anchors[q_block][:, None]  # strictly before the anchor
    blk_vis = q_block[:, None] == q_block[None, :]
    vis = torch.cat([ctx_vis, blk_vis], dim=1)
    mask = torch.zeros(vis.shape, dtype=dtype)
    mask.masked_fill_(~vis, torch.finfo(dtype).min)
    return mask[None, None]


@dataclass
class LossOut:
    """Loss pieces (scalars) and teacher-forced accuracy per block position ([P], fraction in [0, 1]).

    ``ce`` is the CE of the final (corrected) logits; ``l1`` the L1 distance to the target distribution
    (dspark; the total variation is ``l1 / 2``); ``bce`` the confidence BCE (dspark with a confidence head);
    ``base_ce`` the CE of the base logits (domino); ``kl`` KL(p_t || p_d) (dspark with ``kl_weight``). Unused
    pieces are 0. ``hit`` [A, P] bool: prediction (a, k) is the label (teacher-forced, valid positions only); its
    leading run per anchor is the chain acceptance at that anchor.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    acc_per_pos: torch.Tensor
    count_per_pos: torch.Tensor
    bce: torch.Tensor = None
    base_ce: torch.Tensor = None
    hit: torch.Tensor = None
    kl: torch.Tensor = None

    def __post_init__(self):
        zero = torch.zeros((), device=getattr(self.loss, "device", None))  # beside the loss (the trainer stacks them)
        self.bce = zero if self.bce is None else self.bce
        self.base_ce = zero if self.base_ce is None else self.base_ce
        self.kl = zero if self.kl is None else self.kl


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-prediction CE [A, P]; labels < 0 (tokens outside a draft vocabulary) give 0 (they are masked out)."""
    a, p, v = logits.shape
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.clamp(min=0).reshape(-1), reduction="none")
    return ce.view(a, p) * (labels >= 0).float()


def decay_weights(valid: torch.Tensor, gamma: float | None) -> torch.Tensor:
    """w[a, k] = exp(-k / gamma) where valid, else 0: valid [A, P] bool -> [A, P] fp32 (k = 0 is the first
    prediction; DFlash's exp(-(k-1)/gamma) over block positions k >= 1 is the same sequence). ``gamma`` None (or
    <= 0, as SpecForge reads ``loss_decay_gamma``) gives weight 1 to every valid prediction."""
    if gamma is None or gamma <= 0:
        return valid.float()
    p = valid.shape[-1]
    return torch.exp(-torch.arange(p, dtype=torch.float32, device=valid.device) / gamma)[None] * valid.float()


def weight_sum(valid: torch.Tensor, gamma: float | None) -> float:
    """A sequence's share of the batch denominator: the sum of :func:`decay_weights` over its valid predictions
    (valid [A, P] bool; nats-free, a plain count when ``gamma`` is None). SpecForge's ``loss_weights.sum()``
    (DSpark) / ``weight_mask.sum()`` (DFlash, Domino)."""
    return float(decay_weights(valid, gamma).sum())


def label_mask(label_pos: torch.Tensor, seq_len: int, loss_mask: torch.Tensor | None = None, *,
               cumulative: bool = True) -> torch.Tensor:
    """Which block predictions carry a loss (and count in accuracy and chain acceptance).

    Args:
        label_pos: [A, P] int64 position of each prediction's label in the sequence (anchor + 1 + j).
        seq_len: T, the sequence length; labels at T or beyond are invalid.
        loss_mask: [T] bool, True on supervised tokens (the target's own response tokens); None: all are.
        cumulative: DSpark's rule (SpecForge ``OnlineDSparkModel._build_dspark_labels_and_mask``: the per-label
            mask's cumulative product along the block): after the first unsupervised label every later label of
            the block is dropped too, as a chain draft cannot be accepted past it. False: only the unsupervised
            labels themselves (SpecForge ``OnlineDFlashModel`` / ``OnlineDominoModel``: ``weight_mask *
            loss_mask[label]``).
    Returns:
        [A, P] bool. Without a loss mask both rules agree (labels past T form a suffix of every block).
    """
    valid = label_pos < seq_len
    if loss_mask is not None:
        valid = valid & loss_mask.to(torch.bool)[label_pos.clamp(max=seq_len - 1)]
        if cumulative:
            valid = torch.cumprod(valid.to(torch.int32), dim=-1).to(torch.bool)
    return valid


def normaliser(w: torch.Tensor, denom: float | None) -> torch.Tensor | float:
    """The normaliser of a weighted sum: the weights' own sum (per sequence) or the shared batch ``denom``."""
    return w.sum().clamp_min(1e-8) if denom is None else denom


def _accuracy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
    with torch.no_grad():
        a, p, v = logits.shape
        hit = (logits.reshape(-1, v).argmax(-1).view(a, p) == labels) & valid
        cnt = valid.float().sum(0)
        return hit.float().sum(0) / cnt.clamp_min(1), cnt, hit


def domino_loss(logits: torch.Tensor, base_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *,
                gamma: float | None, lam: float, denom: float | None = None) -> LossOut:
    """Domino loss: (1 - lam) CE(corrected) + lam CE(base), both decay-weighted and normalised by the weight sum.

    Args:
        logits: [A, P, V] corrected logits. base_logits: [A, P, V] base logits U. labels [A, P] int64 (< 0: a
        token outside the draft vocabulary, left out of the CE and counted as a miss), valid [A, P] bool.
        gamma: decay (None: none). lam: curriculum weight in [0, 1]
        (:func:`dartree.models.families.domino.lambda_schedule`).
        denom: None: normalise by this sequence's in-vocabulary weight sum; else divide both weighted CE sums by
            it (batch normalisation; SpecForge ``OnlineDominoModel``: ``(1 - lambda) final_num / den + lambda
            base_num / den``).
    Returns:
        LossOut (accuracy from the corrected logits).
    """
    w = decay_weights(valid & (labels >= 0), gamma)
    wsum = normaliser(w, denom)
    ce = (w * _ce(logits, labels)).sum() / wsum
    base_ce = (w * _ce(base_logits, labels)).sum() / wsum
    acc, cnt, hit = _accuracy(logits, labels, valid)
    return LossOut((1 - lam) * ce + lam * base_ce, ce.detach(), torch.zeros((), device=logits.device), acc, cnt,
                   base_ce=base_ce.detach(), hit=hit)


def dspark_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    target_logits: torch.Tensor | None,
    *,
    gamma: float | None,
    ce_weight: float,
    l1_weight: float,
    conf_logits: torch.Tensor | None = None,
    conf_weight: float = 0.0,
    target_probs: tuple[torch.Tensor, torch.Tensor] | None = None,
    denom: float | None = None,
    tv_weight: float = 0.0,
    kl_weight: float = 0.0,
    lk_weight: float = 0.0,
    lk_lambda: float | None = None,
    lk_eta: float = 3.0,
) -> LossOut:
    """DSpark training loss (DSpark paper section 3.3; DeepSpec ``config/dspark``); with ``ce_weight=1,
    l1_weight=0`` and no confidence it is the DFlash loss. The materialised reference of :func:`fused_block_loss`.

    Args:
        logits: [A, P, V] corrected drafter logits (any float dtype; computed in fp32).
        labels: [A, P] int64 target tokens.
        valid: [A, P] bool, False past the sequence end.
        target_logits: [A, P, V] target logits at the same predictions (p_t = softmax), or None for CE only.
        labels: [A, P] int64; < 0 marks a token outside the draft vocabulary (no CE; counted as a miss).
        target_probs: instead of target_logits when the logits cover a draft vocabulary only: (p_t on the same
            columns [A, P, V'], p_t mass outside them [A, P]); the L1 distance adds the outside mass (p_d is 0 there).
        gamma: decay; position k weighs exp(-k / gamma) (None: weight 1).
        conf_logits: [A, P] confidence logits c (pre-sigmoid), trained by BCE towards 1 - ||p_d - p_t||_1 / 2
            (detached), weighted like the other terms; needs target_logits.
        denom: None: each term over this sequence's own weight sum (the CE over in-vocabulary predictions);
            else every weighted sum over ``denom`` (batch normalisation; SpecForge ``OnlineDSparkModel``:
            ``(a_ce CE_num + a_l1 L1_num + a_conf BCE_num) / global weight sum``).
        tv_weight: weight of the total variation 0.5 * L1 (the same distance as ``l1_weight`` at half the scale).
        kl_weight: weight of KL(p_t || p_d) = sum_v p_t (log p_t - log p_d), p_t renormalised over the V columns of
            ``logits`` when ``target_probs`` gives a draft vocabulary's share (module docstring).
        lk_weight: weight of the LK loss lambda KL + (1 - lambda) TV per prediction (arXiv 2602.23881).
        lk_lambda: its fixed lambda in [0, 1]; None: adaptive, lambda = exp(-lk_eta * alpha), alpha = 1 - TV
            (detached; the paper's default eta is 3).
    Returns:
        LossOut; ``loss`` = sum_k w_k (ce_weight*CE + (l1_weight + tv_weight/2)*L1 + kl_weight*KL +
        lk_weight*LK + conf_weight*BCE) / sum_k w_k over valid predictions (or / ``denom``).
    Raises:
        ValueError: conf_logits without target_logits; tv_weight, kl_weight or lk_weight without a target
            distribution.
    """
    a, p, v = logits.shape
    logp = logits.float().reshape(-1, v).log_softmax(-1)  # one normalisation serves the CE and p_d
    w = decay_weights(valid, gamma)
    wsum = normaliser(w, denom)
    w_ce = decay_weights(valid & (labels >= 0), gamma)
    nll = -logp.gather(-1, labels.clamp(min=0).reshape(-1, 1)).view(a, p) * (labels >= 0).float()
    ce_term = (w_ce * nll).sum() / normaliser(w_ce, denom)
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    has_target = target_logits is not None or target_probs is not None
    if conf_logits is not None and not has_target:
        raise ValueError("the confidence BCE needs target_logits (its label is 1 - TV distance to p_t)")
    if (tv_weight or kl_weight or lk_weight) and not has_target:
        raise ValueError("tv_weight / kl_weight / lk_weight need the target distribution: give target_logits or "
                         "target_probs")
    kl_term = _kl_term(logp, w, wsum, target_logits, target_probs) if has_target and (kl_weight or lk_weight) else zero
    l1_coef = l1_weight + 0.5 * tv_weight
    l1_term = bce_term = zero
    if has_target and (l1_coef or conf_logits is not None or lk_weight):
        l1_term, bce_term = _l1_and_bce_terms(logp, w, wsum, target_logits, target_probs, conf_logits)
    loss = ce_weight * ce_term + l1_coef * l1_term + kl_weight * kl_term + conf_weight * bce_term
    if has_target and lk_weight:
        kl = _kl_per_prediction(logp, target_logits, target_probs).view(a, p)
        l1 = _l1_per_prediction(logp, target_logits, target_probs).view(a, p)
        lam = lk_lambdas(l1, lk_lambda, lk_eta)
        loss = loss + lk_weight * (w * (lam * kl + (1 - lam) * 0.5 * l1)).sum() / wsum
    acc, cnt, hit = _accuracy(logits, labels, valid)
    return LossOut(loss, ce_term.detach(), l1_term.detach(), acc, cnt, bce=bce_term.detach(), hit=hit,
                   kl=kl_term.detach())


def lk_lambdas(l1: torch.Tensor, lk_lambda: float | None, eta: float) -> torch.Tensor:
    """The LK loss's lambda per prediction (LK losses, arXiv 2602.23881): ``lk_lambda`` everywhere when fixed, else
    exp(-eta * alpha) with alpha = 1 - l1 / 2 the prediction's acceptance probability (no gradient).

    Args:
        l1: [...] fp32 L1 distances sum_v |p_d - p_t| (twice the total variation).
        lk_lambda: a fixed lambda in [0, 1], or None (adaptive).
        eta: the adaptive rate (the paper's default 3).
    Returns:
        [...] fp32 lambdas in [0, 1], detached.
    """
    if lk_lambda is not None:
        return torch.full_like(l1, float(lk_lambda)).detach()
    alpha = (1 - 0.5 * l1.detach().float()).clamp(0, 1)
    return torch.exp(-float(eta) * alpha)


def _kl_per_prediction(logp: torch.Tensor, target_logits, target_probs) -> torch.Tensor:
    """KL(p_t || p_d) per prediction [A*P] fp32: logp [A*P, V'] the drafter's log-probabilities; p_t from
    ``target_logits`` [A, P, V'] or, on a draft vocabulary, ``target_probs[0]`` renormalised over the V' columns."""
    v = logp.shape[-1]
    if target_probs is not None:  # p_t on the draft columns, renormalised over them
        pt_k = target_probs[0].float().reshape(-1, v)
        pt_k = pt_k / pt_k.sum(-1, keepdim=True).clamp_min(1e-30)
        return torch.xlogy(pt_k, pt_k).sum(-1) - (pt_k * logp).sum(-1)
    lt = target_logits.float().reshape(-1, v).log_softmax(-1)
    return (lt.exp() * (lt - logp)).sum(-1)


def _l1_per_prediction(logp: torch.Tensor, target_logits, target_probs) -> torch.Tensor:
    """The L1 distance sum_v |p_d - p_t| per prediction [A*P] fp32 (plus p_t's mass outside a draft vocabulary,
    ``target_probs[1]``); logp [A*P, V']."""
    v = logp.shape[-1]
    pd = logp.exp()
    if target_probs is not None:
        pt_sub, outside = target_probs
        return (pd - pt_sub.float().reshape(-1, v)).abs().sum(-1) + outside.float().reshape(-1)
    return (pd - target_logits.float().reshape(-1, v).softmax(-1)).abs().sum(-1)


def _kl_term(logp: torch.Tensor, w: torch.Tensor, wsum, target_logits, target_probs) -> torch.Tensor:
    """:func:`dspark_loss`'s KL(p_t || p_d) term (:func:`_kl_per_prediction`) weighted by w [A, P] over its
    normaliser ``wsum``. Returns the weighted mean (a 0-d fp32 tensor, nats)."""
    return (w * _kl_per_prediction(logp, target_logits, target_probs).view(w.shape)).sum() / wsum


def _l1_and_bce_terms(logp: torch.Tensor, w: torch.Tensor, wsum, target_logits, target_probs, conf_logits):
    """:func:`dspark_loss`'s L1 distance sum_v |p_d - p_t| (plus p_t's mass outside a draft vocabulary,
    ``target_probs[1]``) and confidence BCE towards 1 - L1 / 2 (zero without ``conf_logits`` [A, P]), each weighted
    by w [A, P] over ``wsum``; logp [A*P, V']. Returns (L1 term, BCE term), 0-d fp32 tensors."""
    l1 = _l1_per_prediction(logp, target_logits, target_probs).view(w.shape)
    l1_term = (w * l1).sum() / wsum
    bce_term = torch.zeros((), dtype=torch.float32, device=logp.device)
    if conf_logits is not None:
        label = (1 - 0.5 * l1.detach()).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none")
        bce_term = (w * bce).sum() / wsum
    return l1_term, bce_term


def teacher_forced_tau(acc_per_pos: torch.Tensor) -> float:
    """Chain acceptance length implied by per-position teacher-forced accuracies (bonus included).

    tau = 1 + sum_j prod_{i<=j} acc_i: an estimate that treats positions as independent.
    """
    return float(1.0 + torch.cumprod(acc_per_pos.float(), 0).sum())

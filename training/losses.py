"""Block construction and losses for DFlash-family drafter training.

``block_attention_mask`` is ANCHORS.md section 2: a query of block n sees context keys strictly before its
anchor and every key of its own block; blocks are isolated from one another. The three published losses,
each over the P proposals of every block with position k weighted by ``exp(-k / gamma)`` (k = 0 for the first
prediction) and normalised by the weight sum:

- ``dflash``: CE of the base logits (DFlash / SpecForge ``OnlineDFlashModel``);
- ``domino``: ``(1 - lambda) CE(corrected) + lambda CE(base)`` with the base-anchored linear curriculum for
  lambda (Domino, SpecForge ``OnlineDominoModel``, ANCHORS.md 5a);
- ``dspark``: ``alpha_ce CE + alpha_tv ||p_d - p_t||_1 + alpha_conf BCE(c, 1 - ||p_d - p_t||_1 / 2)``
  (DSpark paper section 3.3, ANCHORS.md 5b), the BCE only when the head has a confidence head.
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
    (dspark); ``bce`` the confidence BCE (dspark with a confidence head); ``base_ce`` the CE of the base
    logits (domino). Unused pieces are 0. ``hit`` [A, P] bool: prediction (a, k) is the label (teacher-forced,
    valid positions only); its leading run per anchor is the chain acceptance at that anchor.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    acc_per_pos: torch.Tensor
    count_per_pos: torch.Tensor
    bce: torch.Tensor = None
    base_ce: torch.Tensor = None
    hit: torch.Tensor = None

    def __post_init__(self):
        zero = torch.zeros(())
        self.bce = zero if self.bce is None else self.bce
        self.base_ce = zero if self.base_ce is None else self.base_ce


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-prediction CE [A, P]; labels < 0 (tokens outside a draft vocabulary) give 0 (they are masked out)."""
    a, p, v = logits.shape
    ce = F.cross_entropy(logits.float().reshape(-1, v), labels.clamp(min=0).reshape(-1), reduction="none")
    return ce.view(a, p) * (labels >= 0).float()


def decay_weights(valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """w[a, k] = exp(-k / gamma) where valid, else 0: valid [A, P] bool -> [A, P] fp32 (k = 0 is the first
    prediction; DFlash's exp(-(k-1)/gamma) over block positions k >= 1 is the same sequence)."""
    p = valid.shape[-1]
    return torch.exp(-torch.arange(p, dtype=torch.float32, device=valid.device) / gamma)[None] * valid.float()


def _accuracy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
    with torch.no_grad():
        a, p, v = logits.shape
        hit = (logits.reshape(-1, v).argmax(-1).view(a, p) == labels) & valid
        cnt = valid.float().sum(0)
        return hit.float().sum(0) / cnt.clamp_min(1), cnt, hit


def lambda_schedule(step: int, total_steps: int, start: float = 1.0, ratio: float = 1.0) -> float:
    """Domino's base-anchored curriculum: lambda = clamp(start * (1 - step / (ratio * total)), 0, 1)
    (SpecForge ``OnlineDominoModel``; ANCHORS.md 5a). Raises ValueError for ratio <= 0 or total < 1."""
    if ratio <= 0 or total_steps < 1:
        raise ValueError(f"lambda schedule needs ratio > 0 and total_steps >= 1, got {ratio}, {total_steps}")
    return float(min(1.0, max(0.0, start * (1.0 - step / (ratio * total_steps)))))


def domino_loss(logits: torch.Tensor, base_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *,
                gamma: float, lam: float) -> LossOut:
    """Domino loss: (1 - lam) CE(corrected) + lam CE(base), both decay-weighted and normalised by the weight sum.

    Args:
        logits: [A, P, V] corrected logits. base_logits: [A, P, V] base logits U. labels [A, P] int64 (< 0: a
        token outside the draft vocabulary, left out of the CE and counted as a miss), valid [A, P] bool.
        lam: curriculum weight in [0, 1] (:func:`lambda_schedule`).
    Returns:
        LossOut (accuracy from the corrected logits).
    """
    w = decay_weights(valid & (labels >= 0), gamma)
    wsum = w.sum().clamp_min(1e-8)
    ce = (w * _ce(logits, labels)).sum() / wsum
    base_ce = (w * _ce(base_logits, labels)).sum() / wsum
    acc, cnt, hit = _accuracy(logits, labels, valid)
    return LossOut((1 - lam) * ce + lam * base_ce, ce.detach(), torch.zeros(()), acc, cnt,
                   base_ce=base_ce.detach(), hit=hit)


def dspark_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    target_logits: torch.Tensor | None,
    *,
    gamma: float,
    ce_weight: float,
    l1_weight: float,
    conf_logits: torch.Tensor | None = None,
    conf_weight: float = 0.0,
    target_probs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LossOut:
    """DSpark training loss (DSpark paper section 3.3; DeepSpec ``config/dspark``); with ``ce_weight=1,
    l1_weight=0`` and no confidence it is the DFlash loss.

    Args:
        logits: [A, P, V] corrected drafter logits (any float dtype; computed in fp32).
        labels: [A, P] int64 target tokens.
        valid: [A, P] bool, False past the sequence end.
        target_logits: [A, P, V] target logits at the same predictions (p_t = softmax), or None for CE only.
        labels: [A, P] int64; < 0 marks a token outside the draft vocabulary (no CE; counted as a miss).
        target_probs: instead of target_logits when the logits cover a draft vocabulary only: (p_t on the same
            columns [A, P, V'], p_t mass outside them [A, P]); the L1 distance adds the outside mass (p_d is 0 there).
        gamma: decay; position k weighs exp(-k / gamma).
        conf_logits: [A, P] confidence logits c (pre-sigmoid), trained by BCE towards 1 - ||p_d - p_t||_1 / 2
            (detached), weighted like the other terms; needs target_logits.
    Returns:
        LossOut; ``loss`` = sum_k w_k (ce_weight*CE + l1_weight*L1 + conf_weight*BCE) / sum_k w_k over valid
        predictions.
    Raises:
        ValueError: conf_logits without target_logits.
    """
    a, p, v = logits.shape
    logp = logits.float().reshape(-1, v).log_softmax(-1)  # one normalisation serves the CE and p_d
    w = decay_weights(valid, gamma)
    wsum = w.sum().clamp_min(1e-8)
    w_ce = decay_weights(valid & (labels >= 0), gamma)
    nll = -logp.gather(-1, labels.clamp(min=0).reshape(-1, 1)).view(a, p) * (labels >= 0).float()
    ce_term = (w_ce * nll).sum() / w_ce.sum().clamp_min(1e-8)
    l1_term = torch.zeros((), dtype=torch.float32)
    bce_term = torch.zeros((), dtype=torch.float32)
    has_target = target_logits is not None or target_probs is not None
    if conf_logits is not None and not has_target:
        raise ValueError("the confidence BCE needs target_logits (its label is 1 - TV distance to p_t)")
    if has_target and (l1_weight or conf_logits is not None):
        pd = logp.exp()
        if target_probs is not None:
            pt_sub, outside = target_probs
            l1 = (pd - pt_sub.float().reshape(-1, v)).abs().sum(-1).view(a, p) + outside.float()
        else:
            pt = target_logits.float().reshape(-1, v).softmax(-1)
            l1 = (pd - pt).abs().sum(-1).view(a, p)
        l1_term = (w * l1).sum() / wsum
        if conf_logits is not None:
            label = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none")
            bce_term = (w * bce).sum() / wsum
    loss = ce_weight * ce_term + l1_weight * l1_term + conf_weight * bce_term
    acc, cnt, hit = _accuracy(logits, labels, valid)
    return LossOut(loss, ce_term.detach(), l1_term.detach(), acc, cnt, bce=bce_term.detach(), hit=hit)


def teacher_forced_tau(acc_per_pos: torch.Tensor) -> float:
    """Chain acceptance length implied by per-position teacher-forced accuracies (bonus included).

    tau = 1 + sum_j prod_{i<=j} acc_i: an estimate that treats positions as independent.
    """
    return float(1.0 + torch.cumprod(acc_per_pos.float(), 0).sum())

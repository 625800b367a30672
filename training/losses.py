"""Block construction and losses for DFlash-family drafter training.

``block_attention_mask`` is ANCHORS.md section 2: a query of block n sees context keys strictly before its
anchor and every key of its own block; blocks are isolated from one another. ``dspark_loss`` is DSpark's
loss without the confidence term: ``alpha_ce * CE + alpha_tv * ||p_d - p_t||_1``, each block position k
weighted by ``exp(-k / gamma)`` (k = 0 for the first prediction) and normalised by the weight sum.
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
    """Loss pieces (scalars) and teacher-forced accuracy per block position ([P], fraction in [0, 1])."""

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    acc_per_pos: torch.Tensor
    count_per_pos: torch.Tensor


def dspark_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    target_logits: torch.Tensor | None,
    *,
    gamma: float,
    ce_weight: float,
    l1_weight: float,
) -> LossOut:
    """DSpark training loss (DSpark paper section 3.3; DeepSpec ``config/dspark``), confidence term omitted.

    Args:
        logits: [A, P, V] corrected drafter logits (any float dtype; computed in fp32).
        labels: [A, P] int64 target tokens.
        valid: [A, P] bool, False past the sequence end.
        target_logits: [A, P, V] target logits at the same predictions (p_t = softmax), or None for CE only.
        gamma: decay; position k weighs exp(-k / gamma).
    Returns:
        LossOut; ``loss`` = sum_k w_k (ce_weight*CE + l1_weight*L1) / sum_k w_k over valid predictions.
    """
    a, p, v = logits.shape
    lf = logits.float().reshape(-1, v)
    w = torch.exp(-torch.arange(p, dtype=torch.float32) / gamma)[None].expand(a, p) * valid.float()
    wsum = w.sum().clamp_min(1e-8)
    ce = F.cross_entropy(lf, labels.reshape(-1), reduction="none").view(a, p)
    ce_term = (w * ce).sum() / wsum
    l1_term = torch.zeros((), dtype=torch.float32)
    if target_logits is not None and l1_weight:
        pd = lf.softmax(-1)
        pt = target_logits.float().reshape(-1, v).softmax(-1)
        l1 = (pd - pt).abs().sum(-1).view(a, p)
        l1_term = (w * l1).sum() / wsum
    loss = ce_weight * ce_term + l1_weight * l1_term
    with torch.no_grad():
        hit = (lf.argmax(-1).view(a, p) == labels) & valid
        cnt = valid.float().sum(0)
        acc = hit.float().sum(0) / cnt.clamp_min(1)
    return LossOut(loss, ce_term.detach(), l1_term.detach(), acc, cnt)


def teacher_forced_tau(acc_per_pos: torch.Tensor) -> float:
    """Chain acceptance length implied by per-position teacher-forced accuracies (bonus included).

    tau = 1 + sum_j prod_{i<=j} acc_i: an estimate that treats positions as independent.
    """
    return float(1.0 + torch.cumprod(acc_per_pos.float(), 0).sum())

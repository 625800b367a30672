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
a block after the first masked one.
"""

from __future__ import annotations

import contextlib
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


def _den(w: torch.Tensor, denom: float | None) -> torch.Tensor | float:
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
    wsum = _den(w, denom)
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
    wsum = _den(w, denom)
    w_ce = decay_weights(valid & (labels >= 0), gamma)
    nll = -logp.gather(-1, labels.clamp(min=0).reshape(-1, 1)).view(a, p) * (labels >= 0).float()
    ce_term = (w_ce * nll).sum() / _den(w_ce, denom)
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


class _FusedBlockLoss(torch.autograd.Function):
    """Chunked logits + loss + gradient in one pass (see :func:`fused_block_loss`); the gradient is computed in
    the forward, chunk by chunk, and scaled by the upstream gradient in the backward."""

    @staticmethod
    def forward(ctx, h, a, w_head, w_out, t_h, t_lse, labels, c_ce, c_base, c_l1, c_kl, chunk, want_grad, with_base,
                with_l1, with_kl, c_lk=None, lk_lambda=None, lk_eta=3.0):
        n, d = h.shape
        dt, dev = w_out.dtype, h.device
        f32 = torch.float32
        # autocast off where the device type has one (not ``meta``, where the device tests run the step)
        no_autocast = (torch.autocast(dev.type, enabled=False) if torch.amp.is_autocast_available(dev.type)
                       else contextlib.nullcontext())
        with no_autocast, torch.no_grad():
            hm = h.detach().to(dt)
            am = None if a is None else a.detach().to(dt)
            whm = None if w_head is None else w_head.detach().to(dt)
            thm = None if t_h is None else t_h.to(dt)
            grad_h = torch.empty(n, d, dtype=f32, device=dev)
            g_all = None if a is None or not want_grad else torch.empty(n, w_out.shape[0], dtype=dt, device=dev)
            nll, base_nll, l1, kl = (torch.zeros(n, dtype=f32, device=dev) for _ in range(4))
            hit = torch.zeros(n, dtype=torch.bool, device=dev)
            with_kl = with_kl and thm is not None
            with_l1 = with_l1 and thm is not None
            for s0 in range(0, n, chunk):
                e = slice(s0, min(n, s0 + chunk))
                rows = torch.arange(e.stop - s0, device=dev)
                y = labels[e]
                ok = (y >= 0).to(f32)
                yc = y.clamp(min=0)
                base = hm[e] @ w_out.T  # [c, V'] in the matmul dtype (autocast's rounding)
                x = base.to(f32, copy=True)  # base itself stays U for Domino's base CE
                if am is not None:
                    x += (am[e] @ whm.T).float()
                mx, arg = x.max(-1, keepdim=True)
                hit[e] = arg[:, 0] == y
                x_y = x[rows, yc]
                q = None if thm is None else (thm[e] @ w_out.T).float()  # the target's logits on the same columns
                if with_kl:  # p~_t = softmax of them (renormalised over the columns); sum p~ log p~, sum p~ x
                    lt = q.log_softmax(-1)
                    pt_k = lt.exp()
                    neg_ent = (pt_k * lt).sum(-1)
                    dot = (pt_k * x).sum(-1)
                p = x.sub_(mx).exp_()  # softmax in place: exp(x - max) / sum
                z = p.sum(-1, keepdim=True)
                p.div_(z)
                lz = mx[:, 0] + z[:, 0].log()  # log-sum-exp of x
                nll[e] = (lz - x_y) * ok
                if with_kl:  # KL(p~_t || p) = sum p~ log p~ - sum p~ (x - lse(x))
                    kl[e] = neg_ent - dot + lz
                if with_l1:  # p_t on the same columns (outside mass from the full-vocabulary lse)
                    if t_lse is None:
                        q = q.softmax(-1)
                        outside = 0.0
                    else:
                        q = q.sub_(t_lse[e, None]).exp_()
                        outside = (1 - q.sum(-1)).clamp(min=0)
                    diff = q.neg_().add_(p)  # p - p_t
                    l1[e] = diff.abs().sum(-1) + outside
                    if c_lk is not None:  # LK: lambda KL + (1 - lambda) TV, lambda from this chunk's TV when adaptive
                        lam = lk_lambdas(l1[e], lk_lambda, lk_eta)
                        c_l1[e] += 0.5 * c_lk[e] * (1 - lam)
                        c_kl[e] += c_lk[e] * lam
                if not want_grad:  # evaluation: the pieces only
                    if with_base:
                        base_nll[e] = -base.float().log_softmax(-1)[rows, yc] * ok
                    continue
                _chunk_grad(e, rows, yc, ok, p, diff if with_l1 else None, pt_k if with_kl else None, base,
                            coef=(c_ce, c_base, c_l1, c_kl), with_base=with_base, w_out=w_out,
                            grad_h=grad_h, g_all=g_all, base_nll=base_nll)
            grad_a = grad_w = None
            if am is not None and want_grad:
                grad_a = (g_all @ whm).float()
                grad_w = (g_all.T @ am).float()
            loss = (c_ce * nll).sum() + (c_base * base_nll).sum() + (c_l1 * l1).sum() + (c_kl * kl).sum()
        ctx.save_for_backward(grad_h, grad_a, grad_w)
        ctx.dtypes = (h.dtype, None if a is None else a.dtype, None if w_head is None else w_head.dtype)
        ctx.mark_non_differentiable(nll, base_nll, l1, kl, hit)
        return loss, nll, base_nll, l1, kl, hit

    @staticmethod
    def backward(ctx, g_loss, *_):
        grad_h, grad_a, grad_w = ctx.saved_tensors
        dh, da, dw = ctx.dtypes
        out_a = None if grad_a is None else (grad_a * g_loss).to(da)
        out_w = None if grad_w is None else (grad_w * g_loss).to(dw)
        return (grad_h * g_loss).to(dh), out_a, out_w, *([None] * 16)


def _chunk_grad(e: slice, rows: torch.Tensor, yc: torch.Tensor, ok: torch.Tensor, p: torch.Tensor,
                diff: torch.Tensor | None, pt_k: torch.Tensor | None, base: torch.Tensor, *, coef, with_base: bool,
                w_out: torch.Tensor, grad_h: torch.Tensor, g_all: torch.Tensor | None, base_nll: torch.Tensor) -> None:
    """The gradient step of :class:`_FusedBlockLoss` for one chunk ``e`` of c rows (overwrites ``p``, ``diff`` and
    ``pt_k`` in place).

    The gradient of the chunk's weighted loss with respect to the logits x [c, V']: CE + KL give
    (c_ce + c_kl) p - c_kl p~_t - c_ce onehot(y); the L1 adds c_l1 p_j (s_j - sum_v s_v p_v), s = sign(p - p_t)
    (``diff`` = p - p_t, None without the L1; ``pt_k`` = p~_t, None without the KL); with ``with_base`` Domino's
    base CE on U = ``base`` adds c_base (softmax(U) - onehot(y)) to U's gradient only (A and W get the corrected
    one) and writes the base NLL [c] into ``base_nll[e]``. ``rows`` = arange(c), ``yc`` the clamped labels [c],
    ``ok`` [c] 1.0 for in-vocabulary labels; ``coef`` = (c_ce, c_base, c_l1, c_kl) [N] fp32.
    Writes grad_h[e] = g · w_out [c, D] fp32 and, with factors, g_all[e] = g [c, V'] in w_out's dtype.
    """
    c_ce, c_base, c_l1, c_kl = coef
    dt = w_out.dtype
    cc = c_ce[e]
    ck = c_kl[e, None] if pt_k is not None else 0.0
    if diff is not None:
        sgn = diff.sign_()
        inner = (sgn * p).sum(-1, keepdim=True)
        g = sgn.sub_(inner).mul_(c_l1[e, None]).add_(cc[:, None] + ck).mul_(p)
    else:
        g = p.mul_(cc[:, None] + ck)
    if pt_k is not None:
        g.sub_(pt_k.mul_(ck))
    g[rows, yc] -= cc * ok
    if with_base:  # Domino's base CE on U alone; U gets both gradients, A and W the corrected one
        if g_all is not None:
            g_all[e] = g.to(dt)
        lpb = base.float().log_softmax(-1)
        base_nll[e] = -lpb[rows, yc] * ok
        cb = c_base[e]
        gb = lpb.exp_().mul_(cb[:, None])
        gb[rows, yc] -= cb * ok
        g += gb
        grad_h[e] = (g.to(dt) @ w_out).float()
    else:
        gd = g.to(dt)
        if g_all is not None:
            g_all[e] = gd
        grad_h[e] = (gd @ w_out).float()


def fused_block_loss(
    hidden: torch.Tensor,
    w_out: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    gamma: float | None,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    target_hidden: torch.Tensor | None = None,
    target_lse: torch.Tensor | None = None,
    ce_weight: float = 1.0,
    l1_weight: float = 0.0,
    lam: float | None = None,
    conf_logits: torch.Tensor | None = None,
    conf_weight: float = 0.0,
    chunk: int | None = None,
    denom: float | None = None,
    rows: torch.Tensor | None = None,
    tv_weight: float = 0.0,
    kl_weight: float = 0.0,
    lk_weight: float = 0.0,
    lk_lambda: float | None = None,
    lk_eta: float = 3.0,
) -> LossOut:
    """The dflash / dspark / domino losses without materialising the [A, P, V'] logits (Liger-style fused
    linear cross-entropy, extended to DSpark's L1, the total variation, the KL to the target and Domino's base CE).

    The drafter logits are x = hidden · w_out^T + A · W^T (``factors`` = (A, W) from the head's
    ``block_factors``; None for plain DFlash). Rows are processed ``chunk`` at a time: logits, log-softmax, CE,
    p_t (one [c, D] x [D, V'] matmul, shared by the L1 and the KL), L1, KL, argmax and the gradient with respect to
    x (:func:`_chunk_grad`) stay in cache; only the gradients for hidden, A and W leave the chunk. Matmuls run in
    ``w_out.dtype`` (bf16 rows round their products as autocast does), everything else in fp32. Equals
    :func:`dspark_loss` / :func:`domino_loss` on the materialised logits (loss, pieces, hits and gradients; test).

    Args:
        hidden: [A, P, D] drafter hidden states (any float dtype; differentiable).
        w_out: [V', D] frozen output rows (the target's lm_head, or the draft vocabulary's rows).
        labels: [A, P] int64 draft-vocabulary indices (< 0: outside it; no CE, a sure miss). valid: [A, P] bool.
        gamma: decay; prediction k weighs exp(-k / gamma) (None: weight 1).
        factors: (A [A, P, R], W [V', R]) fp32, differentiable; None for no correction.
        target_hidden: [A, P, D] the target's final hidden state before each label (p_t = softmax of its
            logits on these rows), or None (CE only).
        target_lse: [A, P] the target's full-vocabulary log-sum-exp when ``w_out`` is a draft vocabulary (the
            L1 then adds p_t's mass outside it); None normalises p_t over the V' columns.
        ce_weight, l1_weight: DSpark's weights (``lam`` None). lam: Domino's curriculum weight: the loss is
            (1 - lam) CE(x) + lam CE(U), both over valid in-vocabulary predictions.
        conf_logits: [A, P] confidence logits, trained by BCE towards 1 - L1/2 (detached), weight conf_weight.
        chunk: rows per chunk; None: about 2M logits per chunk (256 rows of an 8,192-token draft vocabulary).
        denom: None: normalise per sequence; else every weighted sum over this shared batch denominator.
        rows: [N] int64 flat indices of ``valid``'s True entries, on ``hidden``'s device (None: found here; a
            caller that knows them on the host passes them, so a CUDA step does not wait at the ``nonzero``).
        tv_weight: weight of the total variation 0.5 * L1 (needs target_hidden; on a draft vocabulary with
            target_lse, as the L1).
        kl_weight: weight of KL(p~_t || p_d), p~_t the target's softmax over the V' columns (needs target_hidden,
            not target_lse). With tv_weight = l1_weight = 0 and no confidence logits the L1 is not computed.
        lk_weight, lk_lambda, lk_eta: the LK loss as :func:`dspark_loss` (needs target_hidden; lambda per prediction
            from its own TV when adaptive).
    Returns:
        LossOut as :func:`dspark_loss` (``lam`` None) or :func:`domino_loss`.
    Raises:
        ValueError: conf_logits, tv_weight or kl_weight without target_hidden; lam with a target or confidence
            logits; chunk < 1.
    """
    chunk = _fused_chunk(chunk, w_out, target_hidden, lam, conf_logits, bool(tv_weight or kl_weight or lk_weight))
    w, w_ce = decay_weights(valid, gamma), decay_weights(valid & (labels >= 0), gamma)
    rows = valid.reshape(-1).nonzero()[:, 0] if rows is None else rows  # only valid predictions are computed
    l1_coef = l1_weight + 0.5 * tv_weight
    with_l1, with_kl, (c_ce, c_base, c_l1, c_kl, c_lk) = _fused_terms(
        rows, w, w_ce, target_hidden is not None, lam=lam, ce_weight=ce_weight, l1_coef=l1_coef, kl_weight=kl_weight,
        lk_weight=lk_weight, conf=conf_logits is not None, denom=denom, device=hidden.device)
    h, a, wh, t_h, t_lse, lab = _fused_rows(rows, hidden, labels, factors, target_hidden, target_lse)
    # Domino's base CE is computed where its weight can be non-zero (known on the host: no device sync)
    with_base = lam is not None and lam != 0
    loss, nll_r, base_r, l1_r, kl_r, hit_r = _FusedBlockLoss.apply(
        h, a, wh, w_out, t_h, t_lse, lab, c_ce.float(), c_base.float(), c_l1.float(), c_kl.float(), int(chunk),
        torch.is_grad_enabled(), with_base, with_l1, with_kl, c_lk, lk_lambda, float(lk_eta))
    grid = (rows, labels.shape, hidden.device)
    return _fused_out(loss, grid, nll_r, base_r, l1_r, hit_r, valid, w, w_ce, denom, lam=lam,
                      with_l1=with_l1, conf_logits=conf_logits, conf_weight=conf_weight,
                      kl_r=kl_r if with_kl else None)


def _fused_out(loss, grid, nll_r, base_r, l1_r, hit_r, valid, w, w_ce, denom, *, lam, with_l1, conf_logits,
               conf_weight, kl_r=None) -> LossOut:
    """:func:`fused_block_loss`'s per-row results (``*_r`` [N] over ``grid`` = (rows, [A, P] shape, device))
    scattered back to [A, P] and reduced to its :class:`LossOut`; adds the confidence BCE to ``loss``."""
    device = grid[2]
    nll, l1, hit = _scatter(nll_r, *grid), _scatter(l1_r, *grid), _scatter(hit_r, *grid, torch.bool)
    ce_term = (w_ce * nll).sum() / _den(w_ce, denom)
    cnt = valid.float().sum(0)
    acc = hit.float().sum(0) / cnt.clamp_min(1)
    if lam is not None:
        base_ce = (w_ce * _scatter(base_r, *grid)).sum() / _den(w_ce, denom)
        return LossOut(loss, ce_term.detach(), torch.zeros((), device=device), acc, cnt,
                       base_ce=base_ce.detach(), hit=hit)
    wsum = _den(w, denom)
    l1_term = (w * l1).sum() / wsum if with_l1 else torch.zeros((), device=device)
    kl_term = (w * _scatter(kl_r, *grid)).sum() / wsum if kl_r is not None else torch.zeros((), device=device)
    bce_term = torch.zeros((), dtype=torch.float32, device=device)
    if conf_logits is not None:
        label = (1 - 0.5 * l1).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), label, reduction="none")
        bce_term = (w * bce).sum() / wsum
        loss = loss + conf_weight * bce_term
    return LossOut(loss, ce_term.detach(), l1_term.detach(), acc, cnt, bce=bce_term.detach(), hit=hit,
                   kl=kl_term.detach())


def _fused_terms(rows, w, w_ce, has_target: bool, *, lam, ce_weight, l1_coef, kl_weight, lk_weight, conf: bool, denom,
                 device):
    """Which of :func:`fused_block_loss`'s distribution terms are computed (``with_l1``, ``with_kl``) and the per-row
    coefficients (c_ce, c_base, c_l1, c_kl, c_lk or None) of :func:`_fused_coefficients`. The L1 is computed for its
    own weight, the confidence label, the LK loss or (as before the KL) whenever a target is given; with the LK loss
    the chunks add its share to c_l1 and c_kl in place, so those are then tensors of their own."""
    lk = has_target and bool(lk_weight) and lam is None
    with_l1 = has_target and bool(l1_coef or conf or not kl_weight or lk)
    with_kl = has_target and bool(kl_weight or lk)
    c_ce, c_base, c_l1, c_kl = _fused_coefficients(rows, w, w_ce, lam=lam, ce_weight=ce_weight, l1_weight=l1_coef,
                                                   kl_weight=kl_weight, with_l1=with_l1, with_kl=with_kl,
                                                   denom=denom, device=device)
    c_lk = None
    if lk:
        c_l1, c_kl = c_l1.clone(), c_kl.clone()
        c_lk = (lk_weight * w / _den(w, denom)).reshape(-1)[rows].float()
    return with_l1, with_kl, (c_ce, c_base, c_l1, c_kl, c_lk)


def _fused_chunk(chunk: int | None, w_out: torch.Tensor, target_hidden, lam, conf_logits,
                 distribution: bool = False) -> int:
    """:func:`fused_block_loss`'s rows per chunk (None: about 2M logits per chunk), after its option checks
    (``distribution``: a TV, KL or LK weight is set).

    Raises:
        ValueError: conf_logits, or a TV / KL / LK weight, without target_hidden; lam with a target or confidence
            logits; chunk < 1.
    """
    if distribution and target_hidden is None:
        raise ValueError("tv_weight / kl_weight / lk_weight need target_hidden (the target's distribution at each "
                         "prediction)")
    if chunk is None:
        chunk = max(16, (1 << 21) // max(1, w_out.shape[0]))
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if conf_logits is not None and target_hidden is None:
        raise ValueError("the confidence BCE needs target_hidden (its label is 1 - TV distance to p_t)")
    if lam is not None and (target_hidden is not None or conf_logits is not None):
        raise ValueError("lam (the Domino loss) takes no target distribution or confidence logits")
    return chunk


def _fused_coefficients(rows: torch.Tensor, w: torch.Tensor, w_ce: torch.Tensor, *, lam: float | None,
                        ce_weight: float, l1_weight: float, with_l1: bool, denom: float | None, device,
                        kl_weight: float = 0.0, with_kl: bool = False):
    """Per valid prediction (``rows``) the weights [N] of :func:`fused_block_loss`'s CE, base CE, L1 and KL terms:
    DSpark's ``ce_weight`` / ``l1_weight`` / ``kl_weight`` (``lam`` None; L1 only ``with_l1``, KL only ``with_kl``)
    or Domino's ``1 - lam`` / ``lam``, times the decay weights ``w`` (valid) / ``w_ce`` (in-vocabulary) [A, P] over
    their normaliser (:func:`_den`)."""
    zero = torch.zeros(rows.numel(), dtype=torch.float32, device=device)
    if lam is None:
        c_ce = (ce_weight * w_ce / _den(w_ce, denom)).reshape(-1)[rows]
        c_l1 = (l1_weight * w / _den(w, denom)).reshape(-1)[rows] if with_l1 else zero
        c_kl = (kl_weight * w / _den(w, denom)).reshape(-1)[rows] if with_kl else zero
        return c_ce, zero, c_l1, c_kl
    wn = (w_ce / _den(w_ce, denom)).reshape(-1)[rows]
    return (1 - lam) * wn, lam * wn, zero, zero


def _fused_rows(rows: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, factors, target_hidden, target_lse):
    """The valid predictions ``rows`` (flat indices into [A * P]) of :func:`fused_block_loss`'s inputs: hidden
    [N, D], the factors (A [N, R], W) or (None, None), target hidden [N, D] or None, target log-sum-exp [N] fp32 (only
    with a target hidden) or None, labels [N]."""
    a_n, p = labels.shape
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)[rows]
    a = wh = None
    if factors is not None:
        a = factors[0].reshape(a_n * p, -1)[rows]
        wh = factors[1]
    t_h = None if target_hidden is None else target_hidden.reshape(-1, d)[rows]
    t_lse = None if target_lse is None or target_hidden is None else target_lse.reshape(-1)[rows].float()
    return h, a, wh, t_h, t_lse, labels.reshape(-1)[rows]


def _scatter(v: torch.Tensor, rows: torch.Tensor, shape: torch.Size, device, dtype=torch.float32) -> torch.Tensor:
    """Per-row values ``v`` [N] back on the [A, P] grid ``shape``, in ``dtype`` on ``device`` (0 / False at the rows
    not computed)."""
    out = torch.zeros(shape[0] * shape[1], dtype=dtype, device=device)
    out[rows] = v
    return out.view(shape[0], shape[1])

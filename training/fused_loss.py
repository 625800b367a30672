"""The training loss without materialised logits: :func:`fused_block_loss` forms the logits, the loss terms of
:mod:`dartree.training.losses` and their gradient a chunk of rows at a time (the gradient in the forward, scaled by the
upstream gradient in the backward), so the [N, P, V'] logits of a step never exist at once; equal to
:func:`~dartree.training.losses.dspark_loss` / :func:`~dartree.training.losses.domino_loss` on the materialised logits
(tested, values and gradients).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from dartree.training.losses import LossOut, decay_weights, lk_lambdas, normaliser


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
    ``w_out.dtype`` (bf16 rows round their products as autocast does), everything else in fp32. Equals the
    materialised ``dspark_loss`` / ``domino_loss`` (loss, pieces, hits and gradients; test).

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
        lk_weight, lk_lambda, lk_eta: the LK loss as ``dspark_loss`` (needs target_hidden; lambda per prediction
            from its own TV when adaptive).
    Returns:
        LossOut as ``dspark_loss`` (``lam`` None) or ``domino_loss``.
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
    ce_term = (w_ce * nll).sum() / normaliser(w_ce, denom)
    cnt = valid.float().sum(0)
    acc = hit.float().sum(0) / cnt.clamp_min(1)
    if lam is not None:
        base_ce = (w_ce * _scatter(base_r, *grid)).sum() / normaliser(w_ce, denom)
        return LossOut(loss, ce_term.detach(), torch.zeros((), device=device), acc, cnt,
                       base_ce=base_ce.detach(), hit=hit)
    wsum = normaliser(w, denom)
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
        c_lk = (lk_weight * w / normaliser(w, denom)).reshape(-1)[rows].float()
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
    their normaliser (:func:`normaliser`)."""
    zero = torch.zeros(rows.numel(), dtype=torch.float32, device=device)
    if lam is None:
        c_ce = (ce_weight * w_ce / normaliser(w_ce, denom)).reshape(-1)[rows]
        c_l1 = (l1_weight * w / normaliser(w, denom)).reshape(-1)[rows] if with_l1 else zero
        c_kl = (kl_weight * w / normaliser(w, denom)).reshape(-1)[rows] if with_kl else zero
        return c_ce, zero, c_l1, c_kl
    wn = (w_ce / normaliser(w_ce, denom)).reshape(-1)[rows]
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

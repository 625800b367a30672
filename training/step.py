"""One training step's arithmetic: anchors and labels of a sequence, its forward under the recipe's loss, and the
held-out evaluation.

A training sequence gets random anchors (DFlash, Chen et al. 2025, Sec. 3: blocks of ``block_size`` tokens whose
first token is the anchor, the rest mask tokens, attending to the target's context features and to their own block);
proposal j of an anchor predicts the token j + 1 after it. The loss is the drafter family's :class:`Objective`
(:mod:`dartree.models.families`): DFlash's decay-weighted CE, Domino's curriculum CE over base and corrected scores,
DFlash 2's selector CE, or DSpark's 0.1 CE + 0.9 L1 to the target distribution (DSpark, Sec. 3.3; ``loss.tv_weight``
/ ``loss.kl_weight`` add the total variation and KL(p_t || p_d)), fused with the lm_head
(:mod:`dartree.training.losses`).

The functions here take a :class:`StepSettings` (the objective and the few step options), which
:func:`dartree.training.settings.step_settings` builds once from the recipe; none of them reads the recipe.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dartree.models.drafter import BlockAttention, DFlashDrafter
from dartree.models.families import Objective
from dartree.models.target import Target
from dartree.training.data import BlockData, sample_anchors
from dartree.training.fused_loss import fused_block_loss
from dartree.training.losses import LossOut, domino_loss, dspark_loss, label_mask, teacher_forced_tau, weight_sum


@dataclass(frozen=True)
class StepSettings:
    """What a training step reads besides the models and the data, built once from the recipe
    (:func:`dartree.training.settings.step_settings`).

    Attributes:
        objective: the drafter family's loss (:class:`~dartree.models.families.Objective`).
        num_anchors: anchors drawn per sequence (``train.num_anchors``).
        cumulative_mask: DSpark's in-block cumulative label mask (``loss.cumulative_mask``;
            :func:`~dartree.training.losses.label_mask`).
        bf16: bf16 autocast of the drafter (``train.bf16``).
        fused_loss: the chunked fused loss (``train.fused_loss``); False: the materialised reference.
    """

    objective: Objective
    num_anchors: int
    cumulative_mask: bool = True
    bf16: bool = False
    fused_loss: bool = True


def seed_mix(*parts: int) -> int:
    """A 63-bit seed mixed from integers (the anchor RNG of one sequence at one step; rank- and resume-free)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class TrainModule(torch.nn.Module):
    """The trainable drafter backbone and correction head as one module (what the DeepSpeed engine wraps).

    ``forward(target, data, i, settings, gen, lam, denom, progress)`` is :func:`sequence_loss` for training sequence i,
    returned
    as a tuple of tensors (loss, ce, l1, bce, acc_per_pos, count_per_pos, kl), or None: ZeRO-3's backward hooks find
    their tensors only in plain containers.
    """

    def __init__(self, drafter: DFlashDrafter, head):
        super().__init__()
        self.drafter, self.head = drafter, head

    def forward(self, target: Target, data: BlockData, i: int, settings: StepSettings, gen: torch.Generator,
                lam: float | None = None, denom: float | None = None, progress: tuple[int, int] | None = None):
        out = sequence_loss(self.drafter, self.head, target, data, i, settings, gen, lam, denom, progress)
        if out is None:
            return None
        return out.loss, out.ce, out.l1, out.bce, out.acc_per_pos, out.count_per_pos, out.kl


def needs_target_lse(settings: StepSettings, draft_vocab_size: int) -> bool:
    """Whether a step needs the target's full-vocabulary log-sum-exp at each prediction: with a draft vocabulary
    (``draft_vocab_size`` > 0), for the L1 / total variation or the confidence label (p_t's mass outside the draft
    vocabulary); the KL alone is over the draft columns and needs none (:mod:`dartree.training.losses`). The
    reference path (``fused_loss`` False) forms p_t from it whenever a target distribution is used."""
    if not draft_vocab_size:
        return False
    l1, kl, conf = settings.objective.distribution_weights()
    return bool(l1 or conf or (kl and not settings.fused_loss))


def output_rows(target: Target, vocab: torch.Tensor | None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen lm_head rows the drafter is trained on ([V, D] or the draft vocabulary's [N, D]), in ``dtype``
    (default: the target's), and the map token id -> draft-vocabulary index ([V] int64, -1 outside; None without a
    vocabulary), both on the target's device, computed once per (target, vocabulary, dtype) and reused. ``vocab``
    ([N] int64, the drafter's ``draft_vocab`` buffer) must be on that device too."""
    w = target.lm_head.weight
    dtype = w.dtype if dtype is None else dtype
    key = (w.data_ptr(), w._version, tuple(w.shape), dtype, None if vocab is None else vocab.data_ptr(),
           None if vocab is None else vocab._version)
    cache = target.__dict__.setdefault("_draft_rows", {})
    hit = cache.get(key)
    # the entry holds the vocabulary tensor itself: while cached its address cannot be reused by another tensor, and
    # an in-place change bumps its version, so (address, version, identity) decide without reading its values
    # (a comparison of values would wait for the device at every sequence)
    if hit is None or (vocab is not None and hit[2] is not vocab):
        if vocab is None:
            hit = (w.detach().to(dtype), None, None)
        else:
            inv = torch.full((target.vocab_size,), -1, dtype=torch.long, device=w.device)
            inv[vocab] = torch.arange(vocab.numel(), device=w.device)
            hit = (w.detach()[vocab].to(dtype).contiguous(), inv, vocab)
        if len(cache) > 4:
            cache.clear()
        cache[key] = hit
    return hit[0], hit[1]


def block_targets(tokens: torch.Tensor, prompt_len: int, loss_mask: torch.Tensor | None, settings: StepSettings,
                  num_proposals: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Anchors and label positions of one training sequence, and which predictions carry a loss, on the CPU (where
    the tokens, the loss mask and the anchor RNG are; :func:`sequence_loss` copies them to the training device).

    Args:
        tokens: [T] int64. prompt_len: tokens before the first response token. loss_mask: [T] bool (True on the
            target's own tokens) or None (everything after the prompt). num_proposals: P. gen: the sequence's
            anchor RNG, a CPU generator (seeded per (seed, step, sequence): the same draw wherever it is made, on
            every device).
    Returns:
        (anchors [A] int64, label positions [A, P] int64 = anchor + 1 + j, valid [A, P] bool): in range and,
        with a loss mask, supervised (``settings.cumulative_mask``: DSpark's in-block cumulative rule,
        :func:`~dartree.training.losses.label_mask`).
    """
    s = tokens.numel()
    anchors = sample_anchors(prompt_len, s, settings.num_anchors, gen, loss_mask=loss_mask)
    lp = anchors[:, None] + 1 + torch.arange(num_proposals)
    valid = label_mask(lp, s, loss_mask, cumulative=settings.cumulative_mask)
    return anchors, lp, valid


def sequence_weight(data: BlockData, i: int, settings: StepSettings, num_proposals: int,
                    gen: torch.Generator) -> float:
    """Sequence i's share of the batch denominator (``loss.normalization=batch``): the decay weights summed over
    its valid predictions at the anchors ``gen`` draws (:func:`block_targets`,
    :func:`~dartree.training.losses.weight_sum`); no forward pass. Give it a generator seeded as the one
    :func:`sequence_loss` gets for the same sequence and step."""
    _, _, valid = block_targets(data.tokens[i], data.prompt_len[i], data.mask_of(i), settings, num_proposals, gen)
    return weight_sum(valid, settings.objective.gamma)


def _autocast(dev: torch.device, bf16: bool):
    """bf16 autocast on ``dev``'s device type (``train.bf16``), or no context at all in fp32 (so a step also runs on
    a device type autocast does not know, such as ``meta``, which the device tests use)."""
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@dataclass
class StepBlocks:
    """One training sequence's step tensors, every one on the training device (the target's): what
    :func:`sequence_loss` feeds the drafter and the loss. A anchors, L block size, P proposals, T tokens.

    Attributes:
        x: [1, A*L, D] fp32 block embeddings (block n = [t[a_n], MASK x (L-1)]). q_pos: [1, A*L] int64 positions
            a_n + arange(L). feats: [1, T, nL*D] context features (bf16 under ``train.bf16``, else fp32).
        mask: the :class:`~dartree.models.drafter.BlockAttention` of the anchors (its bias on the device).
        final: [T, D] the target's final normed states. lp: [A, P] int64 label positions a_n + 1 + j.
        labels: [A, P] int64 label ids (draft-vocabulary indices with a vocabulary, -1 outside it).
        prev: [A, P] int64 the head's previous tokens t[a_n + j]. valid: [A, P] bool predictions with a loss.
        rows: [N] int64 flat indices of ``valid``'s True entries (found on the host).
        w_out: [V or N, D] the frozen output rows (:func:`output_rows`). vocab: [N] draft vocabulary or None.
    """

    x: torch.Tensor
    q_pos: torch.Tensor
    feats: torch.Tensor
    mask: BlockAttention
    final: torch.Tensor
    lp: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    w_out: torch.Tensor
    vocab: torch.Tensor | None


def step_blocks(drafter, target: Target, data: BlockData, i: int, settings: StepSettings,
                gen: torch.Generator) -> StepBlocks | None:
    """The step tensors of training sequence i (:class:`StepBlocks`) on the target's device, or None when it has no
    anchor. The anchors, label positions and valid mask are drawn on the host (:func:`block_targets`, the CPU
    generator ``gen``), so every device sees the same anchors, and copied once, asynchronously; features read
    from a file travel with them (online features are on the device already). Nothing here waits for the device.
    """
    tokens, feats, final, plen = data.sequence(i)
    dev = target.device  # the training device: the drafter, the target and every step tensor live there
    s = tokens.numel()
    dc = drafter.cfg
    L = dc.block_size
    mask = data.mask_of(i) if hasattr(data, "mask_of") else None
    anchors, lp, valid = block_targets(tokens, plen, mask, settings, dc.num_proposals, gen)
    a = anchors.numel()
    if a == 0:
        return None
    # the rows that carry a loss, found on the host (a nonzero() on the device would wait for its queue)
    rows = valid.reshape(-1).nonzero()[:, 0]
    # one asynchronous copy each (pageable host memory is staged; the host does not wait for the device); no-ops
    # for what is on the device already, and on the CPU
    tokens, feats, final, anchors, lp, valid, rows = (
        t.to(dev, non_blocking=True) for t in (tokens, feats, final, anchors, lp, valid, rows))
    block = torch.full((a, L), dc.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = tokens[anchors]
    q_pos = (anchors[:, None] + torch.arange(L, device=dev)).reshape(1, -1)
    x = target.embed(block.reshape(1, -1)).to(torch.float32)  # raw lookup, as z-lab embeds the block
    bf16 = settings.bf16
    vocab = drafter.draft_vocab if dc.draft_vocab_size else None
    # [V or N, D] frozen rows (bf16 once, not per call, for the fused loss); token id -> draft index (-1 outside)
    w_out, inv = output_rows(target, vocab, torch.bfloat16 if settings.fused_loss and bf16 else None)
    labels = tokens[lp.clamp(max=s - 1)]
    if vocab is not None:  # label index within the draft vocabulary, -1 outside it (a sure miss)
        labels = inv[labels]
    return StepBlocks(x=x, q_pos=q_pos, feats=feats[None] if bf16 and feats.dtype == torch.bfloat16
                      else feats[None].float(), mask=BlockAttention.from_anchors(anchors, s, L), final=final,
                      lp=lp, labels=labels, prev=tokens[(lp - 1).clamp(max=s - 1)], valid=valid, rows=rows,
                      w_out=w_out, vocab=vocab)


def sequence_loss(drafter, head, target: Target, data: BlockData, i: int, settings: StepSettings,
                  gen: torch.Generator, lam: float | None = None, denom: float | None = None,
                  progress: tuple[int, int] | None = None):
    """Forward one training sequence with random anchors under the family's objective (``settings.objective``);
    returns :class:`~dartree.training.losses.LossOut` or None when it has no anchor.

    Block n = [t[a_n], MASK x (L-1)] at positions a_n + arange(L); proposal j (at block position
    proposal_offset + j) predicts t[a_n + 1 + j]; the head's previous token for proposal j is t[a_n + j]
    (:func:`step_blocks`, on the target's device). Predictions whose label is past the end or (with the data's loss
    mask) not a target-written token carry no loss (:func:`block_targets`). ``denom``: None normalises the loss by
    this sequence's weight sum; else by this shared batch denominator (``loss.normalization=batch``: the step's
    weight sum over all processes divided by ``train.seqs_per_step``, so that after DeepSpeed's averaging the
    step's gradient is that of sum(weighted terms) / sum(weights), SpecForge's pooled loss).
    ``lam`` is the base-CE weight of a curriculum objective at this step (Domino's lambda,
    :meth:`~dartree.models.families.Objective.lam`; None: 0, its held-out value); an objective with a fixed base
    weight (DFlash 2) or without a base term ignores it. ``progress`` (optimiser step, planned steps) reaches an
    objective that computes its own loss (``Objective.block_loss``), whose schedules read it; None: held-out.
    """
    b = step_blocks(drafter, target, data, i, settings, gen)
    if b is None:
        return None
    obj = settings.objective
    if obj.block_loss is not None:  # a family whose loss is its own, not made of the shared terms
        with _autocast(target.device, settings.bf16):
            out = obj.block_loss(drafter, head, b, gen=gen, progress=progress, denom=denom)
        cnt = b.valid.float().sum(0)
        return LossOut(out["loss"], out["ce"], out["l1"], out["hit"].float().sum(0) / cnt.clamp_min(1), cnt,
                       hit=out["hit"])
    if obj.curriculum is None or lam is None:
        lam = obj.lam()
    conf_head = bool(getattr(head, "confidence_head", False))
    # the target's distribution: for the L1 / TV / KL terms and the confidence label (objectives without a base CE)
    with_target = lam is None and bool(obj.l1_coef or obj.kl_weight or obj.lk_weight or conf_head)
    hidden, factors, conf = _draft_forward(drafter, head, target.device, b, settings,
                                           with_conf=lam is None and obj.corrected and conf_head)
    s = b.final.shape[0]
    t_hidden = b.final[(b.lp - 1).clamp(max=s - 1)] if with_target else None
    # the full-vocabulary lse: for p_t's mass outside a draft vocabulary (the L1 / TV / confidence label; the fused
    # KL needs only the draft columns)
    with_lse = with_target and b.vocab is not None and bool(obj.l1_coef or obj.lk_weight or conf_head
                                                            or not settings.fused_loss)
    t_lse = data.lse_of(i).to(target.device, non_blocking=True)[(b.lp - 1).clamp(max=s - 1)] if with_lse else None
    if settings.fused_loss:
        return _fused_loss(b, obj, hidden, factors, conf, t_hidden, t_lse, lam, denom)
    # the reference path: materialised [A, P, V'] logits through autograd (train.fused_loss=false)
    return _reference_loss(b, obj, hidden, factors, conf, t_hidden, t_lse, lam, denom, bf16=settings.bf16)


def _draft_forward(drafter, head, dev: torch.device, b: StepBlocks, settings: StepSettings, with_conf: bool):
    """The drafter's forward over the blocks ``b`` under ``settings.bf16`` autocast on ``dev``: hidden [A, P, D],
    the head's teacher-forced factors (A [A, P, R], W [V', R]) or None (an uncorrected objective, or the identity
    head), and the confidence logits [A, P] fp32 (``with_conf``) or None."""
    s = b.final.shape[0]
    a, p = b.valid.shape
    with _autocast(dev, settings.bf16):
        hidden = drafter(b.x, b.q_pos, b.feats, torch.arange(s, device=dev)[None], mask=b.mask)
        hidden = hidden.view(a, drafter.cfg.block_size, -1)[:, drafter.cfg.proposal_offset:]  # [A, P, D]
        factors = head.block_factors(b.prev, hidden, b.vocab) if settings.objective.corrected else None
        conf = None
        if with_conf:
            states = head.block_states(b.prev, hidden.float())
            d = hidden.shape[-1]
            conf = head.confidence_logits(hidden.float().reshape(-1, d), states.reshape(a * p, -1)).view(a, p)
    return hidden, factors, conf


def _fused_loss(b: StepBlocks, obj: Objective, hidden, factors, conf, t_hidden, t_lse, lam, denom):
    """:func:`~dartree.training.fused_loss.fused_block_loss` under ``obj``: the base-CE form with ``lam`` (not None),
    the CE of U (an uncorrected objective), or the distribution-matching form."""
    if lam is not None:
        return fused_block_loss(hidden, b.w_out, b.labels, b.valid, gamma=obj.gamma, factors=factors, lam=lam,
                                denom=denom, rows=b.rows)
    if not obj.corrected:
        return fused_block_loss(hidden, b.w_out, b.labels, b.valid, gamma=obj.gamma, ce_weight=obj.ce_weight,
                                denom=denom, rows=b.rows)
    return fused_block_loss(hidden, b.w_out, b.labels, b.valid, gamma=obj.gamma, factors=factors,
                            target_hidden=t_hidden, target_lse=t_lse, ce_weight=obj.ce_weight,
                            l1_weight=obj.l1_weight, conf_logits=conf,
                            conf_weight=obj.conf_weight if conf is not None else 0.0, denom=denom, rows=b.rows,
                            tv_weight=obj.tv_weight, kl_weight=obj.kl_weight, lk_weight=obj.lk_weight,
                            lk_lambda=obj.lk_lambda, lk_eta=obj.lk_eta)


def _reference_loss(b: StepBlocks, obj: Objective, hidden, factors, conf, t_hidden, t_lse, lam, denom, *, bf16):
    """The materialised twin of :func:`_fused_loss`: :func:`~dartree.training.losses.dspark_loss` /
    :func:`~dartree.training.losses.domino_loss` on the [A, P, V'] logits, under bf16 autocast when ``bf16``."""
    labels, valid, w_out = b.labels, b.valid, b.w_out
    with _autocast(hidden.device, bf16):
        base = F.linear(hidden, w_out)  # [A, P, V] (or [A, P, N] on a draft vocabulary)
        if lam is None and not obj.corrected:
            return dspark_loss(base, labels, valid, None, gamma=obj.gamma, ce_weight=obj.ce_weight, l1_weight=0.0,
                               denom=denom)
        logits = base.float() if factors is None else base.float() + F.linear(factors[0], factors[1])
        if lam is not None:
            return domino_loss(logits, base, labels, valid, gamma=obj.gamma, lam=lam, denom=denom)
        t_logits = t_probs = None
        if t_hidden is not None:
            with torch.no_grad():
                z = F.linear(t_hidden.to(w_out.dtype), w_out).float()
                if b.vocab is None:
                    t_logits = z
                else:  # p_t on the draft vocabulary from the cached full-vocabulary log-sum-exp
                    p_sub = torch.exp(z - t_lse[..., None])
                    t_probs = (p_sub, (1 - p_sub.sum(-1)).clamp(min=0))
    return dspark_loss(logits, labels, valid, t_logits, gamma=obj.gamma, ce_weight=obj.ce_weight,
                       l1_weight=obj.l1_weight, conf_logits=conf,
                       conf_weight=obj.conf_weight if conf is not None else 0.0, target_probs=t_probs, denom=denom,
                       tv_weight=obj.tv_weight, kl_weight=obj.kl_weight, lk_weight=obj.lk_weight,
                       lk_lambda=obj.lk_lambda, lk_eta=obj.lk_eta)


@torch.no_grad()
def evaluate_holdout(drafter, head, target, data: BlockData, settings: StepSettings) -> dict:
    """Teacher-forced accuracy per block position on the held-out sequences ([P] fractions), the chain tau
    those imply (``holdout_tf_tau``, positions treated as independent) and the measured chain acceptance
    ``holdout_chain_tau``: the mean over held-out anchors of 1 + the number of leading correct proposals
    (bonus included). The responses are the target's greedy output, so at T=0 a chain decoder drafting at
    those anchors accepts exactly that run (for every head: while the run lasts, its drafted previous tokens
    are the true ones)."""
    if not data.holdout_ids:
        return {}
    hits, cnts, runs = None, None, []
    for i in data.holdout_ids:
        out = sequence_loss(drafter, head, target, data, i, settings,
                            torch.Generator().manual_seed(seed_mix(1234, i)))
        if out is None:
            continue
        h = out.acc_per_pos * out.count_per_pos
        hits = h if hits is None else hits + h
        cnts = out.count_per_pos if cnts is None else cnts + out.count_per_pos
        runs.append(1 + torch.cumprod(out.hit.long(), dim=1).sum(1))
    if hits is None:
        return {}
    acc = hits / cnts.clamp_min(1)
    return {"holdout_acc_per_pos": [round(float(x), 4) for x in acc], "holdout_tf_tau": teacher_forced_tau(acc),
            "holdout_chain_tau": float(torch.cat(runs).float().mean())}

"""Train a DFlash drafter with a correction head: ``python training/train.py recipe=NAME [key=value ...]``.

Stages: load the target -> regenerate responses (cached) -> cache target features -> train with random
anchors per sequence and the block attention mask (ANCHORS.md section 2) under the DSpark loss
(0.1 CE + 0.9 L1 to the target distribution, decay-weighted; DSpark section 3.3) -> save a training
checkpoint (``<output_dir>/checkpoint``: config.json + model.safetensors, written atomically) that
``python convert/to_dartree.py`` turns into the dartree format.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dartree.decode.report import plot_curve_file
from dartree.models.checkpoint import cast_floats, write_folder_atomically
from dartree.models.drafter import BlockAttention, DFlashDrafter, DrafterConfig, build_target_layer_ids
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.heads import build_head
from dartree.models.target import Target, load_target
from dartree.training.data import (
    BlockData,
    DataSpec,
    build_dialogue_data,
    compute_features,
    random_prompts,
    regenerate_responses,
    sample_anchors,
    select_draft_vocab,
    target_lse,
)
from dartree.training.losses import (
    domino_loss,
    dspark_loss,
    fused_block_loss,
    label_mask,
    lambda_schedule,
    teacher_forced_tau,
    weight_sum,
)
from dartree.training.checks import template_kwargs
from dartree.training.recipe import RecipeError, load_recipe

TRAIN_FORMAT = "dartree-train"
# loss.type dflash2: weight of the base (unary) CE beside the selector-corrected CE, (1 - w) CE(U + A W^T) + w CE(U);
# 0.5 weights them equally, as speculators' DFlash 2 trainer does (selector_loss_alpha 1.0 beside the unary loss).
DFLASH2_BASE_WEIGHT = 0.5
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise RecipeError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_recipe_target(path: str, dtype: torch.dtype) -> Target:
    """:func:`~dartree.models.target.load_target` for a recipe's ``target.path``.

    Raises:
        RecipeError: the target cannot be loaded (missing folder, no config.json, a missing package), named.
    """
    try:
        return load_target(path, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"target.path={path!r} cannot be loaded: {reason}") from None


def build_models(cfg: DictConfig, target: Target):
    """Create the drafter backbone and head for ``target`` from the recipe; returns (drafter, head).

    Raises:
        RecipeError: invalid layer ids, head type or sizes (message names the key).
    """
    d = cfg.drafter
    n_t = target.num_layers
    layer_ids = list(d.target_layer_ids) or build_target_layer_ids(n_t, d.num_target_features)
    tcfg = target.config
    mask_id = d.mask_token_id
    if mask_id is None:
        tok = target.tokenizer
        mask_id = tok.unk_token_id if tok is not None and tok.unk_token_id is not None else 0
    dcfg = DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=d.intermediate_size or tcfg.intermediate_size,
        num_layers=d.num_layers,
        num_heads=tcfg.num_attention_heads,
        num_kv_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
        head_dim=getattr(tcfg, "head_dim", None) or target.hidden_size // tcfg.num_attention_heads,
        target_layer_ids=layer_ids,
        mask_token_id=int(mask_id),
        block_size=d.block_size,
        proposal_offset=d.proposal_offset,
        qk_norm=d.qk_norm,
        rms_norm_eps=float(tcfg.rms_norm_eps),
        rope_theta=float(_rope_theta(tcfg)),
        draft_vocab_size=int(d.draft_vocab_size),
        conv_kernel_size=int(d.conv_kernel_size),
        conv_group_size=int(d.conv_group_size),
    )
    try:
        drafter = DFlashDrafter(dcfg)
        if d.init_from_target:
            drafter.init_from_target_layers(target.model, list(range(n_t - d.num_layers, n_t)))
        head = build_head(cfg.head.type, **_head_params(cfg.head, target))
        head.bind_embeddings(target.embed_tokens.weight)  # the gru head reads the target's token embeddings
    except (ValueError, KeyError) as exc:
        raise RecipeError(f"cannot build the drafter from the recipe: {exc}") from None
    return drafter, head


def _head_params(h: DictConfig, target: Target) -> dict:
    """Constructor arguments of the recipe's head type: ``markov`` / ``gated_markov`` / ``rnn`` take ``rank``
    (and optional ``confidence_head``, ``confidence_with_markov``); ``gru`` takes ``emb_dim`` (default: ``rank``),
    ``gru_hidden_dim`` (default 4 x emb_dim) and ``prefix_len`` (default 1, Domino's pure_draft_prefix_len).
    Keys the recipe schema does not hold yet fall back to these defaults."""
    params = {"vocab_size": target.vocab_size}
    if h.type in ("markov", "gated_markov", "rnn"):
        params["rank"] = h.rank
        if h.type != "markov" or h.get("confidence_head", False):
            params["hidden_size"] = target.hidden_size
        if h.get("confidence_head", False):
            params.update(confidence_head=True, confidence_with_markov=bool(h.get("confidence_with_markov", True)))
    elif h.type == "selector":
        params.update(rank=h.rank, hidden_size=target.hidden_size, top_k=int(h.get("top_k", 16)))
    elif h.type == "gru":
        emb = int(h.get("emb_dim", None) or h.rank)
        params.update(hidden_size=target.hidden_size, emb_dim=emb,
                      gru_hidden_dim=int(h.get("gru_hidden_dim", None) or 4 * emb),
                      prefix_len=int(h.get("prefix_len", 1)))
    return params


def _rope_theta(tcfg) -> float:
    rp = getattr(tcfg, "rope_parameters", None) or {}
    return rp.get("rope_theta") or getattr(tcfg, "rope_theta", None) or 10000.0


def prepare_data(cfg: DictConfig, target: Target) -> BlockData:
    """Regenerate responses (cached) and cache features for ``target``'s layer ids; return BlockData.

    Single-turn data with the tail held-out set (``data.max_turns=1``, ``data.holdout_set=tail``, the shipped
    recipes) is :func:`~dartree.training.data.regenerate_responses` (unchanged cache folders); multi-turn data or
    a fixed held-out set is :func:`~dartree.training.data.build_dialogue_data`.

    Raises:
        RecipeError: an unknown ``data.source``, or a data problem (too few usable prompts), named.
    """
    d = cfg.data
    spec = DataSpec(
        num_prompts=d.num_prompts,
        max_prompt_tokens=d.max_prompt_tokens,
        max_new_tokens=d.max_new_tokens,
        seed=d.seed,
        batch_size=d.gen_batch_size,
        code_fraction=d.code_fraction,
        max_turns=int(d.get("max_turns", 1)),
        max_seq_tokens=int(d.get("max_seq_tokens", 2048)),
        chat_template_kwargs=template_kwargs(cfg),
    )
    holdout_set = d.get("holdout_set", "tail")
    if d.source == "campaign":  # committed campaign shards, features recomputed online (no feature store)
        from dartree.training.campaign import DEFAULT_DIR, CampaignError
        from dartree.training.campaign_data import CampaignData, campaign_rows

        try:
            train_rows, hold_rows = campaign_rows(Path(d.campaign_dir or DEFAULT_DIR), int(d.campaign_shards) or None)
        except CampaignError as exc:
            raise RecipeError(f"data.source=campaign: {exc}") from None
        data = CampaignData(target, train_rows, hold_rows)
        data.need_lse = bool(cfg.drafter.draft_vocab_size)
        return data
    if d.source not in ("sharegpt", "random"):
        raise RecipeError(f"data.source {d.source!r} is not 'sharegpt', 'random' or 'campaign'")
    gen_dtype = _dtype(cfg.target.gen_dtype)
    gen_target = target if gen_dtype == target.dtype else load_recipe_target(cfg.target.path, gen_dtype)
    # every stage stops where the target's own generate stops (dartree.models.generation.stop_ids)
    try:
        if spec.max_turns > 1 or holdout_set != "tail":
            responses = build_dialogue_data(gen_target, spec, source=d.source, holdout=d.holdout,
                                            holdout_set=holdout_set, holdout_turns=int(d.get("holdout_turns", 0)),
                                            random_prompt_len=d.random_prompt_len)
        elif cfg.data.source == "sharegpt":
            responses = regenerate_responses(gen_target, spec)
        else:
            prompts = random_prompts(spec.num_prompts, cfg.data.random_prompt_len, target.vocab_size, spec.seed)
            responses = regenerate_responses(gen_target, spec, prompts=prompts)
    except ValueError as exc:
        raise RecipeError(f"data: {exc}") from None
    del gen_target
    feats = compute_features(target, responses)
    return BlockData(responses, feats, holdout=d.holdout)


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (the anchor RNG of one sequence at one step; rank- and resume-free)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class TrainModule(torch.nn.Module):
    """The trainable drafter backbone and correction head as one module (what the DeepSpeed engine wraps).

    ``forward(target, data, i, cfg, gen, lam, denom)`` is :func:`sequence_loss` for training sequence i, returned
    as a tuple of tensors (loss, ce, l1, bce, acc_per_pos, count_per_pos), or None: ZeRO-3's backward hooks find
    their tensors only in plain containers.
    """

    def __init__(self, drafter: DFlashDrafter, head):
        super().__init__()
        self.drafter, self.head = drafter, head

    def forward(self, target: Target, data: BlockData, i: int, cfg: DictConfig, gen: torch.Generator, lam: float = 0.0,
                denom: float | None = None):
        out = sequence_loss(self.drafter, self.head, target, data, i, cfg, gen, lam, denom)
        if out is None:
            return None
        return out.loss, out.ce, out.l1, out.bce, out.acc_per_pos, out.count_per_pos


def _write_json(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def _output_rows(target: Target, vocab: torch.Tensor | None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen lm_head rows the drafter is trained on ([V, D] or the draft vocabulary's [N, D]), in ``dtype``
    (default: the target's), and the map token id -> draft-vocabulary index (-1 outside; None without a
    vocabulary), computed once per (target, vocabulary, dtype) and reused."""
    w = target.lm_head.weight
    dtype = w.dtype if dtype is None else dtype
    key = (w.data_ptr(), w._version, tuple(w.shape), dtype, None if vocab is None else vocab.data_ptr(),
           None if vocab is None else vocab._version)
    cache = target.__dict__.setdefault("_draft_rows", {})
    hit = cache.get(key)
    if hit is None or (vocab is not None and not torch.equal(hit[2], vocab)):
        if vocab is None:
            hit = (w.detach().to(dtype), None, None)
        else:
            inv = torch.full((target.vocab_size,), -1, dtype=torch.long)
            inv[vocab] = torch.arange(vocab.numel())
            hit = (w.detach()[vocab].to(dtype).contiguous(), inv, vocab.clone())
        if len(cache) > 4:
            cache.clear()
        cache[key] = hit
    return hit[0], hit[1]


def block_targets(tokens: torch.Tensor, prompt_len: int, loss_mask: torch.Tensor | None, cfg: DictConfig,
                  num_proposals: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Anchors and label positions of one training sequence, and which predictions carry a loss.

    Args:
        tokens: [T] int64. prompt_len: tokens before the first response token. loss_mask: [T] bool (True on the
            target's own tokens) or None (everything after the prompt). num_proposals: P. gen: the sequence's
            anchor RNG (seeded per (seed, step, sequence): the same draw wherever it is made).
    Returns:
        (anchors [A] int64, label positions [A, P] int64 = anchor + 1 + j, valid [A, P] bool): in range and,
        with a loss mask, supervised (``loss.cumulative_mask``: DSpark's in-block cumulative rule,
        :func:`~dartree.training.losses.label_mask`).
    """
    s = tokens.numel()
    anchors = sample_anchors(prompt_len, s, cfg.train.num_anchors, gen, loss_mask=loss_mask)
    lp = anchors[:, None] + 1 + torch.arange(num_proposals)
    valid = label_mask(lp, s, loss_mask, cumulative=bool(cfg.loss.get("cumulative_mask", True)))
    return anchors, lp, valid


def sequence_weight(data: BlockData, i: int, cfg: DictConfig, num_proposals: int, gen: torch.Generator) -> float:
    """Sequence i's share of the batch denominator (``loss.normalization=batch``): the decay weights summed over
    its valid predictions at the anchors ``gen`` draws (:func:`block_targets`,
    :func:`~dartree.training.losses.weight_sum`); no forward pass. Give it a generator seeded as the one
    :func:`sequence_loss` gets for the same sequence and step."""
    _, _, valid = block_targets(data.tokens[i], data.prompt_len[i], data.mask_of(i), cfg, num_proposals, gen)
    return weight_sum(valid, cfg.loss.gamma)


def sequence_loss(drafter, head, target: Target, data: BlockData, i: int, cfg: DictConfig, gen: torch.Generator,
                  lam: float = 0.0, denom: float | None = None):
    """Forward one training sequence with random anchors under the recipe's loss; returns LossOut or None
    when it has no anchor.

    Block n = [t[a_n], MASK x (L-1)] at positions a_n + arange(L); proposal j (at block position
    proposal_offset + j) predicts t[a_n + 1 + j]; the head's previous token for proposal j is t[a_n + j].
    Predictions whose label is past the end or (with the data's loss mask) not a target-written token carry no
    loss (:func:`block_targets`). ``denom``: None normalises the loss by this sequence's weight sum; else by this
    shared batch denominator (``loss.normalization=batch``: the step's weight sum over all processes divided by
    ``train.seqs_per_step``, so that after DeepSpeed's averaging the step's gradient is that of
    sum(weighted terms) / sum(weights), SpecForge's pooled loss).
    ``lam`` is Domino's curriculum weight on the base CE (loss.type domino); loss.type dflash2 uses the fixed
    :data:`DFLASH2_BASE_WEIGHT`.
    """
    tokens, feats, final, plen = data.sequence(i)
    s = tokens.numel()
    dc = drafter.cfg
    L, off, P = dc.block_size, dc.proposal_offset, dc.num_proposals
    mask = data.mask_of(i) if hasattr(data, "mask_of") else None
    anchors, lp, valid = block_targets(tokens, plen, mask, cfg, P, gen)
    a = anchors.numel()
    if a == 0:
        return None
    block = torch.full((a, L), dc.mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[anchors]
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    x = target.embed(block.reshape(1, -1)).to(torch.float32)  # raw lookup, as z-lab embeds the block
    mask = BlockAttention.from_anchors(anchors, s, L)  # = block_attention_mask, over each block's own keys
    lc = cfg.loss
    bf16 = bool(cfg.train.bf16)
    fused = bool(cfg.train.get("fused_loss", True))
    vocab = drafter.draft_vocab if dc.draft_vocab_size else None
    # [V or N, D] frozen rows (bf16 once, not per call, for the fused loss); token id -> draft index (-1 outside)
    w_out, inv = _output_rows(target, vocab, torch.bfloat16 if fused and bf16 else None)
    feats = feats[None] if bf16 and feats.dtype == torch.bfloat16 else feats[None].float()
    lpc = lp.clamp(max=s - 1)
    labels = tokens[lpc]
    prev = tokens[(lp - 1).clamp(max=s - 1)]
    if vocab is not None:  # label index within the draft vocabulary, -1 outside it (a sure miss)
        labels = inv[labels]
    with_target = lc.type == "dspark" and (lc.l1_weight or getattr(head, "confidence_head", False))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = drafter(x, q_pos, feats, torch.arange(s)[None], mask=mask)
        hidden = hidden.view(a, L, -1)[:, off:]  # [A, P, D]
        factors = None if lc.type == "dflash" else head.block_factors(prev, hidden, vocab)
        conf = None
        if lc.type == "dspark" and getattr(head, "confidence_head", False):
            states = head.block_states(prev, hidden.float())
            d = hidden.shape[-1]
            conf = head.confidence_logits(hidden.float().reshape(-1, d), states.reshape(a * P, -1)).view(a, P)
    t_hidden = final[(lp - 1).clamp(max=s - 1)] if with_target else None
    t_lse = data.lse_of(i)[(lp - 1).clamp(max=s - 1)] if with_target and vocab is not None else None
    if lc.type == "dflash2":  # base (unary) and selector-corrected CE weighted equally (speculators' alpha = 1)
        lam = DFLASH2_BASE_WEIGHT
    if fused:
        if lc.type in ("domino", "dflash2"):
            return fused_block_loss(hidden, w_out, labels, valid, gamma=lc.gamma, factors=factors, lam=lam,
                                    denom=denom)
        if lc.type == "dflash":
            return fused_block_loss(hidden, w_out, labels, valid, gamma=lc.gamma, denom=denom)
        return fused_block_loss(hidden, w_out, labels, valid, gamma=lc.gamma, factors=factors,
                                target_hidden=t_hidden, target_lse=t_lse, ce_weight=lc.ce_weight,
                                l1_weight=lc.l1_weight, conf_logits=conf,
                                conf_weight=lc.conf_weight if conf is not None else 0.0, denom=denom)
    # the reference path: materialised [A, P, V'] logits through autograd (train.fused_loss=false)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        base = F.linear(hidden, w_out)  # [A, P, V] (or [A, P, N] on a draft vocabulary)
        if lc.type == "dflash":
            return dspark_loss(base, labels, valid, None, gamma=lc.gamma, ce_weight=1.0, l1_weight=0.0, denom=denom)
        logits = base.float() if factors is None else base.float() + F.linear(factors[0], factors[1])
        if lc.type in ("domino", "dflash2"):
            return domino_loss(logits, base, labels, valid, gamma=lc.gamma, lam=lam, denom=denom)
        t_logits = t_probs = None
        if with_target:
            with torch.no_grad():
                z = F.linear(t_hidden.to(w_out.dtype), w_out).float()
                if vocab is None:
                    t_logits = z
                else:  # p_t on the draft vocabulary from the cached full-vocabulary log-sum-exp
                    p_sub = torch.exp(z - t_lse[..., None])
                    t_probs = (p_sub, (1 - p_sub.sum(-1)).clamp(min=0))
    return dspark_loss(logits, labels, valid, t_logits, gamma=lc.gamma, ce_weight=lc.ce_weight,
                       l1_weight=lc.l1_weight, conf_logits=conf, conf_weight=lc.conf_weight if conf is not None else 0.0,
                       target_probs=t_probs, denom=denom)


def save_training_checkpoint(folder: Path, drafter, head, target: Target, cfg: DictConfig, state: dict,
                             state_dicts: tuple[dict, dict] | None = None) -> None:
    """Write ``folder`` atomically: config.json (format ``dartree-train``, recipe, drafter/head/target config,
    trainer state) and model.safetensors (``drafter.*`` and ``head.*`` full tensors in fp32).

    ``state_dicts`` = (drafter, head) full state dicts when the modules' own hold partitions (ZeRO-3).
    """
    drafter_sd, head_sd = state_dicts if state_dicts is not None else (drafter.state_dict(), head.state_dict())
    tensors = {f"drafter.{k}": cast_floats(v.detach(), torch.float32).contiguous() for k, v in drafter_sd.items()}
    tensors.update({f"head.{k}": cast_floats(v.detach(), torch.float32).contiguous() for k, v in head_sd.items()})
    config = {
        "format": TRAIN_FORMAT,
        "drafter": drafter.cfg.to_dict(),
        "head": {"type": head.type_name, **head.hparams()},
        "target": target.identity(),
        "recipe": OmegaConf.to_container(cfg),
        "state": state,
    }
    write_folder_atomically(
        folder,
        {"config.json": json.dumps(config, indent=2).encode(), "model.safetensors": {"tensors": tensors}},
    )


@torch.no_grad()
def evaluate_holdout(drafter, head, target, data: BlockData, cfg: DictConfig) -> dict:
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
        out = sequence_loss(drafter, head, target, data, i, cfg, torch.Generator().manual_seed(_seed(1234, i)))
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


def _qk_norm_init(tensors: dict, prefix: str, dcfg) -> dict:
    """q/k norm weights that keep a checkpoint's attention scale when ``load_init`` adds Qwen3 q/k norms.

    Args:
        tensors: the checkpoint's tensors (``{prefix}layers.{i}.{q,k}_proj.weight`` [heads * head_dim, hidden] and
            ``input_layernorm.weight`` [hidden]). prefix: their name prefix. dcfg: the drafter's DrafterConfig.
    Returns:
        ``{prefix}layers.{i}.{q,k}_norm.weight`` -> [head_dim] fp32, each filled with the estimated RMS of the
        projection's output for a unit-RMS input with uncorrelated channels (see :func:`load_init`).
    """
    out = {}
    for i in range(dcfg.num_layers):
        g = tensors[f"{prefix}layers.{i}.input_layernorm.weight"].float()
        for name in ("q", "k"):
            w = tensors[f"{prefix}layers.{i}.{name}_proj.weight"].float() * g
            c = float(w.pow(2).sum(dim=1).mean().sqrt())
            out[f"{prefix}layers.{i}.{name}_norm.weight"] = torch.full((dcfg.head_dim,), c)
    return out


def load_init(path: str, target: Target, cfg: DictConfig):
    """Drafter and head to fine-tune from ``init_from=PATH`` (a dartree checkpoint, e.g. a converted published
    drafter, or a ``training/train.py`` checkpoint). The backbone architecture comes from the checkpoint; a
    checkpoint whose head is ``identity`` (a plain DFlash drafter) gets a fresh head of the recipe's type, and a
    recipe with ``drafter.conv_kernel_size`` > 0 turns a DFlash backbone into a DFlash 2 one whose convolutions
    start as the identity (the same function as the checkpoint's). Two more widenings make a CPU-tuned drafter
    exportable to the published layouts (:func:`dartree.convert.formats.export_config`), which all have Qwen3
    layers over the full vocabulary:

    * ``drafter.qk_norm=true`` on a checkpoint without q/k norms adds them (``layers.{i}.{q,k}_norm.weight``, [head_dim]),
      each weight a constant c = sqrt(mean_j sum_k (W[j, k] g[k])^2) over the rows j of ``q_proj`` / ``k_proj`` (W)
      and the layer's ``input_layernorm`` weight g: the RMS a head's q (k) has for a unit-RMS input with
      uncorrelated channels, so q_norm(q) ~ q and the attention scores start near the checkpoint's (an estimate, not
      an identity: RMSNorm rescales every head to the same RMS).
    * ``drafter.draft_vocab_size=0`` on a checkpoint with a draft vocabulary drops it: the drafter scores the full
      vocabulary with the same (target's) ``lm_head``, so the base scores of the old draft-vocabulary ids are
      unchanged and the other ids are scored too.

    The recipe never narrows a checkpoint: ``qk_norm=false`` or a draft vocabulary in the recipe keep the
    checkpoint's q/k norms and vocabulary.

    Raises:
        RecipeError: the folder is not a drafter checkpoint, does not fit the target, or holds a different head
            type than the recipe trains (other than identity).
    """
    from dartree.models.checkpoint import (CheckpointError, build_from_config, check_target_pairing, load_strict,
                                          read_safetensors)

    folder = Path(path)
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
        fmt = config.get("format")
        if fmt not in ("dartree", TRAIN_FORMAT):
            raise CheckpointError(f"{cfg_path}: format {fmt!r} is not a dartree or training checkpoint; convert it "
                                  "first: python convert/to_dartree.py SRC --out DST, then init_from=DST")
        check_target_pairing(config, target)
        dsec = config.get("drafter", {})
        add_conv = int(cfg.drafter.conv_kernel_size) > 0 and not dsec.get("conv_kernel_size")
        if add_conv:  # DFlash -> DFlash 2: the convolutions start as the identity, so the function is unchanged
            config = {**config, "drafter": {**dsec, "conv_kernel_size": int(cfg.drafter.conv_kernel_size),
                                            "conv_group_size": int(cfg.drafter.conv_group_size)}}
        add_qk = bool(cfg.drafter.qk_norm) and not dsec.get("qk_norm", False)
        full_vocab = int(cfg.drafter.draft_vocab_size) == 0 and bool(dsec.get("draft_vocab_size", 0))
        if add_qk or full_vocab:
            config = {**config, "drafter": {**config["drafter"], **({"qk_norm": True} if add_qk else {}),
                                            **({"draft_vocab_size": 0} if full_vocab else {})}}
        drafter, head = build_from_config(config, cfg_path)
        tensors = read_safetensors(folder / "model.safetensors")  # a truncated file: one line, as eval and convert
        prefix = "backbone." if fmt == "dartree" else "drafter."
        if add_conv:
            tensors = {**{prefix + k: v for k, v in drafter.state_dict().items() if "_conv." in k}, **tensors}
        if full_vocab:
            tensors.pop(prefix + "draft_vocab", None)
        if add_qk:
            tensors = {**tensors, **_qk_norm_init(tensors, prefix, drafter.cfg)}
        load_strict(drafter, tensors, prefix, folder)
        if head.type_name == cfg.head.type:
            load_strict(head, tensors, "head.", folder)
            head.bind_embeddings(target.embed_tokens.weight)
        elif head.type_name == "identity":
            _, head = build_models(cfg, target)
        else:
            raise CheckpointError(f"init_from {folder} holds a {head.type_name!r} head but the recipe trains "
                                  f"{cfg.head.type!r}; set head.type={head.type_name} or start from a DFlash drafter")
    except FileNotFoundError as exc:
        raise RecipeError(f"init_from={path}: {exc.strerror or exc}: {exc.filename}") from None
    except (CheckpointError, ValueError, KeyError) as exc:
        raise RecipeError(f"init_from={path}: {exc}") from None
    return drafter.float(), head.float()


def check_resume_length(saved_step: int, total: int, cfg: DictConfig, out_dir: Path) -> None:
    """Refuse to resume a state saved at a step past this run's last step: the loop would not run, and the longer
    run's weights would be written and reported as this run's.

    Args:
        saved_step: the step the resumable state was saved at. total: this run's planned steps.
    Raises:
        RecipeError: one line naming both steps, the setting that gave ``total`` and the fix.
    """
    if saved_step <= total:
        return
    why = (f"train.max_steps={cfg.train.max_steps}" if cfg.train.max_steps
           else f"train.epochs={cfg.train.epochs} gives {total} steps")
    raise RecipeError(f"resume=true: {out_dir / 'resume'} was saved at step {saved_step} but this run ends at step "
                      f"{total} ({why}); resuming would report the longer run as this one: set train.max_steps to "
                      f"{saved_step} or more, or use a new output_dir")


def run(cfg: DictConfig) -> dict:
    """Run a recipe end to end on every rank; returns a summary dict (rank 0 also writes
    ``<output_dir>/summary.json``, ``acceptance.json`` and the checkpoint)."""
    from dartree.training.engine import (
        check_resumable,
        check_resume_world,
        ds_config,
        full_state_dict,
        gathered,
        init_distributed,
        load_resume,
        make_engine,
        save_resume,
    )

    from dartree.training.checks import check_against_target, check_output_dir, check_recipe

    t_start = time.time()
    check_recipe(cfg)  # also here: a config built or edited in Python after load_recipe
    check_output_dir(cfg.output_dir)
    rank, world = init_distributed()
    main_rank = rank == 0
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.seqs_per_step % world:
        raise RecipeError(f"train.seqs_per_step={cfg.train.seqs_per_step} must be a multiple of the number of "
                          f"processes ({world})")
    out_dir = Path(cfg.output_dir)
    if cfg.resume:  # before any work: a saved state this run cannot continue is refused by name
        try:
            check_resumable(out_dir, OmegaConf.to_container(cfg))
            check_resume_world(out_dir, world)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
    torch.manual_seed(cfg.seed)
    target = load_recipe_target(cfg.target.path, _dtype(cfg.target.dtype))
    check_against_target(cfg, target)  # layer ids, mask id, vocabulary sizes: before the data stage
    if cfg.init_from:
        drafter, head = load_init(cfg.init_from, target, cfg)
        if main_rank:
            print(f"init_from {cfg.init_from}: {drafter.cfg.num_layers}-layer backbone, block {drafter.cfg.block_size}, "
                  f"head {head.type_name}", flush=True)
    else:
        drafter, head = build_models(cfg, target)
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    t_data = time.time()
    if main_rank:  # rank 0 builds the cached data; the others then read the cache
        data = prepare_data(cfg, target)
    dist.barrier()
    if not main_rank:
        data = prepare_data(cfg, target)
    data_s = time.time() - t_data
    if main_rank:
        print(f"data: {len(data)} training sequences ({data.num_tokens()} tokens), {len(data.holdout_ids)} held out; "
              f"prepared in {data_s / 60:.1f} min", flush=True)
    if not len(data):
        raise RecipeError("no training sequence has a response token to predict; raise data.max_new_tokens")
    if drafter.cfg.draft_vocab_size:
        if not cfg.init_from:  # a fine-tuned drafter keeps the vocabulary it was trained with
            try:
                ids, cover = select_draft_vocab(data, drafter.cfg.draft_vocab_size, target.vocab_size,
                                                target_stop_ids(target))
            except ValueError as exc:
                raise RecipeError(f"drafter.draft_vocab_size: {exc}") from None
            drafter.draft_vocab.copy_(ids)
            if main_rank:
                print(f"draft vocabulary: {ids.numel()} of {target.vocab_size} tokens cover {100 * cover:.1f}% of "
                      "the training response tokens", flush=True)
        if not getattr(data, "online", False):  # online data computes it per sequence
            if main_rank:  # cached beside the features: rank 0 computes, the others read
                data.lse = target_lse(target, data.features_path)
            dist.barrier()
            if not main_rank:
                data.lse = target_lse(target, data.features_path)

    if cfg.freeze_backbone:
        drafter.requires_grad_(False)
    module = TrainModule(drafter, head)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise RecipeError("nothing to train: freeze_backbone=true with an identity head (use a DSpark or Domino head)")
    # torch's fused AdamW (one kernel per parameter; CPU and CUDA, fp32): the for-loop version cost ~5% of a
    # dspark_b16 step here at 2 sequences per step
    fused_adam = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95),
                            fused=fused_adam)
    sps = cfg.train.seqs_per_step
    steps_per_epoch = math.ceil(len(data) / sps)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    warm = max(1, int(cfg.train.warmup_ratio * total))
    cap_s = cfg.train.max_minutes * 60
    clock = {"t_train": time.time()}

    def lr_at(step: int) -> float:
        # linear warm-up, then cosine to 5%; with a wall-clock cap the decay follows whichever of
        # steps or time is further along, so a capped run still ends annealed.
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total - warm)
        if cap_s:
            prog = max(prog, (time.time() - clock["t_train"]) / cap_s)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    stage = int(cfg.deepspeed.zero_stage)
    dsc = ds_config(stage, sps // world, cfg.train.grad_clip)
    dsc["zero_allow_untested_optimizer"] = True
    engine = make_engine(module, opt, sched, dsc)
    if stage == 3:  # the heads read their weights functionally (not through a submodule call)
        import deepspeed

        for p in head.parameters():
            deepspeed.zero.register_external_parameter(module, p)

    losses: list[float] = []
    step = preds = 0
    acc_ema = None
    curve: list[dict] = []  # learning curve: held-out chain tau against training tokens and sequences
    seen: set[int] = set()  # distinct training sequences visited
    seen_tokens = 0
    if cfg.resume:
        client = load_resume(engine, out_dir)
        if client is None:
            if main_rank:
                print(f"resume=true but {out_dir / 'resume'} holds no state: starting from step 0", flush=True)
        else:
            step, losses, preds = int(client["step"]), list(client["losses"]), int(client.get("preds", 0))
            acc_ema = torch.tensor(client["acc_ema"]) if client.get("acc_ema") is not None else None
            curve, seen = list(client.get("curve", [])), set(client.get("seen", []))
            seen_tokens = int(client.get("seen_tokens", 0))
            check_resume_length(step, total, cfg, out_dir)
            if main_rank:
                print(f"resumed {out_dir / 'resume'} at step {step}/{total}", flush=True)
    wb = None
    if cfg.wandb.enabled and main_rank:
        import wandb

        wb = wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, name=cfg.recipe,
                        config=OmegaConf.to_container(cfg), dir=str(out_dir))
    n_train = len(data.train_ids)

    def batch_for(st: int) -> list[int]:
        # epoch e visits the training sequences in a permutation seeded by (seed, e); the last batch of an
        # epoch wraps around so every step has seqs_per_step sequences (DeepSpeed's fixed accumulation)
        e, j = divmod(st, steps_per_epoch)
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(_seed(cfg.seed, 7, e))).tolist()
        idx = [perm[(j * sps + q) % n_train] for q in range(sps)]
        return [data.train_ids[q] for q in idx]

    def client_state() -> dict:
        return {"step": step, "losses": losses, "preds": preds,
                "acc_ema": None if acc_ema is None else acc_ema.tolist(),
                "curve": curve, "seen": sorted(seen), "seen_tokens": seen_tokens}

    def add_point(hold: dict) -> None:
        if hold and (not curve or curve[-1]["step"] != step):
            since = losses[(curve[-1]["step"] if curve else 0):step]  # training losses since the previous point
            curve.append({"step": step, "train_tokens": seen_tokens, "sequences": step * sps,
                          "distinct_sequences": len(seen), "holdout_chain_tau": round(hold["holdout_chain_tau"], 4),
                          "holdout_tf_tau": round(hold["holdout_tf_tau"], 4),
                          **({"train_loss": round(sum(since) / len(since), 4)} if since else {})})

    def curve_point() -> None:
        engine.eval()
        with gathered(module, stage):
            hold = evaluate_holdout(drafter, head, target, data, cfg)
        engine.train()
        add_point(hold)
        if hold and main_rank:
            _write_json(out_dir / "curve.json", curve)
            plot_curve_file(curve, out_dir / "curve.png", cfg.recipe)  # a plotting problem only warns

    kill_at = int(os.environ.get("DARTREE_KILL_AT_STEP", "0"))  # tests: SIGKILL after this step
    engine.train()
    clock["t_train"] = time.time()
    t_steps0, preds0 = time.time(), preds
    last_save = time.time()
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.recipe}", unit="step", disable=not main_rank)
    stopped_early = False
    batch_norm = cfg.loss.get("normalization", "per_sequence") == "batch"
    while step < total:
        lam = 0.0
        if cfg.loss.type == "domino":
            lam = lambda_schedule(step, total, cfg.loss.lambda_base_start, cfg.loss.lambda_decay_ratio)
        batch = batch_for(step)
        seen.update(batch)
        seen_tokens += data.num_tokens(batch)
        mine = batch[rank::world]
        denom = None
        if batch_norm:  # SpecForge's pooled loss: this rank's weight sum, all-reduced over the processes
            wsum = torch.tensor([sum(sequence_weight(data, i, cfg, drafter.cfg.num_proposals,
                                                     torch.Generator().manual_seed(_seed(cfg.seed, step, i)))
                                     for i in mine)], dtype=torch.float64)
            dist.all_reduce(wsum)
            # DeepSpeed divides each micro-step's loss by the micro-steps per rank and averages the ranks'
            # gradients: a per-sequence normaliser of (step weight sum) / seqs_per_step leaves sum / sum
            denom = max(float(wsum), 1e-8) / sps
        sums = torch.zeros(5)  # loss, ce, l1, bce, predictions
        for i in mine:
            out = engine(target, data, i, cfg, torch.Generator().manual_seed(_seed(cfg.seed, step, i)), lam, denom)
            if out is None:  # pragma: no cover - BlockData keeps only sequences with anchors
                out_loss = sum(p.sum() for p in params) * 0.0
                engine.backward(out_loss)
                engine.step()
                continue
            loss, o_ce, o_l1, o_bce, o_acc, o_cnt = out
            engine.backward(loss)
            engine.step()
            sums += torch.tensor([float(loss.detach()), float(o_ce), float(o_l1), float(o_bce), float(o_cnt.sum())])
            acc_ema = o_acc if acc_ema is None else 0.9 * acc_ema + 0.1 * o_acc
        dist.all_reduce(sums)
        tot, ce, l1, bce = (sums[:4] / sps).tolist()
        preds += int(sums[4])
        step += 1
        losses.append(round(tot, 6))
        el = time.time() - clock["t_train"]
        tf_tau = teacher_forced_tau(acc_ema) if acc_ema is not None else 1.0
        rate = (preds - preds0) / max(time.time() - t_steps0, 1e-9)
        post = {"loss": f"{tot:.4f}", "ce": f"{ce:.3f}", "tf_tau": f"{tf_tau:.2f}", "pred_s": f"{rate:.0f}"}
        if cfg.loss.type == "dspark":
            post["l1"] = f"{l1:.3f}"
        if cfg.loss.type == "domino":
            post["lam"] = f"{lam:.2f}"
        bar.set_postfix(**post)
        bar.update(1)
        if wb is not None:
            wb.log({"loss": tot, "ce": ce, "l1": l1, "bce": bce, "lam": lam, "lr": sched.get_last_lr()[0],
                    "tf_tau": tf_tau}, step=step)
        flags = torch.tensor([
            float(bool(cfg.train.max_minutes) and el > cap_s),
            float(bool(cfg.train.save_every_minutes) and time.time() - last_save > cfg.train.save_every_minutes * 60),
        ])
        dist.broadcast(flags, 0)  # rank 0's clock decides for everyone
        if cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0 and step < total:
            curve_point()
        due = bool(flags[1]) or (cfg.train.save_every_steps and step % cfg.train.save_every_steps == 0)
        if due and step < total and not bool(flags[0]):
            save_resume(engine, out_dir, client_state(), OmegaConf.to_container(cfg))
            last_save = time.time()
        if kill_at and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if bool(flags[0]):
            stopped_early = True
            break
    bar.close()
    train_s = time.time() - clock["t_train"]
    save_resume(engine, out_dir, client_state(), OmegaConf.to_container(cfg))
    engine.eval()
    with gathered(module, stage):
        hold = evaluate_holdout(drafter, head, target, data, cfg)
    add_point(hold)
    drafter_sd = full_state_dict(drafter, stage)
    head_sd = full_state_dict(head, stage)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    summary = {
        "recipe": cfg.recipe,
        "steps": step,
        "total_steps_planned": total,
        "stopped_by_time_cap": stopped_early,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "processes": world,
        "zero_stage": stage,
        "train_sequences": len(data),
        "train_tokens": data.num_tokens(),
        "predictions": preds,
        "predictions_per_s": (preds - preds0) / max(train_s, 1e-9),
        "train_tf_tau": teacher_forced_tau(acc_ema) if acc_ema is not None else None,
        "train_acc_per_pos": None if acc_ema is None else [round(float(x), 4) for x in acc_ema],
        "data_prep_min": data_s / 60,
        "train_min": train_s / 60,
        "wall_min": (time.time() - t_start) / 60,
        "peak_rss_gib": peak_gib,
        "curve": curve,
        "param_checksum": float(sum(v.double().sum() for v in list(drafter_sd.values()) + list(head_sd.values()))),
        **hold,
    }
    if main_rank:
        save_training_checkpoint(out_dir / "checkpoint", drafter, head, target, cfg,
                                 {**{k: v for k, v in summary.items() if k != "losses"}, "losses": losses},
                                 state_dicts=(drafter_sd, head_sd))
        for name, payload in (("summary.json", summary), ("curve.json", curve),
                              ("acceptance.json", {k: summary.get(k) for k in (
                                  "train_acc_per_pos", "train_tf_tau", "holdout_acc_per_pos", "holdout_tf_tau",
                                  "holdout_chain_tau", "steps", "train_tokens", "train_sequences")})):
            _write_json(out_dir / name, payload)
        if curve:
            plot_curve_file(curve, out_dir / "curve.png", cfg.recipe)  # a plotting problem only warns
    if wb is not None:
        wb.finish()
    print(
        f"[rank {rank}/{world}] done: {step} steps, final loss {summary['final_loss']}, held-out teacher-forced tau "
        f"{summary.get('holdout_tf_tau', float('nan')):.3f}; {summary['predictions_per_s']:.0f} predictions/s; "
        f"wall time {summary['wall_min']:.1f} min (data {summary['data_prep_min']:.1f}, train "
        f"{summary['train_min']:.1f}); peak memory {peak_gib:.2f} GiB; param checksum {summary['param_checksum']:.6f}"
        + (f"; checkpoint {out_dir / 'checkpoint'}" if main_rank else ""),
        flush=True,
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-train``). Returns the exit status (2 for a recipe error, printed as one
    line). Callable repeatedly in one process: it leaves no process group, rendezvous variable or thread setting
    behind (:func:`dartree.training.engine.process_group_scope`)."""
    args = sys.argv[1:] if argv is None else argv
    # the deepspeed launcher passes --local_rank=N (torchrun sets LOCAL_RANK instead)
    args = [a for a in args if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg = load_recipe(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(OmegaConf.to_yaml(cfg), flush=True)
    from dartree.training.engine import process_group_scope

    # the scope tears down the process group this call created (gloo/shm teardown at exit can abort) and every
    # other process-wide setting, so main can run again in the same process
    with process_group_scope():
        try:
            run(cfg)
        except RecipeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dartree.models.checkpoint import write_folder_atomically
from dartree.models.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dartree.models.heads import build_head
from dartree.models.target import Target, load_target
from dartree.training.data import (
    BlockData,
    DataSpec,
    compute_features,
    random_prompts,
    regenerate_responses,
    sample_anchors,
)
from dartree.training.losses import block_attention_mask, dspark_loss, teacher_forced_tau
from dartree.training.recipe import RecipeError, load_recipe

TRAIN_FORMAT = "dartree-train"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise RecipeError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


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
    """Regenerate responses (cached) and cache features for ``target``'s layer ids; return BlockData."""
    spec = DataSpec(
        num_prompts=cfg.data.num_prompts,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_new_tokens=cfg.data.max_new_tokens,
        seed=cfg.data.seed,
        batch_size=cfg.data.gen_batch_size,
    )
    gen_dtype = _dtype(cfg.target.gen_dtype)
    gen_target = target if gen_dtype == target.dtype else load_target(cfg.target.path, dtype=gen_dtype)
    if cfg.data.source == "sharegpt":
        responses = regenerate_responses(gen_target, spec)
    elif cfg.data.source == "random":
        prompts = random_prompts(spec.num_prompts, cfg.data.random_prompt_len, target.vocab_size, spec.seed)
        stop = target.config.eos_token_id
        responses = regenerate_responses(gen_target, spec, prompts=prompts, stop_id=int(stop))
    else:
        raise RecipeError(f"data.source {cfg.data.source!r} is not 'sharegpt' or 'random'")
    del gen_target
    feats = compute_features(target, responses)
    return BlockData(responses, feats, holdout=cfg.data.holdout)


def sequence_loss(drafter, head, target: Target, data: BlockData, i: int, cfg: DictConfig, gen: torch.Generator):
    """Forward one training sequence with random anchors; returns LossOut or None when it has no anchor.

    Block n = [t[a_n], MASK x (L-1)] at positions a_n + arange(L); proposal j (at block position
    proposal_offset + j) predicts t[a_n + 1 + j]; the head's previous token for proposal j is t[a_n + j].
    """
    tokens, feats, final, plen = data.sequence(i)
    s = tokens.numel()
    dc = drafter.cfg
    L, off, P = dc.block_size, dc.proposal_offset, dc.num_proposals
    anchors = sample_anchors(plen, s, cfg.train.num_anchors, gen)
    a = anchors.numel()
    if a == 0:
        return None
    block = torch.full((a, L), dc.mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[anchors]
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    embed = target.embed_tokens
    x = embed(block.reshape(1, -1)).to(torch.float32)
    mask = block_attention_mask(anchors, s, L)
    use_bf16 = bool(cfg.train.bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
        hidden = drafter(x, q_pos, feats[None].float(), torch.arange(s)[None], mask=mask)
        hidden = hidden.view(a, L, -1)[:, off:]  # [A, P, D]
        base = target.lm_head(hidden)  # [A, P, V]
        lp = anchors[:, None] + 1 + torch.arange(P)  # label positions
        valid = lp < s
        lpc = lp.clamp(max=s - 1)
        labels = tokens[lpc]
        prev = tokens[(lp - 1).clamp(max=s - 1)]
        logits = head.block_logits(prev, hidden, base)
        with torch.no_grad():
            t_logits = target.lm_head(final[(lp - 1).clamp(max=s - 1)].to(target.lm_head.weight.dtype))
    return dspark_loss(
        logits, labels, valid, t_logits,
        gamma=cfg.train.loss_gamma, ce_weight=cfg.train.ce_weight, l1_weight=cfg.train.l1_weight,
    )


def save_training_checkpoint(folder: Path, drafter, head, target: Target, cfg: DictConfig, state: dict) -> None:
    """Write ``folder`` atomically: config.json (format ``dartree-train``, recipe, drafter/head/target config,
    trainer state) and model.safetensors (``drafter.*`` and ``head.*`` in fp32)."""
    tensors = {f"drafter.{k}": v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    tensors.update({f"head.{k}": v.detach().float().contiguous() for k, v in head.state_dict().items()})
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
    """Teacher-forced accuracy per block position on the held-out sequences, and the implied chain tau."""
    if not data.holdout_ids:
        return {}
    gen = torch.Generator().manual_seed(1234)
    hits, cnts = None, None
    for i in data.holdout_ids:
        out = sequence_loss(drafter, head, target, data, i, cfg, gen)
        if out is None:
            continue
        h = out.acc_per_pos * out.count_per_pos
        hits = h if hits is None else hits + h
        cnts = out.count_per_pos if cnts is None else cnts + out.count_per_pos
    if hits is None:
        return {}
    acc = hits / cnts.clamp_min(1)
    return {"holdout_acc_per_pos": [round(float(x), 4) for x in acc], "holdout_tf_tau": teacher_forced_tau(acc)}


def run(cfg: DictConfig) -> dict:
    """Run a recipe end to end; returns a summary dict (also written to ``<output_dir>/summary.json``)."""
    t_start = time.time()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.output_dir)
    target = load_target(cfg.target.path, dtype=_dtype(cfg.target.dtype))
    drafter, head = build_models(cfg, target)
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    t_data = time.time()
    data = prepare_data(cfg, target)
    data_s = time.time() - t_data
    print(f"data: {len(data)} training sequences ({data.num_tokens()} tokens), {len(data.holdout_ids)} held out; "
          f"prepared in {data_s / 60:.1f} min", flush=True)

    params = list(drafter.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(data) / cfg.train.seqs_per_step)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    warm = max(1, int(cfg.train.warmup_ratio * total))

    cap_s = cfg.train.max_minutes * 60

    def lr_at(step: int) -> float:
        # linear warm-up, then cosine to 5%; with a wall-clock cap the decay follows whichever of
        # steps or time is further along, so a capped run still ends annealed.
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total - warm)
        if cap_s:
            prog = max(prog, (time.time() - t_train) / cap_s)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))

    t_train = time.time()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    wb = None
    if cfg.wandb.enabled:
        import wandb

        wb = wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, name=cfg.recipe,
                        config=OmegaConf.to_container(cfg), dir=str(out_dir))
    gen = torch.Generator().manual_seed(cfg.seed)
    order_gen = torch.Generator().manual_seed(cfg.seed + 1)
    drafter.train()
    head.train()
    losses, step, preds = [], 0, 0
    last_save = time.time()
    acc_ema = None
    order: list[int] = []
    bar = tqdm(total=total, desc=f"train {cfg.recipe}", unit="step")
    stopped_early = False
    while step < total:
        if not order:
            order = [data.train_ids[j] for j in torch.randperm(len(data.train_ids), generator=order_gen).tolist()]
        batch, order = order[: cfg.train.seqs_per_step], order[cfg.train.seqs_per_step :]
        opt.zero_grad(set_to_none=True)
        tot = ce = l1 = 0.0
        n_ok = 0
        for i in batch:
            out = sequence_loss(drafter, head, target, data, i, cfg, gen)
            if out is None:
                continue
            (out.loss / len(batch)).backward()
            tot += float(out.loss.detach()) / len(batch)
            ce += float(out.ce) / len(batch)
            l1 += float(out.l1) / len(batch)
            preds += int(out.count_per_pos.sum())
            acc_ema = out.acc_per_pos if acc_ema is None else 0.9 * acc_ema + 0.1 * out.acc_per_pos
            n_ok += 1
        if n_ok:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
            opt.step()
        sched.step()
        step += 1
        losses.append(round(tot, 6))
        el = time.time() - t_train
        tf_tau = teacher_forced_tau(acc_ema) if acc_ema is not None else 1.0
        bar.set_postfix(loss=f"{tot:.4f}", ce=f"{ce:.3f}", l1=f"{l1:.3f}", tf_tau=f"{tf_tau:.2f}", tok_s=f"{preds / el:.0f}")
        bar.update(1)
        if wb is not None:
            wb.log({"loss": tot, "ce": ce, "l1": l1, "lr": sched.get_last_lr()[0], "tf_tau": tf_tau}, step=step)
        if cfg.train.max_minutes and el > cfg.train.max_minutes * 60:
            stopped_early = True
            break
        if cfg.train.save_every_minutes and time.time() - last_save > cfg.train.save_every_minutes * 60:
            save_training_checkpoint(out_dir / "checkpoint", drafter, head, target, cfg, {"step": step, "losses": losses})
            last_save = time.time()
    bar.close()
    train_s = time.time() - t_train
    drafter.eval()
    head.eval()
    hold = evaluate_holdout(drafter, head, target, data, cfg)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    summary = {
        "recipe": cfg.recipe,
        "steps": step,
        "total_steps_planned": total,
        "stopped_by_time_cap": stopped_early,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "train_sequences": len(data),
        "train_tokens": data.num_tokens(),
        "predictions": preds,
        "predictions_per_s": preds / max(train_s, 1e-9),
        "train_tf_tau": teacher_forced_tau(acc_ema) if acc_ema is not None else None,
        "data_prep_min": data_s / 60,
        "train_min": train_s / 60,
        "wall_min": (time.time() - t_start) / 60,
        "peak_rss_gib": peak_gib,
        **hold,
    }
    save_training_checkpoint(out_dir / "checkpoint", drafter, head, target, cfg, {"step": step, **{k: v for k, v in summary.items() if k != "losses"}, "losses": losses})
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out_dir / "summary.json")
    if wb is not None:
        wb.finish()
    print(
        f"done: {step} steps, final loss {summary['final_loss']}, held-out teacher-forced tau "
        f"{summary.get('holdout_tf_tau', float('nan')):.3f}; wall time {summary['wall_min']:.1f} min "
        f"(data {summary['data_prep_min']:.1f}, train {summary['train_min']:.1f}); peak memory {peak_gib:.2f} GiB; "
        f"checkpoint {out_dir / 'checkpoint'}",
        flush=True,
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-train``). Returns the exit status (2 for a recipe error)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg = load_recipe(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(OmegaConf.to_yaml(cfg), flush=True)
    try:
        run(cfg)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

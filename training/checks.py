"""Checks of a recipe where it enters: field ranges and combinations when it is loaded, values that depend on the
target right after the target is loaded (before the data stage and any training step), and the output folder.

Every refusal is a :class:`~dartree.training.recipe.RecipeError` whose one-line message names the key, the
value and the allowed range (``dartree-train`` prints it and exits with status 2). Every configuration that
passes builds a drafter and head that save, convert (``convert/to_dartree.py``) and export
(``convert/from_dartree.py``, where the published layout can express it) and re-import; a test walks the
combinations.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dartree.base.dtypes import DTYPES as DTYPE_TABLE
from dartree.models.families import FAMILIES, recipe_fields
from dartree.base.fields import Choice, Flag, IdList, Range, field_problems, folder_problem
from dartree.models.chat import check_chat_template
from dartree.models.drafter import build_target_layer_ids
from dartree.training.campaign_store import CampaignError, check_files


class RecipeError(ValueError):
    """A recipe or an override is invalid; the message names the key and the valid choices."""


DTYPES = tuple(DTYPE_TABLE)

# Allowed values of every numeric (and enumerated) recipe field; keys as in dartree.training.recipe.Recipe.
RECIPE_FIELDS = {
    "seed": Range(0, 2**63 - 1),
    "target.dtype": Choice(DTYPES),
    "target.gen_dtype": Choice(DTYPES + ("auto",), note="auto: bfloat16 where bf16 arithmetic is native, else float32"),
    "drafter.num_layers": Range(1),
    "drafter.intermediate_size": Range(1, optional=True, note="null: the target's"),
    "drafter.target_layer_ids": IdList(0, allow_empty=True,
                                       note="empty: the DFlash rule picks num_target_features ids"),
    "drafter.num_target_features": Range(1),
    "drafter.init_from_target": Choice((False, True, "layers", "specforge"),
                                       note="true = layers: copy the target's top layers; specforge: also the "
                                            "identity projection and the target's norms"),
    "drafter.init_copy_layers": Range(0, note="0: every drafter layer"),
    "drafter.qk_norm": Flag(),
    "drafter.block_size": Range(2, note="the anchor plus at least one proposal"),
    "drafter.proposal_offset": Range(0, 1, note="0: DSpark/Domino, P = L; 1: z-lab DFlash, P = L - 1"),
    "drafter.mask_token_id": Range(0, optional=True, note="null: the tokenizer's unk id, else 0"),
    "drafter.draft_vocab_size": Range(0, note="0: the full vocabulary"),
    "drafter.conv_kernel_size": Range(0, note="0: DFlash layers; k >= 1: DFlash 2 convolutions, at most block_size"),
    "drafter.conv_group_size": Range(1, note="must divide the target's hidden size"),
    "drafter.causal_block": Flag(),
    "head.top_k": Range(1, note="selector head: candidates of U reranked per position"),
    "head.rank": Range(1, note="DSpark Markov rank R, also Domino's emb_dim when that is null; a drafter "
                               "without a Markov head is head.type=identity with loss.type=dflash"),
    "head.emb_dim": Range(1, optional=True, note="null: head.rank"),
    "head.gru_hidden_dim": Range(1, optional=True, note="null: 4 x emb_dim"),
    "head.prefix_len": Range(0),
    "head.confidence_head": Flag(),
    "head.confidence_with_markov": Flag(),
    "loss.gamma": Range(0, integer=False, lo_open=True, optional=True,
                        note="decay exp(-k/gamma) over the proposals; null: no decay, SpecForge's default"),
    "loss.ce_weight": Range(0, integer=False),
    "loss.l1_weight": Range(0, integer=False, note="dspark: L1 distance sum|p_d - p_t|"),
    "loss.tv_weight": Range(0, integer=False, note="dspark: total variation 0.5 sum|p_d - p_t|"),
    "loss.kl_weight": Range(0, integer=False, note="dspark: KL(p_t || p_d)"),
    "loss.lk_weight": Range(0, integer=False, note="dspark: the LK loss lambda KL + (1 - lambda) TV"),
    "loss.lk_lambda": Range(0, 1, integer=False, optional=True, note="null: adaptive, exp(-lk_eta (1 - TV))"),
    "loss.lk_eta": Range(0, integer=False, note="the adaptive LK lambda's rate"),
    "loss.conf_weight": Range(0, integer=False),
    "loss.lambda_base_start": Range(0, 1, integer=False),
    "loss.lambda_decay_ratio": Range(0, integer=False, lo_open=True,
                                     note="domino: lambda reaches 0 after int(ratio x planned steps) steps"),
    "loss.normalization": Choice(("per_sequence", "batch"),
                                 note="batch: sum of weighted terms over the step's weight sum, all processes"),
    "loss.cumulative_mask": Flag(),
    "data.num_prompts": Range(1),
    "data.max_prompt_tokens": Range(1),
    "data.max_new_tokens": Range(1),
    "data.seed": Range(0, 2**63 - 1),
    "data.gen_batch_size": Range(1),
    "data.code_fraction": Range(0, 1, integer=False),
    "data.holdout": Range(0),
    "data.holdout_set": Choice(("tail", "fixed"), note="fixed: held-out conversations independent of num_prompts"),
    "data.holdout_turns": Range(0, note="0: data.max_turns; turns of each fixed held-out conversation"),
    "data.max_turns": Range(1, note="1: the first human turn only"),
    "data.max_seq_tokens": Range(2, note="max_turns > 1: history + max_new_tokens of a regenerated turn"),
    "data.random_prompt_len": Range(1),
    "train.epochs": Range(0, integer=False, note="0 needs train.max_steps > 0"),
    "train.max_steps": Range(0, note="0: train.epochs decide"),
    "train.max_minutes": Range(0, integer=False, note="0: no cap"),
    "train.seqs_per_step": Range(1),
    "train.num_anchors": Range(1),
    "train.lr": Range(0, integer=False, note="0 keeps the weights as initialised"),
    "train.warmup_ratio": Range(0, 1, integer=False),
    "train.lr_schedule": Choice(("cosine", "constant"), note="constant: the warm-up, then the base rate throughout"),
    "train.weight_decay": Range(0, integer=False),
    "train.grad_clip": Range(0, integer=False, note="0: no clipping"),
    "train.bf16": Flag(auto=True, note="auto: bf16 autocast where the training device has native bf16 arithmetic, "
                                       "else fp32"),
    "train.device": Choice(("auto", "cpu", "cuda"), note="auto: cuda where torch.cuda.is_available(), else cpu"),
    "train.engine": Choice(("deepspeed", "torch"), note="torch: the plain-torch engine, ZeRO stage 0 only"),
    "train.fused_loss": Flag(),
    "train.threads": Range(0, note="0: torch's default"),
    "train.save_every_minutes": Range(0, integer=False, note="0: off"),
    "train.save_every_steps": Range(0, note="0: off"),
    "train.eval_every_steps": Range(0, note="0: only at the end"),
    "train.schedule_from_init": Flag(),
    "train.schedule_steps": Range(0, note="0: the lineage's steps so far + this run's"),
    "data.cursor_from_init": Flag(),
    "data.feature_store_gb": Range(0, integer=False, note="0: off; data.source=campaign: GB of target features kept "
                                                          "in the user cache"),
    "deepspeed.zero_stage": Range(0, 3),
    "wandb.enabled": Flag(),
    "wandb.mode": Choice(("online", "offline", "disabled")),
    "resume": Flag(),
    "freeze_backbone": Flag(),
}


def recipe_problems(cfg: DictConfig) -> list[str]:
    """Every out-of-range field and inconsistent combination of a merged recipe, one line each (empty: fine).

    Args:
        cfg: the recipe as :func:`dartree.training.recipe.load_recipe` merges it (or any DictConfig of that schema).
    """
    values = OmegaConf.to_container(cfg, resolve=True)
    families = {f"head.{key}": rule for key, (_, rule) in recipe_fields().items()}  # the families' own head keys
    out = field_problems(values, {**RECIPE_FIELDS, **families})
    if out:
        return out
    lo, da, tr = cfg.loss, cfg.data, cfg.train
    family = FAMILIES.get(lo.type)
    if family is None:
        return [f"loss.type={lo.type!r} is unknown; use one of {sorted(FAMILIES)}"]
    out += family.recipe_problems(values)  # the family's own combinations (dartree.models.families)
    if not family.distribution and (lo.get("tv_weight", 0) or lo.get("kl_weight", 0) or lo.get("lk_weight", 0)):
        names = "/".join(sorted(n for n, f in FAMILIES.items() if f.distribution))
        given = " / ".join(f"loss.{k}={lo.get(k)}" for k in ("tv_weight", "kl_weight", "lk_weight") if lo.get(k, 0))
        out.append(f"{given} apply to loss.type={names} only (this recipe is {lo.type}): set them to 0, or use "
                   f"loss.type={names}")
    dr = cfg.drafter
    if int(dr.get("init_copy_layers", 0) or 0) and not dr.get("init_from_target", False):
        out.append(f"drafter.init_copy_layers={dr.init_copy_layers} copies layers only with a warm start: set "
                   "drafter.init_from_target=layers or specforge, or drop drafter.init_copy_layers")
    if not lo.get("lk_weight", 0) and (lo.get("lk_lambda") is not None or lo.get("lk_eta", 3.0) != 3.0):
        out.append(f"loss.lk_lambda={lo.get('lk_lambda')} / loss.lk_eta={lo.get('lk_eta', 3.0)} shape the LK loss, "
                   "which is off: set loss.lk_weight > 0 (e.g. loss.lk_weight=0.9 loss.l1_weight=0), or drop them")
    if int(dr.get("init_copy_layers", 0) or 0) > dr.num_layers:
        out.append(f"drafter.init_copy_layers={dr.init_copy_layers} exceeds drafter.num_layers={dr.num_layers}: copy "
                   "at most every drafter layer (0: all of them)")
    if da.get("feature_store_gb", 0) and da.source != "campaign":
        out.append(f"data.feature_store_gb={da.feature_store_gb} stores online features, which only data.source=campaign "
                   f"computes (this recipe reads {da.source!r} data from its feature file): set it to 0")
    if (da.get("cursor_from_init", False) or tr.get("schedule_from_init", False)) and not cfg.get("init_from"):
        which = "data.cursor_from_init" if da.get("cursor_from_init", False) else "train.schedule_from_init"
        out.append(f"{which}=true continues init_from's run, but init_from is not set: give init_from=RUN/checkpoint, "
                   f"or set {which}=false")
    if tr.epochs == 0 and tr.max_steps == 0:
        out.append("train.epochs=0 and train.max_steps=0: give the run a length (train.epochs > 0 or "
                   "train.max_steps > 0)")
    if da.holdout_set == "tail" and da.holdout >= da.num_prompts:
        out.append(f"data.holdout={da.holdout} must be < data.num_prompts={da.num_prompts} (at least one training "
                   "prompt)")
    if da.holdout_set == "fixed" and da.holdout == 0:
        out.append("data.holdout_set=fixed with data.holdout=0 holds nothing out: give data.holdout >= 1")
    if da.holdout_set == "tail" and da.holdout_turns:
        out.append(f"data.holdout_turns={da.holdout_turns} applies to the fixed held-out set only: set "
                   "data.holdout_set=fixed, or data.holdout_turns=0")
    if tr.get("engine", "deepspeed") == "torch" and cfg.deepspeed.zero_stage:
        out.append(f"deepspeed.zero_stage={cfg.deepspeed.zero_stage} needs train.engine=deepspeed (the torch engine "
                   "keeps whole tensors on every process): set deepspeed.zero_stage=0 or train.engine=deepspeed")
    if da.max_turns > 1 and da.max_seq_tokens <= da.max_new_tokens:
        out.append(f"data.max_seq_tokens={da.max_seq_tokens} leaves no room for a later turn's history: must be > "
                   f"data.max_new_tokens={da.max_new_tokens}")
    return out


def check_recipe(cfg: DictConfig) -> None:
    """Refuse a recipe with an out-of-range field or an inconsistent combination (:func:`recipe_problems`).

    Raises:
        RecipeError: the first problem, one line naming the key, the value and the allowed range.
    """
    problems = recipe_problems(cfg)
    if problems:
        raise RecipeError(problems[0])


def template_kwargs(cfg: DictConfig) -> dict:
    """``data.chat_template_kwargs`` of a recipe as a plain dict ({} when the recipe predates the field)."""
    value = cfg.data.get("chat_template_kwargs", None)
    return dict(OmegaConf.to_container(value, resolve=True)) if value else {}


def check_against_target(run, target) -> list[int]:
    """Check the recipe values that depend on the target, before the data stage and any training step.

    Args:
        run: the run's :class:`~dartree.training.settings.RunSettings` (its ``drafter`` section, data source and
            chat-template variables, ``init_from``). target: the loaded :class:`~dartree.models.target.Target` (V
            vocabulary rows, n layers).
    Returns:
        The target layer ids the drafter will read (the recipe's, or the DFlash rule's).
    Raises:
        RecipeError: layer ids outside [0, n) (given or from the DFlash rule), a mask token id >= the target's
            embedding rows, ShareGPT prompts for a target without a tokenizer or chat template (or with
            ``data.chat_template_kwargs`` that ``apply_chat_template`` cannot take), a draft vocabulary larger than V,
            more drafter layers than the target has when ``drafter.init_from_target`` copies them, or a drafter
            width that differs from the copied layers'.
    """
    d, source, kwargs = run.models.drafter, run.data.source, run.data.spec.chat_template_kwargs
    n, v = target.num_layers, target.vocab_size
    rows = int(target.embed_tokens.weight.shape[0])
    ids = list(d.target_layer_ids)
    if ids:
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise RecipeError(f"drafter.target_layer_ids={ids} holds {bad}: target {target.name!r} has {n} layers, "
                              f"ids must be in [0, {n - 1}]")
    elif not run.init_from:
        ids = build_target_layer_ids(n, d.num_target_features)
        if any(not 0 <= i < n for i in ids):
            raise RecipeError(f"drafter.num_target_features={d.num_target_features} gives layer ids {ids} on the "
                              f"target's {n} layers; give drafter.target_layer_ids explicitly (ids in [0, {n - 1}])")
    if d.mask_token_id is not None and d.mask_token_id >= rows:
        raise RecipeError(f"drafter.mask_token_id={d.mask_token_id} is not a token id of target {target.name!r}: "
                          f"must be in [0, {rows - 1}]")
    if source == "sharegpt" and target.tokenizer is None:
        raise RecipeError(f"data.source=sharegpt needs a target with a tokenizer (to chat-template the prompts); "
                          f"target {target.name!r} has none: use data.source=random")
    if source == "sharegpt":
        try:
            check_chat_template(target.tokenizer, kwargs, fix="data.source=sharegpt renders prompts through it: use a "
                                "chat model as the target, or data.source=random")
        except ValueError as exc:
            given = f" (data.chat_template_kwargs={kwargs})" if kwargs else ""
            raise RecipeError(f"target {target.name!r}: {exc}{given}") from None
    if d.draft_vocab_size > v:
        raise RecipeError(f"drafter.draft_vocab_size={d.draft_vocab_size} exceeds the target's vocabulary: must be in "
                          f"[0, {v}] (0: the full vocabulary)")
    if d.init_from_target and not run.init_from:
        copies = int(d.init_copy_layers or 0) or d.num_layers
        if copies > n:
            raise RecipeError(f"drafter.num_layers={d.num_layers} with drafter.init_from_target="
                              f"{str(d.init_from_target).lower()} copies more "
                              f"layers than target {target.name!r} has ({n}): must be <= {n}, or set "
                              "drafter.init_from_target=false")
        width = getattr(target.config, "intermediate_size", None)
        if d.intermediate_size is not None and width is not None and d.intermediate_size != width:
            raise RecipeError(f"drafter.intermediate_size={d.intermediate_size} differs from the copied target layers' "
                              f"{width}: leave it null, or set drafter.init_from_target=false")
    return ids


def check_output_dir(path: str | os.PathLike) -> None:
    """Refuse an output folder that cannot be written, before anything is computed or written.

    Raises:
        RecipeError: ``path`` is an existing file, or cannot be created or written (tried and undone:
            :func:`dartree.base.fields.folder_problem`).
    """
    if int(os.environ.get("RANK", "0") or 0) != 0:
        # only rank 0 tries to create the folder: ranks trying at once race on mkdir / rmdir ("File exists");
        # rank 0 refuses the run for all of them
        if Path(path).expanduser().is_file():
            raise RecipeError(f"output_dir={str(path)!r} is an existing file, not a folder; choose another output_dir")
        return
    why = folder_problem(path)
    if why is not None:
        raise RecipeError(f"output_dir={str(path)!r} {why}; choose another output_dir")


def check_data_files(data) -> None:
    """Refuse missing or changed data files before the target loads: with ``data.source=campaign``, every committed
    shard the run reads (the held-out set and the first ``data.campaign_shards``, all when 0) must be there with its
    manifest's sha256 (:func:`dartree.training.campaign_store.check_files`). Other sources read nothing committed.
    ``data``: the run's :class:`~dartree.training.settings.DataSettings`.

    Raises:
        RecipeError: the file named, with the fix (``git checkout`` it).
    """
    if data.source != "campaign":
        return
    try:
        check_files(data.campaign_dir, max_shards=data.campaign_shards)
    except CampaignError as exc:
        raise RecipeError(f"data.source=campaign: {exc}") from None

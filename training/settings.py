"""Typed settings of a training run, built once from the merged recipe at the trainer's door (:func:`run_settings`):
:class:`RunSettings` holds the recipe's sections as the schema's dataclasses (:class:`~dartree.training.recipe.Recipe`)
and the settings of each stage (:class:`ModelSettings` for :func:`~dartree.training.build.build_models`,
:class:`~dartree.training.step.StepSettings` with the drafter family's objective, :class:`DataSettings` for
:func:`~dartree.training.build.prepare_data`, :class:`InitSettings` for :func:`~dartree.training.build.load_init`).
Everything below the trainer receives these objects, never the recipe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dartree.base.dtypes import parse_dtype
from dartree.models.families import get_family
from dartree.training.answers import DataSpec
from dartree.training.campaign_store import DEFAULT_DIR
from dartree.training.checks import check_recipe, template_kwargs
from dartree.training.recipe import DrafterSection, RecipeError, TargetSection, TrainSection, WandbSection
from dartree.training.step import StepSettings, needs_target_lse


def section(cls, node):
    """The schema dataclass ``cls`` (:class:`~dartree.training.recipe.TrainSection`, ...) of recipe section ``node``:
    a field the section lacks (a recipe saved before the field existed) takes its default, a key the schema no longer
    has is dropped."""
    values = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(frozen=True)
class ModelSettings:
    """What builds the drafter and head (:func:`~dartree.training.build.build_models`) and checks them against the
    target (:func:`~dartree.training.checks.check_against_target`).

    Attributes:
        drafter: the ``drafter`` section. head: the ``head`` section (:class:`~dartree.training.recipe.HeadSection`'s
            keys and the families' own), plain data. family: ``loss.type``, the drafter family that trains the head.
    """

    drafter: DrafterSection
    head: dict
    family: str


def model_settings(cfg: DictConfig) -> ModelSettings:
    """The :class:`ModelSettings` of a recipe."""
    return ModelSettings(drafter=section(DrafterSection, cfg.drafter),
                         head=OmegaConf.to_container(cfg.head, resolve=True), family=cfg.loss.type)


def parse_recipe_dtype(name: str, key: str) -> torch.dtype:
    """The dtype a recipe key names (:func:`~dartree.base.dtypes.parse_dtype`).

    Raises:
        RecipeError: an unknown name, with the key and the known names.
    """
    try:
        return parse_dtype(name, key)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def training_device(name: str = "cpu", local_rank: int | None = None) -> torch.device:
    """The device this process trains on: ``name``, the recipe's ``train.device`` (``cpu``, ``cuda``, or ``auto``
    resolved here as :func:`~dartree.training.recipe.resolve_train_device` does at load time); on CUDA the GPU of this
    process's local rank (``local_rank``, default ``$LOCAL_RANK`` or 0), so N processes of one machine use N GPUs.

    Raises:
        RecipeError: ``train.device=cuda`` without a CUDA device, or a local rank with no GPU of its own (one line,
            naming the fix).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RecipeError("train.device=cuda but torch sees no CUDA device (torch.cuda.is_available() is False); "
                          "use train.device=cpu or train.device=auto")
    rank = int(os.environ.get("LOCAL_RANK", "0") or 0) if local_rank is None else int(local_rank)
    if rank >= torch.cuda.device_count():
        raise RecipeError(f"local rank {rank} has no GPU of its own ({torch.cuda.device_count()} visible): start at "
                          f"most {torch.cuda.device_count()} processes per machine")
    return torch.device("cuda", rank)


def step_settings(cfg: DictConfig) -> StepSettings:
    """The step settings of a recipe: the objective of its drafter family (``loss.type``,
    :meth:`~dartree.models.families.Family.objective` of the ``loss`` and ``head`` sections), ``train.num_anchors``,
    ``loss.cumulative_mask``, ``train.bf16`` and ``train.fused_loss``.

    Raises:
        RecipeError: ``loss.type`` names no registered family (the registered ones listed).
    """
    try:
        family = get_family(cfg.loss.type)
    except KeyError as exc:
        raise RecipeError(str(exc.args[0])) from None
    loss, head = (OmegaConf.to_container(s, resolve=True) for s in (cfg.loss, cfg.head))
    return StepSettings(objective=family.objective(loss, head), num_anchors=int(cfg.train.num_anchors),
                        cumulative_mask=bool(cfg.loss.get("cumulative_mask", True)), bf16=bool(cfg.train.bf16),
                        fused_loss=bool(cfg.train.get("fused_loss", True)))


@dataclass(frozen=True)
class DataSettings:
    """What the data stage (:func:`prepare_data`) reads, built once from the recipe (:func:`data_settings`).

    Attributes:
        spec: prompts and generation settings of regenerated data (``data.*``,
            :class:`~dartree.training.answers.DataSpec`).
        source: ``data.source``: ``sharegpt`` / ``random`` (regenerated, features cached) or ``campaign``.
        holdout: held-out sequences (``data.holdout``). holdout_set: ``tail`` or ``fixed`` (``data.holdout_set``).
        holdout_turns: turns per conversation of the fixed held-out set (``data.holdout_turns``; 0: ``max_turns``).
        random_prompt_len: prompt length in tokens of ``random`` data (``data.random_prompt_len``).
        campaign_dir: the campaign folder of ``campaign`` data (``data.campaign_dir``; default: the repository's).
        campaign_shards: train on the first this many campaign shards (``data.campaign_shards``); None: all.
        feature_store_bytes: campaign data keeps the target's features in a store of at most this many bytes
            (``data.feature_store_gb`` * 1e9); None: off, every feature computed online.
        gen_dtype: the target's dtype while regenerating (``target.gen_dtype``); None for campaign data (no
            regeneration). target_path: ``target.path``, loaded again in ``gen_dtype`` when it differs from the
            training target's dtype.
        need_lse: the loss reads the target's full-vocabulary log-sum-exp (a draft vocabulary's L1 / TV / confidence
            label, :func:`~dartree.training.step.needs_target_lse`); campaign data then computes it per sequence.
    """

    spec: DataSpec
    source: str
    holdout: int
    holdout_set: str = "tail"
    holdout_turns: int = 0
    random_prompt_len: int = 12
    campaign_dir: Path = DEFAULT_DIR
    campaign_shards: int | None = None
    feature_store_bytes: int | None = None
    gen_dtype: torch.dtype | None = None
    target_path: str = ""
    need_lse: bool = False


def data_settings(cfg: DictConfig, step: StepSettings | None = None) -> DataSettings:
    """The data settings of a recipe: its ``data`` section, ``target.gen_dtype`` and ``target.path``, and whether its
    loss needs the target's log-sum-exp (``step``, the recipe's :func:`step_settings`, built here when None;
    ``drafter.draft_vocab_size``).

    Raises:
        RecipeError: an unknown ``target.gen_dtype`` of regenerated data, or ``loss.type`` naming no registered
            family (named).
    """
    d = cfg.data
    spec = DataSpec(num_prompts=d.num_prompts, max_prompt_tokens=d.max_prompt_tokens, max_new_tokens=d.max_new_tokens,
                    seed=d.seed, batch_size=d.gen_batch_size, code_fraction=d.code_fraction,
                    max_turns=int(d.get("max_turns", 1)), max_seq_tokens=int(d.get("max_seq_tokens", 2048)),
                    chat_template_kwargs=template_kwargs(cfg))
    store_gb = float(d.get("feature_store_gb", 0) or 0)
    regenerated = d.source in ("sharegpt", "random")
    return DataSettings(
        spec=spec, source=d.source, holdout=d.holdout, holdout_set=d.get("holdout_set", "tail"),
        holdout_turns=int(d.get("holdout_turns", 0)), random_prompt_len=d.random_prompt_len,
        campaign_dir=Path(d.get("campaign_dir", "") or DEFAULT_DIR),
        campaign_shards=int(d.get("campaign_shards", 0)) or None,  # .get: a run's recipe older than campaigns
        feature_store_bytes=int(store_gb * 1e9) if store_gb > 0 else None,
        gen_dtype=parse_recipe_dtype(cfg.target.gen_dtype, "target.gen_dtype") if regenerated else None,
        target_path=cfg.target.path,
        need_lse=needs_target_lse(step or step_settings(cfg), int(cfg.drafter.draft_vocab_size)))


@dataclass(frozen=True)
class InitSettings:
    """What :func:`load_init` reads of the recipe, built once from it (:func:`init_settings`).

    Attributes:
        conv_kernel_size: ``drafter.conv_kernel_size``; > 0 turns a DFlash backbone into a DFlash 2 one.
        conv_group_size: ``drafter.conv_group_size``, the added convolutions' group size.
        qk_norm: ``drafter.qk_norm``; True adds q/k norms to a backbone without them.
        draft_vocab_size: ``drafter.draft_vocab_size``; 0 drops a checkpoint's draft vocabulary.
        head_type: ``head.type``, the head type the recipe trains.
    """

    conv_kernel_size: int
    conv_group_size: int
    qk_norm: bool
    draft_vocab_size: int
    head_type: str


def init_settings(cfg: DictConfig) -> InitSettings:
    """The :class:`InitSettings` of a recipe (its ``drafter`` widening fields and ``head.type``)."""
    d = cfg.drafter
    return InitSettings(conv_kernel_size=int(d.conv_kernel_size), conv_group_size=int(d.conv_group_size),
                        qk_norm=bool(d.qk_norm), draft_vocab_size=int(d.draft_vocab_size), head_type=cfg.head.type)


@dataclass(frozen=True)
class RunSettings:
    """Every setting of one training run, typed, built once from the merged recipe (:func:`run_settings`); the trainer
    (:class:`~dartree.training.trainer.Trainer`) holds it and hands each stage its part.

    Attributes:
        recipe: the merged recipe as plain data (saved with the checkpoint and the resumable state).
        name, seed, output_dir, init_from, resume, freeze_backbone: ``recipe``, ``seed``, ``output_dir`` (as given),
            ``init_from`` (None: a fresh drafter), ``resume``, ``freeze_backbone``.
        target, train, wandb: those sections (:class:`~dartree.training.recipe.TargetSection`, ``TrainSection``,
            ``WandbSection``). zero_stage: ``deepspeed.zero_stage``.
        batch_loss: ``loss.normalization=batch`` (the step's loss over its pooled weight sum).
        cursor_from_init: ``data.cursor_from_init`` (continue init_from's run's data cursor).
        models, step, data, init: the stage settings (:class:`ModelSettings`, :class:`StepSettings`,
            :class:`DataSettings`, :class:`InitSettings`).
    """

    recipe: dict
    name: str
    seed: int
    output_dir: str
    init_from: str | None
    resume: bool
    freeze_backbone: bool
    target: TargetSection
    train: TrainSection
    wandb: WandbSection
    zero_stage: int
    batch_loss: bool
    cursor_from_init: bool
    models: ModelSettings
    step: StepSettings
    data: DataSettings
    init: InitSettings


def run_settings(cfg: DictConfig) -> RunSettings:
    """The :class:`RunSettings` of a merged recipe (:func:`~dartree.training.recipe.load_recipe`), checked again
    first (:func:`~dartree.training.checks.check_recipe`: a config built or edited in Python after loading).

    Raises:
        RecipeError: a field out of range or a combination that does not train (the first one, named), an unknown
            ``target.gen_dtype`` or ``loss.type``.
    """
    check_recipe(cfg)
    step = step_settings(cfg)
    return RunSettings(
        recipe=OmegaConf.to_container(cfg), name=cfg.recipe, seed=int(cfg.seed), output_dir=cfg.output_dir,
        init_from=cfg.init_from or None, resume=bool(cfg.resume), freeze_backbone=bool(cfg.freeze_backbone),
        target=section(TargetSection, cfg.target), train=section(TrainSection, cfg.train),
        wandb=section(WandbSection, cfg.wandb), zero_stage=int(cfg.deepspeed.zero_stage),
        batch_loss=cfg.loss.get("normalization", "per_sequence") == "batch",
        cursor_from_init=bool(cfg.data.get("cursor_from_init", False)), models=model_settings(cfg), step=step,
        data=data_settings(cfg, step), init=init_settings(cfg))

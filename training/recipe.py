"""Recipe schema and loading: YAML recipes (``recipes/<name>.yaml``) merged with ``key=value`` overrides.

The schema is an omegaconf structured config in struct mode, so a misspelt key is an error that lists the
valid keys at that level (recipes as data, as torchtune's YAML configs: pytorch/torchtune ``recipes/configs/``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from dartree.base.dtypes import native_bf16
from dartree.base.schema import merge_settings
from dartree.models.families import FAMILIES
from dartree.models.families.plugins import import_families, load_entry_point_families
from dartree.models.heads import HEADS
from dartree.training.checks import RecipeError, check_recipe  # noqa: F401  (RecipeError: this module's error)

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
_OWN_FAMILY = ("(a family of your own registers when its module is imported: families=[MODULE], or its package's "
               "dartree.families entry point; docs/families.md)")


@dataclass
class TargetSection:
    """The target model (``target.*``)."""
    path: str = "smollm2"  # "smollm2" (packaged default), "tiny-qwen3" (tests) or a local HF folder
    dtype: str = "float32"  # dtype of the target when computing features
    gen_dtype: str = "auto"  # dtype of the target when regenerating responses; auto: see resolve_auto_dtypes


@dataclass
class DrafterSection:
    """The drafter backbone (``drafter.*``)."""
    num_layers: int = 2
    intermediate_size: Optional[int] = None  # default: the target's
    target_layer_ids: list = field(default_factory=list)  # default: DFlash rule for 5 ids
    num_target_features: int = 5  # ids chosen by the DFlash rule when target_layer_ids is empty
    # warm start from the target: false | layers (true) | specforge (the layers, the identity projection on the
    # feature that feeds them, the target's norms; DFlashDrafter.warm_start)
    init_from_target: Any = True
    init_copy_layers: int = 0  # with init_from_target: copy this many of the target's top layers (0: every drafter layer)
    qk_norm: bool = False
    block_size: int = 16
    proposal_offset: int = 0  # 0: DSpark/Domino convention (P = L)
    mask_token_id: Optional[int] = None  # default: tokenizer unk id, else 0
    draft_vocab_size: int = 0  # 0: full vocabulary; N: the N most frequent response tokens (EAGLE-3 style)
    conv_kernel_size: int = 0  # 0: DFlash layers; k >= 1: DFlash 2 grouped dynamic causal convolutions of k taps
    conv_group_size: int = 16  # DFlash 2: channels sharing one dynamic tap
    causal_block: bool = False  # attention causal inside the block (DSpine); false: DFlash's bidirectional block


@dataclass
class HeadSection:
    """The correction head (``head.*``; registered families add keys of their own)."""
    type: str = "markov"  # a head type of loss.type's family (dartree.models.families): identity (dflash), gru
    # (domino), markov | gated_markov | rnn (dspark), selector (dflash2)
    rank: int = 64  # DSpark Markov rank R; Domino emb_dim E when emb_dim is unset
    emb_dim: Optional[int] = None  # gru: rank E of the logit residual (default: rank)
    gru_hidden_dim: Optional[int] = None  # gru: GRU state width G (default: 4 x emb_dim)
    prefix_len: int = 1  # gru: Domino pure_draft_prefix_len (leading proposals without correction)
    confidence_head: bool = False  # DSpark heads: train the confidence head (BCE to 1 - TV/2)
    confidence_with_markov: bool = True  # confidence input [h ; W1[x_prev]] (else h only)
    top_k: int = 16  # selector (DFlash 2): candidates of U reranked per position (selector_top_k)


@dataclass
class LossSection:
    """The drafter family and its loss (``loss.*``)."""
    # the drafter family (dartree.models.families), whose loss trains the head: dflash (CE) | domino ((1-lambda)
    # CE(final) + lambda CE(base)) | dspark (CE + L1 + BCE) | dflash2 (CE(base) + CE(selector-corrected), equal weights)
    type: str = "dspark"
    gamma: Optional[float] = 7.0  # decay exp(-k/gamma) over the proposals (k = 0 first; B=16 default); null: none
    ce_weight: float = 0.1  # dspark
    l1_weight: float = 0.9  # dspark: L1 distance sum|p_d - p_t| to the target distribution (DeepSpec's "TVD" term)
    tv_weight: float = 0.0  # dspark: total variation 0.5 sum|p_d - p_t| (tv_weight w = l1_weight w/2)
    kl_weight: float = 0.0  # dspark: KL(p_t || p_d), p_t renormalised over a draft vocabulary
    # dspark: the LK loss lambda KL + (1 - lambda) TV (LK losses, arXiv 2602.23881), weight lk_weight; lk_lambda a
    # fixed lambda in [0, 1], or null: adaptive, lambda = exp(-lk_eta * (1 - TV)) per prediction (the paper's eta 3)
    lk_weight: float = 0.0
    lk_lambda: Optional[float] = None
    lk_eta: float = 3.0
    conf_weight: float = 1.0  # dspark with head.confidence_head: BCE of the confidence head
    lambda_base_start: float = 1.0  # domino: lambda at step 0
    lambda_decay_ratio: float = 1.0  # domino: lambda reaches 0 after int(ratio * planned steps) steps (SpecForge: 0.5)
    # per_sequence: each sequence's terms over its own weight sum, then the mean over the step's sequences;
    # batch: every weighted term of the step over the step's weight sum (all-reduced over processes; SpecForge)
    normalization: str = "per_sequence"
    cumulative_mask: bool = True  # a masked label drops every later label of its block (DSpark); false: that label only


@dataclass
class DataSection:
    """The training data (``data.*``)."""
    source: str = "sharegpt"  # "sharegpt", "random" (random prompts; tiny test recipes) or "campaign" (committed shards)
    campaign_dir: str = ""  # source=campaign: the campaign folder ("": campaign/ in the repository)
    campaign_shards: int = 0  # source=campaign: train on the first this many shards (0: all); features online
    num_prompts: int = 768
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    seed: int = 0
    gen_batch_size: int = 128  # regeneration slots (continuous batching; docs/training.md has the measured rates)
    code_fraction: float = 0.0  # about this share of the ShareGPT prompts are programming prompts
    holdout: int = 32
    # tail: the last `holdout` of the drawn prompts (depends on num_prompts and seed); fixed: the `holdout`
    # conversations first in SHA-256 order of their first turn, regenerated once, never trained on
    holdout_set: str = "tail"
    holdout_turns: int = 0  # fixed held-out set: turns per held-out conversation (0: max_turns; pin it across max_turns)
    max_turns: int = 1  # human turns per conversation; each assistant turn regenerated with the target's own history
    max_seq_tokens: int = 2048  # max_turns > 1: a turn is regenerated only if history + max_new_tokens fit in this
    random_prompt_len: int = 12  # "random" source only
    # extra chat-template variables passed to apply_chat_template wherever training renders the template, e.g.
    # {enable_thinking: false}; part of the data cache key only when non-empty (older caches keep their hash)
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # continue init_from's run's data cursor (every training sequence once per epoch, in a seeded permutation, the
    # position carried from run to run of a lineage); false: the cursor starts at epoch 0
    cursor_from_init: bool = False
    # source=campaign: keep the target's features of every sequence computed in the user cache (feature-store/, never
    # the repository), at most this many GB, least recently used out; later visits read them (0: off, all online)
    feature_store_gb: float = 0.0


@dataclass
class TrainSection:
    """The optimiser, schedule, device and engine of the loop (``train.*``)."""
    epochs: float = 8.0
    max_steps: int = 0  # 0: epochs decide
    max_minutes: float = 0.0  # 0: no wall-clock cap; else stop (and save) after this many minutes of training
    seqs_per_step: int = 4
    num_anchors: int = 32
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    lr_schedule: str = "cosine"  # cosine (to 5% at the end) | constant (after the warm-up; SpecForge's DSpark notes)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bf16: Any = "auto"  # autocast the drafter to bf16 (true / false / auto: see resolve_auto_dtypes)
    device: str = "auto"  # cpu | cuda | auto (cuda where torch.cuda.is_available(), else cpu): see resolve_train_device
    engine: str = "deepspeed"  # deepspeed | torch (a plain-torch engine, one process or DDP-style all-reduce)
    fused_loss: bool = True  # chunked logits+loss+gradient (fused_loss.fused_block_loss); false: materialised logits
    threads: int = 0  # torch threads; 0 = torch default
    save_every_minutes: float = 15.0  # resumable checkpoint every this many minutes (0: off)
    save_every_steps: int = 0  # ... and/or every this many steps (0: off)
    eval_every_steps: int = 0  # learning curve: held-out chain tau every this many steps (0: only at the end)
    # the LR schedule continues init_from's run's: it starts at the step that run's lineage reached (no second
    # warm-up) and spans the lineage's steps plus this run's
    schedule_from_init: bool = False
    schedule_steps: int = 0  # the schedule's length in lineage steps (0: the lineage's steps so far + this run's)


@dataclass
class DeepSpeedSection:
    """DeepSpeed's ZeRO stage (``deepspeed.*``)."""
    zero_stage: int = 0  # ZeRO stage 0, 1, 2 or 3 (train.engine=deepspeed; gloo on CPU, cpu:gloo,cuda:nccl on CUDA)


@dataclass
class WandbSection:
    """Weights & Biases logging (``wandb.*``)."""
    enabled: bool = False
    mode: str = "offline"
    project: str = "dartree"


@dataclass
class Recipe:
    """A training recipe: the schema every recipe file and ``key=value`` override is merged into (struct mode)."""
    recipe: str = MISSING
    families: List[str] = field(default_factory=list)  # modules imported first, each registering a family of its own
    seed: int = 0
    output_dir: str = "runs/${recipe}"
    init_from: Optional[str] = None  # start from an existing drafter (dartree or training checkpoint folder)
    freeze_backbone: bool = False  # train the head only (adding a correction head to an existing drafter)
    resume: bool = False  # continue from <output_dir>/resume (model, optimiser, scheduler, data position)
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    head: HeadSection = field(default_factory=HeadSection)
    loss: LossSection = field(default_factory=LossSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)


def load_recipe(args: list[str]) -> DictConfig:
    """Build the recipe from ``recipe=NAME|PATH`` and ``key=value`` overrides.

    Args:
        args: command-line words, e.g. ``["recipe=dspark_b16", "train.epochs=2"]``.
    Returns:
        The merged, resolved, struct-mode config.
    Raises:
        RecipeError: no recipe given, recipe file not found, an unknown / ill-typed key (valid keys listed), a
            ``families`` module that cannot be imported, or a value out of its range
            (``dartree.training.checks.RECIPE_FIELDS``: key, value and range named).

    ``families`` (a list of module names, on the command line ``families=[my_family]``) is read from the command
    line, else the recipe file, and imported before anything else is checked, so the families those modules register
    (:mod:`dartree.models.families.plugins`) are known to ``loss.type``, ``head.type`` and the ``head`` keys.
    """
    cli = OmegaConf.from_dotlist(list(args))
    name = cli.get("recipe")
    if not name:
        names = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
        raise RecipeError(f"give a recipe: recipe=NAME with NAME one of {names}, or recipe=path/to/file.yaml")
    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        path = RECIPE_DIR / f"{name}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
        raise RecipeError(f"recipe {name!r} not found ({path}); available: {names}")
    try:
        from_file = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends: report the file and the parser's one-line reason
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"cannot parse recipe {path}: {reason}") from None
    load_entry_point_families()  # families of installed packages, then the recipe's own modules
    _import_families(cli, from_file, path)
    schema = OmegaConf.structured(Recipe)
    OmegaConf.set_struct(schema, True)
    _add_family_fields(schema)
    OmegaConf.set_struct(schema.data.chat_template_kwargs, False)  # template variables: any names
    cli.recipe = path.stem
    schema = merge_settings(schema, [(from_file, str(path)), (cli, "command line")], RecipeError)
    OmegaConf.resolve(schema)
    check_family(schema)
    if schema.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise RecipeError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {schema.deepspeed.zero_stage}")
    if schema.data.source not in ("sharegpt", "random", "campaign"):
        raise RecipeError(f"data.source {schema.data.source!r} is unknown; use 'sharegpt', 'random' or 'campaign'")
    check_recipe(schema)  # every numeric field in range, no combination that trains nothing (one line, named)
    for line in [*resolve_train_device(schema), *resolve_auto_dtypes(schema)]:
        if os.environ.get("RANK", "0") == "0":
            print(line, flush=True)
    return schema


def _add_family_fields(schema: DictConfig) -> None:
    """Add the ``head`` keys the registered families declare (:attr:`~dartree.models.families.Family.recipe_fields`)
    to the recipe schema, at their defaults.

    Raises:
        RecipeError: a family declares a key every recipe's head section already has (:class:`HeadSection`), whose
            meaning and default it would silently share; the family and the fix named.
    """
    shared = set(schema.head)
    with open_dict(schema.head):
        for fam in FAMILIES.values():
            for key, (default, _) in fam.recipe_fields.items():
                if key in shared:
                    raise RecipeError(f"drafter family {fam.name!r} ({type(fam).__module__}) declares recipe field "
                                      f"head.{key}, which every recipe already has (shared keys: {sorted(shared)}); "
                                      f"give its field a name of its own, e.g. {fam.name}_{key}")
                schema.head[key] = default


def _import_families(cli: DictConfig, from_file, path: Path) -> None:
    """Import the ``families`` modules the command line (else the recipe file ``path``) names.

    Raises:
        RecipeError: ``families`` is not a list of module names, or a module cannot be imported (named).
    """
    source, label = (cli, "command line") if "families" in cli else (from_file, str(path))
    names = source.get("families") if isinstance(source, DictConfig) else None
    if names is None:
        return
    if not OmegaConf.is_list(names):
        raise RecipeError(f"families in {label} must be a list of module names, e.g. families=[my_family]; got "
                          f"{names!r}")
    try:
        import_families(list(names))
    except ValueError as exc:
        raise RecipeError(f"{exc} ({label})") from None


def check_family(cfg: DictConfig) -> None:
    """Check that the recipe's ``loss.type`` names a registered drafter family (:mod:`dartree.models.families`) that
    trains its ``head.type``, and that a confidence head is asked of a family whose heads carry one.

    Raises:
        RecipeError: an unknown head type or family (the registered ones listed), or a pair that does not fit.
    """
    head, loss = cfg.head.type, cfg.loss.type
    if head not in HEADS:
        raise RecipeError(f"head.type {head!r} is unknown; available: {sorted(HEADS)} {_OWN_FAMILY}")
    if loss not in FAMILIES:
        raise RecipeError(f"loss.type {loss!r} is unknown; use one of {sorted(FAMILIES)} {_OWN_FAMILY}")
    types = FAMILIES[loss].head_types()
    if head not in types:
        raise RecipeError(f"loss.type {loss!r} trains head.type {sorted(types)}, not {head!r}; change one of them")
    if cfg.head.confidence_head and not FAMILIES[loss].confidence:
        names = " or ".join(sorted(n for n, f in FAMILIES.items() if f.confidence))
        raise RecipeError(f"head.confidence_head=true needs loss.type={names} (a head with a confidence head)")


def resolve_train_device(cfg: DictConfig) -> list[str]:
    """Replace ``train.device=auto`` in place by the device training runs on: ``cuda`` where
    ``torch.cuda.is_available()``, else ``cpu``; check that an explicit ``cuda`` can run here. The resolved value is
    what the run records (recipe.json beside its resumable state, training.json beside the checkpoint), and what
    :func:`resolve_auto_dtypes` then decides bf16 from. Returns one line when ``auto`` was resolved (printed by
    train), else none.

    Raises:
        RecipeError: ``train.device=cuda`` where torch sees no CUDA device (a CPU build of torch, no GPU, or
            ``CUDA_VISIBLE_DEVICES`` empty), one line naming the fix.
    """
    import torch

    lines = []
    with open_dict(cfg):
        if cfg.train.device == "auto":
            cfg.train.device = "cuda" if torch.cuda.is_available() else "cpu"
            lines.append(f"train.device=auto -> {cfg.train.device}: torch.cuda.is_available() is "
                         f"{torch.cuda.is_available()}")
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError(f"train.device=cuda but torch sees no CUDA device (torch {torch.__version__}, "
                          f"torch.cuda.is_available() is False); use train.device=cpu or train.device=auto")
    return lines


def resolve_auto_dtypes(cfg: DictConfig) -> list[str]:
    """Replace ``target.gen_dtype=auto`` and ``train.bf16=auto`` in place by what the training device runs fastest.

    auto means bf16 (regeneration in bfloat16, drafter autocast to bf16) where the device has native bf16
    arithmetic, else float32 / false: on ``train.device=cuda`` where ``torch.cuda.is_bf16_supported()`` (every GPU
    since Ampere), on the CPU where :func:`~dartree.base.dtypes.native_bf16` holds. A recipe whose ``train.device``
    is still ``auto`` is resolved first (:func:`resolve_train_device`). The resolved values are what the run
    records (recipe.yaml beside the checkpoint, the data cache key), so a run is reproducible from its record.
    Returns one line per field resolved (printed by train).
    """
    if cfg.train.device == "auto":
        resolve_train_device(cfg)
    if cfg.train.device == "cuda":
        import torch

        native = bool(torch.cuda.is_bf16_supported())
        why = (f"CUDA device {torch.cuda.get_device_name()} "
               f"{'has' if native else 'has no'} native bf16 arithmetic")
    else:
        native, why = native_bf16()
    lines = []
    with open_dict(cfg):
        if cfg.target.gen_dtype == "auto":
            cfg.target.gen_dtype = "bfloat16" if native else "float32"
            lines.append(f"target.gen_dtype=auto -> {cfg.target.gen_dtype}: {why}")
        if cfg.train.bf16 == "auto":
            cfg.train.bf16 = native
            lines.append(f"train.bf16=auto -> {str(native).lower()}: {why}")
    return lines

"""What a run builds and writes, from its typed settings (:mod:`dartree.training.settings`): the target, the drafter
and head (fresh or from ``init_from``), the training data, and the training checkpoint. :func:`build_models` is the
one place that turns the recipe's ``drafter`` and ``head`` sections (:class:`~dartree.training.settings.ModelSettings`)
into modules; :func:`load_run_models` and :func:`load_run_data` are a run's setup steps.

The checkpoint a run writes (``<output_dir>/checkpoint``) is a dartree checkpoint (:mod:`dartree.models.checkpoint`:
config.json + model.safetensors, tensors in fp32) that ``decode/eval.py --checkpoint`` loads as it is, with the
run's recipe and summary beside it in ``training.json``. Checkpoints of the older training layout (format
``dartree-train``: ``drafter.*`` tensors, recipe and state inside config.json) still load here and convert with
``convert/to_dartree.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from dartree.models.checkpoint import (LINEAGE_FILE, TRAINING_FILE, CheckpointError, build_from_config, cast_floats,
    check_target_pairing, dartree_config, load_strict, read_safetensors)
from dartree.base.files import write_folder_atomically
from dartree.base.records import parse_json
from dartree.models.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dartree.models.families import get_family
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target, cache_root, load_target
from dartree.training.campaign_data import CampaignData, campaign_rows
from dartree.training.campaign_store import CampaignError
from dartree.training.answers import regenerate_responses
from dartree.training.checks import check_against_target
from dartree.training.data import BlockData, select_draft_vocab
from dartree.training.engine import rank0_first
from dartree.training.features import compute_features, target_lse
from dartree.training.recipe import RecipeError
from dartree.training.settings import DataSettings, InitSettings, ModelSettings, RunSettings, parse_recipe_dtype
from dartree.training.feature_store import FeatureStore

# format of the older training checkpoints (read by load_init and convert/to_dartree.py)
TRAIN_FORMAT = "dartree-train"
# TRAINING_FILE (dartree.models.checkpoint): the run's recipe and summary, beside the dartree checkpoint's config.json
# and model.safetensors
# training.json fields copied into the checkpoint's provenance (what convert/to_dartree.py recorded before)
PROVENANCE_FIELDS = ("steps", "final_loss", "train_min", "data_prep_min", "train_sequences", "train_tokens",
                     "holdout_tf_tau", "holdout_chain_tau")


def load_recipe_target(path: str, dtype: torch.dtype, device: torch.device | str | None = None) -> Target:
    """:func:`~dartree.models.target.load_target` for a recipe's ``target.path``, moved to ``device`` (default: where
    it loads, the CPU). Move it before anything binds its weights (the gru head binds its embedding matrix,
    :func:`build_models`, :func:`load_init`).

    Raises:
        RecipeError: the target cannot be loaded (missing folder, no config.json, a missing package), named.
    """
    try:
        target = load_target(path, dtype=dtype)
    except (OSError, RuntimeError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"target.path={path!r} cannot be loaded: {reason}") from None
    if device is not None and torch.device(device) != target.device:
        target.model.to(device)
    return target


def build_models(models: ModelSettings, target: Target):
    """Create the drafter backbone and head for ``target`` from the recipe's ``drafter`` and ``head`` sections
    (``models``); returns (drafter, head). The head is the recipe's ``head.type`` with the constructor arguments its
    family derives from the ``head`` section (:meth:`~dartree.models.families.Family.head_kwargs`).

    Raises:
        RecipeError: invalid layer ids, family, head type or sizes (message names the key).
    """
    d = models.drafter
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
        rope_theta=float(rope_theta(tcfg)),
        draft_vocab_size=int(d.draft_vocab_size),
        conv_kernel_size=int(d.conv_kernel_size),
        conv_group_size=int(d.conv_group_size),
        causal_block=bool(d.causal_block),
    )
    try:
        drafter = DFlashDrafter(dcfg)
        variant = warm_start_variant(d.init_from_target)
        if variant:
            drafter.warm_start(target.model, variant, int(d.init_copy_layers or 0))
        head = get_family(models.family).build_head(models.head, target.vocab_size, target.hidden_size, dcfg.num_layers)
        if variant == "specforge":  # every head starts as "no correction", SpecForge's confidence head at zero
            if hasattr(head, "start_uncorrected"):  # heads whose output rows start random (DFlash 2's selector)
                head.start_uncorrected()
            if hasattr(head, "confidence"):
                with torch.no_grad():
                    head.confidence.weight.zero_()
                    head.confidence.bias.zero_()
        head.bind_embeddings(target.embed_tokens.weight)  # the gru head reads the target's token embeddings
    except (ValueError, KeyError) as exc:
        raise RecipeError(f"cannot build the drafter from the recipe: {exc}") from None
    return drafter, head


def warm_start_variant(value) -> str | None:
    """``drafter.init_from_target`` as a :meth:`~dartree.models.drafter.DFlashDrafter.warm_start` variant: None
    (false: random init), ``"layers"`` (true or "layers") or ``"specforge"``."""
    if value is True or value == "layers":
        return "layers"
    return "specforge" if value == "specforge" else None


def rope_theta(tcfg) -> float:
    """RoPE theta of a transformers config (``rope_parameters.rope_theta``, else ``rope_theta``, else 10000)."""
    rp = getattr(tcfg, "rope_parameters", None) or {}
    return rp.get("rope_theta") or getattr(tcfg, "rope_theta", None) or 10000.0


def prepare_data(settings: DataSettings, target: Target) -> BlockData | CampaignData:
    """The training data of :func:`~dartree.training.settings.data_settings` for ``target``'s layer ids.

    Every ShareGPT or random data set, single-turn (``data.max_turns=1``, the shipped recipes) or multi-turn, with
    either held-out set, is :func:`~dartree.training.answers.regenerate_responses` (one pipeline; single-turn data
    keeps its cache folders) in ``settings.gen_dtype``, with the target's features cached: a BlockData. Campaign data
    is the committed campaign shards with the features computed online (in a feature store where
    ``settings.feature_store_bytes`` is set): a CampaignData.

    Raises:
        RecipeError: an unknown ``data.source``, unreadable campaign shards, or a data problem (too few usable
            prompts), named.
    """
    s = settings
    if s.source == "campaign":  # committed campaign shards, features recomputed online
        try:
            train_rows, hold_rows = campaign_rows(s.campaign_dir, s.campaign_shards)
        except CampaignError as exc:
            raise RecipeError(f"data.source=campaign: {exc}") from None
        store = None
        if s.feature_store_bytes is not None:
            store = FeatureStore(cache_root() / "feature-store", target, s.feature_store_bytes)
        data = CampaignData(target, train_rows, hold_rows, store=store)
        # the full-vocabulary lse per sequence only where the loss reads it (a draft vocabulary's L1 / TV /
        # confidence label): a dflash or domino run, or the KL alone, skips that [T, V] matmul per target forward
        data.need_lse = s.need_lse
        return data
    if s.source not in ("sharegpt", "random"):
        raise RecipeError(f"data.source {s.source!r} is not 'sharegpt', 'random' or 'campaign'")
    # regeneration runs where the target is (continuous_greedy follows the model's device)
    gen_target = (target if s.gen_dtype == target.dtype
                  else load_recipe_target(s.target_path, s.gen_dtype, device=target.device))
    # every stage stops where the target's own generate stops (dartree.models.generation.stop_ids)
    try:
        responses = regenerate_responses(gen_target, s.spec, source=s.source, holdout=s.holdout,
                                         holdout_set=s.holdout_set, holdout_turns=s.holdout_turns,
                                         random_prompt_len=s.random_prompt_len)
    except ValueError as exc:
        raise RecipeError(f"data: {exc}") from None
    del gen_target
    feats = compute_features(target, responses)
    return BlockData(responses, feats, holdout=s.holdout)


def load_run_models(run: RunSettings, device: torch.device, log: Callable[[str], None] = print):
    """A run's (target, drafter, head) on ``device``: the target (``target.path`` in ``target.dtype``) checked against
    the recipe (:func:`~dartree.training.checks.check_against_target`), then init_from's drafter (a checkpoint whose
    head corrects nothing gets :func:`build_models`' fresh head) or a fresh one, reading the target's layers.

    Raises:
        RecipeError: the target does not load or fit the recipe, or init_from does not (one line).
    """
    # on the training device before build_models / load_init bind its embedding (the gru head keeps a reference)
    target = load_recipe_target(run.target.path, parse_recipe_dtype(run.target.dtype, "target.dtype"), device=device)
    check_against_target(run, target)  # layer ids, mask id, vocabulary sizes: before the data stage
    if run.init_from:
        drafter, head = load_init(run.init_from, target, run.init, lambda: build_models(run.models, target)[1])
        log(f"init_from {run.init_from}: {drafter.cfg.num_layers}-layer backbone, block {drafter.cfg.block_size}, "
            f"head {head.type_name}")
    else:
        drafter, head = build_models(run.models, target)
    if device.type != "cpu":  # built on the CPU; DeepSpeed would move the module, the torch engine does not
        drafter.to(device)
        head.to(device)
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    return target, drafter, head


def load_run_data(run: RunSettings, target: Target, main: bool, log: Callable[[str], None] = print):
    """A run's training data (:func:`prepare_data`), made on rank 0 (``main``) first, the other ranks reading its
    cache; returns (the data, seconds it took).

    Raises:
        RecipeError: a data problem (:func:`prepare_data`), or no sequence with a response token to predict.
    """
    t0 = time.time()
    data = rank0_first(lambda: prepare_data(run.data, target), main)
    seconds = time.time() - t0
    log(f"data: {len(data)} training sequences ({data.num_tokens()} tokens), {len(data.holdout_ids)} held out; "
        f"prepared in {seconds / 60:.1f} min")
    if not len(data):
        raise RecipeError("no training sequence has a response token to predict; raise data.max_new_tokens")
    return data, seconds


def choose_draft_vocabulary(run: RunSettings, target: Target, drafter, data, main: bool, log=print) -> None:
    """Choose a fresh drafter's draft vocabulary from ``data`` (:func:`~dartree.training.data.select_draft_vocab`;
    a fine-tuned one keeps its own) and cache the target's log-sum-exp beside stored features (online data computes
    it per sequence).

    Raises:
        RecipeError: ``drafter.draft_vocab_size`` cannot hold the stop ids or exceeds the vocabulary.
    """
    if not run.init_from:
        try:
            ids, cover = select_draft_vocab(data, drafter.cfg.draft_vocab_size, target.vocab_size,
                                            target_stop_ids(target))
        except ValueError as exc:
            raise RecipeError(f"drafter.draft_vocab_size: {exc}") from None
        drafter.draft_vocab.copy_(ids)
        log(f"draft vocabulary: {ids.numel()} of {target.vocab_size} tokens cover {100 * cover:.1f}% of the training "
            "response tokens")
    if not getattr(data, "online", False):
        data.lse = rank0_first(lambda: target_lse(target, data.features_path), main)


def save_training_checkpoint(folder: Path, drafter, head, target: Target, recipe: dict, state: dict,
                             state_dicts: tuple[dict, dict] | None = None) -> Path:
    """Write the run's drafter as a dartree checkpoint, atomically: config.json (format ``dartree``; provenance
    ``source_format`` ``dartree-train`` with the recipe name and :data:`PROVENANCE_FIELDS` of ``state``),
    model.safetensors (``backbone.*`` and ``head.*`` full tensors in fp32) and :data:`TRAINING_FILE` (the recipe
    and ``state``, the run's summary, whose ``lineage`` and ``cursor`` are the lineage record
    :func:`~dartree.models.checkpoint.read_lineage` reads; an older ``lineage.json`` of the folder is dropped).

    Args:
        folder: the checkpoint folder (``<output_dir>/checkpoint``), replaced as a whole.
        recipe: the run's merged recipe as plain data. state: the run's summary (JSON-serialisable).
        state_dicts: (drafter, head) full state dicts when the modules' own hold partitions (ZeRO-3).
    Returns:
        ``folder``.
    """
    drafter_sd, head_sd = state_dicts if state_dicts is not None else (drafter.state_dict(), head.state_dict())
    tensors = {f"backbone.{k}": cast_floats(v.detach(), torch.float32).contiguous() for k, v in drafter_sd.items()}
    tensors.update({f"head.{k}": cast_floats(v.detach(), torch.float32).contiguous() for k, v in head_sd.items()})
    provenance = {"source_format": TRAIN_FORMAT, "recipe": recipe["recipe"],
                  **{k: state.get(k) for k in PROVENANCE_FIELDS if k in state}}
    config = dartree_config(drafter.cfg.to_dict(), {"type": head.type_name, **head.hparams()}, target.identity(),
                            provenance)
    training = {"recipe": recipe, "state": state}
    write_folder_atomically(Path(folder), {
        "config.json": json.dumps(config, indent=2).encode(),
        "model.safetensors": {"tensors": tensors, "metadata": {"format": config["format"]}},
        TRAINING_FILE: json.dumps(training, indent=1).encode(),
    }, drop=(LINEAGE_FILE,))
    return Path(folder)


def run_recipe(folder: Path) -> dict:
    """The recipe a training checkpoint was trained with: ``training.json``'s, or (older layout) config.json's.

    Raises:
        RecipeError: the folder holds no training checkpoint, or one without its recipe (named).
    """
    folder = Path(folder)
    for name, key in ((TRAINING_FILE, "recipe"), ("config.json", "recipe")):
        try:
            recipe = parse_json((folder / name).read_text(), dict, str(folder / name), "give a training run's "
                                "checkpoint", RecipeError).get(key)
        except FileNotFoundError:
            continue
        if isinstance(recipe, dict):
            return recipe
    raise RecipeError(f"{folder} holds no training checkpoint with its recipe (training.json or config.json); give a "
                      "training run folder")


def qk_norm_init(tensors: dict, prefix: str, dcfg) -> dict:
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


def load_init(path: str, target: Target, settings: InitSettings, fresh_head: Callable[[], CorrectionHead]):
    """Drafter and head to fine-tune from ``init_from=PATH`` (a dartree checkpoint, e.g. a converted published
    drafter, or a ``training/train.py`` checkpoint); returns (drafter, head) in fp32. The backbone architecture comes
    from the checkpoint; a checkpoint whose head corrects nothing
    (:attr:`~dartree.models.heads.CorrectionHead.corrects` False: identity, a plain DFlash drafter) gets
    ``fresh_head()`` instead, a fresh head of the recipe's type bound to ``target`` (callers pass
    :func:`build_models`'s; called only in this case), and a recipe with ``drafter.conv_kernel_size`` > 0 turns a
    DFlash backbone into a DFlash 2 one whose convolutions start as the identity (the same function as the
    checkpoint's). Two more widenings make a CPU-tuned drafter exportable to the published layouts
    (:func:`dartree.convert.export_config.export_config`), which all have Qwen3 layers over the full vocabulary:

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

    Args:
        settings: the recipe's :class:`InitSettings` (the ``drafter.*`` and ``head.type`` values named here).
        fresh_head: no arguments; the recipe's head, called only for a checkpoint whose head corrects nothing.
    Raises:
        RecipeError: the folder is not a drafter checkpoint, does not fit the target, or holds a different head
            type than the recipe trains (other than one that corrects nothing), or ``fresh_head`` raises ValueError (a
            RecipeError included); each prefixed ``init_from=PATH:``.
    """
    folder = Path(path)
    cfg_path = folder / "config.json"
    try:
        config = parse_json(cfg_path.read_text(), dict, str(cfg_path), "give a dartree checkpoint", CheckpointError)
        fmt = config.get("format")
        if fmt not in ("dartree", TRAIN_FORMAT):
            raise CheckpointError(f"{cfg_path}: format {fmt!r} is not a dartree or training checkpoint; convert it "
                                  "first: python convert/to_dartree.py SRC --out DST, then init_from=DST")
        check_target_pairing(config, target)
        dsec, s = config.get("drafter", {}), settings
        add_conv = s.conv_kernel_size > 0 and not dsec.get("conv_kernel_size")
        if add_conv:  # DFlash -> DFlash 2: the convolutions start as the identity, so the function is unchanged
            config = {**config, "drafter": {**dsec, "conv_kernel_size": s.conv_kernel_size,
                                            "conv_group_size": s.conv_group_size}}
        add_qk = s.qk_norm and not dsec.get("qk_norm", False)
        full_vocab = s.draft_vocab_size == 0 and bool(dsec.get("draft_vocab_size", 0))
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
            tensors = {**tensors, **qk_norm_init(tensors, prefix, drafter.cfg)}
        load_strict(drafter, tensors, prefix, folder)
        if head.type_name == s.head_type:
            load_strict(head, tensors, "head.", folder)
            head.bind_embeddings(target.embed_tokens.weight)
        elif not head.corrects:  # nothing to keep: the recipe's head starts fresh
            head = fresh_head()
        else:
            raise CheckpointError(f"init_from {folder} holds a {head.type_name!r} head but the recipe trains "
                                  f"{s.head_type!r}; set head.type={head.type_name} or start from a DFlash drafter")
    except FileNotFoundError as exc:
        raise RecipeError(f"init_from={path}: {exc.strerror or exc}: {exc.filename}") from None
    except (CheckpointError, ValueError, KeyError) as exc:
        raise RecipeError(f"init_from={path}: {exc}") from None
    return drafter.float(), head.float()

"""The dartree checkpoint format: ``config.json`` + ``model.safetensors`` in one folder.

config.json::

    {"format": "dartree", "format_version": 1,
     "drafter": {DrafterConfig fields},
     "head": {"type": "markov", "vocab_size": V, "rank": R},
     "target": {"name": ..., "vocab_size": V, "hidden_size": D, "num_layers": n,
                "max_position_embeddings": context length in tokens (optional; exports write it)},
     "provenance": {...free-form: how it was made}}

Beside them a checkpoint may hold the lineage record of the training run that made its weights (what a run that
continues them with ``train.schedule_from_init`` / ``data.cursor_from_init`` reads, :func:`read_lineage`): a
training run's checkpoint in its ``training.json`` (:data:`TRAINING_FILE`), a checkpoint converted from one in
``lineage.json`` (:data:`LINEAGE_FILE`, written by :func:`write_dartree`). Loading reads neither.

Tensors: ``backbone.<DFlashDrafter parameter>`` and ``head.<head parameter>`` (names in checkpoints/README.md).
Loading is strict: a missing, unexpected or mis-shaped tensor is an error naming it, and a drafter/target
mismatch is an error naming both values. Writes go to a temporary folder that is renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dartree.models.drafter import DFlashDrafter, DrafterConfig
from dartree.base.files import write_folder_atomically
from dartree.models.families import build_head, head_fields  # the built-in families register their heads in HEADS
from dartree.models.heads import HEADS, CorrectionHead
from dartree.base.fields import field_problems, same_value, typed
from dartree.base.records import read_json
from dartree.models.validate import DRAFTER_FIELDS

FORMAT = "dartree"
FORMAT_VERSION = 1
# beside a training run's checkpoint (dartree.training.build writes it): the run's recipe and summary, whose
# ``state.lineage`` and ``state.cursor`` are the lineage record
TRAINING_FILE = "training.json"
# beside a checkpoint converted from a training run's: that run's lineage record alone (:func:`write_dartree`), so the
# converted folder holds no training.json and is never taken for a training run's checkpoint
LINEAGE_FILE = "lineage.json"
# the lineage record (dartree.base.records shape): all of lineage.json, and the ``state`` of a training.json.
# ``lineage``: {"step0", "steps", "schedule_steps"}, the lineage steps at the run's start and end and its
# schedule's length; ``cursor``: the run's data cursor at its end (dartree.training.cursor.DataCursor.state)
LINEAGE_RECORD_SHAPE = {"lineage?": ({"steps?": int, "schedule_steps?": int}, None), "cursor?": (dict, None)}
TRAINING_LINEAGE_SHAPE = {"state?": (LINEAGE_RECORD_SHAPE, None)}


class CheckpointError(ValueError):
    """A checkpoint folder is malformed or does not fit the target; the message names the problem and fix."""


@dataclass
class DraftModel:
    """A loaded drafter: backbone, correction head and the checkpoint config."""

    drafter: DFlashDrafter
    head: CorrectionHead
    config: dict


def ensure_replaceable(dest: Path, formats: tuple[str, ...]) -> None:
    """Refuse to overwrite anything but a checkpoint folder of one of ``formats``.

    Raises:
        CheckpointError: ``dest`` is a file, or a folder that is not such a checkpoint (nothing is touched).
    """
    dest = Path(dest)
    if not dest.exists():
        return
    try:
        fmt = json.loads((dest / "config.json").read_text()).get("format") if dest.is_dir() else None
    except (OSError, json.JSONDecodeError):
        fmt = None
    if fmt not in formats:
        raise CheckpointError(
            f"refusing to overwrite {dest}: it exists and is not a {'/'.join(formats)} checkpoint; choose a new --out folder"
        )


def dartree_config(drafter_cfg: dict, head_cfg: dict, target_identity: dict, provenance: dict | None = None) -> dict:
    """The config.json dict of a dartree checkpoint (format and version set; the layout in the module docstring).

    Args:
        drafter_cfg: :class:`DrafterConfig` fields. head_cfg: ``{"type": ..., **hparams}``.
        target_identity: ``name``, ``vocab_size``, ``hidden_size``, ``num_layers`` of the target, and its context
            length ``max_position_embeddings`` where known (:meth:`~dartree.models.target.Target.identity`).
        provenance: free-form record of how the checkpoint was made.
    """
    drafter = dict(drafter_cfg)
    for f in dataclasses.fields(DrafterConfig):  # fields added later get their defaults, so configs compare equal
        if f.default is not dataclasses.MISSING:
            drafter.setdefault(f.name, f.default)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "drafter": drafter,
        "head": dict(head_cfg),
        "target": dict(target_identity),
        "provenance": dict(provenance or {}),
    }


def write_dartree(folder: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                  lineage: dict | None = None) -> Path:
    """Write a dartree checkpoint folder from its config dict and tensors (``backbone.*``, ``head.*``), atomically.

    Tensors are written as given (dtype kept), so a converter can pass published tensors through bit for bit.
    Other files of an existing folder stay (``learning_curve.json``), except an older :data:`LINEAGE_FILE`: the
    lineage record belongs to the weights, so new weights without one drop it.

    Args:
        lineage: the lineage record of the training run that made the weights (:func:`read_lineage`: ``lineage``
            and ``cursor``), written as :data:`LINEAGE_FILE` in the same atomic swap; None or {}: none.
    Returns:
        the folder path.
    """
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    files = {
        "config.json": json.dumps(config, indent=2).encode(),
        "model.safetensors": {"tensors": tensors, "metadata": {"format": FORMAT}},
    }
    if lineage:
        record = {"lineage": lineage.get("lineage"), "cursor": lineage.get("cursor")}
        files[LINEAGE_FILE] = (json.dumps(record) + "\n").encode()
    write_folder_atomically(Path(folder), files, drop=(LINEAGE_FILE,))
    return Path(folder)


def read_lineage(folder: str | os.PathLike, *, error: type[Exception] = CheckpointError,
                 fixes: dict[str, str] | None = None) -> dict:
    """The lineage record of the checkpoint in ``folder``: what the training run that made its weights recorded
    for a run that continues them. A training run's checkpoint keeps it in :data:`TRAINING_FILE` (its ``state``),
    a converted one in :data:`LINEAGE_FILE`; a folder with a training.json is read from that alone.

    Args:
        folder: a checkpoint folder.
        error: the exception class raised for a broken record (the caller's own, e.g. ``RecipeError``).
        fixes: the remedy a broken record's message ends with, by file name (:data:`TRAINING_FILE`,
            :data:`LINEAGE_FILE`); a name not given gets the default (restore or re-convert the file, or remove it so
            the lineage restarts at step 0).
    Returns:
        ``{"lineage": {"step0", "steps", "schedule_steps"} as recorded (ints; an older record may lack some),
        "cursor": the data cursor's state dict or None}``; ``{}`` for a folder with neither file, or whose record
        holds no ``lineage`` object (a published checkpoint, a run trained before the record existed).
    Raises:
        ``error``: the file read does not parse or lacks :data:`LINEAGE_RECORD_SHAPE` (one line naming the file, the
            place in it and the fix), so a broken record never restarts a lineage at step 0 silently.
    """
    folder = Path(folder)
    fix = {TRAINING_FILE: "restore it from the run that wrote it, or move it aside (the lineage then restarts at "
                          "step 0)",
           LINEAGE_FILE: f"convert the training run's checkpoint again (python convert/to_dartree.py RUN/checkpoint "
                         f"--out {folder}), or delete it (the lineage then restarts at step 0)",
           **(fixes or {})}
    training = read_json(folder / TRAINING_FILE, TRAINING_LINEAGE_SHAPE, absent=None, error=error,
                         fix=fix[TRAINING_FILE])
    if training is not None:
        record = training.get("state") or {}
    else:
        record = read_json(folder / LINEAGE_FILE, LINEAGE_RECORD_SHAPE, absent={}, error=error, fix=fix[LINEAGE_FILE])
    if not isinstance(record.get("lineage"), dict):
        return {}
    return {"lineage": record["lineage"], "cursor": record.get("cursor")}


def save_dartree(
    folder: str | os.PathLike,
    drafter: DFlashDrafter,
    head: CorrectionHead,
    target_identity: dict,
    *,
    dtype: torch.dtype = torch.bfloat16,
    provenance: dict | None = None,
) -> Path:
    """Save a drafter + head in the dartree format (atomically), tensors cast to ``dtype``. Returns the folder path."""
    tensors = {f"backbone.{k}": cast_floats(v.detach(), dtype) for k, v in drafter.state_dict().items()}
    tensors.update({f"head.{k}": cast_floats(v.detach(), dtype) for k, v in head.state_dict().items()})
    config = dartree_config(drafter.cfg.to_dict(), {"type": head.type_name, **head.hparams()}, target_identity, provenance)
    return write_dartree(folder, config, tensors)


def cast_floats(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when it is floating point; integer tensors (token ids such as ``draft_vocab``) unchanged."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def expected_tensors(config: dict, where) -> dict[str, tuple[int, ...]]:
    """Names (``backbone.*``, ``head.*``) and shapes of the tensors a checkpoint config calls for.

    Built on the meta device, so it costs no memory even for a large drafter.
    Raises:
        CheckpointError: as :func:`build_from_config`.
    """
    with torch.device("meta"):
        drafter, head = build_from_config(config, where)
    out = {f"backbone.{k}": tuple(v.shape) for k, v in drafter.state_dict().items()}
    out.update({f"head.{k}": tuple(v.shape) for k, v in head.state_dict().items()})
    return out


def build_from_config(config: dict, where) -> tuple[DFlashDrafter, CorrectionHead]:
    """Instantiate the backbone and head a checkpoint config describes (random weights).

    Raises:
        CheckpointError: a missing or unknown field, an unknown head type or an invalid value (named, with its
            allowed range: :func:`check_config_fields`).
    """
    check_config_fields(config, where)
    try:
        drafter = DFlashDrafter(DrafterConfig(**config["drafter"]))
        hcfg = dict(config["head"])
        htype = hcfg.pop("type")
    except KeyError as exc:
        raise CheckpointError(f"{where}: missing or unknown entry {exc}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: invalid drafter/head config: {exc}") from None
    try:
        head = build_head(htype, **hcfg)
    except KeyError as exc:  # an unregistered head type: build_head's message names the registered ones
        raise CheckpointError(f"{where}: {exc.args[0] if exc.args else exc}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: invalid drafter/head config: {exc}") from None
    return drafter, head


def check_config_fields(config, where) -> None:
    """Check the types and ranges of a checkpoint config's ``drafter`` and ``head`` fields when it is loaded
    (:data:`dartree.models.validate.DRAFTER_FIELDS` / the ``fields`` of the registered head class of ``head.type``;
    an unknown head type is left to :func:`build_from_config`, which names the registered ones).

    Raises:
        CheckpointError: ``config`` is not an object with ``drafter`` and ``head`` objects, or a field has the
            wrong type or is out of range; one line naming the file, the key (``drafter.block_size``), the
            value and the allowed range.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: holds a JSON {type(config).__name__}, not an object of config fields")
    for section in ("drafter", "head"):
        if not isinstance(config.get(section), dict):
            raise CheckpointError(f"{where}: missing or invalid entry {section!r} (an object of "
                                  f"{'DrafterConfig fields' if section == 'drafter' else 'head type and hyper-parameters'})")
    problems = (field_problems(config["drafter"], DRAFTER_FIELDS, "drafter.")
                + field_problems(config["head"], head_fields(config["head"].get("type")), "head."))
    if problems:
        raise CheckpointError(f"{where}: {problems[0]}")


def check_target_pairing(config: dict, target) -> None:
    """Check a checkpoint config against a loaded :class:`~dartree.models.target.Target`.

    Raises:
        CheckpointError: vocab, hidden size, layer ids or mask token id do not fit the target (both values named),
            or a config field is invalid (:func:`check_config_fields`).
    """
    check_config_fields(config, "checkpoint config")
    want = config.get("target") if isinstance(config.get("target"), dict) else {}
    d = config["drafter"]
    pairs = [("vocab_size", want.get("vocab_size"), target.vocab_size),
             ("num_layers", want.get("num_layers"), target.num_layers),
             ("head vocab_size", config["head"].get("vocab_size"), target.vocab_size),
             ("hidden_size", d["hidden_size"], target.hidden_size)]
    problems = [f"{what}: checkpoint {typed(got, have)} vs target {typed(have, got)}"
                for what, got, have in pairs if got is not None and not same_value(got, have)]
    bad = [i for i in d["target_layer_ids"] if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {target.num_layers} layers (0..{target.num_layers - 1})")
    hsec = config.get("head", {})
    embed_dim = hsec.get("embed_dim") or hsec.get("hidden_size")
    width = int(target.embed_tokens.weight.shape[1])
    reads = getattr(HEADS.get(hsec.get("type")) if isinstance(hsec.get("type"), str) else None, "reads_embeddings", False)
    if reads and not same_value(embed_dim, width):  # a head that reads the target's token embeddings (gru)
        problems.append(f"{hsec['type']} head embed_dim: checkpoint {typed(embed_dim, width)} vs target embedding "
                        f"width {typed(width, embed_dim)}")
    if not 0 <= d["mask_token_id"] < target.vocab_size:
        problems.append(f"mask_token_id {d['mask_token_id']} >= target vocab rows {target.vocab_size}")
    if problems:
        raise CheckpointError(
            f"drafter does not fit target {target.name!r}: " + "; ".join(problems)
            + " (use the target the drafter was trained for, or retrain)"
        )


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, on the CPU in their stored dtypes, read the way every loader reads them
    (eval, convert, export, training's ``init_from``).

    Raises:
        CheckpointError: the file is missing, unreadable, truncated or not safetensors; one line naming it.
    """
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc} (the file is truncated or not safetensors)") from exc


def load_dartree(
    folder: str | os.PathLike, *, target=None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DraftModel:
    """Load a dartree checkpoint strictly.

    Args:
        folder: folder with config.json and model.safetensors.
        target: optional Target to validate the pairing against; its input embedding is bound to the head
            (``head.bind_embeddings``), which the ``gru`` head needs before use, and its lm_head weight
            (``head.bind_models``, with the drafter, which a head acting between the drafter's layers needs).
        dtype: parameter dtype after loading (checkpoints are stored in bf16).
    Raises:
        CheckpointError: missing files, wrong format, unreadable/truncated safetensors, missing/unexpected/
            mis-shaped tensors (named), or a target mismatch.
        TypeError: ``dtype`` is not a floating ``torch.dtype`` (e.g. the string ``"bfloat16"``).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} must be a floating torch.dtype such as torch.float32 or torch.bfloat16")
    folder = Path(folder)
    cfg_path, w_path = folder / "config.json", folder / "model.safetensors"
    if not cfg_path.exists() or not w_path.exists():
        inner = folder / "checkpoint"
        if (inner / "config.json").exists() and (inner / "model.safetensors").exists():  # a training run's folder
            raise CheckpointError(f"{folder} is a training run's folder, not a dartree checkpoint; its checkpoint is "
                                  f"{inner} (give that path)")
        raise CheckpointError(
            f"{folder} is not a dartree checkpoint (needs config.json and model.safetensors); "
            "convert a published checkpoint with `python convert/to_dartree.py SRC --out DST`"
        )
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} holds a JSON {type(config).__name__}, not an object of config fields")
    fmt, version = config.get("format"), config.get("format_version")
    if not same_value(fmt, FORMAT):
        raise CheckpointError(
            f"{cfg_path} has format {typed(fmt, FORMAT)}, expected {typed(FORMAT, fmt)}; "
            "convert it first with `python convert/to_dartree.py`"
        )
    if not same_value(version, FORMAT_VERSION):
        raise CheckpointError(f"{cfg_path}: format_version {typed(version, FORMAT_VERSION)} is not "
                              f"{typed(FORMAT_VERSION, version)} (write it as the JSON number {FORMAT_VERSION})")
    tensors = read_safetensors(w_path)
    drafter, head = build_from_config(config, cfg_path)
    if target is not None:
        check_target_pairing(config, target)
    load_strict(drafter, tensors, "backbone.", w_path)
    load_strict(head, tensors, "head.", w_path)
    if drafter.cfg.draft_vocab_size:
        ids = drafter.draft_vocab
        v = head.vocab_size if getattr(head, "vocab_size", None) else (target.vocab_size if target is not None else None)
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or (v is not None and int(ids.max()) >= v):
            raise CheckpointError(f"{w_path}: backbone.draft_vocab must hold distinct token ids in [0, {v}); "
                                  "the file is corrupt or was written with a float dtype")
    extra = sorted(k for k in tensors if not k.startswith(("backbone.", "head.")))
    if extra:
        raise CheckpointError(f"{w_path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    drafter.to(device=device, dtype=dtype).eval()
    head.to(device=device, dtype=dtype).eval()
    try:  # a head acting between the drafter's layers attaches itself; one scoring with the lm_head keeps it
        head.bind_models(drafter, target.lm_head.weight if target is not None else None)
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    if target is not None:
        head.bind_embeddings(target.embed_tokens.weight)  # Domino's GRU reads the target's token embeddings
    return DraftModel(drafter, head, config)


def load_strict(module: torch.nn.Module, tensors: dict, prefix: str, where) -> None:
    """Load ``prefix``-named tensors into ``module`` exactly.

    Raises:
        CheckpointError: a missing, unexpected (under ``prefix``) or mis-shaped tensor, named with its shape.
    """
    own = module.state_dict()
    given = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    for name, ref in own.items():
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {prefix + name!r} (expected shape {list(ref.shape)})")
        if tuple(given[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{where}: tensor {prefix + name!r} has shape {list(given[name].shape)}, expected {list(ref.shape)}"
            )
    unexpected = sorted(set(given) - set(own))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {prefix + unexpected[0]!r}")
    module.load_state_dict({k: given[k].to(own[k].dtype) for k in own})

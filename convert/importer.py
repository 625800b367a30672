"""Reading drafter checkpoints into the dartree format (layer 3, the convert library): the readers of every source
layout, format detection and :func:`convert`, which validates strictly and writes the folder by atomic rename. The
command line is ``python convert/to_dartree.py`` (:mod:`dartree.convert.tools.to_dartree`), whose docstring lists
the sources.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from dartree.convert.export_config import with_target_context
from dartree.convert.published_tensors import check_tensors
from dartree.convert.publishers import FORMAT_PAIRS, detect
from dartree.models.checkpoint import (
    FORMAT,
    CheckpointError,
    cast_floats,
    check_target_pairing,
    dartree_config,
    ensure_replaceable,
    expected_tensors,
    load_dartree,
    read_lineage,
    read_safetensors,
    write_dartree,
)


def read_config(src: Path) -> dict:
    """The ``config.json`` of checkpoint folder ``src``, as a dict.

    Raises:
        CheckpointError: ``src`` is not a folder, or its config.json is missing or unreadable (one line).
    """
    if not src.is_dir():
        raise CheckpointError(f"{src} does not exist or is not a folder; give the checkpoint folder as SRC")
    path = src / "config.json"
    if not path.exists():
        raise CheckpointError(f"{src} has no config.json; point SRC at a checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object of config fields")
    return config


def _weight_files(src: Path) -> list[Path]:
    """The safetensors files of a folder; with a ``*.safetensors.index.json`` every shard it names must exist.

    Raises:
        CheckpointError: no safetensors file, or a shard named by the index is missing.
    """
    files = sorted(src.glob("*.safetensors"))
    for index in sorted(src.glob("*.safetensors.index.json")):
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (needs a 'weight_map'): {exc}") from None
        missing = [s for s in shards if not (src / s).exists()]
        if missing:
            raise CheckpointError(f"{src}: shard {missing[0]!r} named in {index.name} is missing; copy the whole folder")
    if not files:
        raise CheckpointError(f"{src} holds no *.safetensors file")
    return files


def _tensor_names(src: Path) -> set[str]:
    """Tensor names from the safetensors headers only (cheap; used for format detection)."""
    names: set[str] = set()
    for f in _weight_files(src):
        try:
            with safe_open(str(f), framework="pt") as fh:
                names.update(fh.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {f}: {exc} (truncated or not safetensors)") from exc
    return names


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint folder.

    Raises:
        CheckpointError: unreadable / truncated file (named), or one tensor name in two shards.
    """
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(src):
        part = read_safetensors(f)
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise CheckpointError(f"{src}: tensor {dup[0]!r} is stored in two shards (again in {f.name})")
        tensors.update(part)
    return tensors


def read_dartree_train(src: Path, config: dict, target=None) -> tuple[dict, dict]:
    """Reader for ``training/train.py`` checkpoints (tensors ``drafter.*`` and ``head.*``, fp32; ``target`` unused).

    Returns:
        (dartree config, tensors by dartree name).
    """
    tensors = _read_tensors(src)
    state = config.get("state", {})
    provenance = {
        "source_format": "dartree-train",
        "recipe": config.get("recipe", {}).get("recipe"),
        "steps": state.get("steps", state.get("step")),
        "final_loss": state.get("final_loss"),
        "train_min": state.get("train_min"),
        "data_prep_min": state.get("data_prep_min"),
        "train_sequences": state.get("train_sequences"),
        "train_tokens": state.get("train_tokens"),
        "holdout_tf_tau": state.get("holdout_tf_tau"),
        "holdout_chain_tau": state.get("holdout_chain_tau"),
    }
    try:
        out = dartree_config(config["drafter"], config["head"], config["target"], provenance)
    except KeyError as exc:
        raise CheckpointError(f"{src / 'config.json'}: missing entry {exc}") from None
    expected = expected_tensors(out, src / "config.json")
    check_tensors(tensors, expected, src, rename=lambda n: "drafter." + n[len("backbone."):] if n.startswith("backbone.") else n)
    mapped = {("backbone." + k[len("drafter."):] if k.startswith("drafter.") else k): v for k, v in tensors.items()}
    return out, mapped


def read_dartree(src: Path, config: dict, target=None) -> tuple[dict, dict]:
    """Reader for checkpoints already in the dartree format (strictly re-validated; tensors kept as stored;
    ``target`` unused: :func:`convert` checks the pairing)."""
    load_dartree(src)  # strict: format, version, names, shapes
    return config, _read_tensors(src)


# every source: dartree's own two, then each published layout of the format registry
READERS: dict[str, Callable] = {
    "dartree-train": read_dartree_train,
    "dartree": read_dartree,
    **{fmt: pair.reader(_read_tensors) for fmt, pair in FORMAT_PAIRS.items()},
}


def detect_format(config: dict, src: Path) -> str:
    """Name the source layout from config fields and tensor names (see :func:`detect_format_why`)."""
    return detect_format_why(config, src)[0]


def detect_format_why(config: dict, src: Path) -> tuple[str, str]:
    """(format, reason) for the checkpoint in ``src``: ``dartree`` / ``dartree-train`` by config.json's ``format``,
    else the first published layout of the format registry that answers
    (:func:`dartree.convert.publishers.detect`).

    Raises:
        CheckpointError: unknown layout; lists the known ones and what each needs.
    """
    fmt = config.get("format")
    if fmt in (FORMAT, "dartree-train"):
        return fmt, f"config.json format={fmt!r}"
    try:
        return detect(config, _tensor_names(src) if fmt is None else set())
    except CheckpointError as exc:
        raise CheckpointError(f"{src}/config.json: {exc}") from None


def convert(
    src: str | Path,
    out: str | Path,
    *,
    source_format: str = "auto",
    dtype: torch.dtype | None = None,
    target=None,
) -> Path:
    """Convert ``src`` into a dartree checkpoint at ``out`` (atomically); returns ``out``.

    A checkpoint of dartree's own (a training run's, with its ``training.json``, or one converted from it, with
    ``lineage.json``) keeps the lineage record of the run that made its weights: ``out/lineage.json``
    (:func:`~dartree.models.checkpoint.read_lineage`, :func:`~dartree.models.checkpoint.write_dartree`), so a run
    continued from ``out`` with ``train.schedule_from_init`` / ``data.cursor_from_init`` picks the lineage up.
    Published layouts carry none; an older ``out/lineage.json`` is dropped when the source has no record.

    Args:
        src: checkpoint folder (config.json + *.safetensors).
        out: output folder; replaced only if it is a dartree checkpoint.
        source_format: ``auto`` or one of :data:`READERS`.
        dtype: cast every tensor to this dtype; None keeps published tensors as stored and writes the checkpoints
            of ``training/train.py`` (fp32; provenance ``source_format`` ``dartree-train``) in bf16.
        target: optional :class:`~dartree.models.target.Target` to validate the pairing against.
    Raises:
        CheckpointError: unreadable or invalid source (named tensor / field), unknown format, target mismatch, or a
            source lineage record (``training.json`` / ``lineage.json``) that does not parse or lacks its shape
            (one line naming the file and the fix).
    """
    src = Path(src)
    ensure_replaceable(Path(out), ("dartree",))
    config = read_config(src)
    fmt = detect_format(config, src) if source_format == "auto" else source_format
    if fmt not in READERS:
        raise CheckpointError(f"--from {fmt!r} is not one of {sorted(READERS)}")
    dconfig, tensors = READERS[fmt](src, config, target=target)
    lineage = read_lineage(src) if fmt in (FORMAT, "dartree-train") else {}  # published layouts record none
    if target is not None:
        check_target_pairing(dconfig, target)
        dconfig = with_target_context(dconfig, target)  # recorded, so an export writes the target's context length
    trained_here = fmt == "dartree-train" or (dconfig.get("provenance") or {}).get("source_format") == "dartree-train"
    if dtype is None and trained_here:  # a training run's fp32 weights ship in bf16
        dtype = torch.bfloat16
    if dtype is not None:
        tensors = {k: cast_floats(v, dtype) for k, v in tensors.items()}
    write_dartree(out, dconfig, tensors, lineage=lineage)
    return Path(out)

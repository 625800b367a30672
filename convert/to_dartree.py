"""Convert a drafter checkpoint into the dartree format: ``python convert/to_dartree.py SRC [--out DST]``.

Sources handled here: ``dartree-train`` (a checkpoint written by ``training/train.py``) and ``dartree``
(re-validated and re-written). Readers for published layouts (z-lab DFlash, SpecForge Domino / DSpark,
DeepSpec DSpark) plug into ``READERS``. Every source is validated strictly: a missing, unexpected or
mis-shaped tensor is an error naming it, and nothing is written unless the whole conversion succeeds
(the output folder appears by atomic rename).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dartree.models.checkpoint import (
    CheckpointError,
    build_from_config,
    ensure_replaceable,
    load_dartree,
    load_strict,
    save_dartree,
)


def _read_config(src: Path) -> dict:
    if not src.is_dir():
        raise CheckpointError(f"{src} does not exist or is not a folder; give the checkpoint folder as SRC")
    path = src / "config.json"
    if not path.exists():
        raise CheckpointError(f"{src} has no config.json; point SRC at a checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} holds no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {f}: {exc} (truncated or not safetensors)") from exc
    return tensors


def read_dartree_train(src: Path, config: dict):
    """Reader for ``training/train.py`` checkpoints: tensors ``drafter.*`` and ``head.*``.

    Returns:
        (drafter, head, target identity, provenance).
    """
    tensors = _read_tensors(src)
    drafter, head = build_from_config(config, src / "config.json")
    load_strict(drafter, tensors, "drafter.", src)
    load_strict(head, tensors, "head.", src)
    extra = sorted(k for k in tensors if not k.startswith(("drafter.", "head.")))
    if extra:
        raise CheckpointError(f"{src}: unexpected tensor {extra[0]!r}")
    state = config.get("state", {})
    provenance = {
        "source_format": "dartree-train",
        "recipe": config.get("recipe", {}).get("recipe"),
        "steps": state.get("step"),
        "final_loss": state.get("final_loss"),
        "train_min": state.get("train_min"),
        "data_prep_min": state.get("data_prep_min"),
        "train_sequences": state.get("train_sequences"),
        "train_tokens": state.get("train_tokens"),
        "holdout_tf_tau": state.get("holdout_tf_tau"),
    }
    return drafter, head, config["target"], provenance


def read_dartree(src: Path, config: dict):
    """Reader for checkpoints already in the dartree format (strictly re-validated)."""
    dm = load_dartree(src)
    return dm.drafter, dm.head, dm.config["target"], dm.config.get("provenance", {})


READERS: dict[str, Callable] = {"dartree-train": read_dartree_train, "dartree": read_dartree}


def detect_format(config: dict, src: Path) -> str:
    """Name the source format from config fields.

    Raises:
        CheckpointError: unknown layout; lists the known ones.
    """
    fmt = config.get("format")
    if fmt in READERS:
        return fmt
    raise CheckpointError(
        f"{src}/config.json: unknown checkpoint layout (format={fmt!r}); this converter reads {sorted(READERS)} "
        "(config.json with a 'format' field as written by dartree)"
    )


def convert(src: str | Path, out: str | Path, *, source_format: str = "auto", dtype=torch.bfloat16) -> Path:
    """Convert ``src`` into a dartree checkpoint at ``out`` (atomically); returns ``out``.

    Raises:
        CheckpointError: unreadable or invalid source (named tensor / field), or unknown format.
    """
    src = Path(src)
    ensure_replaceable(Path(out), ("dartree",))
    config = _read_config(src)
    fmt = detect_format(config, src) if source_format == "auto" else source_format
    if fmt not in READERS:
        raise CheckpointError(f"--from {fmt!r} is not one of {sorted(READERS)}")
    drafter, head, target_identity, provenance = READERS[fmt](src, config)
    save_dartree(out, drafter, head, target_identity, dtype=dtype, provenance=provenance)
    load_dartree(out)  # read back strictly before reporting success
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-convert``); exit status 2 on a bad checkpoint."""
    ap = argparse.ArgumentParser(prog="dartree-convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="checkpoint folder (config.json + *.safetensors)")
    ap.add_argument("--out", help="output folder (default: SRC-dartree)")
    ap.add_argument("--from", dest="source_format", default="auto", choices=["auto", *sorted(READERS)])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    src = Path(args.src)
    out = Path(args.out) if args.out else src.with_name(src.name + "-dartree")
    try:
        config = _read_config(src)
        if args.source_format == "auto":
            fmt = detect_format(config, src)
            print(f"detected format: {fmt}")
        else:
            fmt = args.source_format
            print(f"format: {fmt} (given with --from)")
        convert(src, out, source_format=fmt, dtype=getattr(torch, args.dtype))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {out}: {exc.strerror or exc}; choose a writable --out folder", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

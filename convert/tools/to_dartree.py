"""Convert a drafter checkpoint into the dartree format.

``python convert/to_dartree.py SRC [--out DST] [--from auto|dartree|dartree-train|zlab-dflash|specforge-domino|
specforge-dspark|deepspec-dspark|speculators|zlab-dflash2] [--target SPEC] [--dtype auto|bfloat16|float16|float32]``

Sources: ``dartree`` (re-validated and re-written; ``training/train.py`` writes this format, and its fp32 weights
convert to bf16 by default), ``dartree-train`` (the older training layout) and every published layout of the format
registry (:mod:`dartree.convert.publishers`: z-lab DFlash / DFlash 2, SpecForge Domino / DSpark, DeepSpec DSpark,
vLLM speculators dflash / dflash2 / dspark; config.json + safetensors, sharded or not). ``auto`` detects the layout
from config fields and tensor names (the registry's pairs in order) and says what it detected. Every source is
validated strictly before anything is written: a missing, unexpected or mis-shaped tensor is an error naming it, an
unknown config layout lists the expected fields, and with ``--target`` the vocab / hidden size / layer ids / mask id
are checked against the target. The output folder appears by atomic rename, so a failed conversion leaves nothing
half-written. Published tensors are passed through bit for bit (``--dtype auto``), so converting and exporting back
gives identical tensors. A training run's checkpoint (or one converted from it) keeps the run's lineage record
(steps, schedule length, data cursor) in ``DST/lineage.json``, which ``train.schedule_from_init`` and
``data.cursor_from_init`` read when a run continues from DST.

A program (layer 4, ``convert/tools/``): the command line over :mod:`dartree.convert.importer`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dartree.base.cli import fail
from dartree.convert.importer import READERS, convert, detect_format_why, read_config
from dartree.models.checkpoint import LINEAGE_FILE, CheckpointError, read_lineage
from dartree.models import target as target_lib


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-convert``); exit status 2 on a bad checkpoint (one-line error on stderr)."""
    ap = argparse.ArgumentParser(prog="dartree-convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="checkpoint folder (config.json + *.safetensors, sharded or not)")
    ap.add_argument("--out", help="output folder (default: SRC-dartree)")
    ap.add_argument("--from", dest="source_format", default="auto", choices=["auto", *sorted(READERS)])
    ap.add_argument("--target", help="validate against this target (smollm2, tiny-qwen3 or a local HF folder)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="auto: keep published tensors as stored; training checkpoints go to bf16")
    args = ap.parse_args(argv)
    src = Path(args.src)
    out = Path(args.out) if args.out else src.with_name(src.name + "-dartree")
    try:
        config = read_config(src)
        if args.source_format == "auto":
            fmt, why = detect_format_why(config, src)
            print(f"detected format: {fmt} ({why})")
        else:
            fmt = args.source_format
            print(f"format: {fmt} (given with --from)")
        target = None
        if args.target:
            target = target_lib.load_target(args.target)
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        convert(src, out, source_format=fmt, dtype=dtype, target=target)
        lineage = read_lineage(out) if (out / LINEAGE_FILE).exists() else {}
    except CheckpointError as exc:
        return fail(str(exc))
    except (FileNotFoundError, RuntimeError) as exc:
        return fail(exc)
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or exc}; choose a writable --out folder")
    print(f"wrote {out}")
    if lineage:
        print(f"kept the training lineage ({lineage['lineage'].get('steps', 0)} steps, "
              f"{'a' if lineage['cursor'] else 'no'} data cursor) in {out / LINEAGE_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export a dartree checkpoint back to a published drafter layout, so engines that load those formats can serve it.

``python convert/from_dartree.py SRC --to zlab-dflash|specforge-domino|specforge-dspark|speculators|zlab-dflash2
--out DST [--target SPEC]``

Every layout with a writer in the format registry (:mod:`dartree.convert.publishers`) is a choice. The head type
decides the layout: ``identity`` -> z-lab DFlash, ``gru`` -> SpecForge Domino, ``markov`` / ``gated_markov`` /
``rnn`` -> SpecForge DSpark (:mod:`dartree.convert.zlab`, :mod:`dartree.convert.specforge`); ``speculators`` (vLLM,
:mod:`dartree.convert.vllm_speculators`): ``identity`` -> dflash, DSpark heads -> dspark, with a reduced draft
vocabulary as ``d2t`` / ``t2d`` (needs ``--target``), the DFlash 2 ``selector`` head (with
``drafter.conv_kernel_size`` > 0) -> dflash2; ``zlab-dflash2`` (z-lab ``DFlash2DraftModel``): DFlash 2 drafters with
proposal offset 1. Tensors are written bit for bit under their published names, so ``to_dartree.py`` reads the
export back unchanged. A drafter the layout cannot express (q/k norm off, a proposal offset the layout does not
use, another head type) is refused with the reason. The output folder appears by atomic rename.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dartree.convert.formats import with_target_context
from dartree.convert.publishers import EXPORT_FORMATS, FORMAT_PAIRS
from dartree.base.cli import fail
from dartree.models.checkpoint import CheckpointError, load_dartree, read_safetensors
from dartree.base.files import write_folder_atomically


def _ensure_exportable_destination(dest: Path) -> None:
    """Refuse to overwrite anything but an earlier published drafter export (a folder whose config.json has
    ``dflash_config``).

    Raises:
        CheckpointError: ``dest`` is a file or a folder that is not such a checkpoint (nothing is touched).
    """
    if not dest.exists():
        return
    try:
        cfg = json.loads((dest / "config.json").read_text()) if dest.is_dir() else {}
        ok = "dflash_config" in cfg or "speculators_model_type" in cfg
    except (OSError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(f"refusing to overwrite {dest}: it exists and is not a published drafter checkpoint; "
                              "choose a new --out folder")


def export(src: str | Path, out: str | Path, *, to: str, target=None, verifier: str | None = None) -> Path:
    """Write the dartree checkpoint ``src`` in the published layout ``to`` at ``out`` (atomically); returns ``out``.

    Args:
        src: dartree checkpoint folder. out: destination folder. to: one of :data:`EXPORT_FORMATS`.
        target: optional :class:`~dartree.models.target.Target`; layouts of the format registry use it (speculators:
            the verifier, and the lm_head rows of a reduced draft vocabulary).
        verifier: the target's model id to record (``_name_or_path``; speculators' ``verifier.name_or_path``) in
            place of the one derived from the target (:func:`dartree.models.target.model_id`), e.g. the hub id of a
            local folder that records none.
    Raises:
        CheckpointError: ``src`` is not a valid dartree checkpoint (strict load), ``to`` is unknown, the drafter
            does not fit ``target`` (both values named), or the drafter / head cannot be expressed in ``to`` (the
            message says why and what would fit); ``zlab-dflash`` from a checkpoint that records no target layer count
            (a converted speculators one) without ``target`` (z-lab's loader needs ``num_target_layers``).
    """
    src, out = Path(src), Path(out)
    if to not in EXPORT_FORMATS:
        raise CheckpointError(f"--to {to!r} is not one of {sorted(EXPORT_FORMATS)}")
    _ensure_exportable_destination(out)
    # strict: format, version, names, shapes; with a target, the pairing too (vocab, hidden size, layer ids, mask
    # id: check_target_pairing, as to_dartree.py --target and load_dartree(target=...) do), for every layout
    config = with_target_context(load_dartree(src, target=target).config, target)  # the context length to write
    tensors = read_safetensors(src / "model.safetensors")
    published, mapped = FORMAT_PAIRS[to].write(config, tensors, target, where=src)
    if verifier:
        if "speculators_config" in published:
            published["speculators_config"]["verifier"]["name_or_path"] = verifier
        else:
            published["_name_or_path"] = verifier
    write_folder_atomically(out, {"config.json": json.dumps(published, indent=2).encode(),
                                  "model.safetensors": {"tensors": mapped, "metadata": {"format": "pt"}}})
    return out


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-export``); exit status 2 with a one-line error on a bad checkpoint."""
    ap = argparse.ArgumentParser(prog="dartree-export", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="dartree checkpoint folder")
    ap.add_argument("--to", required=True, choices=sorted(EXPORT_FORMATS), help="published layout to write")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--target", help="the target (smollm2, tiny-qwen3 or a local HF folder); speculators exports record "
                                     "it as the verifier and need it for a reduced draft vocabulary")
    ap.add_argument("--verifier", metavar="MODEL_ID",
                    help="the target's model id to record (default: the hub id of the packaged target, or the one a "
                         "local folder's config.json records, else the folder): what a server loads the verifier from")
    args = ap.parse_args(argv)
    try:
        target = None
        if args.target:
            from dartree.models.target import load_target

            target = load_target(args.target)
        export(args.src, args.out, to=args.to, target=target, verifier=args.verifier)
    except CheckpointError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {args.out}: {exc.strerror or exc}; choose a writable --out folder")
    print(f"wrote {args.out} ({args.to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

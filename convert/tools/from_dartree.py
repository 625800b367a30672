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

A program (layer 4, ``convert/tools/``): the command line over :mod:`dartree.convert.exporter`.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from dartree.base.cli import fail
from dartree.convert.exporter import export
from dartree.convert.publishers import EXPORT_FORMATS
from dartree.models.checkpoint import CheckpointError
from dartree.models import target as target_lib


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-export``); exit status 2 with a one-line error on a bad checkpoint. The
    export's warnings (a speculators verifier recorded as a local folder, a context length the checkpoint does not
    record) are printed as ``warning: ...`` lines on stderr."""
    ap = argparse.ArgumentParser(prog="dartree-export", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="dartree checkpoint folder")
    ap.add_argument("--to", required=True, choices=sorted(EXPORT_FORMATS), help="published layout to write")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--target", help="the target (smollm2, tiny-qwen3 or a local HF folder); speculators exports record "
                                     "it as the verifier and need it for a reduced draft vocabulary")
    ap.add_argument("--verifier", metavar="MODEL_ID",
                    help="the target's model id to record (default: the hub id of the packaged target, or the one a "
                         "local folder's config.json records, else the folder, with a warning): what a server loads the "
                         "verifier from")
    args = ap.parse_args(argv)
    try:
        target = None
        if args.target:
            target = target_lib.load_target(args.target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            export(args.src, args.out, to=args.to, target=target, verifier=args.verifier)
        for w in caught:  # one line each (the export's own cautions: a verifier another machine cannot load, ...)
            print(f"warning: {w.message}", file=sys.stderr)
    except CheckpointError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"cannot write {args.out}: {exc.strerror or exc}; choose a writable --out folder")
    print(f"wrote {args.out} ({args.to})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

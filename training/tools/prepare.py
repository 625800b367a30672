"""Prepare a recipe's training data on its own: ``python training/tools/prepare.py recipe=NAME [key=value ...]``.

Runs the data stage of ``training/train.py`` and stops: the target regenerates responses to the recipe's
prompts (continuous batching, shortest prompt first, progress bar; rows are appended as they finish so an
interrupted run continues where it stopped; with ``data.max_turns`` > 1 every assistant turn in order, the
target's own answers as history), then the target's features are cached. Both are stored under ``$DARTREE_CACHE/data`` (default
``~/.cache/dartree/data``) keyed by a hash of (target, prompts, generation settings) and, for features, the
target layer ids: a changed input rebuilds, an unchanged one is reused, and ``train.py`` finds the cache.
"""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig

from dartree.base.cli import fail
from dartree.models.drafter import build_target_layer_ids
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.build import load_recipe_target, prepare_data
from dartree.training.settings import parse_recipe_dtype, run_settings
from dartree.training.checks import check_against_target
from dartree.training.features import target_lse


def prepare(cfg: DictConfig) -> dict:
    """Build (or find) the recipe's regenerated responses and target features; returns a summary dict.

    Raises:
        RecipeError: invalid recipe values (for example layer ids outside the target).
    """
    t0, run = time.time(), run_settings(cfg)
    target = load_recipe_target(run.target.path, parse_recipe_dtype(run.target.dtype, "target.dtype"))
    check_against_target(run, target)
    d = run.models.drafter
    layer_ids = list(d.target_layer_ids) or build_target_layer_ids(target.num_layers, d.num_target_features)
    try:
        target.set_layer_ids(layer_ids)
    except ValueError as exc:
        raise RecipeError(f"drafter.target_layer_ids: {exc}") from None
    data = prepare_data(run.data, target)
    if d.draft_vocab_size:
        target_lse(target, data.features_path)  # needed by draft-vocabulary training
    return {
        "train_sequences": len(data),
        "holdout_sequences": len(data.holdout_ids),
        "train_tokens": data.num_tokens(),
        # the target's own tokens (multi-turn data: its answers, not the user turns between them)
        "response_tokens": sum(int(data.loss_mask[i].sum()) for i in data.train_ids + data.holdout_ids),
        "layer_ids": layer_ids,
        "minutes": (time.time() - t0) / 60,
    }


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for a recipe error)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        summary = prepare(load_recipe(args))
    except RecipeError as exc:
        return fail(str(exc))
    print(f"data ready: {summary['train_sequences']} training + {summary['holdout_sequences']} held-out sequences, "
          f"{summary['response_tokens']} response tokens, target layers {summary['layer_ids']}, "
          f"{summary['minutes']:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

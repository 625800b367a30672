"""Train/infer parity: teacher-forced acceptance of a trained drafter through the inference code path.

``python training/tools/parity.py runs/NAME`` reads the run's training checkpoint and recipe, rebuilds its data (from
the cache), and for the held-out sequences at the anchors the training metric uses computes, per block position,
how often the drafter's draft equals the true next token, twice:

- training path: :func:`dartree.training.step.evaluate_holdout` (one masked forward over all blocks of a
  sequence, ``head.block_logits``, argmax over the drafting vocabulary);
- inference path: for every anchor, ``decode.draft.draft_block`` with the drafter's own context cache, then
  the head's ``init_state`` / ``score`` / ``advance`` along the true tokens and the top-1 of
  ``decode.trees.expand_frontier`` over the top-K candidates, exactly as the tree builders draft.

The two must agree (within 2 points per position); a gap means training and decoding see different inputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dartree.base.cli import fail
from dartree.training.recipe import RecipeError
from dartree.decode.draft import draft_block
from dartree.decode.trees import block_candidates, expand_frontier
from dartree.models.drafter import DraftCache
from dartree.training.build import build_models, load_init, prepare_data, run_recipe
from dartree.training.settings import (data_settings, init_settings, model_settings, parse_recipe_dtype,
                                       step_settings)
from dartree.training.features import target_lse
from dartree.training.step import StepSettings, block_targets, evaluate_holdout, seed_mix
from dartree.models import target as target_lib


@torch.no_grad()
def inference_metrics(drafter, head, target, data, settings: StepSettings, *,
                      k: int = 64) -> tuple[torch.Tensor, float]:
    """Per-position teacher-forced accuracy [P] and the chain acceptance (mean over anchors of 1 + leading
    correct proposals, bonus included) through the inference path (``draft_block`` + ``expand_frontier`` over
    the top-k candidates) on ``data.holdout_ids``.

    Anchors are drawn as :func:`~dartree.training.step.evaluate_holdout` draws them, so both see the same blocks;
    a prediction whose label carries no loss (past the end, or not a target-written token of multi-turn data:
    :func:`~dartree.training.step.block_targets`) is not counted and ends the leading run, as in training.
    """
    p_len = drafter.cfg.num_proposals
    hits = torch.zeros(p_len)
    cnts = torch.zeros(p_len)
    runs = []
    for i in data.holdout_ids:
        tokens, feats, _, plen = data.sequence(i)
        s = tokens.numel()
        anchors, _, valid = block_targets(tokens, plen, data.mask_of(i), settings, p_len,
                                          torch.Generator().manual_seed(seed_mix(1234, i)))
        for n, a in enumerate(anchors.tolist()):
            block = draft_block(target, drafter, int(tokens[a]), a, feats[:a].float(), DraftCache(1))
            ids, vals = block_candidates(block, k)
            state = head.init_state(tokens[a : a + 1])
            run, leading = 1, True
            for j in range(p_len):
                if a + 1 + j >= s:
                    break
                _, col, _ = expand_frontier(head, block.hidden[j], state, ids[j], vals[j], torch.zeros(1), 1)
                label = tokens[a + 1 + j]
                if bool(valid[n, j]):
                    hit = bool(ids[j, col[0]] == label)
                    hits[j] += float(hit)
                    cnts[j] += 1
                else:
                    hit = False
                leading = leading and hit
                run += int(leading)
                state = head.advance(state, label[None], block.hidden[j : j + 1])  # teacher forcing
            runs.append(run)
    return hits / cnts.clamp_min(1), sum(runs) / max(len(runs), 1)


def parity(run_dir: str | Path, split: str = "holdout") -> dict:
    """Compare training-path and inference-path teacher-forced accuracy of the run in ``run_dir`` on the
    held-out sequences (``split="holdout"``) or the training ones (``"train"``; parity is about code paths, so
    either split shows a gap).

    Returns:
        {"train_path": [P], "inference_path": [P], "max_abs_diff": float, "train_path_chain_tau": float,
        "inference_path_chain_tau": float, ...}.
    Raises:
        RecipeError: the folder holds no training checkpoint, or an unknown split.
    """
    if split not in ("holdout", "train"):
        raise RecipeError(f"split must be 'holdout' or 'train', got {split!r}")
    from omegaconf import OmegaConf

    ckpt = Path(run_dir) / "checkpoint"
    cfg = OmegaConf.create(run_recipe(ckpt))
    target = target_lib.load_target(cfg.target.path, dtype=parse_recipe_dtype(cfg.target.dtype, "target.dtype"))
    # the run's own recipe: loaded as saved
    drafter, head = load_init(str(ckpt), target, init_settings(cfg),
                              lambda: build_models(model_settings(cfg), target)[1])
    drafter.eval()
    head.eval()
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    data = prepare_data(data_settings(cfg), target)
    if drafter.cfg.draft_vocab_size:
        data.lse = target_lse(target, data.features_path)
    if split == "train":
        data.holdout_ids = list(data.train_ids)
    cfg.train.bf16 = False  # compare in fp32, as decoding runs
    step = step_settings(cfg)
    hold = evaluate_holdout(drafter, head, target, data, step)
    train_path = torch.tensor(hold["holdout_acc_per_pos"])
    infer_path, infer_chain = inference_metrics(drafter, head, target, data, step)
    return {"split": split, "sequences": len(data.holdout_ids),
            "train_path": [round(float(x), 4) for x in train_path],
            "inference_path": [round(float(x), 4) for x in infer_path],
            "max_abs_diff": float((train_path - infer_path).abs().max()),
            "train_path_chain_tau": hold["holdout_chain_tau"], "inference_path_chain_tau": infer_chain}


def main(argv: list[str] | None = None) -> int:
    """Console entry point; exit status 1 when the paths differ by more than 2 points, 2 on bad input."""
    import argparse

    ap = argparse.ArgumentParser(prog="parity", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="training run folder (holds checkpoint/)")
    ap.add_argument("--split", default="holdout", choices=["holdout", "train"])
    args = ap.parse_args(argv)
    try:
        out = parity(args.run_dir, args.split)
    except RecipeError as exc:
        return fail(str(exc))
    print(json.dumps(out, indent=1))
    ok = out["max_abs_diff"] <= 0.02
    print(("parity ok" if ok else "PARITY GAP") + f": max difference {100 * out['max_abs_diff']:.2f} points per position")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

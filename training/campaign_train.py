"""The campaign's training stage: ``python training/campaign.py stage=train`` (or ``stage=all``).

Each call trains every recipe of ``train.recipes`` on all committed campaign shards (``data.source=campaign``:
the target's features are recomputed online, see :mod:`dartree.training.campaign_data`), for its share of the
wall-clock limit, through ``training/train.py`` itself (DeepSpeed engine, resumable checkpoints, learning curve).

One run per (recipe, number of shards): ``<cache>/campaign-runs/<recipe>-<shards>``. A run that was stopped by
the clock resumes in the next call (``resume=true``: model, optimiser and data position); once new shards have
landed, a new run starts from the latest weights of the recipe: the previous run's checkpoint when this machine
still has it, else the campaign's committed checkpoint ``campaign/checkpoints/<recipe>``, else the shipped
``checkpoints/<recipe>``. ``campaign/train_state.json`` (committed) records every run: shards, steps, predictions,
held-out chain tau on the campaign's held-out set, and the CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from dartree.training.campaign import REPO, CampaignError, cpu_model, read_manifest


def _state_path(cfg: DictConfig) -> Path:
    return Path(cfg.dir) / "train_state.json"


def read_state(cfg: DictConfig) -> dict:
    """``campaign/train_state.json`` ({recipe: {"runs": [...]}}), empty when absent.

    Raises:
        CampaignError: the file does not parse (restore it with git).
    """
    path = _state_path(cfg)
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CampaignError(f"{path} does not parse ({exc.msg}); restore it with `git checkout {path}`") from None


def init_for(cfg: DictConfig, recipe: str, state: dict) -> str:
    """The checkpoint a new run of ``recipe`` starts from: the latest run's when it is on this machine, else the
    committed campaign checkpoint, else the shipped one."""
    for run in reversed(state.get(recipe, {}).get("runs", [])):
        ck = Path(run["output_dir"]) / "checkpoint"
        if (ck / "config.json").exists():
            return str(ck)
    committed = Path(cfg.dir) / "checkpoints" / recipe
    if (committed / "config.json").exists():
        return str(committed)
    return str(REPO / "checkpoints" / recipe)


def run_train(cfg: DictConfig, deadline: float, runs_root: Path | None = None) -> dict:
    """Train each recipe of ``cfg.train.recipes`` on the committed shards until ``deadline`` (shared equally);
    returns the updated training state (also written to ``campaign/train_state.json``).

    Raises:
        CampaignError: a training run failed (its exit status and output folder named).
    """
    from dartree.models.checkpoint import write_file_atomically
    from dartree.models.target import cache_root
    from dartree.training.train import main as train_main

    tc = cfg.train
    n = len(read_manifest(Path(cfg.dir))["shards"])
    if n < int(tc.min_shards):
        print(f"campaign train: {n} training shards, fewer than train.min_shards={tc.min_shards}; the data stage "
              "goes first", flush=True)
        return read_state(cfg)
    root = Path(runs_root) if runs_root is not None else cache_root() / "campaign-runs"
    recipes = list(tc.recipes)
    for k, recipe in enumerate(recipes):
        minutes = (deadline - time.time()) / 60 / (len(recipes) - k)
        if minutes < 2:
            break
        state = read_state(cfg)
        out = root / f"{recipe}-{n:05d}"
        runs = state.setdefault(recipe, {"runs": []})["runs"]
        same = [r for r in runs if r["output_dir"] == str(out)]
        init = same[-1]["init_from"] if same else init_for(cfg, recipe, state)
        args = [f"recipe={recipe}", "data.source=campaign", f"data.campaign_dir={cfg.dir}",
                f"data.campaign_shards={n}", f"init_from={init}", f"output_dir={out}", "resume=true",
                f"train.max_minutes={minutes:.1f}", f"train.epochs={tc.epochs}", f"train.threads={cfg.threads}",
                f"train.eval_every_steps={tc.eval_every_steps}", *list(tc.overrides)]
        print("campaign train: python training/train.py " + " ".join(args), flush=True)
        rc = train_main(args)
        if rc != 0:
            raise CampaignError(f"training {recipe} on {n} shards exited with {rc}; see the output above and {out}")
        summary = json.loads((out / "summary.json").read_text())
        rec = {"output_dir": str(out), "init_from": init, "shards": n, "steps": summary["steps"],
               "predictions": summary["predictions"], "train_tokens": summary["train_tokens"],
               "holdout_chain_tau": summary.get("holdout_chain_tau"), "holdout_tf_tau": summary.get("holdout_tf_tau"),
               "stopped_by_time_cap": summary["stopped_by_time_cap"], "cpu": cpu_model(),
               "threads": int(cfg.threads), "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if same:
            runs[runs.index(same[-1])] = rec
        else:
            runs.append(rec)
        write_file_atomically(_state_path(cfg), json.dumps(state, indent=1) + "\n")
        print(f"campaign train: {recipe} on {n} shards: step {rec['steps']}, {rec['predictions']} predictions, "
              f"held-out chain tau {rec['holdout_chain_tau']}", flush=True)
    return read_state(cfg)

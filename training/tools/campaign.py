"""A drafter training campaign that accumulates across runs and machines:
``python training/tools/campaign.py [key=value ...]``. Its settings and checks are
:mod:`.campaign_settings`; the pool :mod:`.campaign_pool`, the plan :mod:`.campaign_plan`, the data stage
:mod:`.campaign_shards`, the training stage :mod:`.campaign_train`.

One command continues the campaign from wherever it stopped and runs until a wall-clock limit (``hours``); it is
safe to kill at any moment. Its settings are ``campaign/campaign.yaml`` (``key=value`` overrides any field; a
misspelt key is an error listing the valid ones).

Data stage (``stage=data``). The prompts are one fixed, ordered pool (:func:`pool_items`): ShareGPT conversations
(up to ``data.max_turns`` human turns; programming ones apart from general chat), reasoning-gym ``codeio``
programming tasks and reasoning-gym math word problems, interleaved by the ``data.mix`` weights. The HumanEval,
MT-Bench and GSM8K-style evaluation prompts are never in it (:func:`eval_texts`; ``gsm_symbolic``, the
evaluation's generator, is not a training generator). The pool's first ``data.holdout`` usable items are the fixed
held-out set; training shards follow it, ``data.shard_size`` items each, in pool order. For each shard the target
regenerates every assistant turn greedily with its own earlier answers as the history
(:func:`~dartree.training.answers.regenerate_dialogues`: continuous batching; finished rows are appended to a cache
file, so a killed run resumes inside the shard), then the shard is written to ``campaign/data/`` as a compressed
Parquet file of token ids and loss masks (no hidden states), and ``campaign/manifest.json`` records how it was
made. Shard files and the manifest are written atomically; they are what a later run, on a fresh machine,
continues from (commit them). ``campaign.py stage=verify shard=K`` regenerates shard K again and compares tokens.
``stage=baseline`` scores the shipped checkpoints on the campaign's held-out set; ``stage=curve`` draws the
scaling curve from them and the recorded training runs (:func:`curve_file`: ``checkpoints/campaign_curve.png`` for
the repository's campaign, ``<dir>/campaign_curve.png`` for another folder, or ``out=FILE.png``). Every stage first
checks the call's data settings against the manifest and every listed file against its sha256
(:func:`check_campaign`), in one line, before anything slow.

On a GPU (``device=cuda``, e.g. the burst, :mod:`dartree.training.tools.burst`): ``shards_per_call`` shards share one
continuous batch and each is written as soon as it is complete; follow-up turns are requeued as whole-history
prompts (``gen_requeue``), refills wait for ``gen_min_free`` free slots and prefills take ``gen_prefill_tokens``.
``stage=plan shards=K out=FILE`` writes the next K pieces' tokenized prompts (:func:`write_plan`), so a machine
without the prompt packages regenerates them with ``plan=FILE``.

Training stage (``stage=train``): see :mod:`dartree.training.tools.campaign_train`.

Sources: DFlash (github.com/z-lab/dflash) and DSpark (arXiv 2607.05147) train on target-regenerated responses;
EAGLE-3 (arXiv 2503.01840) reports acceptance growing with training data, which is why this runs for days.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from dartree.base.cli import fail
from dartree.training.campaign_store import CampaignError, read_manifest
from dartree.training.tools.campaign_plan import write_plan
from dartree.training.tools.campaign_settings import check_campaign, curve_file, load_settings
from dartree.training.tools.campaign_shards import run_data, run_verify
from dartree.training.tools.campaign_train import holdout_baseline, plot_curve, run_train


def status(cfg: DictConfig) -> str:
    """A few lines on the campaign's progress (shards, tokens, regeneration speed per CPU)."""
    m = read_manifest(Path(cfg.dir))
    t = m.get("totals") or {}
    lines = [f"campaign {cfg.dir}: {t.get('shards', 0)} training shards, {t.get('conversations', 0)} conversations, "
             f"{t.get('response_tokens', 0)} response tokens of the goal {cfg.data.goal_response_tokens}"
             + (f", held-out set of {m['holdout']['conversations']}" if m.get("holdout") else ", no held-out set yet")]
    by_cpu: dict = {}
    for s in m["shards"] + ([m["holdout"]] if m.get("holdout") else []):
        k = (s["cpu"], s["gen_dtype"], s["threads"])
        a = by_cpu.setdefault(k, [0, 0.0])
        a[0] += s["response_tokens"]
        a[1] += s["seconds"]
    for (cpu, dt, th), (n, sec) in by_cpu.items():
        lines.append(f"  {cpu}, {dt}, {th} thread(s): {n} response tokens in {sec / 3600:.2f} h "
                     f"({n / max(sec, 1e-9):.1f} tokens/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for a settings or state error)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    t0 = time.time()
    try:
        cfg = load_settings(args)
        deadline = t0 + float(cfg.hours) * 3600
        check_campaign(cfg)  # settings and file integrity, for every stage, before anything slow
        if cfg.stage == "status":
            print(status(cfg))
            return 0
        if cfg.stage == "verify":
            return run_verify(cfg)
        if cfg.stage == "plan":
            plan = write_plan(cfg, Path(cfg.out), int(cfg.shards))
            n = sum(len(e["items"]) for e in plan["entries"])
            print(f"campaign plan: {cfg.out}: {len(plan['entries'])} pieces ({plan['entries'][0]['name']} .. "
                  f"{plan['entries'][-1]['name']}), {n} conversations, pool {plan['start']} .. "
                  f"{plan['entries'][-1]['pool'][1]}, {Path(cfg.out).stat().st_size:,} bytes")
            return 0
        if cfg.stage in ("baseline", "curve"):
            if cfg.stage == "baseline":
                for recipe in cfg.train.recipes:
                    holdout_baseline(cfg, recipe)
            path = plot_curve(cfg, curve_file(cfg))
            print(f"scaling curve: {path}" if path else "no baseline yet: run stage=baseline first")
            return 0
        if cfg.stage in ("data", "all"):
            data_deadline = deadline
            if cfg.stage == "all" and len(read_manifest(Path(cfg.dir))["shards"]) >= int(cfg.train.min_shards):
                data_deadline = t0 + (1 - float(cfg.train_share)) * float(cfg.hours) * 3600
            run_data(cfg, data_deadline)
        if cfg.stage in ("train", "all") and time.time() < deadline:
            run_train(cfg, deadline)
        print(status(cfg))
    except CampaignError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("campaign: interrupted; it resumes where it stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

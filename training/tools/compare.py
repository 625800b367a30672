"""The equal-compute comparison of training choices: ``python training/tools/compare.py`` (docs/training.md).

Each *arm* of ``campaign/compare.yaml`` is a list of recipe overrides (a warm start, an objective, a schedule, ...).
Every arm trains the same recipe from the same seed on the same campaign shards for the same number of optimiser
steps (``steps``: equal compute wherever a step costs the same; the process CPU seconds and the draft time are
recorded beside each arm, so an arm whose step costs more is read against its cost), with the held-out chain tau of
the campaign's held-out set every ``eval_every_steps`` steps (the learning curve), then the eval chain tau of its
checkpoint on the evaluation prompts (``decode/eval.py --tree chain --budget 16``, fp32, greedy: the campaign's gate
command). Results go to ``campaign/compare.json`` (committed; written atomically after every arm), from which the
results page renders the table (``make results``).

An arm already recorded with the same settings is skipped; an arm whose run was interrupted resumes from its
resumable state (``resume=true``) in the runs folder (``runs_dir``, default ``<user cache>/compare-runs``). Settings
that change what an arm computes (recipe, steps, shards, seed, common, eval) are part of the record: a record made
with other settings is redone, not mixed in.

    python training/tools/compare.py                       # every arm not yet recorded, one after another
    python training/tools/compare.py only=[baseline,lk]    # just these arms
    python training/tools/compare.py stage=status          # what is recorded

Keys: ``file=`` (the comparison file, default ``campaign/compare.yaml``), ``out=`` (the record, default
``campaign/compare.json``), ``runs_dir=`` (the runs folder), ``only=[ARM,...]``, ``eval=false`` (training and the
held-out curve only), ``stage=run|status``. Every arm's overrides are checked before the first arm trains; an arm
whose training finished but whose evaluation failed is evaluated again, not retrained. A resumed arm's ``cpu_s``
counts the resuming process only (``resumed`` is true in its record).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.schema import merge_settings

REPO = Path(__file__).resolve().parents[2]


class CompareError(ValueError):
    """A settings or record problem of the comparison, in one line naming the key or file and the fix."""


@dataclass
class CompareSettings:
    stage: str = "run"  # run | status
    file: str = str(REPO / "campaign" / "compare.yaml")  # the arms and their shared settings
    out: str = str(REPO / "campaign" / "compare.json")  # the committed record
    runs_dir: str = ""  # "": <user cache>/compare-runs
    only: List[str] = field(default_factory=list)  # arms to run (empty: every arm)
    eval: bool = True  # measure eval chain tau after training (false: training and held-out curve only)


@dataclass
class EvalSpec:
    limit: int = 5  # prompts per data set (HumanEval, MT-Bench, GSM8K-style)
    max_new_tokens: int = 128
    budget: int = 16


@dataclass
class CompareFile:
    recipe: str = "dspark_b16"
    steps: int = 300  # optimiser steps per arm
    shards: int = 0  # campaign shards to train on (0: all committed)
    seed: int = 0
    threads: int = 1
    eval_every_steps: int = 100
    common: List[str] = field(default_factory=list)  # overrides every arm shares
    eval: EvalSpec = field(default_factory=EvalSpec)
    arms: Dict[str, List[str]] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)  # one line per arm: what it tests and its source


def load(args: list[str]):
    """(settings, the comparison file) from ``key=value`` words and the YAML file they name.

    Raises:
        CompareError: an unknown key or bad value (named, valid keys listed), an unknown stage, a missing or
            malformed comparison file, no arms, or an ``only`` arm the file does not define.
    """
    from omegaconf import DictConfig, OmegaConf

    def merged(schema_cls, src, where: str):
        schema = OmegaConf.structured(schema_cls)
        OmegaConf.set_struct(schema, True)
        for key in ("arms", "notes"):  # open maps: any arm name
            if key in schema:
                OmegaConf.set_struct(schema[key], False)
        return merge_settings(schema, [(src, where)], CompareError)

    bare = [a for a in args if a.startswith("only=") and not a[5:].startswith("[")]
    if bare:
        raise CompareError(f"{bare[0]}: give a list, only=[{bare[0][5:]}] (arms separated by commas)")
    cfg = merged(CompareSettings, OmegaConf.from_dotlist(list(args)), "compare.py")
    if cfg.stage not in ("run", "status"):
        raise CompareError(f"stage={cfg.stage!r}: use run or status")
    path = Path(cfg.file)
    if not path.is_file():
        raise CompareError(f"file={path}: no such comparison file; give file=PATH to a YAML with recipe, steps, arms")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # a YAML syntax error: its first line
        raise CompareError(f"{path}: not valid YAML ({str(exc).splitlines()[0]}); fix the file") from None
    if not isinstance(raw, DictConfig):
        raise CompareError(f"{path}: the top level must be a mapping (recipe:, steps:, arms: ...), not a list")
    spec = merged(CompareFile, raw, str(path))
    if not spec.arms:
        raise CompareError(f"{path}: no arms; give arms: {{NAME: [key=value, ...]}}")
    if spec.steps < 1 or spec.threads < 0 or spec.eval_every_steps < 0:
        raise CompareError(f"{path}: steps >= 1, threads >= 0 and eval_every_steps >= 0")
    unknown = [a for a in cfg.only if a not in spec.arms]
    if unknown:
        raise CompareError(f"only={list(cfg.only)}: {unknown} not in {path} (arms: {sorted(spec.arms)})")
    return cfg, spec


def arm_words(spec, name: str, output_dir: Path) -> list[str]:
    """The training command's words of arm ``name``: the recipe, the shared settings, the arm's overrides (last, so
    an arm can change a shared one) and the run's folder."""
    return [f"recipe={spec.recipe}", "data.source=campaign", f"data.campaign_shards={spec.shards}",
            f"seed={spec.seed}", f"train.max_steps={spec.steps}", "train.max_minutes=0",
            f"train.threads={spec.threads}", f"train.eval_every_steps={spec.eval_every_steps}",
            *[str(w) for w in spec.common], *[str(w) for w in spec.arms[name]], f"output_dir={output_dir}"]


def fingerprint(spec, name: str) -> dict:
    """What arm ``name`` computes: a record made under other settings is redone."""
    return {"recipe": spec.recipe, "steps": int(spec.steps), "shards": int(spec.shards), "seed": int(spec.seed),
            "common": [str(w) for w in spec.common], "overrides": [str(w) for w in spec.arms[name]],
            "eval": {"limit": int(spec.eval.limit), "max_new_tokens": int(spec.eval.max_new_tokens),
                     "budget": int(spec.eval.budget)}}


def read_record(path: Path) -> dict:
    """``compare.json`` ({"arms": {name: record}}), empty when absent.

    Raises:
        CompareError: the file is not JSON or not an object with an ``arms`` object (named; restore it with git).
    """
    if not path.exists():
        return {"arms": {}}
    try:
        rec = json.loads(path.read_text())
    except ValueError as exc:
        raise CompareError(f"{path}: not valid JSON ({exc}); restore it with git") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("arms"), dict):
        raise CompareError(f"{path}: expected an object with an 'arms' object; restore it with git")
    return rec


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def train_arm(spec, name: str, runs: Path) -> dict:
    """Train arm ``name`` (resuming its run where a resumable state exists); returns its training figures.

    Raises:
        RecipeError: the arm's overrides do not make a valid recipe (one line).
    """
    # lazy: the status stage and --help stay free of torch
    from dartree.training.recipe import load_recipe
    from dartree.training.trainer import train_recipe

    out = runs / name
    words = arm_words(spec, name, out)
    trained = out / "arm.json"  # the figures of a finished training, kept until the arm is recorded
    if trained.exists() and (out / "checkpoint").exists():
        fig = json.loads(trained.read_text())
        if fig.get("settings") == fingerprint(spec, name):
            print(f"compare: {name} is trained ({out / 'checkpoint'}); evaluating it", flush=True)
            return {k: v for k, v in fig.items() if k != "settings"}
    resume = (out / "resume").exists() and not (out / "checkpoint").exists()
    cfg = load_recipe(words + (["resume=true"] if resume else []))
    cpu0, t0 = _cpu_seconds(), time.time()
    summary = train_recipe(cfg)
    cpu, wall = _cpu_seconds() - cpu0, time.time() - t0
    curve_path = out / "curve.json"
    curve = json.loads(curve_path.read_text()) if curve_path.exists() else []
    points = curve.get("points", curve) if isinstance(curve, dict) else curve
    fig = {"command": "python training/train.py " + " ".join(w for w in words if not w.startswith("output_dir=")),
           "steps": int(summary.get("steps", spec.steps)), "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
           "resumed": resume, "holdout_chain_tau": summary.get("holdout_chain_tau"),
           "holdout_tf_tau": summary.get("holdout_tf_tau"), "predictions": summary.get("predictions"),
           "curve": [{k: p[k] for k in ("step", "train_tokens", "holdout_chain_tau", "holdout_tf_tau", "train_loss")
                      if k in p} for p in points],
           "checkpoint": str(out / "checkpoint"), "target": str(cfg.target.path)}
    write_file_atomically(trained, json.dumps({"settings": fingerprint(spec, name), **fig}) + "\n")
    return fig


def check_arms(cfg, spec, names: list[str], runs: Path) -> None:
    """Every arm's recipe loads (its overrides are valid keys and values) before any arm trains.

    Raises:
        CompareError: an arm's overrides do not make a valid recipe, naming the arm and the file.
    """
    # lazy: the status stage and --help stay free of torch
    from dartree.training.recipe import RecipeError, load_recipe

    for name in names:
        try:
            load_recipe(arm_words(spec, name, runs / name))
        except RecipeError as exc:
            raise CompareError(f"{cfg.file}: arm {name}: {exc}") from None


def eval_arm(spec, checkpoint: Path, report: Path, target: str = "smollm2") -> dict:
    """Eval chain tau of ``checkpoint`` on the evaluation prompts: ``decode/eval.py --tree chain --budget B --limit N
    --max-new-tokens T --dtype float32 --ar-repeats 1`` (one AR run per prompt: the reference tokens of the lossless
    check; the comparison reads tau, not speed) in this process
    (:func:`dartree.training.tools.burst_apply.eval_chain`), plus the mean draft seconds per round.

    ``target``: the recipe's target (``target.path``).

    Raises:
        CompareError: the evaluation failed (its error printed above; the trained arm is kept for the next call).
    """
    # lazy: the status stage stays free of torch
    from dartree.training.tools.burst_apply import eval_chain
    from dartree.training.tools.burst_settings import BurstError

    e = spec.eval
    words = ["--tree", "chain", "--budget", str(e.budget), "--limit", str(e.limit), "--max-new-tokens",
             str(e.max_new_tokens), "--dtype", "float32", "--ar-repeats", "1", "--no-plots"]
    try:
        res = eval_chain(checkpoint, target, words, report)
    except BurstError:
        raise CompareError(f"decode/eval.py could not evaluate {checkpoint} (its error above); fix that and run "
                           "again (the trained arm is kept and only evaluated), or give eval=false") from None
    return {"eval_chain_tau": res["tau"], "eval_prompts": res["prompts"], "eval_mismatches": res["mismatches"],
            "eval_command": "python decode/eval.py --checkpoint CKPT " + " ".join(words), "draft_ms": res["draft_ms"]}


def _write(path: Path, rec: dict) -> None:
    write_file_atomically(path, json.dumps(rec, indent=1, sort_keys=False) + "\n")
    plot_arms(rec, path.with_name("compare_curves.png"))


def plot_arms(rec: dict, png: Path) -> Path | None:
    """The arms' learning curves (held-out chain tau and training loss against training tokens seen;
    :func:`dartree.base.figures.fig_curves`) to ``png``; a plotting problem is a printed warning, never an error."""
    # lazy: the status stage stays free of matplotlib
    from dartree.base.figures import fig_curves, save_png

    curves = {name: [p for p in a.get("curve", []) if "train_tokens" in p and p.get("holdout_chain_tau") is not None]
              for name, a in rec["arms"].items()}
    try:
        return save_png(fig_curves(curves), png)
    except (ValueError, OSError) as exc:
        print(f"compare: warning: no curve figure ({exc})", flush=True)
        return None


def status(cfg, spec) -> int:
    """Print one line per arm: recorded (with its figures), stale (other settings) or to do."""
    rec = read_record(Path(cfg.out))["arms"]
    for name in list(cfg.only) or list(spec.arms):
        r = rec.get(name)
        if r is None:
            print(f"{name}: to do")
        elif r.get("settings") != fingerprint(spec, name):
            print(f"{name}: recorded under other settings (will be redone)")
        else:
            print(f"{name}: held-out chain tau {r.get('holdout_chain_tau')}, eval chain tau {r.get('eval_chain_tau')}, "
                  f"{r.get('steps')} steps, {r.get('cpu_s')} CPU s")
    return 0


def run(cfg, spec) -> int:
    """Train and evaluate every arm not yet recorded under these settings, recording each as it finishes."""
    # lazy: the status stage stays free of torch
    from dartree.models.target import cache_root
    from dartree.training.campaign_store import cpu_model

    out = Path(cfg.out)
    runs = Path(cfg.runs_dir or cache_root() / "compare-runs").absolute()
    names = list(cfg.only) or list(spec.arms)
    check_arms(cfg, spec, names, runs)
    for name in names:
        rec = read_record(out)
        done = rec["arms"].get(name)
        if done is not None and done.get("settings") == fingerprint(spec, name) and (
                done.get("eval_chain_tau") is not None or not cfg.eval):
            print(f"compare: {name} is recorded; skipped", flush=True)
            continue
        print(f"compare: arm {name}: {' '.join(spec.arms[name]) or '(the recipe as it is)'}", flush=True)
        fig = train_arm(spec, name, runs)
        if cfg.eval:
            fig.update(eval_arm(spec, Path(fig["checkpoint"]), runs / f"{name}-eval", fig.get("target", "smollm2")))
        fig.pop("checkpoint")
        fig.pop("target", None)
        rec = read_record(out)  # again: another process may have recorded an arm meanwhile
        rec["arms"][name] = {"settings": fingerprint(spec, name), "note": spec.notes.get(name, ""), **fig,
                             "cpu": cpu_model(), "threads": int(spec.threads),
                             "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write(out, rec)
        print(f"compare: {name}: held-out chain tau {fig.get('holdout_chain_tau')}, eval chain tau "
              f"{fig.get('eval_chain_tau')}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (``key=value`` words); exit 2 with one line for bad settings or records."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg, spec = load(args)
        return status(cfg, spec) if cfg.stage == "status" else run(cfg, spec)
    except CompareError as exc:
        return fail(exc)
    except ValueError as exc:  # RecipeError / BurstError: one line naming the problem
        return fail(exc)


if __name__ == "__main__":
    sys.exit(main())

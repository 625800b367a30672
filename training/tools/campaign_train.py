"""The campaign's training stage: ``python training/tools/campaign.py stage=train`` (or ``stage=all``).

Each call trains every recipe of ``train.recipes`` on all committed campaign shards (``data.source=campaign``:
the target's features are recomputed online, see :mod:`dartree.training.campaign_data`), for its share of the
wall-clock limit, through :func:`dartree.training.trainer.train_recipe`, the body of ``training/train.py``
(DeepSpeed engine, resumable checkpoints, learning curve).

One run per (recipe, number of shards): ``<cache>/campaign-runs/<recipe>-<shards>``. A run that was stopped by
the clock resumes in the next call (``resume=true``: model, optimiser and data position); once new shards have
landed, a new run starts from the latest weights of the recipe: the previous run's checkpoint when this machine
still has it, else the campaign's committed checkpoint ``campaign/checkpoints/<recipe>``, else the shipped
``checkpoints/<recipe>``. ``campaign/train_state.json`` (committed) records every run: shards, steps, predictions,
held-out chain tau on the campaign's held-out set, and the CPU. Its folders are relative to stated roots
(``runs:``, ``campaign:``, ``repo:``; :class:`dartree.training.campaign_store.RecordRoots`): :func:`read_state`
gives them as local absolute paths (also for old records that stored absolute paths) and :func:`write_state`
stores them relative again, so the committed file names no folder of the machine that wrote it.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from omegaconf import DictConfig

from dartree.base.files import write_file_atomically
from dartree.base.cli import fail
from dartree.base.records import NUMBER, read_json
from dartree.training.campaign_store import (CampaignError, DEFAULT_DIR, REPO, RecordRoots, STATE_SHAPE, cpu_model,
                                             device_name, from_record, read_manifest, read_shard, resolve_device,
                                             to_record)

# what the campaign and the burst read from a training run's summary.json (the trainer writes more)
SUMMARY_SHAPE = {"steps": int, "predictions": NUMBER, "train_tokens": int, "stopped_by_time_cap": bool,
                 "holdout_chain_tau?": (*NUMBER, None), "holdout_tf_tau?": (*NUMBER, None)}


def _state_path(cfg: DictConfig) -> Path:
    return Path(cfg.dir) / "train_state.json"


def runs_folder(cfg: DictConfig) -> Path:
    """The campaign's runs folder, absolute: ``runs_dir``, else ``<user cache>/campaign-runs``."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.models.target import cache_root

    return Path(cfg.get("runs_dir") or cache_root() / "campaign-runs").absolute()


def record_roots(cfg: DictConfig) -> RecordRoots:
    """The folders the stated roots of ``train_state.json`` stand for here: the runs folder (:func:`runs_folder`),
    the campaign folder (``dir``) and the repository."""
    return RecordRoots(runs=runs_folder(cfg), campaign=Path(cfg.dir).absolute())


def read_state(cfg: DictConfig) -> dict:
    """``campaign/train_state.json`` ({recipe: {"runs": [...]}}), empty when absent; its stored paths as local
    absolute paths (:func:`record_roots`), records with absolute paths of another machine mapped the same way.

    Raises:
        CampaignError: the file does not parse or lacks what the campaign reads (one line naming the file and the
            place: :data:`dartree.training.campaign_store.STATE_SHAPE`; restore it with git).
    """
    path = _state_path(cfg)
    stored = read_json(path, STATE_SHAPE, fix=f"restore it with `git checkout {path}`", absent={},
                       error=CampaignError)
    return from_record(stored, record_roots(cfg))


def write_state(cfg: DictConfig, state: dict) -> None:
    """Write the training state to ``campaign/train_state.json`` atomically, every path relative to its stated
    root (:func:`dartree.training.campaign_store.to_record`). Callers that may run side by side use
    :func:`locked_state` instead."""
    write_file_atomically(_state_path(cfg), json.dumps(to_record(state, record_roots(cfg)), indent=1) + "\n")


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


def run_folder(root: Path, recipe: str, shards: int, state: dict) -> Path:
    """The folder of this call's run of ``recipe`` on ``shards`` shards: ``RECIPE-NNNNN`` in ``root`` (one run per
    recipe and number of shards), unless a run is recorded under that name without its resumable state on this
    machine (it ran on another machine, or its folder is gone): that run cannot be continued here, so the new one takes
    the next free ``RECIPE-NNNNN.K`` (K = 2, 3, ...), with a record of its own whose parent (the recorded run, when it
    starts from the checkpoint that run committed or shipped) is not itself."""
    recorded = {r["output_dir"] for r in state.get(recipe, {}).get("runs", [])}
    out, k = root / f"{recipe}-{shards:05d}", 1
    while str(out) in recorded and not (out / "resume").exists():
        k += 1
        out = root / f"{recipe}-{shards:05d}.{k}"
    return out


def start_for(cfg: DictConfig, recipe: str, state: dict, out: Path) -> tuple[str, bool]:
    """Where the run of ``recipe`` in ``out`` starts: ``(init_from, resumable)``.

    A run recorded for ``out`` whose resumable state is on this machine (``out/resume``) continues from that state
    (its weights come from there): with the ``init_from`` it was started with while that folder exists, else with
    its own last checkpoint (``out/checkpoint``), else :func:`init_for` (the starting checkpoint only builds the
    model). Otherwise, a new run or the same shards on another machine (the record names a run folder or an
    ``init_from`` of that machine), the run starts from :func:`init_for`.
    """
    same = [r for r in state.get(recipe, {}).get("runs", []) if r["output_dir"] == str(out)]
    if same and (Path(out) / "resume").exists():
        for init in (same[-1]["init_from"], str(Path(out) / "checkpoint")):
            if (Path(init) / "config.json").exists():
                return init, True
        return init_for(cfg, recipe, state), True
    return init_for(cfg, recipe, state), False


def continues_lineage(cfg: DictConfig, init: str) -> bool:
    """Whether a run started from ``init`` continues its lineage (its data cursor and schedule, ``train.lineage``):
    always from this campaign's runs and committed checkpoints; from a shipped checkpoint (``checkpoints/RECIPE``,
    whose lineage record is the repository campaign's) only in the repository's own campaign folder, since another
    campaign's data would refuse its cursor (:func:`dartree.training.cursor.run_cursor`)."""
    shipped = Path(init).resolve().parent == (REPO / "checkpoints").resolve()
    return not shipped or Path(cfg.dir).resolve() == DEFAULT_DIR.resolve()


def parent_of(cfg: DictConfig, recipe: str, state: dict, init: str) -> str | None:
    """The run whose weights ``init`` holds, by its ``output_dir``, or None for the campaign's baseline (the
    drafters trained before the campaign). A run folder's checkpoint is that run; the committed
    ``campaign/checkpoints/<recipe>`` is ``state[recipe]["committed_run"]`` and the shipped
    ``checkpoints/<recipe>`` is ``state[recipe]["shipped_run"]`` (both recorded when a checkpoint is committed or
    shipped; absent: the baseline). Recorded in each run as ``parent``, so the curve counts the predictions of a
    run's own lineage only."""
    path = Path(init)
    if path.name == "checkpoint":
        return str(path.parent)
    rec = state.get(recipe, {})
    if path.resolve() == (Path(cfg.dir) / "checkpoints" / recipe).resolve():
        return rec.get("committed_run")
    return rec.get("shipped_run")


@contextlib.contextmanager
def locked_state(cfg: DictConfig):
    """The training state read under an exclusive lock (``train_state.json.lock``, ``fcntl.flock``) and written
    atomically when the block ends without error: campaign processes training recipes side by side (the burst)
    each add their own run without losing the others'."""
    import fcntl

    path = _state_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_state(cfg)
        yield state
        write_state(cfg, state)


def recipe_has(key: str) -> bool:
    """Whether the recipe schema has the dotted ``key`` (e.g. ``train.device``), so the campaign passes settings
    only to a trainer that takes them."""
    from omegaconf import OmegaConf

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.recipe import Recipe

    return OmegaConf.select(OmegaConf.structured(Recipe), key, default="<absent>") != "<absent>"


def _device_words(cfg: DictConfig) -> list[str]:
    """``train.device=...`` for the recipe where the trainer takes it and the campaign is not on the CPU."""
    return [f"train.device={cfg.device}"] if cfg.device != "cpu" and recipe_has("train.device") else []


def _minutes_for(cfg: DictConfig, k: int, deadline: float) -> float:
    """Recipe k's minutes: its share (``train.shares``, else equal) of the time left among recipes k, k+1, ..."""
    tc = cfg.train
    w = [float(x) for x in tc.shares] if len(tc.shares) else [1.0] * len(tc.recipes)
    return (deadline - time.time()) / 60 * w[k] / sum(w[k:])


def run_train(cfg: DictConfig, deadline: float, runs_root: Path | None = None) -> dict:
    """Train each recipe of ``cfg.train.recipes`` on the committed shards until ``deadline`` (by
    ``train.shares``, else equally); returns the updated training state (also written to
    ``campaign/train_state.json``, under :func:`locked_state`).

    ``train.init=scratch`` starts a new run from random weights (recorded ``from_scratch``; the curve then counts
    its own data and predictions only); ``train.overhead_minutes`` is kept from each run's ``train.max_minutes``
    for its set-up, held-out evaluation and save; a recipe with under ``train.min_minutes`` left is not started.
    ``runs_root`` (else ``runs_dir``, else the user cache): where the runs live, and the root their records'
    ``runs:`` paths are relative to.

    Raises:
        CampaignError: a training run failed (its exit status and output folder named).
    """
    # lazy: the trainer loads torch, transformers and deepspeed; the campaign's status and plan stages stay light
    from dartree.training.recipe import RecipeError, load_recipe
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.trainer import train_recipe

    tc = cfg.train
    n = len(read_manifest(Path(cfg.dir))["shards"])
    if n < int(tc.min_shards):
        print(f"campaign train: {n} training shards, fewer than train.min_shards={tc.min_shards}; the data stage "
              "goes first", flush=True)
        return read_state(cfg)
    if runs_root is not None:  # the records' runs root too
        from omegaconf import OmegaConf

        cfg = OmegaConf.merge(cfg, {"runs_dir": str(Path(runs_root).absolute())})
    root = runs_folder(cfg)
    for k, recipe in enumerate(list(tc.recipes)):
        minutes = _minutes_for(cfg, k, deadline)
        if minutes < float(tc.min_minutes):
            break
        state = read_state(cfg)
        out = run_folder(root, recipe, n, state)
        runs = state.get(recipe, {}).get("runs", [])
        init, resumable = start_for(cfg, recipe, state, out)
        scratch = tc.init == "scratch" and not resumable
        same = [r for r in runs if r["output_dir"] == str(out)]
        parent = same[-1].get("parent") if resumable else (None if scratch else parent_of(cfg, recipe, state, init))
        origin = (same[-1].get("init_from") if resumable and same else None) or init  # what the run started from
        args = [f"recipe={recipe}", "data.source=campaign", f"data.campaign_dir={cfg.dir}",
                f"data.campaign_shards={n}", *([] if scratch else [f"init_from={init}"]), f"output_dir={out}",
                "resume=true", f"train.max_minutes={max(minutes - float(tc.overhead_minutes), 0.1):.2f}",
                f"train.epochs={tc.epochs}", f"train.threads={cfg.threads}",
                f"train.eval_every_steps={tc.eval_every_steps}", *_device_words(cfg),
                *(["data.cursor_from_init=true", "train.schedule_from_init=true"]
                  if tc.lineage and not scratch and continues_lineage(cfg, origin) else []),
                *list(tc.overrides)]
        print("campaign train: python training/train.py " + " ".join(args), flush=True)
        try:  # the train command's run, from the merged recipe (no argv round trip)
            train_recipe(load_recipe(args))
            rc = 0
        except RecipeError as exc:
            rc = fail(str(exc))
        if rc != 0:
            raise CampaignError(f"training {recipe} on {n} shards exited with {rc}; see the output above and {out}")
        summary = read_json(out / "summary.json", SUMMARY_SHAPE, error=CampaignError,
                            fix=f"the run in {out} did not finish writing it; train again")
        rec = {"output_dir": str(out), "init_from": None if scratch else init, "parent": parent, "shards": n,
               "steps": summary["steps"], "predictions": summary["predictions"],
               "train_tokens": summary["train_tokens"], "holdout_chain_tau": summary.get("holdout_chain_tau"),
               "holdout_tf_tau": summary.get("holdout_tf_tau"), "stopped_by_time_cap": summary["stopped_by_time_cap"],
               "cpu": cpu_model(), "threads": int(cfg.threads),
               "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if scratch or (same and same[-1].get("from_scratch")):
            rec["from_scratch"] = True
        if cfg.device != "cpu":
            rec["device"] = device_name(resolve_device(cfg.device))
        with locked_state(cfg) as state:
            runs = state.setdefault(recipe, {"runs": []})["runs"]
            old = [i for i, r in enumerate(runs) if r["output_dir"] == str(out)]
            if resumable and old:
                runs[old[-1]] = rec
            else:  # a new run, or the same shards again on a machine without that run: a record of its own
                runs.append(rec)
        print(f"campaign train: {recipe} on {n} shards: step {rec['steps']}, {rec['predictions']} predictions, "
              f"held-out chain tau {rec['holdout_chain_tau']}", flush=True)
    return read_state(cfg)


# Published growth of acceptance with target-regenerated training data, in tau per doubling of the data (public
# small-compute runs: docs/design.md, "Acceptance against training data").
PUBLISHED_SLOPES = (0.30, 0.45)
# What the campaign's starting drafters (the pre-campaign drafters, docs/results.md) were trained on: 1,504
# sequences, 324,110 response tokens, 3,008 steps of 2 sequences x ~1,024 predictions; campaign/train_state.json
# keeps their held-out scores as the baseline.
SHIPPED = {"response_tokens": 324_110, "predictions": 6_160_000}


def holdout_baseline(cfg: DictConfig, recipe: str, checkpoint: str | None = None) -> dict:
    """Held-out chain and teacher-forced tau of a checkpoint (default: the shipped ``checkpoints/<recipe>``) on the
    campaign's held-out set, the reference point every campaign run is compared with; recorded in
    ``campaign/train_state.json`` under ``baseline``.

    The baseline is recorded once: it is the point the campaign started from (the drafters trained on the
    ``SHIPPED`` data), so a second call for a recipe that has one is refused rather than overwriting it with a
    checkpoint trained on other data.

    Raises:
        CampaignError: no held-out set yet (run the data stage), a baseline is already recorded for ``recipe``,
            or the checkpoint does not load (named).
    """
    import torch

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.campaign_data import CampaignData, campaign_rows
    from dartree.training.recipe import RecipeError, load_recipe
    from dartree.training.build import build_models, load_init, load_recipe_target
    from dartree.training.settings import parse_recipe_dtype, run_settings
    from dartree.training.step import evaluate_holdout

    checkpoint = checkpoint or str(REPO / "checkpoints" / recipe)
    known = read_state(cfg).get("baseline", {}).get(recipe)
    if known is not None:
        raise CampaignError(f"{_state_path(cfg)} already records the baseline of {recipe} ({known['checkpoint']}, "
                            f"held-out chain tau {known['holdout_chain_tau']}, trained on "
                            f"{known['response_tokens']:,} response tokens); the campaign's curve starts there. "
                            f"To score {checkpoint} as a new starting point, remove baseline.{recipe} from that file "
                            "first")
    m = read_manifest(Path(cfg.dir))
    if not m.get("holdout"):
        raise CampaignError("no held-out set yet; run `python training/tools/campaign.py stage=data` first")
    _, hold = campaign_rows(Path(cfg.dir), 0) if m["shards"] else ([], _holdout_only(cfg))
    torch.set_num_threads(int(cfg.threads))
    try:
        rc = run_settings(load_recipe([f"recipe={recipe}", "data.source=campaign", f"data.campaign_dir={cfg.dir}"]))
        target = load_recipe_target(rc.target.path, parse_recipe_dtype(rc.target.dtype, "target.dtype"))
        drafter, head = load_init(checkpoint, target, rc.init, lambda: build_models(rc.models, target)[1])
    except RecipeError as exc:
        raise CampaignError(str(exc)) from None
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    data = CampaignData(target, [], hold)
    data.need_lse = bool(drafter.cfg.draft_vocab_size)
    res = evaluate_holdout(drafter.eval(), head.eval(), target, data, rc.step)
    rel = Path(checkpoint).resolve()
    shown = str(rel.relative_to(REPO)) if rel.is_relative_to(REPO) else checkpoint
    rec = {"checkpoint": shown, "holdout_chain_tau": round(res["holdout_chain_tau"], 4),
           "holdout_tf_tau": round(res["holdout_tf_tau"], 4), "holdout_sequences": len(data.holdout_ids),
           **SHIPPED}
    state = read_state(cfg)
    state.setdefault("baseline", {})[recipe] = rec
    write_state(cfg, state)
    print(f"campaign baseline: {recipe} ({checkpoint}): held-out chain tau {rec['holdout_chain_tau']} on "
          f"{rec['holdout_sequences']} campaign held-out conversations", flush=True)
    return rec


def _holdout_only(cfg: DictConfig) -> list:
    m = read_manifest(Path(cfg.dir))
    return read_shard(Path(cfg.dir) / m["holdout"]["file"])


def curve_points(cfg: DictConfig) -> dict:
    """Per recipe, the scaling-curve points: the baseline and every campaign run, as dicts with
    ``response_tokens`` (regenerated tokens trained on: the baseline's data plus the shards a run used, since every
    run descends from the baseline's weights), ``predictions`` (the baseline's, plus those of the run and of the
    runs it continued: its ``parent`` chain, :func:`parent_of`) and ``holdout_chain_tau`` (on the campaign's
    held-out set), and ``eval_chain_tau`` where the record has one (``decode/eval.py --tree chain`` on the
    evaluation prompts: recorded with its settings in ``eval_chain`` by ``training/tools/burst.py stage=apply``, or added
    by hand with the command on the results page, docs/results.md). A run recorded
    without ``parent`` (before lineage was recorded) counts every earlier run. A lineage that began from random
    weights (``from_scratch``, e.g. a GPU burst) counts its own shards and predictions only, not the baseline's."""
    state = read_state(cfg)
    m = read_manifest(Path(cfg.dir))
    per_shard = [s["response_tokens"] for s in m["shards"]]
    out = {}
    for recipe, base in state.get("baseline", {}).items():
        keys = ("response_tokens", "predictions", "holdout_chain_tau", "eval_chain_tau")
        pts = [{"label": "baseline", **{k: base[k] for k in keys if k in base}}]
        total = {}  # output_dir -> predictions of that run's lineage, since the baseline (or since scratch)
        fresh = set()  # runs whose lineage began from random weights (from_scratch): no baseline data in it
        running = 0
        for run in state.get(recipe, {}).get("runs", []):
            running += run["predictions"]
            if "parent" in run:
                own = run["predictions"] + (total.get(run["parent"], 0) if run["parent"] else 0)
            else:
                own = running
            total[run["output_dir"]] = own
            if run.get("from_scratch") or run.get("parent") in fresh:
                fresh.add(run["output_dir"])
            b = {"response_tokens": 0, "predictions": 0} if run["output_dir"] in fresh else base
            if run.get("holdout_chain_tau") is None:
                continue
            pts.append({"label": f"{run['shards']} shards" + (" (from scratch)" if b is not base else ""),
                        # continued from the shipped weights: both data sets
                        "response_tokens": b["response_tokens"] + sum(per_shard[: run["shards"]]),
                        "predictions": b["predictions"] + own, "holdout_chain_tau": run["holdout_chain_tau"],
                        **({"eval_chain_tau": run["eval_chain_tau"], "eval_setting": eval_setting(run)}
                           if "eval_chain_tau" in run else {})})
        out[recipe] = pts
    return out


# The settings of the eval chain tau recorded by hand (docs/results.md, "The shipped drafters"): the make-run
# prompts, 5 per set
HAND_EVAL_SETTING = "15 prompts x 128 tokens"


def eval_setting(record: dict) -> str:
    """What a record's ``eval_chain_tau`` was measured on, for the curve's legend: ``"N prompts x T tokens"`` from its
    ``eval_chain`` settings (``training/tools/burst.py stage=apply`` writes them), else :data:`HAND_EVAL_SETTING`."""
    ev = record.get("eval_chain") or {}
    if "prompts" in ev and "max_new_tokens" in ev:
        return f"{ev['prompts']} prompts x {ev['max_new_tokens']} tokens"
    return HAND_EVAL_SETTING


def plot_curve(cfg: DictConfig, path: Path) -> Path | None:
    """Draw held-out chain tau (circles, solid) and, where measured, eval chain tau (squares, dashed) against
    regenerated response tokens and training predictions (log axes), with the published +0.30 and +0.45 tau per
    doubling of the data drawn from the baseline point; returns the path, or None when there is no baseline yet.
    Written atomically (PNG)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator

    points = curve_points(cfg)
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "response_tokens", "regenerated response tokens trained on"),
                           (axes[1], "predictions", "training predictions (cumulative)")):
        for recipe, pts in points.items():
            pts = sorted(pts, key=lambda p: p[key])  # runs of different lineages: drawn in order of x
            (line,) = ax.plot([p[key] for p in pts], [p["holdout_chain_tau"] for p in pts], "o-",
                              label=f"{recipe} held-out")
            ev = [p for p in pts if "eval_chain_tau" in p]
            for setting in dict.fromkeys(p.get("eval_setting", HAND_EVAL_SETTING) for p in ev):  # one series each
                same = [p for p in ev if p.get("eval_setting", HAND_EVAL_SETTING) == setting]
                ax.plot([p[key] for p in same], [p["eval_chain_tau"] for p in same], "s--", color=line.get_color(),
                        label=f"{recipe} eval ({setting})")
        if key == "response_tokens":  # the published slopes, from the first recipe's shipped point
            first = next(iter(points))
            x0, y0 = points[first][0][key], points[first][0]["holdout_chain_tau"]
            xs = np.geomspace(x0, x0 * 32, 20)
            for s, style in zip(PUBLISHED_SLOPES, (":", "--")):
                ax.plot(xs, y0 + s * np.log2(xs / x0), style, color="gray",
                        label=f"+{s} tau per doubling (published), from {first}")
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k"))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k"))
        ax.tick_params(axis="x", which="both", labelsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("chain tau")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("dartree campaign: acceptance against data and compute")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_file_atomically(path, buf.getvalue())
    return path

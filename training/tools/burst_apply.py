"""The burst's ``stage=apply`` (here, afterwards; docs/burst.md): join and check the returned files, add the new
shards, checkpoints and runs to the campaign (:func:`apply_results`), then measure eval chain tau on the CPU of each
returned checkpoint and of the shipped one and ship each run that beats it (:func:`evaluate_and_ship`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import time
from pathlib import Path

from dartree.base.files import write_file_atomically
from dartree.base.integrity import record_problem
from dartree.base.records import NUMBER, read_json
from dartree.decode.harness.report_rows import EvalReport
from dartree.training.campaign_store import (LISTED_FILE_SHAPE, MANIFEST_SHAPE, STATE_SHAPE, cpu_model, from_record,
                                             read_manifest)
from dartree.training.tools.burst_settings import BurstError, REPO, campaign_dir, sha256_file
from dartree.training.campaign_store import CampaignError
from dartree.training.tools.campaign_settings import load_settings as campaign_settings
from dartree.training.tools.campaign_train import locked_state, record_roots


# What apply reads from the returned report.json and from decode/eval.py's report (dartree.base.records shapes)
REPORT_SHAPE = {"files": [{"file": str, "bytes": int, "sha256": str, "whole": str, "whole_sha256": str, "set": int}],
                "workers?": [{"recipe": str, "returned?": bool, "run?": str, "summary?": dict, "eval?": dict}],
                "payload": {"dartree": (str, None)}}
EVAL_REPORT_SHAPE = {"methods": {"chain?": {"tau": NUMBER, "prompts": int, "mismatches": int}},
                     "environment": {"prompts": [{"dataset": str, "id": (str, int)}]}}


def apply_results(cfg) -> dict:
    """``stage=apply``: join the returned pieces (sha256 of each whole file checked against the report), then add
    the new shards and the manifest to the campaign (its data settings and existing shards must be the returned
    manifest's own), each checkpoint to the campaign's runs (``runs_dir``/``<recipe>-<shards>``) and each run to
    ``train_state.json`` with that local folder (so the next campaign run continues from it and the curve counts
    it; a run applied again keeps one record). Then, with ``eval_limit > 0``, :func:`evaluate_and_ship`: eval chain
    tau of each run and of the shipped checkpoint on the CPU, recorded in the run, and each run that beats the
    shipped one shipped (``ship``, ``ship_dir``).

    Args:
        cfg: the burst settings (``results``, ``dir``, ``campaign``, ``runs_dir``, ``eval_*``, ``ship*``).
    Returns:
        {"shards": new shard files, "runs": run folders, "recipes": :func:`evaluate_and_ship`'s answer (only
        with ``eval_limit > 0`` and runs)}.
    Raises:
        BurstError: no report.json, a missing piece or set (fetch it), a sha256 mismatch, or a manifest that does
            not extend the local campaign (named); from the evaluation, a checkpoint it cannot evaluate or ship
            (the merge is then complete: apply again once fixed, or with ``eval_limit=0``).
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.models.target import cache_root

    dirs = [Path(d) for d in cfg.results]
    rep = next((d / "report.json" for d in dirs if (d / "report.json").exists()), None)
    if rep is None:
        raise BurstError(f"no report.json in results={[str(d) for d in dirs]}; give the folder of set 1")
    report = read_json(rep, REPORT_SHAPE, error=BurstError, fix="copy set 1 (the device's $OUT) again")
    stage = Path(cfg.dir if Path(cfg.dir).is_absolute() else REPO / cfg.dir) / "returned"
    _join_pieces(report, dirs, stage)
    camp = campaign_dir(cfg)
    new = _merge_shards(camp, stage)
    runs_root = (Path(cfg.runs_dir) if cfg.runs_dir else cache_root() / "campaign-runs").absolute()
    added = _add_runs(report, stage, camp, runs_root)
    print(f"burst apply: {len(new)} shards into {camp}, {len(added)} runs: {[d for _, d in added]}", flush=True)
    out = {"shards": [s["file"] for s in new], "runs": [d for _, d in added]}
    if int(cfg.eval_limit) > 0 and added:
        out["recipes"] = evaluate_and_ship(cfg, added)
    return out


def _join_pieces(report: dict, dirs: list[Path], stage: Path) -> None:
    """Join the returned pieces of each whole file of ``report`` (looked up in ``dirs``) into ``stage`` (replaced).

    Raises:
        BurstError: a piece is missing (the fetch command of its set named), a piece's size or sha256 differs from
            its record (the piece and its set named), or a joined file's sha256 differs.
    """
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    wholes: dict = {}
    for f in report["files"]:
        src = next((d / f["file"] for d in dirs if (d / f["file"]).exists()), None)
        if src is None:
            raise BurstError(f"{f['file']} (set {f['set']}) is not in the results; fetch set {f['set']} "
                             f"(bash training/tools/burst.sh fetch {f['set']}) and give its folder too")
        problem = record_problem(src, f)
        if problem:
            raise BurstError(f"{src} (set {f['set']}) failed its check against report.json ({problem}); fetch set "
                             f"{f['set']} again and give its folder")
        wholes.setdefault(f["whole"], (f["whole_sha256"], []))[1].append(src)
    for name, (sha, parts) in wholes.items():
        with open(stage / name, "wb") as o:
            for p in parts:
                o.write(p.read_bytes())
        if sha256_file(stage / name) != sha:
            raise BurstError(f"{name}: the joined pieces do not match the report's sha256; fetch them again")


def _merge_shards(camp: Path, stage: Path) -> list[dict]:
    """Add the new shards of the joined ``stage/data.tar`` and its manifest to the campaign folder ``camp``;
    returns the new shards' manifest entries (the held-out set's too when ``camp`` had none).

    Raises:
        BurstError: the returned manifest does not extend the local one, or a shard's sha256 differs from it.
    """
    local = read_manifest(camp)
    with tarfile.open(stage / "data.tar") as tar:
        tar.extractall(stage / "data", filter="data")
    path = stage / "data" / "manifest.json"
    if not path.exists():  # the device's campaign had no manifest: no data came back
        return []
    got = read_json(path, {**MANIFEST_SHAPE, "shards": [LISTED_FILE_SHAPE], "holdout": (LISTED_FILE_SHAPE, None)},
                    error=BurstError, fix="its data.tar is not the device's; fetch the results again")
    n_local = len(local["shards"])
    if local["data"] is not None and (got["data"] != local["data"] or got["shards"][:n_local] != local["shards"]):
        raise BurstError(f"the returned manifest does not extend {camp / 'manifest.json'} (other data settings or "
                         "other shards); apply it to the campaign it was planned from")
    new = got["shards"][n_local:] + ([got["holdout"]] if local["holdout"] is None and got["holdout"] else [])
    for s in new:
        blob = (stage / "data" / s["file"]).read_bytes()
        if hashlib.sha256(blob).hexdigest() != s["sha256"]:
            raise BurstError(f"{s['file']}: its sha256 differs from the returned manifest's")
        write_file_atomically(camp / s["file"], blob)
    write_file_atomically(camp / "manifest.json", json.dumps(got, indent=1) + "\n")
    return new


def _add_runs(report: dict, stage: Path, camp: Path, runs_root: Path) -> list[tuple[str, str]]:
    """Unpack each returned worker's checkpoint into ``runs_root/<run>`` and record the run in
    ``camp/train_state.json`` with that folder (its device record, else its summary; a run applied again keeps one
    record, with its measured eval kept); returns the (recipe, run folder) pairs added."""
    from omegaconf import OmegaConf

    state_cfg = OmegaConf.create({"dir": str(camp), "runs_dir": str(runs_root)})
    # the device's record, its paths read against this machine's roots (a run's folder keeps its name)
    dev_state = from_record(read_json(stage / "data" / "train_state.json", STATE_SHAPE, absent={}, error=BurstError,
                                      fix="its data.tar is not the device's; fetch the results again"),
                            record_roots(state_cfg))
    added = []
    for w in report.get("workers", []):
        if not w.get("returned"):
            continue
        dest = runs_root / w["run"]
        with tarfile.open(stage / f"{w['recipe']}.tar") as tar:
            shutil.rmtree(dest, ignore_errors=True)
            tar.extractall(dest, filter="data")
        rec = next((r for r in reversed(dev_state.get(w["recipe"], {}).get("runs", []))
                    if Path(r["output_dir"]).name == w["run"]), None)
        if rec is None:  # killed before the campaign recorded it: the summary, where there is one
            s = w.get("summary") or {}
            rec = {"shards": int(w["run"].rsplit("-", 1)[1]), "steps": s.get("steps"),
                   "predictions": s.get("predictions") or 0, "holdout_chain_tau": s.get("holdout_chain_tau"),
                   "from_scratch": True, "parent": None, "init_from": None}
        rec = {**rec, "output_dir": str(dest), "burst": report["payload"]["dartree"],
               **({"eval_device": w["eval"]} if "eval" in w else {})}
        with locked_state(state_cfg) as state:
            runs = state.setdefault(w["recipe"], {"runs": []})["runs"]
            old = [i for i, r in enumerate(runs) if r["output_dir"] == str(dest)]
            if old:  # applied again: the same run, one record (its CPU eval kept until measured again)
                runs[old[-1]] = {**{k: runs[old[-1]][k] for k in EVAL_KEYS if k in runs[old[-1]]}, **rec}
            else:
                runs.append(rec)
        added.append((w["recipe"], str(dest)))
    return added


EVAL_KEYS = ("eval_chain_tau", "eval_chain")  # what evaluate_and_ship adds to a run's record


def ship_root(cfg) -> Path:
    """Where shipped checkpoints live: ``ship_dir``, else the repository's ``checkpoints/`` for its own
    ``campaign/`` and ``<campaign>/shipped`` for any other campaign folder (as the curve goes beside ``dir=``), so
    applying a trial campaign never replaces the committed drafters.

    Returns:
        the folder holding ``<recipe>/`` checkpoints (it need not exist yet).
    """
    if cfg.ship_dir:
        return Path(cfg.ship_dir)
    camp = campaign_dir(cfg)
    return REPO / "checkpoints" if camp.resolve() == (REPO / "campaign").resolve() else camp / "shipped"


def eval_words(cfg) -> list[str]:
    """The ``decode/eval.py`` words of the CPU evaluation, without checkpoint, target and output folder: chain
    only (``--budget 16`` as the campaign's gate command; chain runs at full length), ``eval_limit`` prompts per
    set, ``eval_max_new_tokens``, float32 (the exact mode), no figures, then ``eval_args``."""
    return ["--tree", "chain", "--budget", "16", "--limit", str(int(cfg.eval_limit)), "--max-new-tokens",
            str(int(cfg.eval_max_new_tokens)), "--dtype", "float32", "--no-plots", *[str(a) for a in cfg.eval_args]]


def eval_chain(checkpoint: Path, target: str, words: list[str], out: Path) -> dict:
    """Eval chain tau of one checkpoint on the CPU: ``decode/eval.py`` (:func:`dartree.decode.harness.eval.main`, in this
    process) with ``words`` (:func:`eval_words`), its report read back from ``out/report.json``.

    Args:
        checkpoint: a dartree checkpoint folder.
        target: the campaign's target (``smollm2`` or a local folder).
        words: the evaluation's settings, the same for every checkpoint compared.
        out: the report folder (replaced).
    Returns:
        {"tau" (4 decimals), "prompts", "mismatches", "draft_ms" (mean draft milliseconds per round, or None),
        "prompt_ids" (``dataset:id``, in order), "report"}.
    Raises:
        BurstError: the evaluation failed (its one-line error is printed above), refused a word of ``eval_args``
            or wrote no chain row.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.decode.harness.eval import main as eval_main

    shutil.rmtree(out, ignore_errors=True)
    try:
        rc = eval_main(["--checkpoint", str(checkpoint), "--target", str(target), *words, "--out", str(out)])
    except SystemExit:  # argparse refused a word (its message above)
        raise BurstError(f"decode/eval.py refused the words {words}; fix eval_args=") from None
    rep_path = out / "report.json"
    if rc != 0 or not rep_path.exists():
        raise BurstError(f"decode/eval.py could not evaluate {checkpoint} (exit {rc}, its error above); fix that "
                         "and run stage=apply again (it merges the same results once), or give eval_limit=0")
    rep = read_json(rep_path, EVAL_REPORT_SHAPE, error=BurstError, fix="run stage=apply again")
    try:
        chain = EvalReport.from_json(rep, str(rep_path)).methods.get("chain")
    except ValueError as exc:
        raise BurstError(f"{exc}; run stage=apply again") from None
    if chain is None:
        raise BurstError(f"{rep_path} has no chain row (eval_args={words}); drop the words that change --tree")
    draft = chain.stage_ms.get("draft")
    return {"tau": round(float(chain.tau), 4), "prompts": chain.prompts, "mismatches": chain.mismatches,
            "draft_ms": None if draft is None else round(float(draft), 2),
            "prompt_ids": [f"{p['dataset']}:{p['id']}" for p in rep["environment"]["prompts"]], "report": str(rep_path)}


def _set_run(camp: Path, runs_dir: str, recipe: str, output_dir: str, fields: dict) -> None:
    """Update the last record of run ``output_dir`` of ``recipe`` in ``camp/train_state.json`` (under its lock;
    ``runs_dir``: the runs folder its ``runs:`` paths are relative to, "" for the default).

    Raises:
        BurstError: the state has no such run.
    """
    with _state_lock(camp, runs_dir) as state:
        runs = state.setdefault(recipe, {"runs": []})["runs"]
        rec = next((r for r in reversed(runs) if r["output_dir"] == output_dir), None)
        if rec is None:
            raise BurstError(f"{camp / 'train_state.json'} has no run {output_dir} of {recipe}; run stage=apply "
                             "with the results that hold it")
        rec.update(fields)


def evaluate_and_ship(cfg, runs: list[tuple[str, str]]) -> dict:
    """After the merge: eval chain tau on the CPU of each run's checkpoint and of the shipped
    ``<ship_root>/<recipe>`` on the same prompts and settings (:func:`eval_chain`, :func:`eval_words`); each run's
    record in ``train_state.json`` gets ``eval_chain_tau`` and ``eval_chain`` (the settings, prompts, CPU and the
    shipped checkpoint's tau) as soon as it is measured. With ``ship=true`` a run whose tau beats the shipped one's
    (or a recipe with nothing shipped yet) is converted into ``<ship_root>/<recipe>`` in bf16
    (:func:`dartree.convert.importer.convert`: atomic, files it does not write such as ``learning_curve.json``
    kept) and recorded as the recipe's ``shipped_run``. Prints one line per run: new tau against shipped tau,
    shipped or kept.

    Args:
        cfg: the burst settings (``eval_*``, ``ship``, ``ship_dir``, ``campaign``, ``campaign_args``, ``dir``).
        runs: (recipe, run folder) pairs already recorded in the campaign's ``train_state.json``.
    Returns:
        {recipe: {"run", "tau", "shipped_tau" (None: nothing shipped), "shipped" (bool), "checkpoint"}}.
    Raises:
        BurstError: an evaluation failed, the two evaluations saw different prompts, or the conversion failed
            (named; ``ship_dir`` and the state stay as they were for that recipe).
    """
    import torch

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.convert.importer import convert
    from dartree.models.checkpoint import CheckpointError
    camp = campaign_dir(cfg)
    try:
        target = campaign_settings([f"dir={camp}", *list(cfg.campaign_args)]).target
    except CampaignError as exc:
        raise BurstError(str(exc)) from None
    words = eval_words(cfg)
    root = ship_root(cfg)
    work = Path(cfg.dir if Path(cfg.dir).is_absolute() else REPO / cfg.dir) / "eval"
    shipped_tau: dict = {}
    out: dict = {}
    for recipe, run in runs:
        ck, dest = Path(run) / "checkpoint", root / recipe
        print(f"burst apply: eval chain tau of {ck} (python decode/eval.py {' '.join(words)})", flush=True)
        new = eval_chain(ck, target, words, work / Path(run).name)
        if recipe not in shipped_tau:
            shipped_tau[recipe] = (eval_chain(dest, target, words, work / f"{recipe}-shipped")
                                   if (dest / "config.json").exists() else None)
        old = shipped_tau[recipe]
        if old is not None and old["prompt_ids"] != new["prompt_ids"]:
            raise BurstError(f"the evaluations of {ck} and {dest} saw different prompts; give eval_args= without "
                             "prompt choices that vary between calls")
        wins = old is None or new["tau"] > old["tau"]
        _set_run(camp, cfg.runs_dir, recipe, run, {"eval_chain_tau": new["tau"], "eval_chain": {
            "command": "python decode/eval.py " + " ".join(words), "limit": int(cfg.eval_limit),
            "max_new_tokens": int(cfg.eval_max_new_tokens), "dtype": "float32", "prompts": new["prompts"],
            "mismatches": new["mismatches"], "cpu": cpu_model(), "target": str(target),
            "shipped": _shown(dest), "shipped_tau": None if old is None else old["tau"],
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
        shipped = bool(wins and cfg.ship)
        if shipped:
            try:
                convert(ck, dest, dtype=torch.bfloat16)
            except (CheckpointError, OSError) as exc:
                raise BurstError(f"shipping {ck} into {dest} failed ({exc}); {dest} is as it was: give ship_dir= a "
                                 "writable folder of dartree checkpoints and run stage=apply again") from None
            with _state_lock(camp, cfg.runs_dir) as state:
                state.setdefault(recipe, {"runs": []})["shipped_run"] = run
            shipped_tau[recipe] = new
        vs = "nothing shipped yet" if old is None else f"shipped {old['tau']:.4f}"
        what = (f"shipped into {_shown(dest)}" if shipped else "would ship (ship=false)" if wins
                else f"kept {_shown(dest)}")
        print(f"burst apply: {recipe}: eval chain tau {new['tau']:.4f} ({Path(run).name}, {new['prompts']} prompts, "
              f"{new['mismatches']} mismatches) vs {vs}: {what}", flush=True)
        out[recipe] = {"run": run, "tau": new["tau"], "shipped_tau": None if old is None else old["tau"],
                       "shipped": shipped, "checkpoint": str(dest)}
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it (as committed state records it), else as given."""
    full = Path(path).resolve()
    return str(full.relative_to(REPO)) if full.is_relative_to(REPO) else str(path)


def _state_lock(camp: Path, runs_dir: str):
    """:func:`dartree.training.tools.campaign_train.locked_state` of the campaign folder ``camp`` whose runs are in
    ``runs_dir`` ("": the default runs folder)."""
    from omegaconf import OmegaConf

    return locked_state(OmegaConf.create({"dir": str(camp), "runs_dir": str(runs_dir)}))

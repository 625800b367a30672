"""The burst's ``stage=device`` (on the GPU machine without network; docs/burst.md): the data stage, one worker per
recipe that trains from scratch and evaluates against AR on the GPU (:func:`recipe_worker`, :func:`evaluate`), then
the result files packed into sets that fit the transfer back (:func:`pack`, :func:`group_sets`), all inside the
deadline (:func:`run_device`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from dartree.base.records import RecordError, parse_json, read_json
from dartree.models.generation import stop_ids
from dartree.training.campaign_store import read_manifest
from dartree.training.tools import campaign_train
from dartree.training.tools.burst_settings import (BurstError, MIB, REPO, atomic_json, campaign_dir, keep_dir,
                                                   sha256_file, upload_dir)
from dartree.training.tools.campaign_train import SUMMARY_SHAPE


def _run_stage(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> dict:
    """Run one stage as a subprocess (output to ``log``), killed at ``timeout`` seconds; returns {"rc", "seconds",
    "timed_out", "log"}."""
    t0 = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(timeout, 1.0)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc, timed_out = proc.wait(), True
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "timed_out": timed_out, "log": log.name}


def _campaign_words(cfg, keep: Path) -> list[str]:
    return [f"dir={campaign_dir(cfg)}", f"device={cfg.device}", f"runs_dir={keep / 'runs'}", *list(cfg.campaign_args)]


def _worker_cmd(cfg, recipe: str, hours: float, keep: Path) -> list[str]:
    words = [str(o) for o in cfg.train_overrides]
    if campaign_train.recipe_has("train.engine") and not any(w.startswith("train.engine=") for w in words):
        words.append("train.engine=torch")  # a plain-torch engine where the trainer has one: no DeepSpeed, no NCCL
    over = ",".join(json.dumps(w) for w in words)  # quoted: a value may hold brackets and commas
    return [sys.executable, str(REPO / "training" / "tools" / "campaign.py"), "stage=train", f"hours={hours:.6f}",
            f"train.recipes=[{recipe}]", "train.init=scratch", "train.min_shards=1", "train.min_minutes=0.2",
            f"train.overhead_minutes={cfg.overhead_minutes}", "train.eval_every_steps=0",
            f"train.overrides=[{over}]", *_campaign_words(cfg, keep)]


def evaluate(checkpoint: Path, target_spec: str, prompts: list[dict], *, device: str, max_new_tokens: int,
             budget: int, deadline: float) -> dict:
    """Chain and pruned (``budget`` nodes) against AR, greedy, on ``device`` (bf16 on CUDA, fp32 on a CPU), over
    ``prompts`` until ``deadline``, as ``decode/eval.py`` decodes (its command line has no device option): models by
    :func:`dartree.decode.assembly.assemble`, each prompt by :func:`dartree.decode.harness.runner.decode_one`.

    Returns:
        {"device", "dtype", "prompts" (evaluated), "max_new_tokens", "ar_tokens_per_s", "chain": {"tau",
        "tokens_per_s", "speedup", "mismatches"}, "pruned": {...}}.
    """
    import torch

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.decode.assembly import assemble
    from dartree.decode.harness.runner import decode_one
    from dartree.decode.settings import DecodeSettings
    from dartree.models.chat import chat_prompt_ids

    dev = torch.device(device)
    asm = assemble(checkpoint, target_spec, dtype="bfloat16" if dev.type == "cuda" else "float32", device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    done: dict = {name: [] for name in ("ar", "chain", "pruned")}  # each method's PromptDecode per prompt, AR first
    try:
        base = DecodeSettings(None, max_new_tokens=max_new_tokens, stop_ids=tuple(stop_ids(asm.target)))
        methods = {"ar": base, "chain": base.with_(builder="chain"), "pruned": base.with_(builder="pruned",
                                                                                           budget=budget)}
        for p in prompts:
            if time.time() > deadline:
                break
            ids = chat_prompt_ids(asm.target.tokenizer, p["text"])
            for name, m in methods.items():
                sync()
                done[name].append(decode_one(asm.target, ids, m, drafter=asm.drafter, head=asm.head,
                                             reference=done["ar"][-1].tokens if m.builder else None))
                sync()
    finally:
        asm.close()
    tps = {k: sum(len(o.tokens) for o in v) / max(sum(o.stats.decode_s for o in v), 1e-9) for k, v in done.items()}
    out = {"device": str(dev), "dtype": asm.dtype_name, "prompts": len(done["pruned"]),
           "max_new_tokens": max_new_tokens, "ar_tokens_per_s": round(tps["ar"], 1)}
    for name in ("chain", "pruned"):
        lens = [n for o in done[name] for n in o.stats.accept_lengths]
        out[name] = {"tau": round(sum(lens) / max(len(lens), 1), 4), "tokens_per_s": round(tps[name], 1),
                     "speedup": round(tps[name] / max(tps["ar"], 1e-9), 3),
                     "mismatches": sum(bool(o.mismatch) for o in done[name]),
                     **({"budget": budget} if name == "pruned" else {})}
    return out


def recipe_worker(cfg, recipe: str, train_until: float, eval_until: float, keep: Path, target_spec: str) -> dict:
    """Train ``recipe`` from scratch on every shard (``campaign.py stage=train`` in a subprocess killed at
    ``train_until``), then evaluate its checkpoint until ``eval_until``; writes ``<keep>/results/<recipe>.json``."""
    res: dict = {"recipe": recipe}
    hours = max(train_until - time.time(), 1.0) / 3600  # the run keeps overhead_minutes of it for set-up and save
    res["train"] = _run_stage(_worker_cmd(cfg, recipe, hours, keep), train_until - time.time() + 10,
                              keep / "logs" / f"train-{recipe}.log")
    runs = sorted((keep / "runs").glob(f"{recipe}-*"))
    ck = runs[-1] / "checkpoint" if runs else None
    if runs and (runs[-1] / "summary.json").exists():
        try:
            s = read_json(runs[-1] / "summary.json", SUMMARY_SHAPE, fix="the run stopped while writing it")
            res["summary"] = {k: s.get(k) for k in ("steps", "predictions", "predictions_per_s", "holdout_chain_tau",
                                                     "holdout_tf_tau", "stopped_by_time_cap", "train_tokens")}
        except RecordError as exc:  # the report says why; the checkpoint still comes back
            res["summary_error"] = str(exc)
    if ck is not None and (ck / "config.json").exists() and time.time() < eval_until:
        t0 = time.time()
        try:
            path = upload_dir(cfg, 2) / "eval_prompts.jsonl"
            prompts = [parse_json(line, {"text": str}, f"{path} line {i}", "build the payload again")
                       for i, line in enumerate(open(path), 1) if line.strip()]
            res["eval"] = evaluate(ck, target_spec, prompts, device=cfg.device, max_new_tokens=int(cfg.eval_tokens),
                                   budget=int(cfg.eval_budget), deadline=eval_until)
        except Exception as exc:  # the report says why; the checkpoint still comes back
            res["eval"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        res["eval_seconds"] = round(time.time() - t0, 1)
    atomic_json(keep / "results" / f"{recipe}.json", res)
    return res


def run_device(cfg, target_spec: str) -> dict:
    """``stage=device``: data, then the recipe workers (side by side or by shares), then packing, all inside
    ``minutes`` of wall clock from ``started``; returns the report (also ``<out>/report.json``)."""
    t0 = float(cfg.started) or time.time()
    deadline = t0 + 60 * float(cfg.minutes)
    keep = keep_dir(cfg)
    camp = campaign_dir(cfg)
    before = read_manifest(camp)
    report: dict = {"started": t0, "minutes": float(cfg.minutes), "setup_seconds": round(time.time() - t0, 1),
                    "payload": read_json(upload_dir(cfg, 2) / "payload.json", {"dartree": (str, None)},
                                         error=BurstError, fix="upload .burst/up2 again (stage=payload writes it)"),
                    "stages": {}}
    work_end = deadline - float(cfg.pack_seconds)
    data_s = (work_end - time.time()) * float(cfg.data_share)
    cmd = [sys.executable, str(REPO / "training" / "tools" / "campaign.py"), "stage=data", f"hours={data_s / 3600:.6f}",
           f"plan={upload_dir(cfg, 2) / 'plan.json.gz'}", *_campaign_words(cfg, keep), *list(cfg.data_args)]
    report["stages"]["data"] = _run_stage(cmd, data_s + 15, keep / "logs" / "data.log")
    after = read_manifest(camp)
    new = after["shards"][len(before["shards"]):]
    report["data"] = {"new_shards": len(new), "holdout_added": before["holdout"] is None and bool(after["holdout"]),
                      "response_tokens": sum(s["response_tokens"] for s in new),
                      "seconds": round(sum(s["seconds"] for s in new), 1)}
    report["data"]["response_tokens_per_s"] = round(report["data"]["response_tokens"]
                                                    / max(report["data"]["seconds"], 1e-9), 1)
    report["workers"] = _train_all(cfg, keep, target_spec, work_end)
    report["stages"]["workers_seconds"] = round(time.time() - t0 - report["setup_seconds"]
                                                - report["stages"]["data"]["seconds"], 1)
    return pack(cfg, report, before, keep, deadline)


def _train_all(cfg, keep: Path, target_spec: str, work_end: float) -> list[dict]:
    """Every recipe's worker: side by side (each a process training until ``work_end`` minus its evaluation time),
    or one after another with ``shares`` of the time."""
    import multiprocessing as mp

    recipes = list(cfg.recipes)
    ev = float(cfg.eval_seconds)
    # made first: each worker's output_dir check (base.fields.folder_problem) creates and removes the missing
    # parents of its own folder, so side by side one worker could remove runs/ under another's check
    (keep / "runs").mkdir(parents=True, exist_ok=True)
    if cfg.parallel:
        ctx = mp.get_context("spawn")
        from omegaconf import OmegaConf

        text = OmegaConf.to_yaml(cfg)
        procs = [ctx.Process(target=_worker_entry, args=(text, r, work_end - ev, work_end, str(keep), target_spec))
                 for r in recipes]
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(work_end - time.time(), 0) + 10)
            if p.is_alive():
                p.kill()
    else:
        w = [float(x) for x in cfg.shares]
        for k, r in enumerate(recipes):
            end = time.time() + (work_end - time.time()) * w[k] / sum(w[k:])
            recipe_worker(cfg, r, end - ev, end, keep, target_spec)
    out = []
    for r in recipes:
        path = keep / "results" / f"{r}.json"
        try:
            out.append(read_json(path, {"recipe": str}, fix="the worker was killed while writing it"))
        except RecordError as exc:
            out.append({"recipe": r, "error": "no result (killed)" if not path.exists() else str(exc)})
    return out


def _worker_entry(settings_yaml: str, recipe: str, train_until: float, eval_until: float, keep: str,
                  target_spec: str) -> None:
    """A spawned recipe worker's body (:func:`recipe_worker` with the settings passed as YAML)."""
    from omegaconf import OmegaConf

    recipe_worker(OmegaConf.create(settings_yaml), recipe, train_until, eval_until, Path(keep), target_spec)


def _add_file(files: list, path: Path, piece: int) -> None:
    """Split ``path`` into pieces of at most ``piece`` bytes (``NAME.partK``) where it is larger; records each."""
    n = path.stat().st_size
    whole = sha256_file(path)
    if n <= piece:
        files.append({"file": path.name, "bytes": n, "sha256": whole, "whole": path.name, "whole_sha256": whole})
        return
    with open(path, "rb") as fh:
        k = 0
        while True:
            block = fh.read(piece)
            if not block:
                break
            k += 1
            part = path.with_name(f"{path.name}.part{k}")
            part.write_bytes(block)
            files.append({"file": part.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest(),
                          "whole": path.name, "whole_sha256": whole})
    path.unlink()


def group_sets(files: list[dict], set_files: int, set_mib: float) -> list[list[dict]]:
    """The result files (records with ``bytes``) in order, first fit, in sets of at most ``set_files`` files and
    ``set_mib`` MiB, set 1 keeping one file and 1 MiB for ``report.json``; a file larger than a set's room gets a set
    of its own (:func:`pack` splits files into ``piece_mib`` pieces first)."""
    sets, cur, size = [], [], 0
    for f in files:
        room = (set_files - (0 if sets else 1), set_mib * MIB - (0 if sets else MIB))
        if cur and (len(cur) >= room[0] or size + f["bytes"] > room[1]):
            sets.append(cur)
            cur, size = [], 0
        cur.append(f)
        size += f["bytes"]
    return sets + [cur]


def pack(cfg, report: dict, before: dict, keep: Path, deadline: float) -> dict:
    """Pack what exists into sets of at most ``set_files`` files (``piece_mib`` each, ``set_mib`` together, one file
    kept for the report): ``data.tar`` (new shards, manifest, train_state), one ``<recipe>.tar`` per checkpoint (bf16,
    ``convert/to_dartree.py``, with its summary, curve and eval), split into pieces where larger; set 1 goes to
    ``out`` with ``report.json``, the others to ``<keep>/out/set-N`` (``burst.sh fetch N``)."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.convert.tools.to_dartree import main as convert_main

    camp = campaign_dir(cfg)
    stage = keep / "pack"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    t0 = time.time()
    with tarfile.open(stage / "data.tar", "w") as tar:
        after = read_manifest(camp, BurstError) if (camp / "manifest.json").exists() else None
        if after is not None:
            new = after["shards"][len(before["shards"]):] + ([after["holdout"]] if report["data"]["holdout_added"]
                                                            else [])
            for s in new:
                tar.add(camp / s["file"], arcname=s["file"])
            tar.add(camp / "manifest.json", arcname="manifest.json")
        if (camp / "train_state.json").exists():
            tar.add(camp / "train_state.json", arcname="train_state.json")
    order = [stage / "data.tar"]
    for w in report["workers"]:
        runs = sorted((keep / "runs").glob(f"{w['recipe']}-*"))
        if not runs or not (runs[-1] / "checkpoint" / "config.json").exists():
            w["returned"] = False
            continue
        bf16 = stage / w["recipe"] / "checkpoint"
        rc = convert_main([str(runs[-1] / "checkpoint"), "--out", str(bf16), "--dtype", "bfloat16"])
        with tarfile.open(stage / f"{w['recipe']}.tar", "w") as tar:
            tar.add(bf16 if rc == 0 else runs[-1] / "checkpoint", arcname="checkpoint")
            for f in ("summary.json", "curve.json", "acceptance.json"):
                if (runs[-1] / f).exists():
                    tar.add(runs[-1] / f, arcname=f)
        w.update(returned=True, run=runs[-1].name, bf16=rc == 0)
        order.append(stage / f"{w['recipe']}.tar")
    files: list = []
    for path in order:
        _add_file(files, path, int(float(cfg.piece_mib) * MIB))
    sets = group_sets(files, int(cfg.set_files), float(cfg.set_mib))
    for k, group in enumerate(sets, 1):
        dest = Path(cfg.out) if k == 1 else keep / "out" / f"set-{k}"
        dest.mkdir(parents=True, exist_ok=True)
        for f in group:
            shutil.move(str(stage / f["file"]), dest / f["file"])
            f["set"] = k
    report.update(files=files, sets=len(sets), pack_seconds=round(time.time() - t0, 1),
                  wall_seconds=round(time.time() - report["started"], 1), deadline_met=time.time() <= deadline)
    atomic_json(Path(cfg.out) / "report.json", report)
    return report

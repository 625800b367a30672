"""The campaign's committed data: the manifest and the shard files under ``campaign/`` (see docs/campaign.md).

A shard is one Parquet file (zstd) of regenerated conversations: columns ``id``, ``kind`` (chat / code / math),
``turns``, ``prompt_ids``, ``response_ids`` and ``loss_mask`` (True on the target's own tokens), ids as uint32.
``manifest.json`` records the pool, the held-out set and every shard (pool range, tokens, dtype, seconds, CPU,
sha256), with totals.
"""

from __future__ import annotations

import io
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from dartree.base.files import write_file_atomically
from dartree.base.records import NUMBER, check_shape, read_json

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "campaign"


class CampaignError(ValueError):
    """A campaign setting or state problem; the message names it and the fix."""


# What the campaign's readers rely on (dartree.base.records shapes): the manifest's skeleton, and a listed file
MANIFEST_SHAPE = {"data": (dict, None), "holdout": (dict, None), "shards": [dict], "totals?": dict}
LISTED_FILE_SHAPE = {"file": str, "sha256": str}
# train_state.json: {"path_roots", "baseline": {recipe: record}, recipe: {"runs": [run], "shipped_run", ...}}
RUN_SHAPE = {"output_dir": str, "shards": int, "predictions?": NUMBER, "parent?": (str, None),
             "init_from?": (str, None), "steps?": (int, None)}
STATE_SHAPE = {"path_roots?": dict, "baseline?": {"*": dict},
               "*": {"runs": [RUN_SHAPE], "shipped_run?": (str, None), "committed_run?": (str, None)}}


def check_files(folder: Path, manifest: dict | None = None, max_shards: int | None = None) -> dict:
    """Check that every file the manifest lists (the held-out set and the first ``max_shards`` training shards; all
    when None) is there and matches its recorded sha256, before anything slow starts; returns the manifest.

    Args:
        folder: the campaign folder (``manifest.json`` and ``data/``).
        manifest: the manifest already read (default: read it from ``folder``).
        max_shards: how many training shards to check (None: all; 0: the held-out set only).
    Raises:
        CampaignError: a listed file is missing or its bytes differ from the manifest's sha256 (the file named; fix:
            ``git checkout`` it, or delete it and its manifest entry to regenerate it).
    """
    import hashlib

    folder = Path(folder)
    m = read_manifest(folder) if manifest is None else manifest
    shards = m.get("shards") or []
    recs = ([m["holdout"]] if m.get("holdout") else []) + (shards if max_shards is None else shards[:max_shards])
    for i, rec in enumerate(recs):
        check_shape(rec, LISTED_FILE_SHAPE, f"{folder / 'manifest.json'} (listed file {i})",
                    f"restore it with `git checkout {folder / 'manifest.json'}`", CampaignError)
        path = folder / rec["file"]
        if not path.is_file():
            raise CampaignError(f"{path} is missing but {folder / 'manifest.json'} lists it; restore it with "
                                f"`git checkout {path}`, or delete its manifest entry to regenerate it")
        if hashlib.sha256(path.read_bytes()).hexdigest() != rec["sha256"]:
            raise CampaignError(f"{path} does not match its manifest entry (sha256); restore it with "
                                f"`git checkout {path}`, or delete it and its manifest entry to regenerate it")
    return m


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), with the torch CPU capability (``AVX2``, ``AVX512``, ...)."""
    import torch

    name = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs)"

def resolve_device(name: str):
    """``cpu``, ``cuda`` or ``auto`` (cuda where available) as a ``torch.device``.

    Raises:
        CampaignError: ``cuda`` without a CUDA device (fix: device=cpu or auto).
    """
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CampaignError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")
    return torch.device(name)


def device_name(device) -> str:
    """What a shard record names as its device: the GPU's name and ``cuda``, or ``cpu``."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return f"{torch.cuda.get_device_name(device)}, cuda"
    return "cpu"


def read_manifest(folder: Path, error: type[Exception] = CampaignError) -> dict:
    """``<folder>/manifest.json``, or an empty manifest (no shards) when there is none.

    Args:
        folder: the campaign folder. error: the exception class a bad file raises (the caller's own).
    Raises:
        ``error``: the file does not parse or lacks ``data``, ``holdout`` or the ``shards`` list (one line naming
            the file and the place; fix: restore it from git).
    """
    path = Path(folder) / "manifest.json"
    return read_json(path, MANIFEST_SHAPE, fix=f"restore it with `git checkout {path}`", error=error,
                     absent={"data": None, "holdout": None, "shards": []})

def write_manifest(folder: Path, manifest: dict) -> None:
    """Write ``<folder>/manifest.json`` atomically, with totals over the training shards."""
    shards = manifest["shards"]
    manifest["totals"] = {
        "shards": len(shards),
        "conversations": sum(s["conversations"] for s in shards),
        "response_tokens": sum(s["response_tokens"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "regeneration_seconds": round(sum(s["seconds"] for s in shards), 1),
    }
    write_file_atomically(Path(folder) / "manifest.json", json.dumps(manifest, indent=1) + "\n")

def shard_table(rows: list[dict], items: list) -> bytes:
    """One shard as Parquet bytes (zstd): columns id, kind (chat / code / math), turns, prompt_ids,
    response_ids, loss_mask (1 on the target's tokens, one entry per response id), ids as uint32."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_index = {int(r["index"]): r for r in rows}
    cols = {k: [] for k in ("id", "kind", "turns", "prompt_ids", "response_ids", "loss_mask")}
    for c, (item, _) in enumerate(items):
        r = by_index.get(c)
        if r is None:
            continue
        cols["id"].append(item.id)
        cols["kind"].append(item.kind)
        cols["turns"].append(int(r["turns"]))
        cols["prompt_ids"].append(r["prompt_ids"])
        cols["response_ids"].append(r["response_ids"])
        cols["loss_mask"].append([bool(x) for x in r["loss_mask"]])
    table = pa.table({
        "id": pa.array(cols["id"], pa.string()),
        "kind": pa.array(cols["kind"], pa.string()),
        "turns": pa.array(cols["turns"], pa.int16()),
        "prompt_ids": pa.array(cols["prompt_ids"], pa.list_(pa.uint32())),
        "response_ids": pa.array(cols["response_ids"], pa.list_(pa.uint32())),
        "loss_mask": pa.array(cols["loss_mask"], pa.list_(pa.bool_())),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", compression_level=19)
    return buf.getvalue()

def read_shard(path: Path) -> list[dict]:
    """The rows of one shard file (:func:`shard_table`) as dicts of Python lists.

    Raises:
        CampaignError: the file is missing or not a readable Parquet file (fix: ``git checkout`` it, or delete it
            and its manifest entry to regenerate it).
    """
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path)).to_pylist()
    except (OSError, ValueError) as exc:
        raise CampaignError(f"campaign shard {path} cannot be read ({str(exc).splitlines()[0]}); restore it with "
                            "`git checkout` or delete it and its manifest entry to regenerate it") from None


# ------------------------------------------------------------------------------------------- paths in records
# Committed records (train_state.json) name folders relative to one of three stated roots, never as absolute paths
# of the machine that wrote them: ``runs:NAME`` (the campaign's runs folder: ``runs_dir``, else
# ``<user cache>/campaign-runs``), ``campaign:PATH`` (the campaign folder, ``dir``) and ``repo:PATH`` (the
# repository). A path under none of them is kept relative to the repository (``repo:../..``).
RECORD_ROOTS = ("runs", "campaign", "repo")
# What train_state.json says about its own paths (written at its top, dropped when it is read)
ROOTS_NOTE_KEY = "path_roots"
ROOTS_NOTE = {"runs": "the campaign's runs folder (runs_dir=, else ~/.cache/dartree/campaign-runs)",
              "campaign": "the campaign folder (dir=, else campaign/ of the repository)",
              "repo": "the repository"}


@dataclass(frozen=True)
class RecordRoots:
    """The local folders the stated roots of a record stand for on this machine.

    Attributes:
        runs: the campaign's runs folder (absolute).
        campaign: the campaign folder (absolute).
        repo: the repository (absolute).
    """

    runs: Path
    campaign: Path
    repo: Path = REPO

    def _folders(self) -> dict[str, Path]:
        return {"runs": self.runs, "campaign": self.campaign, "repo": self.repo}

    def portable(self, text: str) -> str:
        """``text`` as a record stores it: an absolute path as ``ROOT:RELATIVE`` under the deepest root holding it
        (a path of another machine by its last ``campaign-runs``, ``campaign/checkpoints`` or ``checkpoints``
        folder, :func:`legacy_root`), else relative to the repository; any other string unchanged.

        Args:
            text: a value of a record (str).
        Returns:
            the stored form (str); never an absolute path.
        """
        if not os.path.isabs(text):
            return text
        path = Path(os.path.normpath(text))
        best = None
        for name, folder in self._folders().items():
            for base in dict.fromkeys((Path(os.path.normpath(folder)), folder.resolve())):
                for p in dict.fromkeys((path, path.resolve())):
                    if p.is_relative_to(base) and (best is None or len(base.parts) > best[0]):
                        best = (len(base.parts), name, p.relative_to(base).as_posix())
        if best is not None:
            return f"{best[1]}:{best[2]}"
        legacy = legacy_root(path)
        if legacy is not None:
            return legacy
        return "repo:" + Path(os.path.relpath(path, self.repo)).as_posix()

    def local(self, text: str) -> str:
        """The local absolute path of a stored ``ROOT:RELATIVE`` (normalised); an absolute path of another
        machine (records written before paths were relative) mapped the same way through :meth:`portable`; any
        other string unchanged.

        Args:
            text: a value of a record (str).
        Returns:
            a path on this machine (str), or ``text``.
        """
        if os.path.isabs(text):
            text = self.portable(text)
        root, sep, rel = text.partition(":")
        if not sep or root not in RECORD_ROOTS:
            return text
        return os.path.normpath(self._folders()[root] / rel)


def legacy_root(path: Path) -> str | None:
    """The stated-root form of an absolute path of another machine, by the folders it passes through: after the
    last ``campaign-runs`` -> ``runs:``, after ``campaign/checkpoints`` -> ``campaign:checkpoints/...``, after the
    last ``checkpoints`` -> ``repo:checkpoints/...``; None when it has none of them."""
    parts = path.parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "campaign-runs" and i + 1 < len(parts):
            return "runs:" + "/".join(parts[i + 1:])
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "checkpoints" and i + 1 < len(parts):
            if parts[i - 1] == "campaign":
                return "campaign:" + "/".join(parts[i:])
            return "repo:" + "/".join(parts[i:])
    return None


def map_strings(value, fn):
    """``value`` (JSON data: dicts, lists, scalars) with every string ``s`` replaced by ``fn(s)``; dict keys kept."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fn) for v in value]
    return value


def to_record(state: dict, roots: RecordRoots) -> dict:
    """The training state as committed: every absolute path stored relative to its stated root
    (:meth:`RecordRoots.portable`), with the roots described under ``path_roots`` at the top."""
    body = {k: v for k, v in state.items() if k != ROOTS_NOTE_KEY}
    return {ROOTS_NOTE_KEY: ROOTS_NOTE, **map_strings(body, roots.portable)}


def from_record(state: dict, roots: RecordRoots) -> dict:
    """The training state as the code uses it: every stored path as a local absolute path
    (:meth:`RecordRoots.local`; old records with absolute paths read the same way), ``path_roots`` dropped."""
    return map_strings({k: v for k, v in state.items() if k != ROOTS_NOTE_KEY}, roots.local)

"""Cached derived data is checked against what was recorded when it was written, before it is used.

Readers such as ``torch.load`` and Parquet do not verify every byte, so a cache entry with a few flipped bytes can
parse and be used as data. Every cache of dartree (the feature store, the dequantised default target, the
burst's compressed target and returned pieces, the partial answers and data sets of regeneration, the feature
files) records the size and sha256 of what it wrote, and its reader compares them before use; a bad entry is
recomputed, or refused in one line where it cannot be. Three forms, one digest (sha256, about 1.3 GB/s on one core
of a CPU with SHA instructions):

- a sealed blob (:func:`seal` / :func:`unseal`): the payload followed by a 48-byte trailer (``DARTSUM1``, the
  payload's length, its sha256), for small files read whole (feature-store entries);
- a sidecar record (:func:`write_record` / :func:`check_record`): ``NAME.sum.json`` beside a large file or one
  other programs read as is (``responses.jsonl``, safetensors), or a record kept in the writer's own metadata
  (:func:`file_record`, :func:`record_problem`); :func:`check_folder` for a folder's files;
- a sealed line (:func:`seal_line` / :func:`unseal_line`): an append-only log's line with its digest after a tab.

Layer 0 (``dartree.base``): imports nothing of dartree but :mod:`~dartree.base.files`.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

from dartree.base.files import write_file_atomically

MAGIC = b"DARTSUM1"
_TRAILER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload: 48 bytes
SIDECAR = ".sum.json"  # a file's sidecar record: NAME.sum.json beside it
FOLDER_RECORD = "dartree-checksums.json"  # a folder's record of its files (check_folder)
_BLOCK = 8 << 20
_verified: dict = {}  # check_folder(memo=True): folder -> the (size, mtime, inode) of its files when it matched


class IntegrityError(ValueError):
    """Cached data differs from what was recorded when it was written (or nothing was recorded); the message
    names the problem."""


def seal(payload: bytes) -> bytes:
    """``payload`` with its trailer: the bytes to write (:func:`unseal` gives ``payload`` back or refuses)."""
    return payload + _TRAILER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())


def unseal(blob: bytes) -> bytes:
    """The payload of a :func:`seal`-ed blob, checked.

    Raises:
        IntegrityError: no trailer (an older or foreign file, or one cut short), another length (truncated or
            grown), or a sha256 that differs (bytes changed).
    """
    if len(blob) < _TRAILER.size:
        raise IntegrityError(f"{len(blob)} bytes, shorter than a checksum trailer")
    magic, n, digest = _TRAILER.unpack_from(blob, len(blob) - _TRAILER.size)
    if magic != MAGIC:
        raise IntegrityError("no checksum trailer (not written by this version, or cut short)")
    view = memoryview(blob)[: len(blob) - _TRAILER.size]
    if n != len(view):
        raise IntegrityError(f"{len(view)} bytes of data, {n} recorded")
    if hashlib.sha256(view).digest() != digest:
        raise IntegrityError("its sha256 differs from the one recorded when it was written")
    return bytes(view)


def file_record(path: Path) -> dict:
    """``{"bytes", "sha256"}`` of a file, read in 8 MiB blocks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_BLOCK), b""):
            h.update(block)
            n += len(block)
    return {"bytes": n, "sha256": h.hexdigest()}


def record_problem(path: Path, record: dict | None) -> str | None:
    """How ``path`` differs from ``record`` (:func:`file_record` at write time; a record without ``bytes`` is
    checked by its sha256 alone), or None when it matches. The size is compared first, so a truncated file
    costs no hashing."""
    path = Path(path)
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return "no checksum was recorded when it was written"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "it is missing"
    if isinstance(record.get("bytes"), int) and size != record["bytes"]:
        return f"{size} bytes, {record['bytes']} recorded"
    if file_record(path)["sha256"] != record["sha256"]:
        return "its sha256 differs from the one recorded when it was written"
    return None


def sidecar(path: Path) -> Path:
    """The sidecar record of ``path``: ``NAME.sum.json`` beside it."""
    return Path(path).with_name(Path(path).name + SIDECAR)


def write_record(path: Path) -> dict:
    """Record ``path``'s size and sha256 in its sidecar (written atomically, after the file is complete); returns
    the record."""
    rec = file_record(path)
    write_file_atomically(sidecar(path), json.dumps(rec, indent=1))
    return rec


def check_record(path: Path) -> str | None:
    """How ``path`` differs from its sidecar record (:func:`write_record`), or None when it matches; a file
    without a readable record is a problem too (it cannot be checked)."""
    try:
        rec = json.loads(sidecar(path).read_text())
    except (OSError, ValueError):
        rec = None
    return record_problem(path, rec)


def discard(path: Path) -> None:
    """Remove a cache file and its sidecar record (either may be absent)."""
    for p in (Path(path), sidecar(path)):
        p.unlink(missing_ok=True)


def cached(path: Path) -> bool:
    """Whether the cache file ``path`` can be reused: True when it exists and matches its sidecar record
    (:func:`check_record`); a file that does not (bytes changed, cut short, no record) is named on stderr and
    removed with its record, so the caller computes it again (False, as for an absent file)."""
    path = Path(path)
    if not path.exists():
        return False
    problem = check_record(path)
    if problem is None:
        return True
    print(f"dartree: the cached {path} failed its check ({problem}); computing it again", file=sys.stderr,
          flush=True)
    discard(path)
    return False


def write_folder_record(folder: Path) -> dict:
    """Record every file of ``folder`` (recursively, by relative path) in ``folder/dartree-checksums.json``;
    returns ``{relative path: {"bytes", "sha256"}}``. Call it inside the folder's atomic write."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): file_record(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != FOLDER_RECORD}
    write_file_atomically(folder / FOLDER_RECORD, json.dumps(files, indent=1))
    return files


def _signature(folder: Path, names) -> tuple:
    out = []
    for name in sorted(names):
        st = (folder / name).stat()
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def check_folder(folder: Path, memo: bool = False) -> str | None:
    """How ``folder`` differs from its record (:func:`write_folder_record`): a recorded file missing or changed
    (named), or no record; None when every recorded file matches.

    Args:
        folder: the cached folder.
        memo: skip the hashing when this process verified the folder before and no recorded file's size, time
            or inode changed since (for large folders loaded many times per process).
    """
    folder = Path(folder)
    try:
        files = json.loads((folder / FOLDER_RECORD).read_text())
    except (OSError, ValueError):
        return f"no {FOLDER_RECORD} was recorded when it was written"
    if not isinstance(files, dict) or not files:
        return f"{FOLDER_RECORD} is not a record of its files"
    try:
        sig = _signature(folder, files)
    except OSError:
        sig = None
    if memo and sig is not None and _verified.get(str(folder.resolve())) == sig:
        return None
    for name, rec in files.items():
        problem = record_problem(folder / name, rec)
        if problem:
            return f"{name}: {problem}"
    if sig is not None:
        _verified[str(folder.resolve())] = sig
    return None


def seal_line(text: str) -> str:
    """One line of an append-only log with its digest: ``TEXT<TAB>16 hex digits`` (``text`` holds no tab or
    newline, as ``json.dumps`` output never does); no newline added."""
    return f"{text}\t{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def unseal_line(line: str) -> str | None:
    """The text of a :func:`seal_line` line (a trailing newline allowed), or None when its digest is missing or
    differs (a torn or changed line)."""
    text, tab, digest = line.rstrip("\n").rpartition("\t")
    if not tab or hashlib.sha256(text.encode()).hexdigest()[:16] != digest:
        return None
    return text

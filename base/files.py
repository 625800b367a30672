"""Files and folders written atomically: a reader (or a process killed mid-write) sees the old version or the
complete new one, never a torn mix. Every checkpoint, report, data set and cache of dartree is written through
these helpers (a temporary file or folder beside the destination, then one ``os.replace``, atomic on POSIX).
Layer 0 (``dartree.base``): imports nothing of dartree.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator



def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_file_atomically(dest: Path, data: bytes | str) -> None:
    """Write one file so that ``dest`` is either its old content or the complete new one, never a torn mix.

    The bytes go to a uniquely named temporary file in the same folder (so two writers of one path never share
    a temporary name), are fsynced, and the file is renamed over ``dest`` (atomic on POSIX).

    Args:
        dest: the file to (re)write; its folder is created. data: bytes, or str written as UTF-8.
    Raises:
        OSError: the folder is not writable (the old ``dest`` is left as it was).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def replace_folder(tmp: Path, dest: Path) -> None:
    """Put the finished folder ``tmp`` in place of ``dest`` (absent or an older version): ``dest`` is moved aside,
    ``tmp`` renamed onto it, the old version removed. A reader sees the old folder or the new one; a kill between
    the two renames leaves ``dest`` absent and the old version beside it (``.NAME.old-PID``), never a mix.

    Args:
        tmp: a complete folder on the same file system as ``dest`` (its parent, normally).
        dest: the folder to (re)create.
    Raises:
        OSError: a rename failed (``tmp`` is left for the caller to remove).
    """
    dest, old = Path(dest), None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _carry(src: Path, dst: Path) -> None:
    """``src`` (file, link or folder) at ``dst``: links kept as links, files hard-linked (copied across devices)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def atomic_folder(dest: Path, keep_others: bool = True, drop: tuple[str, ...] = ()) -> Iterator[Path]:
    """A fresh temporary folder beside ``dest`` to fill; when the block ends without an error it replaces ``dest``
    (:func:`replace_folder`), else it is removed and ``dest`` stays as it was.

    A program owns the files it writes, not the folder: with ``keep_others`` every entry of an existing ``dest``
    that the block did not write (a checkpoint's ``learning_curve.json`` beside a re-converted ``config.json`` and
    ``model.safetensors``, a user's notes) is carried into the new version (hard-linked where the file system
    allows, else copied) before the swap, so replacing a folder never deletes what its writer did not write.
    The entries named in ``drop`` are the writer's own even when it did not write them this time (a converted
    checkpoint's ``lineage.json``, which describes the old weights): they are not carried over.

    Args:
        dest: the folder to (re)create; its parent is created.
        keep_others: carry over the entries of an existing ``dest`` that the block did not write (default).
        drop: names of entries of an existing ``dest`` never carried over (the writer's, left out this time).
    Yields:
        the temporary folder (Path).
    Raises:
        OSError: the parent is not writable, or the rename failed.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        if keep_others and dest.is_dir():
            for entry in dest.iterdir():
                if entry.name in drop:
                    continue
                if not (tmp / entry.name).exists() and not (tmp / entry.name).is_symlink():
                    _carry(entry, tmp / entry.name)
        os.chmod(tmp, 0o777 & ~_umask())
        replace_folder(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_folder_atomically(dest: Path, files: dict[str, bytes | dict], drop: tuple[str, ...] = ()) -> None:
    """Write a folder of files so that ``dest`` is either its old version or the complete new one
    (:func:`atomic_folder`; the old version's other files stay, except those named in ``drop``).

    Args:
        dest: the folder to (re)create.
        files: name -> bytes, or name -> {"tensors": dict, "metadata": dict} for a safetensors file.
        drop: names of the old version's files not carried over when ``files`` does not hold them (a file the
            writer owns but has no content for this time).
    Raises:
        OSError: the folder cannot be written (``dest`` is left as it was).
    """
    umask = _umask()
    with atomic_folder(dest, drop=tuple(drop)) as tmp:
        for name, content in files.items():
            if isinstance(content, dict):
                from safetensors.torch import save_file  # lazy: torch loads only where tensors are written

                save_file(content["tensors"], str(tmp / name), metadata=content.get("metadata"))
            else:
                (tmp / name).write_bytes(content)
            os.chmod(tmp / name, 0o666 & ~umask)

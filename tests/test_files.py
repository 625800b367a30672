"""Atomic writes (dartree.base.files): a destination is its old version or the complete new one, never a mix, and
a failed write leaves nothing behind."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dartree.base.files import atomic_folder, write_file_atomically, write_folder_atomically


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_file_is_replaced_whole_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    dest = tmp_path / "sub" / "report.json"
    write_file_atomically(dest, "old")
    write_file_atomically(dest, b"new")
    assert dest.read_text() == "new" and _leftovers(dest.parent) == []

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_file_atomically(dest, "never")
    assert dest.read_text() == "new" and _leftovers(dest.parent) == []


def test_a_folder_is_swapped_whole_and_an_error_inside_the_block_keeps_the_old_one(tmp_path):
    dest = tmp_path / "ckpt"
    write_folder_atomically(dest, {"a.txt": b"1", "w.safetensors": {"tensors": {"w": torch.arange(3.0)},
                                                                    "metadata": {"k": "v"}}})
    assert (dest / "a.txt").read_bytes() == b"1" and torch.equal(load_file(dest / "w.safetensors")["w"], torch.arange(3.0))
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_folder(dest) as tmp:
            (tmp / "a.txt").write_bytes(b"2")
            raise RuntimeError("boom")
    assert sorted(p.name for p in dest.iterdir()) == ["a.txt", "w.safetensors"] and (dest / "a.txt").read_bytes() == b"1"
    with atomic_folder(dest, keep_others=False) as tmp:  # the writer owns the whole folder: a clean swap
        (tmp / "b.txt").write_bytes(b"3")
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"] and _leftovers(tmp_path) == []


def test_a_writer_killed_mid_write_leaves_the_old_folder(tmp_path):
    dest = tmp_path / "out"
    write_folder_atomically(dest, {"x": b"old"})
    script = ("import os, sys; from pathlib import Path; from dartree.base.files import atomic_folder\n"
              "with atomic_folder(Path(sys.argv[1])) as tmp:\n"
              "    (tmp / 'x').write_bytes(b'half')\n"
              "    os._exit(9)\n")
    r = subprocess.run([sys.executable, "-c", script, str(dest)], capture_output=True)
    assert r.returncode == 9 and (dest / "x").read_bytes() == b"old"


def test_replacing_a_folder_keeps_the_files_its_writer_did_not_write(tmp_path):
    dest = tmp_path / "ckpt"
    write_folder_atomically(dest, {"config.json": b"old", "model.safetensors": {"tensors": {"w": torch.zeros(2)}}})
    (dest / "learning_curve.json").write_text("[1, 2]")  # placed beside it by hand, as checkpoints/README.md says
    (dest / "notes").mkdir()
    (dest / "notes" / "a.txt").write_text("mine")
    write_folder_atomically(dest, {"config.json": b"new", "model.safetensors": {"tensors": {"w": torch.ones(2)}}})
    assert (dest / "config.json").read_bytes() == b"new" and torch.equal(load_file(dest / "model.safetensors")["w"],
                                                                          torch.ones(2))
    assert (dest / "learning_curve.json").read_text() == "[1, 2]" and (dest / "notes" / "a.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old folder left
    with atomic_folder(dest, keep_others=False) as tmp:  # a writer that owns the whole folder
        (tmp / "config.json").write_bytes(b"only")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json"]


def test_a_writer_drops_its_own_file_it_did_not_write_this_time(tmp_path):
    dest = tmp_path / "ckpt"
    write_folder_atomically(dest, {"config.json": b"old", "lineage.json": b"{}"})
    (dest / "learning_curve.json").write_text("[]")
    write_folder_atomically(dest, {"config.json": b"new"}, drop=("lineage.json",))
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "learning_curve.json"]
    assert _leftovers(tmp_path) == []


def test_converting_into_a_shipped_folder_keeps_its_learning_curve(tmp_path):
    import json

    from dartree.convert.tools.to_dartree import main as convert_main

    from pathlib import Path

    from dartree.convert.importer import convert

    src = tmp_path / "src"
    dest = tmp_path / "shipped"
    repo = Path(__file__).resolve().parents[1]
    convert(repo / "checkpoints" / "dspark_b16", src)
    convert(repo / "checkpoints" / "dspark_b16", dest)
    (dest / "learning_curve.json").write_text(json.dumps([{"train_tokens": 1, "holdout_chain_tau": 1.2}]))
    assert convert_main([str(src), "--out", str(dest)]) == 0  # the documented shipping command
    assert json.loads((dest / "learning_curve.json").read_text())[0]["holdout_chain_tau"] == 1.2
    assert convert_main([str(dest), "--out", str(dest)]) == 0  # in place
    assert (dest / "learning_curve.json").exists() and (dest / "model.safetensors").exists()

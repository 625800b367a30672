"""Cached derived data is checked against what was recorded when it was written (dartree.base.integrity): bytes
flipped in each kind of cache are found before use, and the entry is computed again (or refused in one line),
never used: the feature store, the dequantised default target, the data sets, partial answers and feature files of
regeneration, the burst's compressed target and its returned pieces."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from dartree.base.integrity import (IntegrityError, cached, check_folder, check_record, seal, seal_line, unseal,
                                    unseal_line, write_folder_record, write_record)

STOP = 1  # the tiny target's stop id


def _flip(path: Path, at: int, n: int = 64) -> None:
    """Invert ``n`` bytes of ``path`` from offset ``at`` (the size stays: only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def test_a_sealed_blob_a_sidecar_record_and_a_sealed_line_refuse_changed_bytes(tmp_path):
    blob = seal(b"x" * 1000)
    assert unseal(blob) == b"x" * 1000 and len(blob) == 1048
    bad = bytearray(blob)
    bad[500] ^= 1
    with pytest.raises(IntegrityError, match="sha256 differs"):
        unseal(bytes(bad))
    with pytest.raises(IntegrityError, match="no checksum trailer"):
        unseal(blob[:-1])
    with pytest.raises(IntegrityError, match="no checksum trailer"):
        unseal(b"x" * 1000)  # a file of an older layout
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(10_000))
    assert check_record(f) == "no checksum was recorded when it was written"
    write_record(f)
    assert check_record(f) is None and cached(f)
    _flip(f, 5000, 8)
    assert check_record(f) == "its sha256 differs from the one recorded when it was written"
    f.write_bytes(f.read_bytes()[:-1])
    assert check_record(f) == "9999 bytes, 10000 recorded"
    assert not cached(f) and not f.exists() and not f.with_name("data.bin.sum.json").exists()  # removed: recomputed
    line = seal_line('{"index": 3, "response_ids": [17, 1]}')
    assert unseal_line(line + "\n") == '{"index": 3, "response_ids": [17, 1]}'
    assert unseal_line(line.replace("17", "71")) is None and unseal_line('{"index": 3}') is None


def _rows(n, g):
    return [{"prompt_ids": torch.randint(2, 90, (5,), generator=g).tolist(),
             "response_ids": torch.randint(2, 90, (7 + k,), generator=g).tolist(), "loss_mask": [1] * (7 + k)}
            for k in range(n)]


def test_a_feature_store_entry_with_flipped_bytes_is_recomputed_not_used(target, tmp_path, capsys):
    from dartree.training.campaign_data import CampaignData
    from dartree.training.feature_store import FeatureStore

    rows = _rows(3, torch.Generator().manual_seed(1))
    online = CampaignData(target, rows, [], cache_size=1)
    first = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "fs", target, 10**9))
    for i in range(3):
        first.sequence(i)
    entry = first.store.path(first.tokens[1])
    feats = online.sequence(1)[1]
    raw = feats.contiguous().view(torch.uint8).numpy().tobytes()
    at = entry.read_bytes().find(raw[:256])
    assert at > 0  # the tensor's bytes, inside the entry
    _flip(entry, at + 64)  # 64 bytes of feats: the archive still loads, with other numbers
    again = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "fs", target, 10**9))
    for i in range(3):
        assert torch.equal(again.sequence(i)[1], online.sequence(i)[1]), i
    store = again.store
    assert (store.hits, store.misses, store.rejected) == (2, 1, 1) and again.forward_tokens == len(again.tokens[1])
    assert f"feature store: {entry} failed its check (its sha256 differs" in capsys.readouterr().err
    third = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "fs", target, 10**9))
    assert torch.equal(third.sequence(1)[1], feats) and third.store.hits == 1  # stored again, sealed
    entry.write_bytes(entry.read_bytes()[:-100])  # cut short: rejected too
    fourth = CampaignData(target, rows, [], cache_size=1, store=FeatureStore(tmp_path / "fs", target, 10**9))
    assert torch.equal(fourth.sequence(1)[1], feats) and fourth.store.rejected == 1


def _fake_dequantise(calls: list):
    from dartree.base.files import atomic_folder

    def write(out: Path) -> None:
        calls.append(out)
        with atomic_folder(out, keep_others=False) as tmp:
            (tmp / "config.json").write_text("{}")
            (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 64)
            write_folder_record(tmp)
    return write


def test_the_dequantised_default_target_is_checked_and_dequantised_again_when_changed(tmp_path, monkeypatch, capsys):
    import dartree.models.target as target_mod

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(target_mod, "_dequantise_smollm2", _fake_dequantise(calls))
    folder = target_mod._smollm2_folder()
    assert folder == tmp_path / "targets" / "smollm2-135m-instruct" and len(calls) == 1
    assert target_mod._smollm2_folder() == folder and len(calls) == 1  # checked, reused
    good = (folder / "model.safetensors").read_bytes()
    _flip(folder / "model.safetensors", 1000)
    assert check_folder(folder) == ("model.safetensors: its sha256 differs from the one recorded when it was "
                                    "written")
    assert target_mod._smollm2_folder() == folder and len(calls) == 2  # never loaded: dequantised again
    assert (folder / "model.safetensors").read_bytes() == good
    assert "the cached default target" in capsys.readouterr().err
    (folder / "dartree-checksums.json").unlink()  # a folder written before the record: it cannot be checked
    assert target_mod._smollm2_folder() == folder and len(calls) == 3 and check_folder(folder) is None
    (folder / "config.json").unlink()
    assert target_mod._smollm2_folder() == folder and len(calls) == 4


def test_regenerated_data_sets_partial_answers_features_and_lse_are_checked_before_reuse(target, tmp_path, capsys):
    from dartree.training.answers import DataSpec, _PartialLog, regenerate_dialogues
    from dartree.training.dialogues import random_dialogues
    from dartree.training.features import compute_features, target_lse

    spec = DataSpec(num_prompts=4, max_new_tokens=6, batch_size=4, max_turns=2, max_seq_tokens=64)
    dialogues = random_dialogues(4, 2, 5, 96, seed=3, stop_id=STOP)
    path = regenerate_dialogues(target, spec, dialogues, tmp_path / "d", stop_id=STOP)
    good = path.read_text()
    first = json.loads(good.splitlines()[0])
    other = [7 if first["response_ids"][0] != 7 else 8] + first["response_ids"][1:]
    changed = good.replace(json.dumps(first["response_ids"]), json.dumps(other), 1)
    assert changed != good
    path.write_text(changed)  # still valid rows, other token ids
    assert regenerate_dialogues(target, spec, dialogues, tmp_path / "d", stop_id=STOP).read_text() == good
    assert f"the cached {path} failed its check" in capsys.readouterr().err
    # partial answers: a changed line, a torn one and one without a digest are generated again, not used
    log = _PartialLog(tmp_path / "p.partial.jsonl")
    for c in range(3):
        log.add({"index": c, "turn": 0, "response_ids": [10 + c, STOP]})
    log.flush()
    lines = (tmp_path / "p.partial.jsonl").read_text().splitlines()
    (tmp_path / "p.partial.jsonl").write_text("\n".join([lines[0], lines[1].replace("11", "12"), lines[2]]) + "\n"
                                              + json.dumps({"index": 3, "turn": 0, "response_ids": [9]}) + "\n"
                                              + lines[0][:10])
    assert [r["index"] for r in _PartialLog(tmp_path / "p.partial.jsonl").read()] == [0, 2]
    assert (tmp_path / "p.partial.jsonl").read_text() == lines[0] + "\n" + lines[2] + "\n"
    assert "3 line(s)" in capsys.readouterr().err
    # the feature file and the log-sum-exp beside it
    feats = compute_features(target, path)
    lse = target_lse(target, feats)
    whole = feats.read_bytes()
    _flip(feats, len(whole) - 200)
    assert compute_features(target, path) == feats and feats.read_bytes() == whole
    lse_file = feats.with_name("lse-" + feats.name)
    _flip(lse_file, lse_file.stat().st_size - 8, 4)
    assert torch.equal(target_lse(target, feats), lse)
    assert check_record(feats) is None and check_record(lse_file) is None


def _burst_cfg(args):
    from dartree.training.tools.burst_settings import load_settings

    return load_settings(args)


def test_the_bursts_cached_target_is_compressed_again_when_its_bytes_changed(tmp_path, monkeypatch, capsys):
    from dartree.training.tools.burst_payload import _compressed_target
    from dartree.training.tools.burst_settings import sha256_file

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "model.safetensors").write_bytes(os.urandom(50_000))
    cfg = _burst_cfg([f"target={src}"])
    xz, target = _compressed_target(cfg)
    good = xz.read_bytes()
    assert target["joined_sha256"] == hashlib.sha256(good).hexdigest() and target["joined_bytes"] == len(good)
    _flip(xz, len(good) // 2, 16)
    xz2, again = _compressed_target(cfg)
    assert xz2 == xz and "failed its check (its sha256 differs" in capsys.readouterr().out
    assert sha256_file(xz) == again["joined_sha256"] == target["joined_sha256"]  # the parts split a checked file
    xz.write_bytes(good[:-10])
    assert _compressed_target(cfg)[1]["joined_bytes"] == len(good)


def test_a_returned_piece_with_flipped_bytes_is_named_with_its_set(tmp_path):
    from dartree.training.tools.burst_apply import _join_pieces
    from dartree.training.tools.burst_device import _add_file
    from dartree.training.tools.burst_settings import BurstError

    whole = tmp_path / "dev" / "data.tar"
    whole.parent.mkdir()
    whole.write_bytes(os.urandom(3000))
    files: list = []
    _add_file(files, whole, 1000)
    for k, f in enumerate(files):
        f["set"] = 1 + k // 2
    sets = [tmp_path / "set1", tmp_path / "set2"]
    for d in sets:
        d.mkdir()
    for f in files:
        (sets[f["set"] - 1] / f["file"]).write_bytes((whole.parent / f["file"]).read_bytes())
    report = {"files": files}
    _join_pieces(report, sets, tmp_path / "stage")
    assert (tmp_path / "stage" / "data.tar").stat().st_size == 3000
    _flip(sets[1] / "data.tar.part3", 100, 8)
    with pytest.raises(BurstError, match=r"data.tar.part3 \(set 2\) failed its check against report.json \(its "
                                         r"sha256 differs.*\); fetch set 2 again"):
        _join_pieces(report, sets, tmp_path / "stage")

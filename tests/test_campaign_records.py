"""Committed campaign records name folders relative to stated roots, never as absolute paths of the machine that
wrote them; records written before that (absolute paths) still read (training/campaign_store.py RecordRoots)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from dartree.training.campaign_store import REPO, RecordRoots, legacy_root


def _strings(value):
    """Every string of JSON data, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _cfg(tmp_path: Path):
    return OmegaConf.create({"dir": str(tmp_path / "camp"), "runs_dir": str(tmp_path / "runs")})


def test_a_written_record_stores_no_absolute_path_and_reads_back_local_paths(tmp_path):
    from dartree.training.tools.campaign_train import locked_state, read_state

    cfg = _cfg(tmp_path)
    runs, camp = tmp_path / "runs", tmp_path / "camp"
    run = {"output_dir": str(runs / "x-00003"), "init_from": str(camp / "checkpoints" / "x"),
           "parent": str(runs / "x-00002"), "shards": 3, "cpu": "AMD EPYC (AVX2, 2 CPUs)",
           "eval_chain": {"shipped": str(REPO / "checkpoints" / "x"), "target": "/elsewhere/tiny",
                          "command": "python decode/eval.py --tree chain"}}
    with locked_state(cfg) as state:
        state["x"] = {"runs": [run], "shipped_run": str(runs / "x-00003")}
    stored = json.loads((camp / "train_state.json").read_text())
    assert not [s for s in _strings(stored) if os.path.isabs(s)]
    rec = stored["x"]["runs"][0]
    assert (rec["output_dir"], rec["init_from"], rec["parent"]) == ("runs:x-00003", "campaign:checkpoints/x",
                                                                     "runs:x-00002")
    assert rec["eval_chain"]["shipped"] == "repo:checkpoints/x" and stored["x"]["shipped_run"] == "runs:x-00003"
    assert rec["eval_chain"]["target"] == "repo:" + os.path.relpath("/elsewhere/tiny", REPO)  # under no root
    assert rec["cpu"] == run["cpu"] and rec["eval_chain"]["command"] == run["eval_chain"]["command"]
    assert set(stored["path_roots"]) == {"runs", "campaign", "repo"}
    assert read_state(cfg) == {"x": {"runs": [run], "shipped_run": str(runs / "x-00003")}}  # as written, here
    # the same record read on a machine with another runs folder names that machine's folders
    other = read_state(OmegaConf.create({"dir": str(camp), "runs_dir": "/mnt/runs"}))
    assert other["x"]["runs"][0]["output_dir"] == "/mnt/runs/x-00003"


def test_an_old_record_with_absolute_paths_still_reads(tmp_path):
    """Paths of another machine map to this one's roots by their campaign-runs / campaign/checkpoints /
    checkpoints folders; the lineage (parent_of, curve_points) works on the mapped paths."""
    from dartree.training.tools.campaign_train import curve_points, parent_of, read_state, write_state

    cfg = _cfg(tmp_path)
    camp, runs = tmp_path / "camp", tmp_path / "runs"
    camp.mkdir()
    (camp / "manifest.json").write_text(json.dumps({"data": None, "holdout": None, "shards": [
        {"response_tokens": 100}, {"response_tokens": 50}]}))
    old = {"baseline": {"x": {"response_tokens": 1000, "predictions": 10_000, "holdout_chain_tau": 1.4}},
           "x": {"shipped_run": "/root/.cache/dartree/campaign-runs/x-00002", "runs": [
               {"output_dir": "/root/.cache/dartree/campaign-runs/x-00001", "init_from": "/work/wt/checkpoints/x",
                "parent": None, "shards": 1, "predictions": 7, "holdout_chain_tau": 1.5},
               {"output_dir": "/root/.cache/dartree/campaign-runs/x-00002",
                "init_from": "/work/other/campaign/checkpoints/x",
                "parent": "/root/.cache/dartree/campaign-runs/x-00001", "shards": 2, "predictions": 30,
                "holdout_chain_tau": 1.6}]}}
    (camp / "train_state.json").write_text(json.dumps(old))
    state = read_state(cfg)
    first, second = state["x"]["runs"]
    assert first["output_dir"] == str(runs / "x-00001") and second["parent"] == str(runs / "x-00001")
    assert first["init_from"] == str(REPO / "checkpoints" / "x")
    assert second["init_from"] == str(camp / "checkpoints" / "x")
    assert state["x"]["shipped_run"] == str(runs / "x-00002")
    assert parent_of(cfg, "x", state, str(runs / "x-00002" / "checkpoint")) == str(runs / "x-00002")
    assert parent_of(cfg, "x", state, str(REPO / "checkpoints" / "x")) == str(runs / "x-00002")  # shipped_run
    assert [p["predictions"] for p in curve_points(cfg)["x"]] == [10_000, 10_007, 10_037]  # the lineage holds
    write_state(cfg, state)  # rewritten: relative, and the same state again
    stored = json.loads((camp / "train_state.json").read_text())
    assert stored["x"]["runs"][1]["parent"] == "runs:x-00001" and read_state(cfg) == state


def test_legacy_roots_and_the_committed_state():
    assert legacy_root(Path("/home/u/.cache/dartree/campaign-runs/x-00012/checkpoint")) == "runs:x-00012/checkpoint"
    assert legacy_root(Path("/a/campaign/checkpoints/x")) == "campaign:checkpoints/x"
    assert legacy_root(Path("/a/b/checkpoints/x")) == "repo:checkpoints/x"
    assert legacy_root(Path("/a/b/c")) is None
    roots = RecordRoots(runs=Path("/r"), campaign=Path("/r/c"))  # nested roots: the deepest one holds the path
    assert roots.portable("/r/c/checkpoints/x") == "campaign:checkpoints/x" and roots.portable("/r/y") == "runs:y"
    assert roots.local("runs:y/../z") == "/r/z" and roots.local("not a path") == "not a path"
    stored = json.loads((REPO / "campaign" / "train_state.json").read_text())
    assert not [s for s in _strings(stored) if os.path.isabs(s)]
    assert stored["dspark_b16"]["shipped_run"].startswith("runs:dspark_b16-")

"""``make gpu-check`` stays alive without a GPU: ``kernels/tools/gpu_check.py --dry`` runs every section small and writes
the JSON report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_writes_a_complete_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(REPO / "kernels" / "tools" / "gpu_check.py"), "--dry", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["mode"] == "dry" and r["ok"] is True and r["failures"] == []
    assert {row["kernel"] for row in r["kernels"]} == {"candidates", "frontier", "gru", "tree_compile"}
    assert all(row["ok"] for row in r["kernels"])
    assert [row["budget"] for row in r["tree_build"]] == [8, 16]
    assert all(row["pruned_ms"] > 0 and row["heap_sequential_ms"] > 0 for row in r["tree_build"])
    ev = {row["method"]: row for row in r["eval"]}
    assert ev["ar"]["ms_per_token"] > 0
    assert {"chain", "ddtree", "pctree", "heap-sequential"} <= set(ev)
    for name, row in ev.items():
        if name != "ar":
            assert row["mismatches"] == 0 and row["tau"] >= 1.0
            assert set(row["stage_ms_per_round"]) == {"draft", "tree_build", "tree_compile", "verify", "commit"}
    inv = r["invariant"]  # the row-invariant Triton path on the tiny fp32 target: every row, every output exact
    assert inv["dtype"] == "float32" and inv["failures"] == []
    assert {(x["mode"], x["shape"]) for x in inv["rows"]} == {("off", "chain"), ("off", "tree"), ("on", "chain"),
                                                                ("on", "tree")}
    assert all(x["equal"] == x["of"] == 9 for x in inv["rows"] if x["mode"] == "on")
    assert [(e["method"], e["differs_from_ar"]) for e in inv["eval"]] == [("chain", []), ("pruned", [])]


def test_gpu_check_bad_time_limit_is_an_argument_error(tmp_path):
    from dartree.kernels.tools.gpu_check import main

    assert main(["--dry", "--time-limit", "0", "--out", str(tmp_path / "x.json")]) == 2

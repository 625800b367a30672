"""The results page is rendered from data (training/tools/results.py): lineage from the training state, data from the
manifest, curves from learning_curve.json, measurements from results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dartree.training.tools.results import REPO, ResultsError, ResultSources, load_sources, main, render_results

STATE = {
    "path_roots": {"runs": "the runs folder"},
    "baseline": {"x": {"response_tokens": 1000, "predictions": 2_000_000, "holdout_chain_tau": 1.4,
                       "eval_chain_tau": 1.3}},
    "x": {"shipped_run": "runs:x-00002", "runs": [
        {"output_dir": "runs:x-00001", "parent": None, "shards": 1, "steps": 10, "predictions": 250_000,
         "holdout_chain_tau": 1.5, "cpu": "AMD EPYC (AVX2, 2 CPUs)", "updated": "2026-12-03T14:57:24Z"},
        {"output_dir": "/old/machine/campaign-runs/x-00002", "parent": "runs:x-00001", "shards": 2, "steps": 30,
         "predictions": 500_000, "holdout_chain_tau": 1.61234, "eval_chain_tau": 1.45, "cpu": "Zen 5",
         "updated": "2026-12-04T10:00:00Z"}]}}
MANIFEST = {"shards": [
    {"conversations": 128, "response_tokens": 5000, "seconds": 100.0, "gen_dtype": "float32", "cpu": "A", "threads": 1,
     "created": "2026-12-03T10:00:00Z"},
    {"conversations": 128, "response_tokens": 6000, "seconds": 100.0, "gen_dtype": "float32", "cpu": "A", "threads": 1,
     "created": "2026-12-03T11:00:00Z"},
    {"conversations": 64, "response_tokens": 3000, "seconds": 10.0, "gen_dtype": "bfloat16", "cpu": "B", "threads": 1,
     "created": "2026-12-04T11:00:00Z"}],
    "totals": {"shards": 3, "conversations": 320, "response_tokens": 14000, "regeneration_seconds": 7200.0}}
RESULTS = {"shipped": {"runs": {"x-00002": "fp32, 9 min of one core"},
                       "eval": {"setting": "3 prompts", "command": "python decode/eval.py --tree chain",
                                "machine": "one Zen 2 core"}},
           "notes": {"runs": ["A remark on the runs."]},
           "measurements": [{"id": "m", "title": "A sweep", "command": "python decode/eval.py --budget 8",
                             "machine": "2-core CPU", "dtype": "float32",
                             "table": {"columns": ["method", "tau"], "rows": [["chain", "1.2|x"]]},
                             "notes": ["Lossless."]}]}
CURVES = {"x": [{"step": 100, "train_tokens": 5000, "distinct_sequences": 10, "holdout_chain_tau": 1.25},
                {"step": 200, "train_tokens": 10000, "distinct_sequences": 20, "holdout_chain_tau": 1.3}],
          "y": [{"step": 7, "train_tokens": 70, "distinct_sequences": 1, "holdout_chain_tau": 1.0}]}


def _page() -> list[str]:
    state = {k: v for k, v in STATE.items() if k != "path_roots"}
    return render_results(ResultSources(state=state, manifest=MANIFEST, curves=CURVES, results=RESULTS)).splitlines()


def test_the_page_renders_lineage_runs_data_curves_and_measurements():
    lines = _page()
    assert lines[0] == "# Results"
    # the lineage follows parent from the shipped run back to the baseline (an old absolute path by its name)
    assert ("| `x` | baseline -> x-00001 (1 shards, 10 steps) -> x-00002 (2 shards, 30 steps; fp32, 9 min of one "
            "core) | 0.75M | 1.400 -> 1.612 | 1.300 -> 1.450 |") in lines
    assert ("Eval chain tau: 3 prompts; `python decode/eval.py --tree chain` on one Zen 2 core.") in lines
    assert "| `x` | baseline |  |  | 2.00M | 1.400 | 1.300 |  |  |" in lines
    assert "| `x` | x-00002 (shipped) | x-00001 | 2 / 30 | 0.50M | 1.612 | 1.450 | Zen 5 | 2026-12-04 |" in lines
    assert lines[lines.index("| `x` | x-00002 (shipped) | x-00001 | 2 / 30 | 0.50M | 1.612 | 1.450 | Zen 5 | "
                             "2026-12-04 |") + 2] == "A remark on the runs."
    # shards grouped by machine and dtype, with their rates
    assert "| 0-1 | 2026-12-03 | A | float32 | 1 | 256 | 11,000 | 50.0-60.0 (55.0 over the group) |" in lines
    assert "| 2-2 | 2026-12-04 | B | bfloat16 | 1 | 64 | 3,000 | 300.0-300.0 (300.0 over the group) |" in lines
    assert "In all: 3 shards, 320 conversations, 14,000 response tokens, 2.0 hours of regeneration." in lines
    # curves of other data in a table of their own
    assert "| 200 | 10,000 (20) | 1.300 |" in lines and "| 7 | 70 (1) | 1.000 |" in lines
    assert lines.count("| step | sequence tokens seen (distinct sequences) | `x` |") == 1
    # a measurement: title, command and machine, its table (| escaped), its notes
    i = lines.index("### A sweep")
    assert lines[i + 2] == "Command: `python decode/eval.py --budget 8`; machine: 2-core CPU; dtype: float32."
    assert lines[i + 4: i + 7] == ["| method | tau |", "|---|---|", "| chain | 1.2\\|x |"]
    assert lines[i + 8] == "Lossless."


def test_a_measurement_without_its_command_or_a_broken_lineage_is_refused():
    bad = {**RESULTS, "measurements": [{"title": "t", "machine": "m"}]}
    with pytest.raises(ResultsError, match=r"lacks \['command'\]; every figure needs its command and machine"):
        render_results(ResultSources(state={}, manifest={}, results=bad))
    state = {"x": {"shipped_run": "runs:x-9", "runs": []}}
    with pytest.raises(ResultsError, match="x has no run x-9"):
        render_results(ResultSources(state=state, manifest={}))


def test_main_writes_the_page_and_check_compares_it(tmp_path, capsys):
    (tmp_path / "campaign").mkdir()
    (tmp_path / "checkpoints" / "x").mkdir(parents=True)
    (tmp_path / "campaign" / "train_state.json").write_text(json.dumps(STATE))
    (tmp_path / "campaign" / "manifest.json").write_text(json.dumps(MANIFEST))
    (tmp_path / "checkpoints" / "results.json").write_text(json.dumps(RESULTS))
    (tmp_path / "checkpoints" / "x" / "learning_curve.json").write_text(json.dumps(CURVES["x"]))
    out = tmp_path / "docs" / "results.md"
    assert main(["--repo", str(tmp_path), "--check"]) == 1
    assert main(["--repo", str(tmp_path)]) == 0
    assert "x-00001 (1 shards, 10 steps)" in out.read_text() and "| 100 | 5,000 (10) | 1.250 |" in out.read_text()
    assert main(["--repo", str(tmp_path), "--check"]) == 0
    (tmp_path / "checkpoints" / "results.json").write_text("{")
    assert main(["--repo", str(tmp_path)]) == 2
    assert "results.json does not parse" in capsys.readouterr().err


def test_the_committed_page_is_rendered_from_the_committed_data():
    page = render_results(load_sources(REPO))
    assert (REPO / "docs" / "results.md").read_text() == page, "run `make results` and commit docs/results.md"
    assert "| `dspark_b16` | dspark_b16-00027.2 (shipped) | dspark_b16-00027 | 27 / 1728 | 3.28M | 1.741 | 1.522 |" \
        in page

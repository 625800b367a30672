"""Every reader of a record that a dartree program wrote goes through dartree.base.records: a truncated file or one
without what its reader needs is one line naming the file and the place (exit 2 from a program), never a traceback;
the results page's check says where the page differs."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from dartree.base.records import RecordError, parse_json, read_json, shape_problem
from dartree.training.campaign_store import CampaignError


def _err(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_shape_names_the_first_place_that_lacks_it(tmp_path):
    shape = {"shards": [{"file": str, "sha256": str, "bytes?": int}], "holdout": ({"file": str}, None)}
    assert shape_problem({"shards": [{"file": "a", "sha256": "b"}], "holdout": None}, shape) is None
    assert shape_problem({"shards": [{"file": "a", "sha256": None}], "holdout": None}, shape) == \
        "shards[0].sha256 is null, not a string"
    assert shape_problem({"shards": {}, "holdout": None}, shape) == "shards is an object, not a list"
    assert shape_problem({"shards": [], "holdout": {"file": 3}}, shape) == "holdout.file is an integer, not a string"
    assert shape_problem({"shards": [{"file": "a", "sha256": "b", "bytes": True}], "holdout": None}, shape) == \
        "shards[0].bytes is true, not an integer"
    assert shape_problem([], shape) == "the top level is a list, not an object"
    assert shape_problem({"shards": []}, shape) == "the key 'holdout' is missing"
    assert shape_problem({"a b": {"x": 1.5}}, {"*": {"x": int}}) == '["a b"].x is a number, not an integer'
    f = tmp_path / "r.json"
    f.write_text('{"a": [1, 2')
    with pytest.raises(RecordError, match=r"^.*r.json does not parse \(Expecting ',' delimiter at line 1, column 12\); "
                                          "restore it$"):
        read_json(f, fix="restore it")
    assert read_json(tmp_path / "none.json", absent={"x": []}) == {"x": []}
    with pytest.raises(RecordError, match="none.json is missing; fix"):
        read_json(tmp_path / "none.json", fix="fix")
    with pytest.raises(CampaignError, match=r"^plan: the top level is a list, not an object; again$"):
        parse_json(b"[]", dict, "plan", "again", CampaignError)


# ---- the results page ----

def _repo(tmp_path: Path) -> Path:
    from test_results import CURVES, MANIFEST, RESULTS, STATE

    (tmp_path / "campaign").mkdir()
    (tmp_path / "checkpoints" / "x").mkdir(parents=True)
    (tmp_path / "campaign" / "train_state.json").write_text(json.dumps(STATE))
    (tmp_path / "campaign" / "manifest.json").write_text(json.dumps(MANIFEST))
    (tmp_path / "checkpoints" / "results.json").write_text(json.dumps(RESULTS))
    (tmp_path / "checkpoints" / "x" / "learning_curve.json").write_text(json.dumps(CURVES["x"]))
    return tmp_path


@pytest.mark.parametrize("file, content, place", [
    ("checkpoints/results.json", {"measurements": [{"title": "t", "command": "c", "machine": "m",
                                                    "table": {"columns": ["a"]}}]}, "measurements[0].table.rows is missing"),
    ("checkpoints/x/learning_curve.json", {"step": 100}, "the top level is an object, not a list"),
    ("checkpoints/x/learning_curve.json", [{"holdout_chain_tau": 1.2}], "[0].step is missing"),
    ("campaign/train_state.json", {"x": {"runs": [{"output_dir": "runs:x-1", "shards": 1, "predictions": "many"}]}},
     "x.runs[0].predictions is a string, not a number"),
    ("campaign/manifest.json", {"shards": [{"conversations": 1, "response_tokens": 5}]}, "shards[0].seconds is missing"),
    ("campaign/manifest.json", "[1, 2", "does not parse"),
])
def test_the_results_page_refuses_a_malformed_source_in_one_line(tmp_path, capsys, file, content, place):
    from dartree.training.tools.results import main

    repo = _repo(tmp_path)
    (repo / file).write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["--repo", str(repo)]) == 2
    line = _err(capsys)
    assert line.startswith(f"error: {repo / file}") and place in line and line.endswith("restore it with git"), line


def test_the_results_check_says_which_section_and_figure_differ(tmp_path, capsys):
    from test_results import RESULTS

    from dartree.training.tools.results import main

    repo = _repo(tmp_path)
    assert main(["--repo", str(repo)]) == 0
    capsys.readouterr()
    changed = json.loads(json.dumps(RESULTS))
    changed["measurements"][0]["table"]["rows"][0][1] = "1.3"
    (repo / "checkpoints" / "results.json").write_text(json.dumps(changed))
    assert main(["--repo", str(repo), "--check"]) == 1
    out = capsys.readouterr().out
    assert "differs from its data at line" in out and "section 'Measurements', figure 'A sweep'" in out, out
    (repo / "checkpoints" / "x" / "learning_curve.json").write_text(json.dumps([{"step": 100, "train_tokens": 5000,
                                                                                "holdout_chain_tau": 1.5}]))
    assert main(["--repo", str(repo), "--check"]) == 1
    assert "section 'Learning curves of the shipped folders'" in capsys.readouterr().out


# ---- the burst's apply stage ----

def test_burst_apply_refuses_a_truncated_or_incomplete_report_in_one_line(tmp_path, capsys):
    from dartree.training.tools.burst import main

    res = tmp_path / "res"
    res.mkdir()
    (res / "report.json").write_text('{"files": [{"file": "data.tar"')
    words = ["stage=apply", f"results=[{res}]", f"dir={tmp_path / 'b'}", f"campaign={tmp_path / 'camp'}"]
    assert main(words) == 2
    line = _err(capsys)
    assert line.startswith(f"error: {res / 'report.json'} does not parse (Expecting ',' delimiter") and \
        line.endswith("copy set 1 (the device's $OUT) again"), line
    (res / "report.json").write_text(json.dumps({"files": [], "workers": []}))
    assert main(words) == 2
    assert "report.json: the key 'payload' is missing" in _err(capsys)


def test_burst_apply_refuses_a_returned_manifest_or_state_without_its_fields(tmp_path):
    import tarfile

    from dartree.training.tools.burst_apply import _add_runs, _merge_shards
    from dartree.training.tools.burst_settings import BurstError

    stage, camp = tmp_path / "stage", tmp_path / "camp"
    (stage / "src").mkdir(parents=True)
    camp.mkdir()
    (stage / "src" / "manifest.json").write_text(json.dumps({"data": {"seed": 0}, "holdout": None,
                                                             "shards": [{"file": "data/train-00000.parquet"}]}))
    with tarfile.open(stage / "data.tar", "w") as tar:
        tar.add(stage / "src" / "manifest.json", arcname="manifest.json")
    with pytest.raises(BurstError, match=r"manifest.json: shards\[0\].sha256 is missing; its data.tar"):
        _merge_shards(camp, stage)
    (stage / "data" / "train_state.json").write_text(json.dumps({"dspark_b16": {"runs": {}}}))
    report = {"workers": [{"recipe": "dspark_b16", "returned": True, "run": "dspark_b16-00001"}],
              "payload": {"dartree": "abc"}}
    with pytest.raises(BurstError, match=r"train_state.json: dspark_b16.runs is an object, not a list"):
        _add_runs(report, stage, camp, tmp_path / "runs")


def test_burst_eval_reads_the_eval_report_through_its_shape(tmp_path, monkeypatch):
    import dartree.decode.harness.eval as eval_mod
    from dartree.training.tools.burst_apply import eval_chain
    from dartree.training.tools.burst_settings import BurstError

    def fake_eval(argv):
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "report.json").write_text(json.dumps({"methods": {"chain": {"tau": 1.25}}}))
        return 0

    monkeypatch.setattr(eval_mod, "main", fake_eval)
    with pytest.raises(BurstError, match=r"report.json: methods.chain.prompts is missing; run stage=apply again"):
        eval_chain(tmp_path / "ck", "tiny", [], tmp_path / "ev")


# ---- the campaign ----

def test_the_campaign_refuses_a_malformed_manifest_state_plan_or_seconds_record(tmp_path, capsys, monkeypatch):
    from dartree.training.tools.campaign import main
    from dartree.training.tools.campaign_plan import PLAN_VERSION, read_plan
    from dartree.training.tools.campaign_settings import data_key, load_settings
    from dartree.training.tools.campaign_shards import _note_seconds
    from dartree.training.tools.campaign_train import read_state

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"data": None, "holdout": None, "shards": {}}))
    assert main(["stage=status", f"dir={folder}"]) == 2
    assert _err(capsys) == (f"error: {folder / 'manifest.json'}: shards is an object, not a list; restore it with "
                            f"`git checkout {folder / 'manifest.json'}`")
    (folder / "manifest.json").write_text(json.dumps({"data": None, "holdout": None, "shards": []}))
    (folder / "train_state.json").write_text(json.dumps({"x": {"runs": [{"shards": 1}]}}))
    cfg = load_settings([f"dir={folder}"], folder=folder)
    with pytest.raises(CampaignError, match=r"train_state.json: x.runs\[0\].output_dir is missing"):
        read_state(cfg)
    assert main(["stage=curve", f"dir={folder}", f"out={tmp_path / 'c.png'}"]) == 2
    assert "x.runs[0].output_dir is missing" in _err(capsys)
    plan = tmp_path / "plan.json.gz"
    plan.write_bytes(gzip.compress(json.dumps({"version": PLAN_VERSION, "data": data_key(cfg), "start": 0,
                                               "entries": [{"name": "holdout", "pool": [0, 2]}]}).encode()))
    with pytest.raises(CampaignError, match=r"^plan=.*plan.json.gz: entries\[0\].items is missing; write it with"):
        read_plan(plan, cfg, {"data": None, "holdout": None, "shards": []})
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "seconds.json").write_text("[3.5]")
    with pytest.raises(CampaignError, match=r"seconds.json: the top level is a list, not an object; delete it"):
        _note_seconds(tmp_path / "w", 1.0)


def test_campaign_training_refuses_a_summary_without_its_figures(tmp_path, monkeypatch):
    import dartree.training.recipe as recipe_mod
    import dartree.training.trainer as trainer_mod
    from dartree.training.tools.campaign_settings import load_settings
    from dartree.training.tools.campaign_train import run_train

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"data": None, "holdout": None,
                                                      "shards": [{"response_tokens": 5}]}))
    cfg = load_settings([f"dir={folder}", f"runs_dir={tmp_path / 'runs'}", "train.min_shards=1",
                         "train.recipes=[dspark_b16]"], folder=folder)

    def fake_train(args):
        out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("output_dir=")))
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"predictions": 5}))

    monkeypatch.setattr(recipe_mod, "load_recipe", lambda args: args)
    monkeypatch.setattr(trainer_mod, "train_recipe", fake_train)
    with pytest.raises(CampaignError, match=r"summary.json: the key 'steps' is missing; the run in .* did not "
                                            "finish writing it; train again"):
        run_train(cfg, time.time() + 3600)


# ---- training's own records ----

def test_trainings_readers_name_a_broken_lineage_recipe_or_run_record(tmp_path, monkeypatch):
    from dartree.training.build import run_recipe
    from dartree.training.cursor import lineage_record
    from dartree.training.engine import RECIPE_FILE, RESUME_DIR, check_resumable
    from dartree.training.recipe import RecipeError

    (tmp_path / "training.json").write_text("[1]")
    with pytest.raises(RecipeError, match=r"training.json: the top level is a list, not an object; give init_from"):
        lineage_record(str(tmp_path))
    (tmp_path / "training.json").write_text(json.dumps({"state": {"lineage": {"steps": "7"}}}))
    with pytest.raises(RecipeError, match=r"training.json: state.lineage.steps is a string, not an integer"):
        lineage_record(str(tmp_path))
    (tmp_path / "training.json").write_text("[1]")
    with pytest.raises(RecipeError, match=r"training.json: the top level is a list, not an object; give a training"):
        run_recipe(tmp_path)
    (tmp_path / RESUME_DIR).mkdir()
    (tmp_path / RESUME_DIR / RECIPE_FILE).write_text('{"recipe": "dspark')
    with pytest.raises(ValueError, match=rf"{RECIPE_FILE} does not parse \(Unterminated string.*\); start a new "
                                         "output_dir"):
        check_resumable(tmp_path, {"recipe": "dspark_b16"})


def test_the_training_benchmark_names_an_incomplete_summary(tmp_path, monkeypatch):
    import subprocess

    import dartree.training.tools.bench as bench

    def fake_run(cmd, **kw):
        out = Path(next(a.split("=", 1)[1] for a in cmd if str(a).startswith("output_dir=")))
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"steps": 3}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    with pytest.raises(RecordError, match=r"summary.json: the key 'predictions_per_s' is missing; the training run"):
        bench.bench_training("dspark_b16", 2, tmp_path)

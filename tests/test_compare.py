"""The equal-compute comparison (training/tools/compare.py) and its section of the results page."""

import json
from pathlib import Path

import pytest

from dartree.training.tools import compare, results

ARMS = """
recipe: tiny_dspark
steps: 4
seed: 0
threads: 1
eval_every_steps: 2
common: [data.source=random, train.engine=torch, train.bf16=false]
arms:
  base: []
  lk: [loss.lk_weight=0.9, loss.l1_weight=0.0]
notes:
  lk: the LK loss
"""


def _files(tmp_path, text=ARMS):
    f = tmp_path / "arms.yaml"
    f.write_text(text)
    return [f"file={f}", f"out={tmp_path / 'compare.json'}", f"runs_dir={tmp_path / 'runs'}", "eval=false"]


def test_arms_train_equal_steps_are_recorded_once_and_redone_when_their_settings_change(tmp_path, capsys):
    words = _files(tmp_path)
    assert compare.main(words) == 0
    rec = json.loads((tmp_path / "compare.json").read_text())
    assert list(rec["arms"]) == ["base", "lk"]
    for name, arm in rec["arms"].items():
        assert arm["steps"] == 4 and arm["cpu_s"] > 0 and arm["threads"] == 1
        assert [p["step"] for p in arm["curve"]] == [2, 4]  # every eval_every_steps, and the end
        assert all(p["holdout_chain_tau"] >= 1.0 and p["train_tokens"] > 0 for p in arm["curve"])
        assert arm["command"].startswith("python training/train.py recipe=tiny_dspark data.source=campaign")
        assert "train.max_steps=4" in arm["command"] and "output_dir" not in arm["command"]
    assert rec["arms"]["lk"]["settings"]["overrides"] == ["loss.lk_weight=0.9", "loss.l1_weight=0.0"]
    assert rec["arms"]["lk"]["note"] == "the LK loss"
    # the two arms differ only by their objective: the same steps, a different training loss
    assert rec["arms"]["base"]["curve"][0]["train_loss"] != rec["arms"]["lk"]["curve"][0]["train_loss"]
    assert (tmp_path / "compare_curves.png").stat().st_size > 1000
    capsys.readouterr()
    assert compare.main(words) == 0  # recorded under the same settings: skipped
    assert capsys.readouterr().out.count("is recorded; skipped") == 2
    assert compare.main(words + ["stage=status"]) == 0
    assert "lk: held-out chain tau" in capsys.readouterr().out
    changed = _files(tmp_path, ARMS.replace("steps: 4", "steps: 2"))
    assert compare.main(changed + ["stage=status"]) == 0
    assert capsys.readouterr().out.count("recorded under other settings") == 2


def test_bad_settings_and_records_are_one_line(tmp_path, capsys):
    words = _files(tmp_path)
    assert compare.main(words + ["only=[nope]"]) == 2
    assert "['nope'] not in" in capsys.readouterr().err
    assert compare.main(words + ["stepz=1"]) == 2
    assert "unknown key 'stepz'" in capsys.readouterr().err
    assert compare.main(_files(tmp_path, "recipe: tiny_dspark\narms: {}\n")) == 2
    assert "no arms" in capsys.readouterr().err
    (tmp_path / "compare.json").write_text("{\"arms\": [")
    assert compare.main(_files(tmp_path) + ["stage=status"]) == 2
    assert "compare.json: not valid JSON" in capsys.readouterr().err
    (tmp_path / "compare.json").unlink()
    assert compare.main(_files(tmp_path, ARMS.replace("arms:\n", "arms:\n  bad: [drafter.init_from_target=copy]\n")) + ["only=[bad]"]) == 2
    assert "drafter.init_from_target='copy' is not allowed" in capsys.readouterr().err
    # a typo in a later arm is refused before the first arm trains, naming the arm and the file
    typo = _files(tmp_path, ARMS.replace("lk: [loss.lk_weight=0.9, loss.l1_weight=0.0]", "lk: [loss.lk_wieght=0.9]"))
    assert compare.main(typo) == 2
    err = capsys.readouterr().err
    assert "arms.yaml: arm lk: " in err and "lk_wieght" in err and not (tmp_path / "compare.json").exists()
    assert not (tmp_path / "runs" / "base").exists()
    assert compare.main(words + ["only=base"]) == 2
    assert "give a list, only=[base]" in capsys.readouterr().err
    assert compare.main(_files(tmp_path, "- a\n- b\n")) == 2
    assert "the top level must be a mapping" in capsys.readouterr().err


def _arm(name, tau, ev):
    return {"settings": {"recipe": "dspark_b16", "steps": 300, "overrides": [] if name == "baseline" else [name]},
            "note": f"{name} note", "command": f"python training/train.py recipe=dspark_b16 {name}", "steps": 300,
            "cpu_s": 1800.0, "holdout_chain_tau": tau, "eval_chain_tau": ev, "eval_mismatches": 0, "draft_ms": 12.5,
            "curve": [{"step": 100, "holdout_chain_tau": 1.1}, {"step": 300, "holdout_chain_tau": tau}],
            "cpu": "Xeon (AVX512)", "updated": "2026-12-07T04:00:00Z"}


def test_the_results_page_renders_the_comparison_from_its_record(tmp_path):
    src = results.ResultSources(state={}, manifest={}, compare={"arms": {
        "baseline": _arm("baseline", 1.2345, 1.2), "drafter.init_from_target=specforge": _arm("x", 1.3, 1.25)}})
    page = results.render_results(src)
    assert "## Equal-compute comparison of training choices" in page
    assert ("| `baseline` | (the recipe) | 300 | 30 | 1.100 | 1.234 | 1.234 | 1.200 | 12.5 | Xeon (AVX512) | "
            "2026-12-07 |") in page
    assert "- `baseline`: baseline note. `python training/train.py recipe=dspark_b16 baseline`" in page
    (tmp_path / "campaign").mkdir()
    (tmp_path / "campaign" / "compare.json").write_text(json.dumps({"arms": {"a": {"settings": {}}}}))
    with pytest.raises(results.ResultsError, match=r"compare.json: .*settings.recipe"):
        results.load_sources(tmp_path)

"""Report figures: every plotting function draws exactly the values it is given (read back from the figure
objects), a broken figure never costs report.json / report.md, and dartree-report redraws / overlays reports."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dartree.decode.harness import plots
from dartree.decode.harness import report_command as cmd
from dartree.decode.harness import report_figures as figs
from dartree.base import figures as curves_mod
from dartree.decode.harness.report_rows import EvalReport
from dartree.decode.settings import DecodeSettings
from test_eval_cli import tiny_folder  # noqa: F401  (fixture: the tiny target and drafter folders)

REPO = Path(__file__).resolve().parents[1]


def _row(dataset, lens, depth_nodes=None, acc=None, decode_s=1.0, stage_ms=None):
    row = {"dataset": dataset, "id": "x", "new_tokens": sum(lens) + 1, "decode_s": decode_s, "accept_lengths": lens}
    if depth_nodes is not None:
        rounds = len(lens)
        row.update(depth_nodes=depth_nodes, accepted_depths=acc, tree_nodes=[sum(r) for r in depth_nodes],
                   stage_s={k: v * rounds / 1000 for k, v in stage_ms.items()}, mismatch=False)
    return row


STAGE_MS = {"chain": dict(draft=10.0, tree_build=1.0, tree_compile=0.5, verify=30.0, commit=0.25),
            "pruned@B4": dict(draft=10.0, tree_build=4.0, tree_compile=1.0, verify=35.0, commit=0.25),
            "pruned@B8": dict(draft=10.0, tree_build=6.0, tree_compile=1.5, verify=44.0, commit=0.5)}


def _summary(tau: float, speedup: float, **more) -> dict:
    """A method's summary as report.json stores it (the figures these tests do not read set to 1)."""
    return {"tau": tau, "speedup": speedup, "tokens_per_s": 1.0, "rounds": 1, "decode_tokens": 1, "prompts": 1, **more}


def typed(rep: dict) -> EvalReport:
    """The report read back from its JSON dict, as dartree-report reads report.json."""
    return EvalReport.from_json(rep)


def synthetic_report() -> dict:
    """Two data sets, AR + chain + a pruned budget sweep (B 4, 8), P = 5 proposals, one recorded tree per method.
    The last chain round of gsm8k is truncated (accepted depth 3, committed 2)."""
    chain_dn = [1] * 5
    pp = {
        "ar": [_row("humaneval", [1] * 8, decode_s=0.16), _row("gsm8k", [1] * 4, decode_s=0.12)],
        "chain": [_row("humaneval", [1, 3, 2, 6], [chain_dn] * 4, [0, 2, 1, 5], stage_ms=STAGE_MS["chain"]),
                  _row("gsm8k", [2, 1, 2], [chain_dn] * 3, [1, 0, 3], stage_ms=STAGE_MS["chain"])],
        "pruned@B4": [_row("humaneval", [2, 4, 1], [[2, 1, 1], [1, 1, 1, 1], [3, 1]], [1, 3, 0],
                           stage_ms=STAGE_MS["pruned@B4"]),
                      _row("gsm8k", [3], [[2, 2]], [2], stage_ms=STAGE_MS["pruned@B4"])],
        "pruned@B8": [_row("humaneval", [3, 5], [[3, 2, 2, 1], [2, 2, 2, 1, 1]], [2, 4], stage_ms=STAGE_MS["pruned@B8"]),
                      _row("gsm8k", [2, 2], [[4, 3, 1], [5, 2, 1]], [1, 1], stage_ms=STAGE_MS["pruned@B8"])],
    }
    methods = {"ar": _summary(1.0, 1.0)}
    sweep = {"chain": (2.4286, 0.9), "pruned@B4": (2.5, 1.1), "pruned@B8": (3.0, 1.25)}
    for m, (tau, sp) in sweep.items():
        methods[m] = {**_summary(tau, sp), **{f"{k}_ms_per_round": v for k, v in STAGE_MS[m].items()}}
    # round 1: root 'def' -> ' f' (accepted) -> '(x' (accepted), ' g' rejected sibling; bonus ':'
    tree = {"root": 10, "tokens": [11, 12, 13, 14], "parents": [0, 0, 1, 3], "depth": [1, 1, 2, 3],
            "accepted": [0, 1, 3], "bonus": 15, "root_text": "def", "texts": [" f", " g", "(x", ")"],
            "bonus_text": ":$"}
    small = {"root": 10, "tokens": [11], "parents": [0], "depth": [1], "accepted": [0], "bonus": 16,
             "root_text": "def", "texts": [" f"], "bonus_text": "\n"}
    return {"methods": methods, "datasets": {"humaneval": {}, "gsm8k": {}}, "per_prompt": pp,
            "trees": {"pruned@B4": {"dataset": "humaneval", "id": "x", "rounds": [small, tree, small]}},
            "environment": {"proposals": 5, "target": "t", "checkpoint": "c", "dtype": "float32", "budget": [4, 8]}}


def _lines(ax) -> dict:
    return {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}


def test_survival_and_depth_helpers_by_hand():
    assert plots.survival([1, 3, 2, 6], 7) == [1.0, 0.75, 0.5, 0.25, 0.25, 0.25, 0.0]
    assert all(math.isnan(x) for x in plots.survival([], 3))
    assert plots.mean_depth_nodes([[2, 1, 1], [1, 1, 1, 1], [3, 1]], 5) == [2.0, 1.0, 2 / 3, 1 / 3, 0.0]
    # depth 1: 3 rounds tried it, 2 accepted; depth 2: rounds with accepted depth >= 1 and a node there: 2, one
    # accepted; depth 3: only the second round reached depth 2, accepted; depth 4: it tried, rejected; depth 5: none
    rate = plots.depth_acceptance([[2, 1, 1], [1, 1, 1, 1], [3, 1]], [1, 3, 0], 5)
    assert rate[:4] == [2 / 3, 1 / 2, 1.0, 0.0] and math.isnan(rate[4])
    with pytest.raises(ValueError, match="3 rounds of depth_nodes but 2"):
        plots.depth_acceptance([[1], [1], [1]], [0, 1], 2)
    rounds = synthetic_report()["trees"]["pruned@B4"]["rounds"]
    assert plots.default_round(rounds) == 1


def test_acceptance_figure_draws_the_survival_of_each_method_and_scope():
    rep = synthetic_report()
    fig = plots.fig_acceptance(typed(rep))
    ax_all, ax_he, ax_gsm = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["all prompts", "humaneval", "gsm8k"]
    lines = _lines(ax_all)
    assert set(lines) == {"chain", "pruned@B4", "pruned@B8"}  # AR (L = 1 always) is left out
    assert list(lines["chain"].get_xdata()) == [1, 2, 3, 4, 5, 6]  # t = 1 .. P + 1
    # chain, all prompts: L = 1, 3, 2, 6, 2, 1, 2
    assert list(lines["chain"].get_ydata()) == pytest.approx([1, 5 / 7, 2 / 7, 1 / 7, 1 / 7, 1 / 7])
    assert sum(lines["chain"].get_ydata()) == pytest.approx(17 / 7)  # = tau
    assert list(_lines(ax_gsm)["pruned@B8"].get_ydata()) == [1, 1, 0, 0, 0, 0]
    assert list(_lines(ax_he)["pruned@B4"].get_ydata()) == pytest.approx([1, 2 / 3, 1 / 3, 1 / 3, 0, 0])
    assert "tau 2.43" in lines["chain"].get_label()


def test_sweep_figure_draws_tau_and_speedup_per_builder():
    fig = plots.fig_sweep(typed(synthetic_report()))
    ax_tau, ax_sp = fig.axes
    tl, sl = _lines(ax_tau), _lines(ax_sp)
    assert list(tl["pruned"].get_xdata()) == [4, 8] and list(tl["pruned"].get_ydata()) == [2.5, 3.0]
    assert list(sl["pruned"].get_ydata()) == [1.1, 1.25]
    assert list(tl["chain"].get_ydata()) == [2.4286, 2.4286] and list(sl["chain"].get_ydata()) == [0.9, 0.9]
    assert list(sl["ar"].get_ydata()) == [1.0, 1.0]
    no_sweep = synthetic_report()
    no_sweep["methods"] = {"ar": no_sweep["methods"]["ar"], "chain": no_sweep["methods"]["chain"]}
    assert plots.fig_sweep(typed(no_sweep)) is None


def test_stage_figure_stacks_ms_per_round_with_the_ar_step_line():
    rep = synthetic_report()
    fig = plots.fig_stages(typed(rep))
    ax = fig.axes[0]
    conts = {c.get_label(): c for c in ax.containers}
    assert list(conts) == ["draft", "tree_build", "tree_compile", "verify", "commit"]
    for st, c in conts.items():
        assert [p.get_height() for p in c.patches] == [STAGE_MS[m][st] for m in ("chain", "pruned@B4", "pruned@B8")]
        assert [p.get_gid() for p in c.patches] == [f"{st}:{m}" for m in ("chain", "pruned@B4", "pruned@B8")]
    # stacked: verify of pruned@B8 starts on draft + tree_build + tree_compile
    assert conts["verify"].patches[2].get_y() == pytest.approx(10.0 + 6.0 + 1.5)
    # AR step = AR decode seconds / AR rounds = 0.28 s / 12 rounds
    assert _lines(ax)["ar"].get_ydata()[0] == pytest.approx(280 / 12)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["chain", "pruned@B4", "pruned@B8"]
    # a peer row has no stage times: no (empty) bar for it
    rep["methods"]["hf-prompt-lookup"] = _summary(2.0, 1.1, peer=True)
    ax = plots.fig_stages(typed(rep)).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["chain", "pruned@B4", "pruned@B8"]
    assert len(ax.containers[0].patches) == 3


def test_tree_shape_figure_draws_nodes_and_acceptance_per_depth():
    fig = plots.fig_tree_shape(typed(synthetic_report()))
    ax_n, ax_a = fig.axes
    n, a = _lines(ax_n), _lines(ax_a)
    assert list(n["chain"].get_xdata()) == [1, 2, 3, 4, 5] and list(n["chain"].get_ydata()) == [1.0] * 5
    # pruned@B4 over both data sets: rounds [2,1,1], [1,1,1,1], [3,1], [2,2]
    assert list(n["pruned@B4"].get_ydata()) == pytest.approx([2.0, 1.25, 0.5, 0.25, 0.0])
    # chain accepted depths 0,2,1,5,1,0,3: depth 1 tried 7 -> 5; depth 2 tried 5 -> 3; 3: 3 -> 2; 4: 2 -> 1; 5: 1 -> 1
    assert list(a["chain"].get_ydata()) == pytest.approx([5 / 7, 3 / 5, 2 / 3, 1 / 2, 1.0])


def _node_texts(fig) -> dict:
    return {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("node:")}


def test_tree_drawing_labels_tokens_highlights_the_accepted_path_and_runs_depth_left_to_right():
    rec = synthetic_report()["trees"]["pruned@B4"]["rounds"][1]
    fig = plots.fig_tree(rec, "t")
    nodes = _node_texts(fig)
    assert set(nodes) == {"node:0", "node:1", "node:2", "node:3", "node:4", "node:bonus"}
    assert {k: t.get_text() for k, t in nodes.items()} == {
        "node:0": "def", "node:1": "␣f", "node:2": "␣g", "node:3": "(x", "node:4": ")", "node:bonus": r":\$"}
    face = {k: t.get_bbox_patch().get_facecolor()[:3] for k, t in nodes.items()}
    green = tuple(int(plots._ACCEPTED[i:i + 2], 16) / 255 for i in (1, 3, 5))
    assert [k for k, c in face.items() if c == pytest.approx(green)] == ["node:1", "node:3"]
    x = {k: t.get_position()[0] for k, t in nodes.items()}
    assert x["node:0"] < x["node:1"] == x["node:2"] < x["node:3"] < x["node:4"] == x["node:bonus"]  # one column per depth
    y = {k: t.get_position()[1] for k, t in nodes.items()}
    assert y["node:1"] > y["node:2"]  # the builder's first child on top
    with pytest.raises(ValueError, match="parents must precede"):
        plots.fig_tree({**rec, "parents": [0, 2, 1, 3]})


def test_curves_figure_draws_tau_and_loss_against_tokens():
    a = [{"train_tokens": 100, "holdout_chain_tau": 1.1, "holdout_tf_tau": 1.05, "train_loss": 5.0},
         {"train_tokens": 250, "holdout_chain_tau": 1.3, "holdout_tf_tau": 1.2, "train_loss": 4.0}]
    b = [{"train_tokens": 120, "holdout_chain_tau": 1.2, "holdout_tf_tau": 1.1}]
    fig = curves_mod.fig_curves({"a": a, "b": b})
    ax_tau, ax_loss = fig.axes
    t = _lines(ax_tau)
    assert list(t["a"].get_xdata()) == [100, 250] and list(t["a"].get_ydata()) == [1.1, 1.3]
    assert list(t["a:tf"].get_ydata()) == [1.05, 1.2] and list(t["b"].get_ydata()) == [1.2]
    assert list(_lines(ax_loss)["a:loss"].get_ydata()) == [5.0, 4.0] and "b:loss" not in _lines(ax_loss)
    assert len(curves_mod.fig_curves({"b": b}).axes) == 1  # no loss recorded: no loss panel
    with pytest.raises(ValueError, match="no learning-curve points"):
        curves_mod.fig_curves({"a": []})


def test_write_figures_embeds_pngs_and_a_broken_figure_is_only_a_warning(tmp_path, monkeypatch):
    rep = synthetic_report()
    (tmp_path / "report.json").write_text(json.dumps(rep))
    (tmp_path / "report.md").write_text("# tables\n\n| method | tau |\n")
    notes = figs.write_figures(typed(rep), tmp_path)
    assert notes == []
    md = (tmp_path / "report.md").read_text()
    files = ["acceptance.png", "sweep.png", "stages.png", "tree_shape.png", "tree_pruned_at_B4.png"]
    for f in files:
        assert f"]({f})" in md and (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.startswith("# tables\n\n| method | tau |") and md.count(figs.FIGURES_MARKER) == 1
    assert "round 2 of 3" in md  # the default round: the longest accepted path
    # redrawing replaces the section instead of appending a second one; --draw-round picks a round
    assert figs.write_figures(typed(rep), tmp_path, draw_round=3) == []
    md = (tmp_path / "report.md").read_text()
    assert md.count(figs.FIGURES_MARKER) == 1 and "round 3 of 3" in md and "round 2 of 3" not in md
    assert "has 3 recorded rounds" in figs.write_figures(typed(rep), tmp_path, draw_round=9)[0]

    def boom(report):
        raise RuntimeError("no ink")

    monkeypatch.setattr(plots, "fig_stages", boom)
    (tmp_path / "stages.png").unlink()
    notes = figs.write_figures(typed(rep), tmp_path)
    assert notes == ["WARNING: figure stages.png failed: RuntimeError: no ink"]
    md = (tmp_path / "report.md").read_text()
    assert "](stages.png)" not in md and "](acceptance.png)" in md and md.startswith("# tables")
    assert json.loads((tmp_path / "report.json").read_text()) == rep
    # even a failure outside any single figure leaves the report and returns a warning
    monkeypatch.setattr(figs, "render_figures", lambda *a, **k: 1 / 0)
    assert "figures not written: ZeroDivisionError" in figs.write_figures(typed(rep), tmp_path)[0]
    assert json.loads((tmp_path / "report.json").read_text()) == rep


def test_merge_labels_and_comparison_tables(tmp_path):
    a, b = typed(synthetic_report()), typed(synthetic_report())
    b.methods["chain"].tau = 1.5
    assert cmd.run_labels([tmp_path / "x" / "latest", tmp_path / "y" / "latest"]) == ["x/latest", "y/latest"]
    assert cmd.run_labels(["reports/dflash", "reports/dspark"]) == ["dflash", "dspark"]
    merged = cmd.merge_reports({"fp32": a, "bf16": b})
    assert merged.methods["bf16/chain"].tau == 1.5 and "fp32/ar" in merged.per_prompt
    assert set(plots.ar_step_ms(merged)) == {"fp32/ar", "bf16/ar"}
    assert set(plots.sweep_points(merged)) == {"fp32/pruned", "bf16/pruned"}
    ar_lines = _lines(plots.fig_stages(merged).axes[0])  # each run's AR step spans that run's bars
    assert list(ar_lines["fp32/ar"].get_xdata()) == pytest.approx([-0.4, 2.4])
    assert list(ar_lines["bf16/ar"].get_xdata()) == pytest.approx([2.6, 5.4])
    md = cmd.comparison_markdown({"fp32": a, "bf16": b})
    assert "| chain | 2.429 | 0.900x | 1.500 | 0.900x |" in md
    with pytest.raises(ValueError, match="contains '/'"):
        cmd.merge_reports({"a/b": a})


@pytest.mark.slow
def test_report_cli_redraws_one_and_overlays_several(tmp_path):
    for name, tau in (("dflash", 2.0), ("dspark", 2.5)):
        rep = synthetic_report()
        rep["methods"]["chain"]["tau"] = tau
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(rep))
    one = subprocess.run([sys.executable, "decode/harness/report_command.py", str(tmp_path / "dflash")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert (tmp_path / "dflash" / "tree_shape.png").is_file()
    assert "](acceptance.png)" in (tmp_path / "dflash" / "report.md").read_text()
    out = tmp_path / "cmp"
    both = subprocess.run([sys.executable, "decode/harness/report_command.py", str(tmp_path / "dflash"), str(tmp_path / "dspark"),
                           "--out", str(out), "--draw-round", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert both.returncode == 0, both.stderr
    md = (out / "report.md").read_text()
    assert "| chain | 2.000 | 0.900x | 2.500 | 0.900x |" in md
    assert "](tree_dflash_pruned_at_B4.png)" in md and "](tree_dspark_pruned_at_B4.png)" in md
    assert "round 1 of 3" in md
    merged = json.loads((out / "report.json").read_text())
    assert merged["methods"]["dspark/chain"]["tau"] == 2.5
    bad = subprocess.run([sys.executable, "decode/harness/report_command.py", str(tmp_path / "nothing")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "holds no report.json" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_report_cli_draws_the_reference_learning_curves(tmp_path):
    ck = [REPO / "checkpoints" / n for n in ("dflash_b16", "domino_b16", "dspark_b16")]
    png = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, "decode/harness/report_command.py", "--curves", *map(str, ck), "--out", str(png)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    curves = {p.name: cmd.load_curve(p) for p in ck}
    fig = curves_mod.fig_curves(curves)
    lines = _lines(fig.axes[0])
    for name, pts in curves.items():
        assert list(lines[name].get_ydata()) == [p["holdout_chain_tau"] for p in pts]


def test_annotate_trees_decodes_each_distinct_id_once():
    calls = []

    def decode(i):
        calls.append(i)
        return f"<{i}>"

    out = figs.annotate_trees([{"root": 1, "tokens": [2, 3], "bonus": 2}, {"root": 2, "tokens": [], "bonus": 4}], decode)
    assert out[0]["texts"] == ["<2>", "<3>"] and out[0]["root_text"] == "<1>" and out[1]["bonus_text"] == "<4>"
    assert sorted(calls) == [1, 2, 3, 4]


def test_plot_curve_file_never_raises(tmp_path, capsys):
    assert plots is not None
    assert curves_mod.plot_curve_file([], tmp_path / "c.png") is None
    assert "not written" in capsys.readouterr().err
    pts = [{"train_tokens": 1, "holdout_chain_tau": 1.2, "train_loss": 3.0}]
    assert curves_mod.plot_curve_file(pts, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ the per-round data behind the figures


def test_decode_stats_record_depths_before_truncation_and_the_verify_trees(target):
    import torch

    from conftest import VOCAB, make_drafter
    from dartree.decode.builders import BUILDERS
    from dartree.decode.generate import autoregressive_generate, speculative_generate
    from dartree.decode.trees import Tree
    from dartree.models.heads import IdentityHead

    prompt = [21, 22, 23]
    ref = autoregressive_generate(target, prompt, max_new_tokens=20).tokens
    state = {"pos": 0}

    def oracle(block, head, root_id, budget, **_):  # the true continuation as a chain, plus a wrong sibling at depth 1
        pos = state["pos"]
        assert ref[pos] == root_id
        good = ref[pos + 1 : pos + 1 + budget]
        state["pos"] = pos + budget + 1
        toks = [good[0], (good[0] + 1) % VOCAB, *good[1:]]
        parents = [0, 0, 1, *range(3, budget + 1)]
        depth = [1, 1, *range(2, budget + 1)]
        return Tree(torch.tensor(toks), torch.tensor(parents), torch.tensor(depth), torch.zeros(len(toks)))

    BUILDERS["test-plot-oracle"] = oracle
    try:
        drafter = make_drafter()
        runs = {}
        for record in (False, True):
            state["pos"] = 0
            runs[record] = speculative_generate(target, drafter, IdentityHead(), prompt,
                                                DecodeSettings(builder="test-plot-oracle", budget=3, max_new_tokens=10,
                                                               record_trees=record))
    finally:
        del BUILDERS["test-plot-oracle"]
    plain, rec = runs[False], runs[True]
    assert plain.tokens == rec.tokens == ref[:10]
    for st in (plain.stats, rec.stats):
        assert st.accept_lengths == [4, 4, 1]  # 1 (prefill) + 4 + 4 + 1: the last round is cut by max_new_tokens
        assert st.accepted_depths == [3, 3, 3]  # ... but accepted depth 3 there too, before truncation
        assert st.depth_nodes == [[2, 1, 1]] * 3 and st.tree_nodes == [4] * 3
    assert plain.stats.trees == []
    assert [t["accepted"] for t in rec.stats.trees] == [[0, 1, 3, 4]] * 3
    assert [t["root"] for t in rec.stats.trees] == [ref[0], ref[4], ref[8]]
    assert [t["bonus"] for t in rec.stats.trees] == [ref[4], ref[8], ref[12]]
    assert rec.stats.trees[1]["tokens"] == [ref[5], (ref[5] + 1) % VOCAB, ref[6], ref[7]]
    assert rec.stats.trees[0]["parents"] == [0, 0, 1, 3] and rec.stats.trees[0]["depth"] == [1, 1, 2, 3]


@pytest.mark.slow
def test_eval_writes_the_figures_beside_its_report_and_no_plots_skips_them(tiny_folder, tmp_path):
    base = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
            str(tiny_folder / "ckpt"), "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "12"]
    out = tmp_path / "rep"
    r = subprocess.run([*base, "--tree", "chain", "pruned", "--budget", "2", "4", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["environment"]["proposals"] == 8  # the tiny drafter's block size 8, offset 0
    for m in ("chain", "pruned@B2", "pruned@B4"):
        row = rep["per_prompt"][m][0]
        lens, acc, dn = row["accept_lengths"], row["accepted_depths"], row["depth_nodes"]
        assert len(lens) == len(acc) == len(dn) > 0
        assert [sum(d) for d in dn] == row["tree_nodes"] and all(all(x > 0 for x in d) for d in dn)
        assert [x - 1 for x in lens[:-1]] == acc[:-1] and lens[-1] <= acc[-1] + 1  # only the last round may be cut
        rounds = rep["trees"][m]["rounds"]
        assert [len(t["accepted"]) - 1 for t in rounds] == acc and [len(t["tokens"]) for t in rounds] == row["tree_nodes"]
        assert all(len(t["texts"]) == len(t["tokens"]) and isinstance(t["root_text"], str) for t in rounds)
    md = (out / "report.md").read_text()
    assert md.index("| pruned@B4 |") < md.index(figs.FIGURES_MARKER)
    for f in ("acceptance.png", "sweep.png", "stages.png", "tree_shape.png", "tree_chain.png", "tree_pruned_at_B2.png",
              "tree_pruned_at_B4.png"):
        assert f"]({f})" in md and (out / f).read_bytes()[:4] == b"\x89PNG", f
    lean = tmp_path / "lean"
    r = subprocess.run([*base, "--tree", "chain", "--no-plots", "--out", str(lean)], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(lean.glob("*.png")) and figs.FIGURES_MARKER not in (lean / "report.md").read_text()
    assert json.loads((lean / "report.json").read_text())["trees"]["chain"]["rounds"]  # drawable later
    bad = subprocess.run([*base, "--draw-round", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--draw-round is 1-based" in bad.stderr


def test_reports_without_tree_methods_or_per_depth_data_draw_what_they_can(tmp_path):
    rep = synthetic_report()
    ar_only = {"methods": {"ar": rep["methods"]["ar"]}, "per_prompt": {"ar": rep["per_prompt"]["ar"]}}
    assert figs.render_figures(typed(ar_only), tmp_path / "ar") == ([], [])
    old = {k: v for k, v in rep.items() if k != "trees"}  # written before per-depth data and trees existed
    old["per_prompt"] = {m: [{k: v for k, v in row.items() if k not in ("depth_nodes", "accepted_depths")}
                             for row in rows] for m, rows in rep["per_prompt"].items()}
    written, notes = figs.render_figures(typed(old), tmp_path / "old")
    assert notes == [] and [f["file"] for f in written] == ["acceptance.png", "sweep.png", "stages.png"]
    assert "pruned: B=4 tau 2.500 1.100x, B=8 tau 3.000 1.250x." in written[1]["caption"]

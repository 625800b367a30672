"""The eval CLI end to end on a tiny model (with the default target's tokenizer), writing a valid report."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dartree.decode.harness.report import report_warnings
from dartree.decode.harness.report_rows import EvalReport, PromptRow
from dartree.models.checkpoint import save_dartree
from dartree.models.drafter import DFlashDrafter, DrafterConfig
from dartree.models.families.dspark import MarkovHead
from dartree.models.target import resolve_target_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_src = resolve_target_path("smollm2")  # dequantised once from the packaged GGUF, then cached
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1,
                      pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    for f in tok_src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, root / "target" / f.name)
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, target_layer_ids=[0, 1], mask_token_id=0, block_size=8)
    ident = {"name": "tiny", "vocab_size": 49152, "hidden_size": 32, "num_layers": 2}
    save_dartree(root / "ckpt", DFlashDrafter(dcfg), MarkovHead(49152, 4), ident)
    return root


@pytest.mark.slow
def test_eval_cli_writes_report(tiny_folder, tmp_path):
    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "chain", "pruned", "--datasets", "gsm8k", "mtbench", "--limit", "2",
           "--max-new-tokens", "12", "--budget", "4", "6", "auto", "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert EvalReport.from_json(rep).to_json() == rep  # report.json reads back to the report that wrote it
    # a budget sweep; chain runs at full length and, as auto is in the sweep, with the cost-model budget
    assert set(rep["methods"]) == {"ar", "chain", "chain@auto", "pruned@B4", "pruned@B6", "pruned@auto"}
    assert set(rep["environment"]["cost_models"]) == {"chain@auto", "pruned@auto"}
    full, auto = rep["methods"]["chain"], rep["methods"]["chain@auto"]
    assert sum(auto["budget_histogram"].values()) == auto["rounds"]  # chain@auto chose a budget every round
    assert full["mean_tree_nodes"] > 4 >= min(int(b) for b in auto["budget_histogram"])  # full length: 7 a round
    for m in ("chain", "chain@auto", "pruned@B4", "pruned@B6", "pruned@auto"):
        row = rep["methods"][m]
        assert row["lossless"] is True and row["mismatches"] == 0
        assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0 and row["speedup"] > 0
        assert set(rep["datasets"]) == {"gsm8k", "mtbench"} and rep["datasets"]["gsm8k"][m]["prompts"] == 2
    env = rep["environment"]
    for key in ("device", "dtype", "torch", "transformers", "prompts", "max_new_tokens", "attn_implementation"):
        assert key in env
    assert len(env["prompts"]) == 4
    from dartree.base.dtypes import onednn_linear_supported

    assert env["linear"] == ("onednn" if onednn_linear_supported()[0] else "aten")  # --linear auto
    assert f"linear layers: {env['linear']}" in r.stdout and env["linear_reason"].startswith("auto:")
    assert rep["methods"]["ar"]["tau"] == 1.0
    # the AR baseline ran twice per prompt (--ar-repeats 2, the default): its time is the mean, its spread reported
    assert env["ar_repeats"] == 2
    for row in rep["per_prompt"]["ar"]:
        assert len(row["decode_s_repeats"]) == 2 and all(t > 0 for t in row["decode_s_repeats"])
        assert row["decode_s"] == pytest.approx(sum(row["decode_s_repeats"]) / 2)
    spreads = [abs(a - b) / ((a + b) / 2) for a, b in (r["decode_s_repeats"] for r in rep["per_prompt"]["ar"])]
    assert rep["methods"]["ar"]["repeat_spread"] == pytest.approx(sum(spreads) / len(spreads))
    md = (out / "report.md").read_text()
    assert "AR timing spread over its 2 runs per prompt (all)" in md
    assert "| pruned@B6 |" in md
    assert rep["methods"]["pruned@B4"]["mean_tree_nodes"] <= 4 < rep["methods"]["chain"]["mean_tree_nodes"]
    # the loud tau warning appears exactly when tau is about 1
    for m in ("chain", "chain@auto", "pruned@B4", "pruned@B6", "pruned@auto"):
        assert (f"WARNING: {m} " in r.stdout) == (rep["methods"][m]["tau"] < 1.05), m
    # unpaired, a round is priced against the AR baseline's time per token (mean of its 2 runs per prompt)
    ar_ms = 1000 * sum(r["decode_s"] for r in rep["per_prompt"]["ar"]) / sum(
        r["new_tokens"] - 1 for r in rep["per_prompt"]["ar"])
    for m in ("chain", "chain@auto", "pruned@B4", "pruned@B6", "pruned@auto"):
        be = rep["methods"][m]["break_even"]
        assert be["ar_basis"] == "baseline" and be["ar_ms_per_token"] == pytest.approx(ar_ms)
        assert f"- {m}: {be['explanation']}" in md and be["explanation"].endswith(
            f"(measured: {rep['methods'][m]['speedup']:.2f}x AR).")


def _report(methods: dict, environment: dict | None = None) -> EvalReport:
    """A report from method summaries that give only what a test reads (the other required figures set to 1)."""
    filled = {m: {"tau": 1.0, "tokens_per_s": 1.0, "speedup": 1.0, "rounds": 1, "decode_tokens": 1, "prompts": 1, **r}
              for m, r in methods.items()}
    return EvalReport.from_json({"methods": filled, "environment": environment or {}})


def _row(**fields) -> PromptRow:
    """One prompt's row with the given fields (dataset and id filled in)."""
    return PromptRow(dataset="d", id=0, **fields)


def test_report_warnings_flag_tau_about_one_and_mismatches():
    rep = {"methods": {"ar": {"tau": 1.0, "lossless": None},
                       "chain": {"tau": 1.0, "lossless": True, "mismatches": 0},
                       "pruned": {"tau": 2.1, "lossless": False, "mismatches": 3}}}
    w = report_warnings(_report(**rep))
    assert len(w) == 2 and "chain tau = 1.000 is about 1" in w[0] and "pruned differs from AR on 3" in w[1]
    never = {"tau": 1.0, "lossless": True, "mismatches": 0, "mean_tree_nodes": 0.0}
    rep = {"methods": {"ar": {"tau": 1.0, "lossless": None}, "chain@auto": never, "pruned@B0": never},
           "environment": {"cost_models": {"chain@auto": {}}}}
    w = report_warnings(_report(**rep))
    assert "chain@auto took a plain AR step every round" in w[0] and "pruned@B0 drafted no tree nodes" in w[1]


def test_the_drafter_warning_tells_a_policy_that_chose_not_to_draft_from_drafts_that_were_rejected():
    """Issue 43: make run warned "the drafter contributes nothing" for auto rows whose policy had stopped drafting
    while a fixed budget of the same builder gained in the same run. The warning now says which it is, with the
    drafted rounds' own tokens and the fixed-budget row beside the auto one."""
    from dartree.decode.harness.report import _budget_lines, aggregate

    # the aggregate counts the drafted rounds (budget > 0) apart: 3 rounds, one an AR step
    rows = [_row(new_tokens=6, decode_s=1.0, accept_lengths=[1, 3, 2], budgets=[0, 4, 2], accepted_depths=[0, 2, 1],
                 stage_s={"draft": 0.1}, tree_nodes=[0, 4, 2])]
    agg = aggregate(rows, [_row(new_tokens=6, decode_s=2.0, accept_lengths=[1] * 5)])
    assert (agg.drafted_rounds, agg.drafted_tau, agg.drafted_accepted) == (2, 2.5, 3)
    assert agg.budget_histogram == {0: 1, 2: 1, 4: 1}
    fixed = {"tau": 1.6, "speedup": 1.12, "paired_speedup": 1.15, "lossless": True, "mismatches": 0,
             "budget_histogram": {8: 100}, "rounds": 100, "drafted_rounds": 100, "drafted_tau": 1.6,
             "drafted_accepted": 60}

    def auto_row(hist, tau, dtau, accepted):
        drafted = sum(n for b, n in hist.items() if b > 0)
        return {"tau": tau, "speedup": 0.99, "paired_speedup": 0.99, "lossless": True, "mismatches": 0,
                "budget_histogram": hist, "rounds": sum(hist.values()), "drafted_rounds": drafted,
                "drafted_tau": dtau, "drafted_accepted": accepted}

    prior = {"source": "calibration prompt (64 tokens)", "rounds": 31, "weight": 8.0, "tokens_per_round": 1.5,
             "ar_steps_per_round": 1.2, "ar_step": 1.0, "calibration": 0.6, "budgets": {}}
    env = {"cost_models": {"pruned@auto": {"prior": prior}}, "paired": True}
    skipped = {"methods": {"ar": {"tau": 1.0, "lossless": None}, "pruned@auto": auto_row({0: 90, 4: 10}, 1.02, 1.6, 6),
                           "pruned@B8": fixed}, "environment": env}
    w = report_warnings(_report(**skipped))
    assert len(w) == 1 and "contributes nothing" not in w[0]
    assert w[0].startswith("WARNING: pruned@auto tau = 1.020: the policy (--budget auto) chose not to draft (B=0 in 90 "
                           "of 100 rounds); its 10 drafted rounds committed 1.60 tokens each, so the drafter does "
                           "contribute; pruned@B8 (a fixed budget of the same builder, same prompts): tau 1.600")
    assert "1.150x AR paired" in w[0]
    rejected = dict(skipped, methods={**skipped["methods"], "pruned@auto": auto_row({0: 10, 4: 90}, 1.0, 1.0, 0)})
    w = report_warnings(_report(**rejected))
    assert len(w) == 1 and w[0] == ("WARNING: pruned@auto tau = 1.000 is about 1 and its 90 drafted rounds accepted 0 "
                                    "drafts in all: the drafter contributes nothing (untrained, mismatched to the "
                                    "target, or the wrong checkpoint)")
    # tau above the floor, but the policy skipped most rounds while the fixed budget gained: still loud
    missed = dict(skipped, methods={**skipped["methods"], "pruned@auto": auto_row({0: 60, 4: 40}, 1.2, 1.5, 20)})
    w = report_warnings(_report(**missed))
    assert len(w) == 1 and w[0].startswith("WARNING: pruned@auto chose B=0 in 60 of 100 rounds while pruned@B8")
    # no warning when the policy drafted and the drafted rounds accepted drafts
    fine = dict(skipped, methods={**skipped["methods"], "pruned@auto": auto_row({0: 5, 4: 95}, 1.5, 1.53, 50)})
    assert report_warnings(_report(**fine)) == []
    line = _budget_lines(_report(**fine))[0]
    assert line.startswith("pruned@auto: B=0: 5, B=4: 95; drafted in 95 of 100 rounds (1.53 tokens per drafted round)")
    assert "against pruned@B8 (a fixed budget of the same builder" in line and "started from 31 drafted rounds" in line


@pytest.mark.slow
def test_eval_cli_bad_checkpoint_is_clear(tiny_folder, tmp_path):
    r = subprocess.run([sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
                        str(tmp_path), "--limit", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "not a dartree checkpoint" in r.stderr


def test_tree_all_expands_to_every_builder_once():
    from dartree.decode.harness.session import resolve_methods

    got = resolve_methods(["all"])
    assert got == ["chain", "ddtree", "fixed", "heap-sequential", "pctree", "pruned"]
    assert resolve_methods(["dartree-pruned", "pruned", "ar"]) == ["pruned"]
    assert resolve_methods(["dartree-pruned+lookup", "chain+lookup", "pruned"]) == ["pruned+lookup", "chain+lookup",
                                                                                    "pruned"]
    with pytest.raises(ValueError, match="available"):
        resolve_methods(["beam"])
    with pytest.raises(ValueError, match="NAME\\+lookup"):
        resolve_methods(["beam+lookup"])
    # METHOD@B<n>: a fixed-budget row beside --budget; the auto row of that method is then METHOD@auto
    from dartree.decode.harness.session import plan_runs

    got = resolve_methods(["chain", "pruned", "dartree-pruned@B8", "pruned+lookup", "chain@B04"])
    assert got == ["chain", "pruned", "pruned@B8", "pruned+lookup", "chain@B4"]
    assert plan_runs(got, ["auto"]) == {"chain@auto": ("chain", "auto"), "pruned@auto": ("pruned", "auto"),
                                        "pruned@B8": ("pruned", 8), "pruned+lookup": ("pruned", "auto"),
                                        "chain@B4": ("chain", 4)}
    assert plan_runs(["pruned", "pruned@B8"], ["auto", 8]) == {"pruned@auto": ("pruned", "auto"),
                                                               "pruned@B8": ("pruned", 8)}
    with pytest.raises(ValueError, match="NAME@B<n>"):
        resolve_methods(["ar@B3"])


@pytest.mark.slow
def test_eval_cli_lookup_rows_side_by_side(tiny_folder, tmp_path):
    # pruned and pruned+lookup in one run, auto budget: both lossless, the lookup settings and its acceptance
    # by chain position in the report
    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "pruned", "pruned+lookup", "--datasets", "humaneval", "--limit", "2",
           "--max-new-tokens", "24", "--lookup", "6", "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["methods"]) == {"ar", "pruned", "pruned+lookup"}
    assert all(rep["methods"][m]["lossless"] is True for m in ("pruned", "pruned+lookup"))
    env = rep["environment"]
    assert env["lookup"] == 6 and env["lookup_ngram"] == 3
    assert env["cost_models"]["pruned"]["lookup_acceptance"] == {}
    assert isinstance(env["cost_models"]["pruned+lookup"]["lookup_acceptance"], dict)


def test_negative_threads_is_a_one_line_error(capsys):
    from dartree.decode.harness.eval import main

    assert main(["--threads", "-2", "--limit", "1"]) == 2
    assert "--threads must be >= 0" in capsys.readouterr().err


def test_ar_repeats_spread_through_a_prompts_rows():
    from dartree.decode.harness.prompt_rows import spread_repeats

    assert spread_repeats(["b", "ar", "c", "d"], "ar", 2) == ["b", "ar", "c", "ar#2", "d"]
    assert spread_repeats(["ar", "m1", "m2", "m3", "p1", "p2"], "ar", 3) == [
        "ar", "m1", "ar#2", "m2", "m3", "ar#3", "p1", "p2"]
    assert spread_repeats(["m1", "m2", "ar"], "ar", 3) == ["ar#2", "m1", "ar#3", "m2", "ar"]  # wraps to the front
    assert spread_repeats(["ar", "x"], "ar", 1) == ["ar", "x"]
    with pytest.raises(ValueError, match="repeats >= 1"):
        spread_repeats(["x"], "ar", 2)


@pytest.mark.slow
def test_eval_cli_rejects_zero_ar_repeats(tmp_path):
    r = subprocess.run([sys.executable, "decode/eval.py", "--ar-repeats", "0", "--out", str(tmp_path / "r")], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--ar-repeats must be >= 1" in r.stderr


@pytest.mark.slow
def test_eval_cli_paired_rows_time_each_method_against_its_own_lockstep_ar(tiny_folder, tmp_path):
    """--paired: every method row carries the AR decode that ran in lockstep with it (same tokens as the AR row),
    and the report's paired speedup is the pooled time-per-token ratio of those pairs, in report.md's column too."""
    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "chain", "pruned", "--datasets", "gsm8k", "--limit", "2",
           "--max-new-tokens", "12", "--budget", "4", "--paired", "--ar-repeats", "1", "--no-plots", "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["environment"]["paired"] is True and EvalReport.from_json(rep).to_json() == rep
    ar_rows = rep["per_prompt"]["ar"]
    for m in ("chain", "pruned"):
        rows = rep["per_prompt"][m]
        assert [r["paired_ar_new_tokens"] for r in rows] == [a["new_tokens"] for a in ar_rows]
        assert all(r["paired_ar_decode_s"] > 0 for r in rows)
        tps = sum(r["new_tokens"] - 1 for r in rows) / sum(r["decode_s"] for r in rows)
        ar_tps = sum(r["paired_ar_new_tokens"] - 1 for r in rows) / sum(r["paired_ar_decode_s"] for r in rows)
        assert rep["methods"][m]["paired_speedup"] == pytest.approx(tps / ar_tps)
        assert rep["datasets"]["gsm8k"][m]["paired_speedup"] == pytest.approx(tps / ar_tps)
        lo, hi = rep["methods"][m]["paired_speedup_range"]
        assert lo <= rep["methods"][m]["paired_speedup"] * 1.0001 and hi >= rep["methods"][m]["paired_speedup"] * 0.9999
    assert "paired_speedup" not in rep["methods"]["ar"]
    md = (out / "report.md").read_text()
    assert "| method | tau | needs tau | tokens/s | speedup | paired x AR |" in md and "paired x AR: each method" in md
    # what a round costs here: its stages' mean ms over the lockstep AR's ms per token, beside the tau reached
    assert "## what a round costs here, and the tau that pays for it" in md
    for m in ("chain", "pruned"):
        agg, rows = rep["methods"][m], rep["per_prompt"][m]
        be = agg["break_even"]
        ar_ms = 1000 * sum(r["paired_ar_decode_s"] for r in rows) / sum(r["paired_ar_new_tokens"] - 1 for r in rows)
        assert be["ar_basis"] == "paired" and be["ar_ms_per_token"] == pytest.approx(ar_ms)
        round_ms = 1000 * sum(sum(r["stage_s"].values()) for r in rows) / agg["rounds"]
        assert be["break_even_tau"] == pytest.approx(round_ms / ar_ms) and be["tau"] == pytest.approx(agg["tau"])
        assert be["pays"] is (agg["tau"] > be["break_even_tau"])
        assert f"| {m} | {agg['tau']:.3f} | {be['break_even_tau']:.2f} |" in md
        assert f"- {m}: {be['explanation']}" in md and be["explanation"].startswith("a verify of ")
        said = be["explanation"]
        assert f"so it needs tau >= {be['break_even_tau']:.2f} to beat AR; it reached {agg['tau']:.2f}, " in said
        assert said.endswith(f"(measured: {agg['paired_speedup']:.2f}x AR paired).")
        assert f"{m}: a verify of" in r.stdout  # the printed explanation


@pytest.mark.slow
def test_bench_replay_sweeps_budgets_from_one_recorded_decode(tiny_folder, tmp_path):
    # decode/bench.py --replay: the pruned rounds recorded at B = 6 replayed at every smaller budget, with the auto
    # policy and the hindsight bound; the replayed tau at the recorded budget is the measured one
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "decode/bench.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "pruned", "--budget", "2", "6", "--datasets", "gsm8k", "--limit", "1",
           "--max-new-tokens", "16", "--reps", "1", "--context", "16", "--replay", "--replay-orders", "3",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    entry = next(iter(json.loads(out.read_text())["dtypes"].values()))
    rep = entry["replay"]["pruned"]
    assert rep["budget"] == 6 and rep["rounds"] > 0
    assert sorted(int(b) for b in rep["fixed"]) == [1, 2, 3, 4, 6]
    measured = entry["methods"]["pruned@6"]
    # the replay counts every accepted draft of a round; the measured tau counts the tokens committed (the last
    # round is cut at --max-new-tokens), so the replay is never below it
    assert rep["fixed"]["6"]["tau"] >= measured["tau"] - 1e-9
    taus = [rep["fixed"][str(b)]["tau"] for b in (1, 2, 3, 4, 6)]
    assert taus == sorted(taus)  # a bigger top-b sub-tree never accepts less
    assert rep["hindsight"]["rate"] >= max(v["rate"] for v in rep["fixed"].values()) - 1e-12
    assert sum(rep["auto"]["chosen"].values()) == sum(rep["auto_scores"]["chosen"].values()) == rep["rounds"]
    assert "pinned at T" in r.stdout and "hindsight" in r.stdout and "per-round rule" in r.stdout
    # three prompt orders, each from a fresh policy: with one prompt every order is the run's own, so each rule's mean
    # and worst are its auto row's rate against the best fixed budget
    orders, best = rep["orders"], rep["fixed"][str(rep["best_fixed"])]["rate"]
    assert orders["outcomes"]["orders"] == orders["scores"]["orders"] == 3 and "over 3 prompt orders" in r.stdout
    for rule, row in (("outcomes", "auto"), ("scores", "auto_scores")):
        assert orders[rule]["mean"] == pytest.approx(rep[row]["rate"] / best - 1, abs=1e-12)
        assert orders[rule]["worst"] == pytest.approx(orders[rule]["mean"], abs=1e-12)


@pytest.mark.slow
def test_bench_invariant_measures_each_dtype_twice_and_the_invariant_rounds_equal_ar(tiny_folder, tmp_path):
    # decode/bench.py --invariant: the same dtype measured with today's kernels and in the row-invariant mode
    # (DTYPE/invariant, its mode recorded), in one process; the invariant rounds' output equals AR's by construction
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "decode/bench.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "chain", "pruned", "--budget", "4", "--datasets", "gsm8k", "--limit",
           "1", "--max-new-tokens", "16", "--reps", "1", "--context", "16", "--dtype", "bfloat16", "--invariant",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    dtypes = json.loads(out.read_text())["dtypes"]
    assert sorted(dtypes) == ["bfloat16", "bfloat16/invariant"]
    assert dtypes["bfloat16"]["row_invariant"] is None and dtypes["bfloat16/invariant"]["row_invariant"]["linear"]
    for entry in dtypes.values():
        assert sorted(entry["methods"]) == ["chain", "pruned@4"] and entry["t_ar_ms"] > 0
    assert "bfloat16/invariant: row-invariant target forwards" in r.stdout
    assert "differs from AR" not in r.stdout  # checked where the arithmetic is exact: the invariant rows


@pytest.mark.slow
def test_report_writers_of_one_folder_never_share_a_temporary_file(tmp_path):
    """Two processes writing one report folder (two runs with the same --out) each write under their own temporary
    name: with a fixed ``report.md.tmp`` one writer's rename took the other's file and the other crashed
    (FileNotFoundError)."""
    script = ("import sys; from pathlib import Path; from dartree.decode.harness.report import write_report_files; "
              "from dartree.decode.harness.report_figures import attach_figures; out, k = Path(sys.argv[1]), sys.argv[2]\n"
              "for i in range(300):\n"
              "    write_report_files(out, {'writer': k, 'i': i}, f'# writer {k} row {i}\\n')\n"
              "    attach_figures(out / 'report.md', [])\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(k)], stderr=subprocess.PIPE,
                              text=True) for k in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert json.loads((tmp_path / "report.json").read_text())["i"] == 299
    assert (tmp_path / "report.md").read_text().startswith("# writer ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]  # no temporary file left


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_eval_cli_stopped_by_a_signal_exits_in_one_line_and_keeps_the_finished_prompts(tiny_folder, tmp_path, sig,
                                                                                      status):
    """SIGTERM / Ctrl-C mid-run: exit 143 / 130 with one line (no traceback) saying where the report is; report.json
    and report.md hold the same finished prompts, marked as interrupted, and no temporary file is left."""
    import signal
    import time

    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "chain", "--datasets", "gsm8k", "mtbench", "--limit", "10",
           "--max-new-tokens", "64", "--budget", "4", "--linear", "aten", "--ar-repeats", "1", "--no-plots",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not (out / "report.json").exists():  # the first prompt is done
        assert proc.poll() is None and time.time() - t0 < 500, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == status, err[-3000:]
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    rep = json.loads((out / "report.json").read_text())
    done = rep["environment"]["prompts_done"]
    assert 1 <= done < 20 and rep["environment"]["interrupted"] == sig
    assert line == f"interrupted by {sig}: {out}/report.json and report.md hold the {done} of 20 prompts that finished"
    assert len(rep["per_prompt"]["ar"]) == len(rep["per_prompt"]["chain"]) == len(rep["environment"]["prompts"]) == done
    md = (out / "report.md").read_text()
    assert f"{done} of 20 prompts (interrupted by {sig})" in md
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def _target_copy(tiny_folder, tmp_path, config: dict | None = None, generation: dict | None = None,
                 chat_template: bool = True) -> Path:
    """A copy of the tiny target folder with ``config.json`` / ``generation_config.json`` entries replaced and,
    with ``chat_template=False``, its tokenizer's chat template removed (a base model)."""
    dst = tmp_path / "target"
    shutil.copytree(tiny_folder / "target", dst)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        if changes:
            data = json.loads((dst / name).read_text())
            (dst / name).write_text(json.dumps({**data, **changes}))
    if not chat_template:
        for f in dst.glob("*.jinja"):
            f.unlink()
        tc = json.loads((dst / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst


def _eval_cli(target, ckpt, out, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "decode/eval.py", "--target", str(target), "--checkpoint", str(ckpt), "--tree", "chain",
           "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "12", "--budget", "4", "--dtype", "float32",
           "--linear", "aten", "--ar-repeats", "1", "--no-plots", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    """The run failed cleanly: exit 2, no traceback; returns its last stderr line (the error)."""
    assert r.returncode == 2, r.stderr[-3000:] + r.stdout[-3000:]
    assert "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_eval_cli_stops_at_every_end_id_of_the_generation_config(tiny_folder, tmp_path):
    """A generation_config naming two end ids (and top_k, which greedy decoding ignores): every row stops where
    the target's own generate(do_sample=False) stops; the report names the stop ids, the sampling rule and the
    chat-template options."""
    from dartree.decode.generate import autoregressive_generate
    from dartree.decode.harness.prompts import load_prompts
    from dartree.models.target import load_target
    from dartree.models.chat import chat_prompt_ids

    base = load_target(tiny_folder / "target")
    ids = chat_prompt_ids(base.tokenizer, load_prompts("gsm8k", 1, 0)[0].text)
    free = autoregressive_generate(base, ids, max_new_tokens=12).tokens  # no end id at all
    end = free[0]  # the tiny random model repeats one token: as an end id, the target's own generate stops at once
    assert len(free) == 12 and end != 2
    target = _target_copy(tiny_folder, tmp_path, generation={"eos_token_id": [2, end], "top_k": 20})
    out = tmp_path / "rep"
    r = _eval_cli(target, tiny_folder / "ckpt", out, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    env = rep["environment"]
    assert env["stop_ids"] == [2, end]
    x = torch.tensor([ids])
    hf = load_target(target).model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                            max_new_tokens=12)[0, len(ids):].tolist()
    assert hf == free[: free.index(end) + 1] and len(hf) < 12  # the target's own generate stops at the second id
    assert rep["per_prompt"]["ar"][0]["new_tokens"] == len(hf)
    assert rep["methods"]["chain"]["lossless"] is True
    assert env["sampling"] == {"temperature": 0.0, "rule": "greedy (argmax)", "ignored": {},
                               "generation_config": {"top_k": 20}}
    assert env["chat_template"] == "tokenizer" and env["chat_template_kwargs"] == {"enable_thinking": False}
    md = (out / "report.md").read_text()
    assert (f"stop ids [2, {end}]; sampling: greedy (argmax); prompts: the tokenizer's chat template with "
            '{"enable_thinking": false}') in md


@pytest.mark.slow
def test_eval_cli_refuses_generation_config_sampling_it_does_not_apply(tiny_folder, tmp_path):
    """At T > 0 the target's top_k / top_p are refused by name with the flag that overrides them (was: sampled
    without them, silently); with --ignore-generation-config the run goes ahead and the report says so."""
    target = _target_copy(tiny_folder, tmp_path, generation={"top_k": 20, "top_p": 0.9, "do_sample": True})
    out = tmp_path / "rep"
    line = _one_error_line(_eval_cli(target, tiny_folder / "ckpt", out, "--temperature", "0.7"))
    assert line.startswith("error: --target ") and "generation_config sets top_k=20, top_p=0.9" in line
    assert "--ignore-generation-config" in line and "--temperature 0" in line
    assert not (out / "report.json").exists()
    r = _eval_cli(target, tiny_folder / "ckpt", out, "--temperature", "0.7", "--ignore-generation-config",
                  "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["environment"]["sampling"]["ignored"] == {"top_k": 20, "top_p": 0.9}
    assert "target generation_config {'top_k': 20, 'top_p': 0.9} not applied" in (out / "report.md").read_text()


@pytest.mark.slow
def test_eval_cli_base_model_without_chat_template(tiny_folder, tmp_path):
    """A tokenizer without a chat template: one line naming --chat-template none (was a transformers traceback);
    with it, the raw prompt text is decoded and the report says so. Bad --chat-template-kwargs: one line."""
    target = _target_copy(tiny_folder, tmp_path, chat_template=False)
    out = tmp_path / "rep"
    line = _one_error_line(_eval_cli(target, tiny_folder / "ckpt", out))
    assert "tokenizer has no chat template" in line and "--chat-template none" in line
    line = _one_error_line(_eval_cli(target, tiny_folder / "ckpt", out, "--chat-template", "none",
                                     "--chat-template-kwargs", '{"enable_thinking": false}'))
    assert "--chat-template-kwargs needs a chat template" in line
    r = _eval_cli(target, tiny_folder / "ckpt", out, "--chat-template", "none")
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    env = json.loads((out / "report.json").read_text())["environment"]
    assert env["chat_template"] == "none (raw prompt text)" and env["chat_template_kwargs"] == {}
    assert "prompts: raw text, no chat template (--chat-template none)" in (out / "report.md").read_text()
    line = _one_error_line(_eval_cli(tiny_folder / "target", tiny_folder / "ckpt", out, "--chat-template-kwargs",
                                     '{"tokenize": true}'))
    assert "['tokenize'] are apply_chat_template's own arguments" in line
    r = _eval_cli(tiny_folder / "target", tiny_folder / "ckpt", out, "--chat-template-kwargs", "[1]")
    assert r.returncode == 2 and "is a JSON list, not an object" in r.stderr


@pytest.mark.slow
def test_eval_cli_refuses_a_sliding_window_target_before_calibrating(tiny_folder, tmp_path):
    """A Mistral target with sliding_window set: one line, exit 2, right after loading (was a 25-line traceback
    after loading and calibrating)."""
    from transformers import MistralConfig, MistralForCausalLM

    target = tmp_path / "mistral"
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16, eos_token_id=2,
                        bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    MistralForCausalLM(cfg).save_pretrained(target)
    for f in (tiny_folder / "target").iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, target / f.name)
    r = _eval_cli(target, tiny_folder / "ckpt", tmp_path / "rep", "--budget", "auto")
    line = _one_error_line(r)
    assert "DynamicSlidingWindowLayer" in line and "sliding_window=16" in line
    assert "calibrated" not in r.stdout and "linear layers" not in r.stdout


@pytest.mark.slow
def test_eval_cli_refuses_a_prompt_past_the_context_before_decoding(tiny_folder, tmp_path):
    """A prompt plus --max-new-tokens past max_position_embeddings: one line naming the prompt, its length, the
    context and the fix, before calibration (was decoded past the context without a word)."""
    from dartree.decode.harness.prompts import load_prompts
    from dartree.models.target import load_target
    from dartree.models.chat import chat_prompt_ids

    target = _target_copy(tiny_folder, tmp_path, config={"max_position_embeddings": 128})
    p = load_prompts("gsm8k", 1, 0)[0]
    n = len(chat_prompt_ids(load_target(target).tokenizer, p.text))
    assert n < 128 < n + 60
    r = _eval_cli(target, tiny_folder / "ckpt", tmp_path / "rep", "--max-new-tokens", "60", "--budget", "auto")
    line = _one_error_line(r)
    assert line == (f"error: prompt gsm8k:{p.id} has {n} tokens; with max_new_tokens=60 the decode needs {n + 60} "
                    "positions, over the target's context of 128 (max_position_embeddings): lower --max-new-tokens to "
                    f"at most {128 - n} or shorten the prompt")
    assert "calibrated" not in r.stdout


@pytest.mark.slow
def test_eval_cli_prompts_file_replaces_the_packaged_sets(tiny_folder, tmp_path, capsys):
    """--prompts FILE: "text" and "messages" lines decoded (the first --limit of them), the file and its sha256 the
    report's one data set; a bad file, --datasets with it, and messages without a chat template: one line, exit 2."""
    import hashlib

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}]
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ({"text": "Say hi."}, {"messages": chat}, {"text": "Unused."})) + "\n")
    name = f"{f} sha256:{hashlib.sha256(f.read_bytes()).hexdigest()}"
    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "chain", "--prompts", str(f), "--limit", "2", "--max-new-tokens", "8",
           "--budget", "4", "--ar-repeats", "1", "--no-plots", "--out", str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert list(rep["datasets"]) == [name] and rep["datasets"][name]["chain"]["prompts"] == 2
    assert rep["environment"]["prompt_file"] == {"path": str(f.resolve()), "sha256": name.split("sha256:")[1],
                                                 "format": "jsonl", "name": name, "prompts": 2}
    assert [(p["id"], p["text"]) for p in rep["environment"]["prompts"]] == [("1", "Say hi."), ("2", "Count to five.")]
    assert rep["methods"]["chain"]["lossless"] is True and rep["methods"]["chain"]["mismatches"] == 0
    assert "decode/s" in r.stderr and "4/4" in r.stderr  # the progress bar: 2 prompts x (AR + chain) decodes

    from dartree.decode.harness.eval import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"input_text": "no prompt field"}\n')
    assert main(["--prompts", str(bad), "--target", str(tiny_folder / "target"), "--tree", "ar"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --prompts {bad}:2: no prompt field (fields ['input_text'])")
    assert "Traceback" not in "".join(err)
    with pytest.raises(SystemExit) as info:  # argparse: the two prompt sources are mutually exclusive
        main(["--prompts", str(f), "--datasets", "gsm8k"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert main(["--prompts", str(f), "--target", str(tiny_folder / "target"), "--tree", "ar",
                 "--chat-template", "none", "--out", str(tmp_path / "rep2")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --prompts {f} has \"messages\" lines, which need the chat template; drop --chat-template none, "
        "or give \"text\" lines")


def test_splits_are_named_mismatch_only_where_the_arithmetic_is_exact():
    from dartree.decode.harness.report import lossless_cell, split_label

    real = dict(mismatch=True, exact=True, first_divergence=7, margin_at_divergence=0.01)
    tie = {**real, "exact": False}
    cell = lambda peer=False, **r: lossless_cell(_report({"m": r}).methods["m"], peer)  # noqa: E731
    row = lambda **r: _row(new_tokens=2, decode_s=1.0, accept_lengths=[1], **r)  # noqa: E731
    assert split_label(row(**real)) == "MISMATCH" and split_label(row(mismatch=False)) == ""
    assert split_label(row(**tie)) == "split@7 (top-2 margin 0.010)"
    assert cell(lossless=False, mismatches=2, exact=True) == "NO (2)"
    assert cell(lossless=False, mismatches=2, exact=False) == "split (2), near-ties"
    assert cell(lossless=False, mismatches=1, exact=False, peer=True) == "split (1), own arithmetic"
    assert cell(lossless=True, mismatches=0) == "yes" and cell(lossless=None) == "n/a"
    rep = {"methods": {"ar": {"tau": 1.0, "lossless": None},
                       "pruned": {"tau": 2.1, "lossless": False, "mismatches": 3, "exact": False},
                       "hf-prompt-lookup": {"tau": 1.5, "lossless": False, "mismatches": 1, "exact": False,
                                            "peer": True}}}
    w = report_warnings(_report(**rep))
    assert len(w) == 2 and not any(x.startswith("WARNING") for x in w)
    assert "pruned splits from AR on 3 prompts" in w[0] and "--invariant" in w[0] and "own arithmetic" in w[1]


@pytest.mark.slow
def test_eval_cli_invariant_mode_in_bf16_equals_ar_and_says_so(tiny_folder, tmp_path):
    """--invariant in bf16: every speculative output equals bf16 AR's by construction, and the report records the
    mode (its linear path) and states that a split would be a MISMATCH."""
    out = tmp_path / "rep"
    r = _eval_cli(tiny_folder / "target", tiny_folder / "ckpt", out, "--dtype", "bfloat16", "--invariant",
                  "--tree", "chain", "pruned", "--limit", "2", "--max-new-tokens", "24")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["environment"]["row_invariant"]["linear"] in ("onednn", "aten")
    for m in ("chain", "pruned"):
        assert rep["methods"][m]["lossless"] is True and rep["methods"][m]["exact"] is True, m
    assert "row-invariant verify (--invariant" in (out / "report.md").read_text()
    assert "row-invariant verify: on" in r.stdout
    # --invariant off: today's kernels, recorded as such; bf16 splits would be named, not called MISMATCH
    out = tmp_path / "off"
    r = _eval_cli(tiny_folder / "target", tiny_folder / "ckpt", out, "--dtype", "bfloat16", "--invariant", "off",
                  "--tree", "chain", "--limit", "1", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["environment"]["row_invariant"] is None
    assert "row-invariant verify: off (--invariant off)" in r.stdout
    assert "without the row-invariant mode" in (out / "report.md").read_text()


def test_eval_dtype_auto_times_the_exact_modes_and_keeps_the_faster(tiny_folder, tmp_path, monkeypatch, capsys):
    """--dtype auto where bf16 is native: bf16 (in the row-invariant mode) and fp32 are both assembled and timed,
    the faster decodes, the header and report say why, and its outputs equal AR's; --invariant off leaves only
    fp32."""
    import dartree.decode.assembly as assembly
    from dartree.decode.harness.eval import main as eval_main

    monkeypatch.setattr(assembly, "dtype_candidates", lambda requested, device="cpu": (["bfloat16", "float32"],
                                                                                      "auto: stub"))
    out = tmp_path / "rep"
    args = ["--target", str(tiny_folder / "target"), "--checkpoint", str(tiny_folder / "ckpt"), "--datasets",
            "gsm8k", "--limit", "1", "--max-new-tokens", "12", "--threads", "1", "--no-plots"]
    assert eval_main([*args, "--tree", "chain", "pruned", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mode: bfloat16 or float32 (timed below)" in printed
    env = json.loads((out / "report.json").read_text())["environment"]
    reason = env["dtype_reason"]
    assert env["dtype"] in ("bfloat16", "float32") and f"mode: {env['dtype']}; " in printed
    if "measured at start-up" in reason:  # both exact here: the figures of both are named
        assert f"{env['dtype']} decodes fastest" in reason and "bfloat16 " in reason and "float32 " in reason
        assert "tok/s (AR step" in reason and "(the checkpoint's" not in reason  # the tiny drafter records no tau
        assert "at tau 1.50 (assumed" in reason
    else:  # no row-invariant bf16 path on this CPU: bf16 is not a candidate
        assert env["dtype"] == "float32" and "only float32 is exact here: bfloat16 (" in reason
    assert (env["row_invariant"] is not None) == (env["dtype"] == "bfloat16")
    chosen = printed.split(f"mode: {env['dtype']}; ")[1]  # after the candidates' lines: the setting that decodes
    assert f"row-invariant verify (the {env['dtype']} mode chosen): {'on' if env['row_invariant'] else 'off'}" in chosen
    rows = json.loads((out / "report.json").read_text())["methods"]
    assert all(rows[m]["lossless"] is True and rows[m]["exact"] is True for m in ("chain", "pruned"))
    assert eval_main([*args, "--tree", "chain", "--invariant", "off", "--out", str(tmp_path / "off")]) == 0
    env = json.loads((tmp_path / "off" / "report.json").read_text())["environment"]
    assert env["dtype"] == "float32" and "--invariant off leaves bfloat16 inexact" in env["dtype_reason"]


@pytest.mark.parametrize("program", ["eval", "bench"])
def test_eval_and_bench_refuse_a_prompt_past_the_context_in_the_same_words(tiny_folder, tmp_path, program, capsys):
    """The same --prompts file and --max-new-tokens reach decoding through one check in both programs: one line
    naming the prompt, exit 2 (bench crashed with a traceback)."""
    from dartree.decode.harness.bench import main as bench_main
    from dartree.decode.harness.eval import main as eval_main
    from dartree.models.chat import chat_prompt_ids
    from dartree.models.target import load_target

    target = _target_copy(tiny_folder, tmp_path, config={"max_position_embeddings": 128})
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"text": "Short."}) + "\n" + json.dumps({"text": "word " * 150}) + "\n")
    n = len(chat_prompt_ids(load_target(target).tokenizer, "word " * 150))
    args = ["--prompts", str(f), "--limit", "2", "--target", str(target), "--checkpoint", str(tiny_folder / "ckpt"),
            "--max-new-tokens", "8", "--threads", "1", "--out", str(tmp_path / "out")]
    code = eval_main([*args, "--tree", "chain", "--no-plots"]) if program == "eval" else \
        bench_main([*args, "--tree", "chain", "--budget", "2", "--reps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"error: prompt {f} sha256:") and err[-1].endswith(
        f":2 has {n} tokens; with max_new_tokens=8 the decode needs {n + 8} positions, over the target's context of "
        "128 (max_position_embeddings): shorten the prompt to at most 120 tokens")


def test_eval_and_bench_share_one_flag_declaration_with_their_own_defaults(capsys):
    """The flags both programs take come from one declaration (dartree.decode.harness.flags.add_decode_flags), each
    program keeping its defaults and forms (eval: one dtype, auto budgets, --invariant auto/on/off; bench: several
    dtypes, integer budgets, --invariant a switch); eval's EvalConfig is built once from its flags, never rewritten."""
    import dataclasses

    from dartree.decode.harness import bench, eval as ev
    from dartree.decode.harness.session import EvalConfig

    shared = ["tree", "budget", "dtype", "linear", "tune", "invariant", "limit", "max_new_tokens", "threads", "out"]
    e, b = vars(ev.parse_args([])), vars(bench.parse_args([]))
    assert [e[k] for k in shared] == [["pruned"], ["auto"], "auto", "auto", True, "auto", 20, 256, 0, "reports/latest"]
    assert [b[k] for k in shared] == [["chain", "pruned"], [2, 4, 8, 16], ["float32"], ["auto"], True, False, 1, 128,
                                      0, "reports/decode-bench.json"]
    assert all(e[k] == b[k] for k in ("checkpoint", "target", "datasets", "prompts"))
    assert ev.parse_args(["--invariant", "--budget", "auto", "3"]).invariant == "on"
    assert ev.parse_args(["--budget", "auto", "3"]).budget == ["auto", 3]
    assert bench.parse_args(["--invariant", "--dtype", "float32", "bfloat16"]).invariant is True
    for parse, argv, says in ((bench.parse_args, ["--budget", "auto"], "argument --budget: invalid int value: 'auto'"),
                              (bench.parse_args, ["--dtype", "auto"], "argument --dtype: invalid choice: 'auto'"),
                              (ev.parse_args, ["--linear", "aten", "onednn"], "unrecognized arguments: onednn")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert says in capsys.readouterr().err
    config = EvalConfig.from_args(ev.parse_args(["--width", "3", "--dtype", "bfloat16"]))
    assert config.builder_params["width"] == 3 and config.dtype == "bfloat16" and config.tune is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = "float32"

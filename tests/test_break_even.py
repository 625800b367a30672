"""The report's break-even tau (decode/harness/break_even.py) on hand-made figures: a round's cost in AR steps is
its stages' mean time over the AR time per token of the same run, and a method beats AR only above it."""

import pytest

from dartree.decode.harness.break_even import break_even, break_even_fields, break_even_sentence, needs_tau_cell
from dartree.decode.harness.report import aggregate, report_console, report_markdown
from dartree.decode.harness.report_rows import EvalReport, MethodSummary, PromptRow

STAGES_MS = {"draft": 2.0, "tree_build": 0.5, "tree_compile": 0.2, "verify": 14.4, "commit": 0.3}  # 17.4 ms a round


def test_a_round_that_costs_more_ar_steps_than_its_tau_cannot_beat_ar():
    """A 9-token verify at 14.4 ms against 10 ms per AR token is 1.44 AR steps; the whole round 17.4 ms is 1.74, so
    tau 1.65 falls short: 1.65 / 1.74 = 0.948x AR by these costs."""
    be = break_even(STAGES_MS, 10.0, 1.65, 9.0)
    assert be["round_ms"] == pytest.approx(17.4)
    assert be["round_ar_steps"] == pytest.approx(1.74) and be["break_even_tau"] == pytest.approx(1.74)
    assert be["verify_ar_steps"] == pytest.approx(1.44)
    assert be["stage_ar_steps"] == pytest.approx({"draft": 0.2, "tree_build": 0.05, "tree_compile": 0.02,
                                                  "verify": 1.44, "commit": 0.03})
    assert be["predicted_speedup"] == pytest.approx(1.65 / 1.74) and be["pays"] is False
    assert break_even_sentence(be, "measured: 0.97x AR paired") == (
        "a verify of 9 tokens (8 drafted + the root) costs 1.44 AR steps here, a whole round 1.74 (draft 0.20, "
        "build 0.05, compile 0.02, verify 1.44, commit 0.03), so it needs tau >= 1.74 to beat AR; it reached 1.65, "
        "short of it, so it cannot beat AR here: 0.95x AR by these costs (measured: 0.97x AR paired).")


def test_a_round_whose_tau_exceeds_its_cost_pays_and_a_mean_tree_says_on_average():
    be = break_even({"draft": 3.0, "verify": 9.0}, 6.0, 3.0, 5.27)  # 12 ms = 2 AR steps; tau 3 -> 1.5x
    assert be["break_even_tau"] == pytest.approx(2.0) and be["pays"] is True
    assert be["predicted_speedup"] == pytest.approx(1.5)
    text = break_even_sentence(be)
    assert text.startswith("a verify of 5.27 tokens (4.27 drafted + the root, on average) costs 1.50 AR steps here")
    assert text.endswith("it reached 3.00, above it, so it pays here: 1.50x AR by these costs.")
    plain = break_even({"draft": 0.1, "verify": 11.9}, 10.0, 1.0, 1.0)  # --budget auto chose plain steps throughout
    assert break_even_sentence(plain).startswith("a verify of 1 token (the root alone: no drafted node) costs 1.19 AR "
                                                 "steps here, a whole round 1.20 (draft 0.01, verify 1.19)")


@pytest.mark.parametrize("ar_ms,stages,word", [(0.0, STAGES_MS, "ar_ms_per_token must be a positive"),
                                               (float("nan"), STAGES_MS, "ar_ms_per_token must be a positive"),
                                               (10.0, {}, "stage_ms must map each stage"),
                                               (10.0, {"verify": -1.0}, r"\(bad: \['verify'\]\)")])
def test_bad_figures_are_one_line_naming_the_problem(ar_ms, stages, word):
    with pytest.raises(ValueError, match=word) as exc:
        break_even(stages, ar_ms, 1.5, 2.0)
    assert "\n" not in str(exc.value) and "pass the" in str(exc.value)


def _rows(paired: bool) -> tuple[list[PromptRow], list[PromptRow]]:
    """One prompt: AR took 0.1 s for 10 decoded tokens (10 ms each); the method 5 rounds committing 11 tokens
    (tau 2.2), its stages 0.1 s in all (20 ms a round = 2 AR steps); paired, its lockstep AR took 8 ms a token."""
    row = PromptRow(dataset="d", id=0, new_tokens=12, decode_s=0.105, accept_lengths=[2, 2, 2, 2, 3],
                    stage_s={"draft": 0.02, "tree_build": 0.005, "tree_compile": 0.005, "verify": 0.065,
                             "commit": 0.005},
                    tree_nodes=[4, 4, 4, 4, 4], budgets=[4] * 5, accepted_depths=[1, 1, 1, 1, 2], mismatch=False,
                    exact=True)
    if paired:
        row.paired_ar_decode_s, row.paired_ar_new_tokens = 0.088, 12  # 11 tokens after the first: 8 ms each
    return [row], [PromptRow(dataset="d", id=0, new_tokens=11, decode_s=0.1, accept_lengths=[1] * 10)]


@pytest.mark.parametrize("paired", [False, True], ids=["baseline", "paired"])
def test_the_report_aggregate_carries_the_break_even_tau_against_the_ar_it_was_timed_with(paired):
    """Without --paired the AR baseline's 10 ms a token prices a round at 20 / 10 = 2 AR steps (tau 2.2 pays);
    with --paired the lockstep AR's 8 ms prices it at 2.5 (tau 2.2 does not)."""
    rows, ar = _rows(paired)
    agg = aggregate(rows, ar)
    be = agg.break_even
    assert be["ar_basis"] == ("paired" if paired else "baseline")
    assert be["ar_ms_per_token"] == pytest.approx(8.0 if paired else 10.0)
    assert be["break_even_tau"] == pytest.approx(2.5 if paired else 2.0) and be["tau"] == pytest.approx(2.2)
    assert be["pays"] is (not paired)
    assert be["verify_tokens"] == pytest.approx(5.0)
    assert be["verify_ar_steps"] == pytest.approx(1.625 if paired else 1.3)
    measured = f"measured: {agg.paired_speedup:.2f}x AR paired" if paired else f"measured: {agg.speedup:.2f}x AR"
    assert be["explanation"].endswith(f"({measured}).")
    assert needs_tau_cell(agg) == ("2.50" if paired else "2.00")
    assert aggregate(ar, ar).break_even is None and needs_tau_cell(aggregate(ar, ar)) == ""  # AR itself has none
    empty = MethodSummary(tau=1.0, tokens_per_s=1.0, speedup=1.0, rounds=0, decode_tokens=0, prompts=0)
    assert break_even_fields([], ar, empty) is None  # an empty scope
    assert "break_even" not in aggregate(ar, ar).to_json() and agg.to_json()["break_even"] == be


def test_report_md_and_the_console_explain_each_row_and_an_older_report_still_renders():
    rows, ar = _rows(True)
    env = {"target": "t", "dtype": "float32", "linear": "aten", "device": "cpu", "checkpoint": "c", "temperature": 0.0,
           "max_new_tokens": 12, "budget": 4, "builder_params": {"k": 4, "width": 1, "beta": 0.0, "children": 2},
           "prompts_done": 1, "prompts_planned": 1, "interrupted": None, "stop_ids": [2],
           "sampling": {"rule": "greedy", "ignored": None}, "chat_template": "tokenizer", "chat_template_kwargs": {},
           "row_invariant": None, "paired": True, "ar_repeats": 1, "cost_models": {}}
    report = EvalReport(environment=env, methods={"ar": aggregate(ar, ar), "pruned@B4": aggregate(rows, ar)})
    md = report_markdown(report)
    assert "| method | tau | needs tau | tokens/s | speedup | paired x AR |" in md
    assert "| pruned@B4 | 2.200 | 2.50 |" in md
    assert "## what a round costs here, and the tau that pays for it" in md
    assert "time per token of the AR decode that ran in lockstep with each method (--paired)" in md
    assert ("- pruned@B4: a verify of 5 tokens (4 drafted + the root) costs 1.62 AR steps here, a whole round 2.50 "
            "(draft 0.50, build 0.12, compile 0.12, verify 1.62, commit 0.12), so it needs tau >= 2.50 to beat AR; it "
            "reached 2.20, short of it, so it cannot beat AR here: 0.88x AR by these costs") in md
    printed = [x for x in report_console(report) if isinstance(x, str)]
    assert printed[-1].startswith("pruned@B4: a verify of 5 tokens") and printed[-1] in md
    stored = report.to_json()
    del stored["methods"]["pruned@B4"]["break_even"]  # a report.json written before the figure was recorded
    old = report_markdown(EvalReport.from_json(stored))
    assert "what a round costs here" not in old and "| pruned@B4 | 2.200 |  |" in old

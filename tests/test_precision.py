"""The dtype ``auto`` picks by measurement (dartree.decode.precision, dartree.base.dtypes.dtype_candidates): the
rate formula, the choice and its reason, the held-out tau it scores with, and the interleaved timing."""

import pytest
import torch

import dartree.decode.budget as budget
from dartree.decode.budget import CostModel
from dartree.decode.precision import PRIOR_TAU, drafter_tau, mode_rate, pick_dtype, time_modes


def _cost(ar, draft, v9):
    return CostModel(t_ar=ar, t_draft=draft, verify_s={1: ar, 9: v9})


def test_mode_rate_is_the_faster_of_an_ar_step_and_a_drafted_round():
    c = _cost(0.050, 0.005, 0.060)
    assert c.verify_time(9) == pytest.approx(0.060)
    assert mode_rate(c, 1.5, 8) == pytest.approx(1.5 / 0.065)  # 23.1 tok/s beats AR's 20
    assert mode_rate(c, 1.2, 8) == pytest.approx(20.0)  # 18.5 tok/s drafted: the AR step wins
    assert mode_rate(c, None) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="budget >= 1, got 0"):
        mode_rate(c, 1.5, 0)
    with pytest.raises(ValueError, match="tau >= 1"):
        mode_rate(c, 0.5)


def test_pick_dtype_weighs_a_cheap_verify_against_a_cheap_ar_step():
    # the AMX Xeon's shape: bf16 (in the mode) has a slightly slower AR step than fp32 here, but a far cheaper verify
    costs = {torch.float32: _cost(0.045, 0.009, 0.086), torch.bfloat16: _cost(0.048, 0.004, 0.057)}
    choice = pick_dtype(costs, 1.54, "the checkpoint's held-out chain tau", excluded={"float16": "not tried"})
    assert choice.dtype == torch.bfloat16
    assert choice.rates["bfloat16"] == pytest.approx(1.54 / 0.061)
    assert choice.rates["float32"] == pytest.approx(max(1 / 0.045, 1.54 / 0.095))
    for part in ("bfloat16 decodes fastest", "bfloat16 25.2 tok/s", "float32 22.2 tok/s", "AR step 48.0 ms",
                 "9-token verify 57.0 ms", "at tau 1.54 (the checkpoint's held-out chain tau)",
                 "not a candidate: float16 (not tried)"):
        assert part in choice.reason, part
    only_ar = pick_dtype(costs, None)  # nothing drafts: the faster AR step decides
    assert only_ar.dtype == torch.float32 and "AR only" in only_ar.reason
    with pytest.raises(ValueError, match="at least one"):
        pick_dtype({}, 1.5)


def test_drafter_tau_reads_the_checkpoints_held_out_figure_or_says_it_assumed():
    assert drafter_tau({"provenance": {"holdout_chain_tau": 1.544}}) == (1.544, "the checkpoint's held-out chain tau")
    for config in (None, {}, {"provenance": {}}, {"provenance": {"holdout_chain_tau": 0.2}}):
        tau, why = drafter_tau(config)
        assert tau == PRIOR_TAU and why.startswith("assumed")


def test_time_modes_interleaves_the_candidates_and_keeps_each_figures_fastest(monkeypatch):
    calls = []
    figures = iter([(0.05, 0.006, 0.07), (0.04, 0.009, 0.09), (0.06, 0.004, 0.08), (0.03, 0.010, 0.10)])

    def fake_calibrate(target, drafter, ids, max_budget, reps):
        calls.append(target)
        ar, draft, v9 = next(figures)
        return CostModel(t_ar=ar, t_draft=draft, verify_s={1: ar, 9: v9}, max_budget=max_budget)

    monkeypatch.setattr(budget, "calibrate", fake_calibrate)
    costs = time_modes({"A": ("a", None), "B": ("b", None)}, [1, 2, 3], passes=2)
    assert calls == ["a", "b", "a", "b"]
    assert (costs["A"].t_ar, costs["A"].t_draft, costs["A"].verify_s[9]) == (0.05, 0.004, 0.07)
    assert (costs["B"].t_ar, costs["B"].t_draft, costs["B"].verify_s[9]) == (0.03, 0.009, 0.09)


def test_dtype_candidates_time_both_only_where_bf16_is_native(monkeypatch):
    import dartree.base.dtypes as dtypes

    assert dtypes.dtype_candidates("float32")[0] == ["float32"]
    assert dtypes.dtype_candidates("bfloat16")[0] == ["bfloat16"]
    assert dtypes.dtype_candidates("auto", "cuda")[0] == ["bfloat16"]
    monkeypatch.setattr(dtypes, "native_bf16", lambda: (True, "stub"))
    names, why = dtypes.dtype_candidates("auto")
    assert names == ["bfloat16", "float32"] and "timed at start-up" in why
    monkeypatch.setattr(dtypes, "native_bf16", lambda: (False, "stub"))
    names, why = dtypes.dtype_candidates("auto")
    assert names == ["float32"] and "no native bf16" in why
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtypes.dtype_candidates("fp8")

"""The decode dtype chosen by measurement: of the modes that decode exactly here, the one that decodes fastest.

A speculative round costs t_draft + t_verify(B + 1) and commits tau tokens on average; a plain AR step costs t_AR
and commits one. Which dtype makes that cheapest depends on the CPU, not on a capability flag: on an AVX-512-BF16
Zen 4 and an AMX Xeon a bf16 AR step was no faster than an fp32 one (0.98x and 0.93x of fp32 AR's speed), while a
bf16 9-token verify cost about one AR step against 1.5-1.8 in fp32 (docs/invariance.md, "The dtype auto takes"). So
``--dtype auto`` times each candidate that decodes exactly on this machine (float32; bfloat16 only with the
row-invariant mode, :mod:`dartree.models.invariant`, else its outputs split from AR at near-ties) with the
cost-model calibration (:func:`dartree.decode.budget.calibrate`: an AR step, verifies, a draft) and keeps the one
whose expected rate is higher:

    rate(dtype) = max(1 / t_AR, tau / (t_draft + t_verify(B + 1)))              tokens per second

with tau the drafter's held-out chain acceptance length when its checkpoint records one
(``provenance.holdout_chain_tau``), else :data:`PRIOR_TAU`, and B = :data:`SCORE_BUDGET` (the budget the
cost-model policy picks most often for the shipped drafters). The first term is the plain AR step the policy falls
back to where drafting loses (:mod:`dartree.decode.budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dartree.decode.budget import CostModel
from dartree.decode import budget as budget_lib

# Acceptance length assumed for a drafter whose checkpoint records no held-out figure (the shipped drafters' held-out
# chain tau is 1.4-1.7 on the default target, recorded in their provenance).
PRIOR_TAU = 1.5
# The tree size the score prices a drafted round at (B nodes, a verify of B + 1 tokens).
SCORE_BUDGET = 8


def drafter_tau(config: dict | None) -> tuple[float, str]:
    """The acceptance length to score with, and where it came from.

    Args:
        config: a dartree checkpoint config (:class:`~dartree.models.checkpoint.DraftModel` ``.config``) or None.
    Returns:
        (tau >= 1, ``"held-out chain tau of the checkpoint"`` or ``"assumed: no held-out tau recorded"``).
    """
    tau = ((config or {}).get("provenance") or {}).get("holdout_chain_tau")
    if isinstance(tau, (int, float)) and tau >= 1.0:
        return float(tau), "the checkpoint's held-out chain tau"
    return PRIOR_TAU, "assumed: the checkpoint records no held-out tau"


def mode_rate(cost: CostModel, tau: float | None, budget: int = SCORE_BUDGET) -> float:
    """Tokens per second a decode in this mode is expected to reach (module docstring).

    Args:
        cost: the mode's calibration (:func:`dartree.decode.budget.calibrate`): t_ar, t_draft, verify_time() in s.
        tau: acceptance length of a drafted round (tokens committed per verify), or None when only AR runs.
        budget: B, the tree nodes a drafted round verifies.
    Returns:
        max(1 / t_AR, tau / (t_draft + t_verify(B + 1))) in tokens/s.
    Raises:
        ValueError: budget < 1 or tau < 1.
    """
    if budget < 1:
        raise ValueError(f"mode_rate needs budget >= 1, got {budget}")
    ar = 1.0 / cost.t_ar
    if tau is None:
        return ar
    if tau < 1.0:
        raise ValueError(f"mode_rate needs tau >= 1 (tokens per round, bonus included), got {tau}")
    return max(ar, tau / (cost.t_draft + cost.verify_time(budget + 1)))


@dataclass
class DtypeChoice:
    """The dtype ``auto`` chose and the figures it chose by.

    Attributes:
        dtype: the chosen torch dtype.
        rates: {dtype name: expected tokens/s} per timed candidate (:func:`mode_rate`).
        tau: the acceptance length scored with; tau_source: where it came from (:func:`drafter_tau`).
        excluded: {dtype name: why it was not a candidate} (e.g. bf16 without a row-invariant path).
        reason: one line for the run's header and report.
    """

    dtype: torch.dtype
    rates: dict
    tau: float | None
    tau_source: str
    excluded: dict
    reason: str


def pick_dtype(costs: dict[torch.dtype, CostModel], tau: float | None, tau_source: str = "",
               excluded: dict | None = None, budget: int = SCORE_BUDGET) -> DtypeChoice:
    """The candidate with the highest :func:`mode_rate`, with a one-line reason naming every figure.

    Args:
        costs: {dtype: its calibration} for each candidate that decodes exactly here (at least one).
        tau: the acceptance length to score drafted rounds with (None: AR only). tau_source: where tau came from.
        excluded: {dtype name: reason} of dtypes that were not candidates (named in the reason).
        budget: B of the scored round.
    Returns:
        :class:`DtypeChoice`; ties go to the first candidate in ``costs``.
    Raises:
        ValueError: no candidate.
    """
    if not costs:
        raise ValueError("pick_dtype needs at least one timed candidate")
    excluded = dict(excluded or {})
    rates = {str(d).replace("torch.", ""): mode_rate(c, tau, budget) for d, c in costs.items()}
    best = max(costs, key=lambda d: rates[str(d).replace("torch.", "")])
    name = str(best).replace("torch.", "")

    def figures(d: torch.dtype) -> str:
        c = costs[d]
        return (f"{str(d).replace('torch.', '')} {rates[str(d).replace('torch.', '')]:.1f} tok/s (AR step "
                f"{1e3 * c.t_ar:.1f} ms, draft {1e3 * c.t_draft:.1f} ms, {budget + 1}-token verify "
                f"{1e3 * c.verify_time(budget + 1):.1f} ms)")

    scored = f"at tau {tau:.2f} ({tau_source}), budget {budget}" if tau is not None else "AR only"
    why = (f"auto: measured at start-up, {name} decodes fastest of the exact modes: "
           + "; ".join(figures(d) for d in costs) + f", {scored}")
    if excluded:
        why += "; not a candidate: " + "; ".join(f"{k} ({v})" for k, v in excluded.items())
    return DtypeChoice(dtype=best, rates=rates, tau=tau, tau_source=tau_source, excluded=excluded, reason=why)


def time_modes(candidates: dict, context_ids: list[int], *, passes: int = 2, reps: int = 3,
               budget: int = SCORE_BUDGET) -> dict:
    """Calibrate each candidate mode, interleaved, so that a drift of the machine's speed falls on all of them.

    Args:
        candidates: {dtype: (target, drafter)}, each ready to decode (linears packed, the row-invariant mode entered
            where it applies).
        context_ids: [T0 >= 2] token ids to time on (e.g. the first prompt).
        passes: calibrations per candidate, alternating between candidates (A B A B ...); each figure keeps its
            fastest pass, since other load only ever adds time.
        reps, budget: as :func:`dartree.decode.budget.calibrate` (``max_budget=budget``).
    Returns:
        {dtype: :class:`~dartree.decode.budget.CostModel`}.
    Raises:
        ValueError: fewer than 2 context tokens (:func:`~dartree.decode.budget.calibrate`).
    """
    best: dict = {}
    for _ in range(max(1, passes)):
        for d, (target, drafter) in candidates.items():
            c = budget_lib.calibrate(target, drafter, context_ids, max_budget=budget, reps=reps)
            old = best.get(d)
            if old is not None:
                c = CostModel(t_ar=min(c.t_ar, old.t_ar), t_draft=min(c.t_draft, old.t_draft),
                              verify_s={t: min(s, old.verify_s[t]) for t, s in c.verify_s.items()},
                              max_budget=c.max_budget)
            best[d] = c
    return best

"""The batch-aware auto budget: every row's tree sized for the batch's throughput (``budget="auto"`` of
:func:`dartree.decode.batched.batched_generate`).

A batched round runs one drafter forward over N rows and one verify forward over N rows padded to the shared width
W + 1 (the widest row's tree plus the root), so it costs

    t_round(N, W) = t_draft(1) x d(N) + N x t_build + t_verify(1, W + 1) x f(N, W + 1)

where t_draft(1), t_build and t_verify(1, T) are the batch-1 cost model's (:class:`~dartree.decode.budget.CostModel`:
calibrated, then followed online) and d(N), f(N, T) the ratios of forwards over N rows against one row, measured in
the decoding process (:class:`~dartree.decode.row_costs.RowCosts`). Since the rows are padded to W + 1, a row's nodes
up to W cost nothing more, and the round keeps min(W, M_i) of row i's best nodes (by ``score + beta * depth``,
prefix-closed: DARTree Lemma 1), W the width that maximises the batch's expected committed tokens per second:

    W* = argmax_W  sum_i (1 + A_i(min(W, M_i))) / t_round(N, W)

with A_i(b) the optimistic accepted drafts of row i's top-b sub-tree (:meth:`CostModel.outcome_gains`: what each
budget accepted in earlier rounds, shrunk towards the row's own calibrated node estimates; rounds with a grafted
lookup chain sum each row's calibrated estimates instead, the batch-1 "scores" rule). At N = 1 this is the batch-1
rule itself (the same arithmetic, the same exploration and probes). As N grows and f(N, T) grows with it (on a CPU
every row x token is arithmetic; on a GPU nearly free until the device fills), W* shrinks: fewer nodes, the few best
ones, which for a confident drafter is a chain; when even one node does not pay, W* = 0. Whether the batch drafts at
all is the batch-1 decision (:meth:`CostModel.should_draft`: an upper confidence bound of the drafted rounds'
committed tokens per row and AR step of their moment, against a plain AR step's one token per row) with every cost
counted at the batch's rows: a drafted round's cost in batched AR steps (seconds / t_verify(N, 1)), the recent costs,
timed AR steps and the curve's online scale kept per row count (:meth:`BatchCostModel.set_rows`), so the batch falls
back to plain batched AR steps when drafting stops paying, and probes now and then whether it pays again.

No public engine sizes trees per request against the batch's verify cost: SGLang verifies one width for every request
(its DDTree pull request pads to max(block size, budget + 1)); vLLM's EAGLE trees are static. This rule extends
DSpark's confidence-scheduled chain length (arXiv 2607.05147, Algorithm 1) and DARTree's budget (arXiv 2608.13524,
conclusion, left there as future work) to a batch. docs/budget.md, "A batch", gives the derivation and the tests.

Shapes and units: N rows, M_i row i's tree nodes, W shared tree width (nodes, root excluded); seconds; tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dartree.decode.budget import CostModel, calibrate, prune_to
from dartree.decode.cost_acceptance import OUTCOME_EXPLORE
from dartree.decode.cost_timing import OUTLIER_CLIP
from dartree.decode.generate import SEED_TOKENS, seed_policy, warm_paths
from dartree.decode.row_costs import RowCosts, batch_rows
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree


# What a BatchCostModel keeps per row count (set_rows): the drafted rounds' recent costs and the modelled cost padding
# them, the timed 1-token forwards, the verify curve's online scale, the timed drafts' error against the row table
ROW_STATE = ("costs", "_modelled_steps", "ar_n", "ar_s", "ar_u", "speed", "draft_corr")
# EMA weight of a timed drafter forward over N rows in draft_corr: drafted rounds are rare at N > 1 (a probe every 16+
# plain rounds), so each one counts more than a verify does in the curve's scale (SPEED_EMA)
DRAFT_CORR_EMA = 0.3


@dataclass
class BatchCostModel(CostModel):
    """A :class:`~dartree.decode.budget.CostModel` whose costs depend on the rows of the forward too.

    With :attr:`rows` = 1 every method is the batch-1 model's (the ratios are exactly 1). With N rows,
    :meth:`verify_time` (T) is t_verify(N, T) (the batch-1 curve times :meth:`RowCosts.factor`), the overhead of a
    drafted round is t_draft x d(N) + N x t_build, the timings it observes are brought back to one row before they
    update the batch-1 figures, and a round's cost in AR steps is counted in batched AR steps of N rows. Every row's
    verified tree teaches the shared acceptance calibration and outcomes (:meth:`record_rows`).

    Attributes (besides the base class's):
        row_costs: the measured ratios of N rows to one (shared with other models of the same decoder).
        rows: N, the rows of the batch now (:meth:`set_rows`).
        draft_corr: timed / modelled seconds of a drafter forward over N rows (t_draft x d(N)), followed online per
            row count (:meth:`observe_draft`); 1.0 at one row and before any N-row draft was timed.
        chosen_rows: {N: {W: rounds}}, the widths chosen per row count, for reports.
        rounds_rows: {N: [drafted rounds, plain rounds, drafted tokens per row summed, drafted costs summed]}.
    """

    row_costs: RowCosts = field(default_factory=RowCosts)
    rows: int = 1
    draft_corr: float = 1.0
    _time_ar: bool = field(default=False, repr=False, compare=False)
    chosen_rows: dict = field(default_factory=dict)
    rounds_rows: dict = field(default_factory=dict)
    _windows: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_model(cls, model: CostModel, row_costs: RowCosts) -> "BatchCostModel":
        """A batch model starting from everything ``model`` holds (its calibration, a seeded prior; copied, so the
        two learn apart) with the row table ``row_costs`` (shared, not copied: rows measured later reach it)."""
        state = {f.name: copy.deepcopy(getattr(model, f.name)) for f in dataclasses.fields(CostModel)}
        return cls(**state, row_costs=row_costs)

    def fresh(self) -> "BatchCostModel":
        """As :meth:`CostModel.fresh`, with the same row table and one row."""
        return BatchCostModel.from_model(super().fresh(), self.row_costs)

    def verify_time(self, tokens: int) -> float:
        """t_verify(N, T) in seconds: the batch-1 curve (:meth:`CostModel.verify_time`) times
        :meth:`RowCosts.factor` (N, T) for the N = :attr:`rows` of the batch now."""
        base = super().verify_time(tokens)
        return base if self.rows == 1 else base * self.row_costs.factor(self.rows, tokens)

    def round_overhead(self) -> float:
        """t_draft x d(N) x :attr:`draft_corr` + N x t_build: one drafter forward over N rows (as the row table
        says, corrected by the timed N-row drafts), then N trees built one after another."""
        if self.rows == 1:
            return super().round_overhead()
        return self.t_draft * self.row_costs.draft_factor(self.rows) * self.draft_corr + self.t_build * self.rows

    def sd_prior(self) -> float:
        """:data:`~dartree.decode.cost_decision.SD_PRIOR` / sqrt(N): a batch round's committed tokens
        (:meth:`record_rows`) are the mean over its N rows, whose spread shrinks as 1 / sqrt(N) for rows that
        accept independently; so the drafted rounds' upper confidence bound (:meth:`CostModel.draft_bound`) is as
        wide as N times the row-rounds make it, and a batch where drafting does not pay re-tries it less often than
        one row would."""
        return super().sd_prior() / self.rows ** 0.5

    def should_draft(self) -> bool:
        """:meth:`CostModel.should_draft` at N rows, except that the first round at a row count new to the model
        (:meth:`set_rows`; N > 1, outside a calibration pass) is a plain batched step: the alternative every drafted
        round is weighed against is then timed at this row count before any decision, not taken from the row
        table's f(N, 1), its least certain figure (1.3-1.4x at 8 rows against 2.2x for whole batched AR steps on an
        AVX-512-BF16 Xeon, docs/performance.md)."""
        if self._time_ar and self._force <= 0:
            self._time_ar = False
            self.skipped += 1
            self.since_anchor = 0
            return False
        return super().should_draft()

    def probe_gap(self, alternative: float = 1.0) -> int:
        """N x the batch-1 gap (:meth:`CostModel.probe_gap` with the costs of N rows): a probe over N rows measures N
        rows' acceptance at once, so probing N times less often gathers as many row-rounds of evidence per round
        as one row's probes do, at 1/N of the tokens lost (where drafting does not pay at N rows, as on a CPU, the
        forced probes are what a batch loses against batched AR)."""
        return super().probe_gap(alternative) * self.rows

    def observe_draft(self, seconds: float) -> None:
        """A timed drafter forward: at one row it updates ``t_draft`` (:meth:`CostModel.observe_draft`); over N > 1
        rows its ratio to the modelled t_draft x d(N) updates :attr:`draft_corr` (EMA, weight
        :data:`DRAFT_CORR_EMA`; the ratio winsorised at :data:`~dartree.decode.cost_timing.OUTLIER_CLIP` against the
        correction so far), so a row table that times N rows too cheap (or too dear) stops steering the draft
        decision after a few drafted rounds, and the one-row ``t_draft`` keeps the one-row figure."""
        if self.rows == 1:
            super().observe_draft(seconds)
            return
        modelled = self.t_draft * self.row_costs.draft_factor(self.rows)
        if seconds > 0 and modelled > 0:
            ratio = min(max(seconds / modelled, self.draft_corr / OUTLIER_CLIP), self.draft_corr * OUTLIER_CLIP)
            self.draft_corr += DRAFT_CORR_EMA * (ratio - self.draft_corr)

    def observe_build(self, seconds: float) -> None:
        """The batch's build stage (N trees), as one tree's build (/ N) before it updates ``t_build``."""
        super().observe_build(seconds if self.rows == 1 else seconds / self.rows)

    def _learn_shape(self, tokens: int, seconds: float) -> None:
        """The curve's shape is learnt from one-row verifies only (the row table owns the shape in N)."""
        if self.rows == 1:
            super()._learn_shape(tokens, seconds)
        else:
            self._last_verify = None

    def modelled_cost(self, rows: int, nodes: int) -> float:
        """The modelled cost, in batched AR steps of ``rows`` rows, of a drafted round of that many rows verifying
        ``nodes`` nodes per row: t_round(N, b) / t_verify(N, 1)."""
        keep, self.rows = self.rows, int(rows)
        try:
            return (self.round_overhead() + self.verify_time(nodes + 1)) / self.verify_time(1)
        finally:
            self.rows = keep

    def set_rows(self, rows: int) -> None:
        """The batch now has ``rows`` rows (it changes as rows finish and the queue runs dry).

        What the model measures of whole rounds is kept per row count (:data:`ROW_STATE`): the drafted rounds' recent
        costs (:attr:`costs`, in batched AR steps of that row count), the timed 1-token forwards (``ar_*``), the
        online scale of the verify curve (:attr:`speed`, so an error of the row table at one row count is absorbed
        there and not carried to the others) and the draft's correction (:attr:`draft_corr`). A row count seen
        before gets its own back; a new one starts from the present costs scaled by the modelled cost ratio of the
        two row counts at the budget chosen most (the realised-to-modelled error carried over), no timed AR step,
        the present scale and the present draft correction, and takes its first round as a plain step
        (:meth:`should_draft`). The next verify does not pair with
        the last one (:meth:`mark_gap`).

        Raises:
            ValueError: ``rows`` < 1.
        """
        rows = int(rows)
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1 (rows of the batch)")
        if rows == self.rows:
            return
        self._windows[self.rows] = {k: getattr(self, k) for k in ROW_STATE}
        if rows in self._windows:
            for k, v in self._windows.pop(rows).items():
                setattr(self, k, v)
        else:
            hist = {**((self.prior or {}).get("budgets") or {}), **self.chosen}
            b = max((k for k in hist if int(k) > 0), key=lambda k: hist[k], default=1)
            ratio = self.modelled_cost(rows, int(b)) / self.modelled_cost(self.rows, int(b))
            self.costs = [c * ratio for c in self.costs]
            self._modelled_steps = self.modelled_cost(rows, int(b))
            self.ar_n = self.ar_s = self.ar_u = 0.0
            self._time_ar = rows > 1
        self.rows = rows
        self.mark_gap()

    def choose_rows(self, trees: Sequence[Tree], beta: float = 0.0, chain_pos: Sequence | None = None,
                    drafted: bool = True) -> tuple[int, float]:
        """The shared width W* of a batch's built trees (row i keeps its min(W*, M_i) best nodes by
        ``score + beta * depth``); :meth:`CostModel.choose` for N rows (the module docstring's rule).

        Args:
            trees: N trees, each built with ``max_budget`` nodes (M_i may be 0: that row verifies its root alone).
            beta: the builder's depth bonus (<= 0). drafted: as :meth:`CostModel.choose`.
            chain_pos: N lookup chain positions ([M_i] int64, 0 for a drafter node) or None each; None: no chains.
        Returns:
            (W*, the expected committed tokens per row of that width); W* >= 1 in a probe.
        Raises:
            ValueError: ``chain_pos`` not one per tree, or no tree.
        """
        n = len(trees)
        chain_pos = [None] * n if chain_pos is None else list(chain_pos)
        if n == 0 or len(chain_pos) != n:
            raise ValueError(f"choose_rows: {n} trees and {len(chain_pos)} chain positions; give one per row (>= 1)")
        m = max(t.size for t in trees)
        probe, self._probe = drafted and self._probe, False
        lo = int(probe and m > 0)
        self._beta = beta
        if m == 0:
            self._expect(drafted, 0, probe)
            return 0, 1.0
        ests = []
        for tree, cp in zip(trees, chain_pos):
            if not tree.size:
                ests.append(torch.zeros(0))
                continue
            adj = tree.score.float() + beta * tree.depth.float()
            order = torch.sort(adj, descending=True, stable=True).indices
            p = torch.exp(tree.score.float()[order]).clamp(max=1.0)
            est = self.calibrated(p)
            ests.append(est if cp is None else torch.where(cp[order] > 0, p, est))
        if drafted and all(cp is None for cp in chain_pos) and self.rule == "outcomes":
            best_b, best_exp = self._rows_by_outcomes([e.tolist() for e in ests], lo)
        else:
            best_b, best_exp = _width_by_scores(self.verify_time, ests, lo)
        self._expect(drafted, best_b, probe)
        return best_b, best_exp

    def _rows_by_outcomes(self, ests: list[list[float]], lo: int) -> tuple[int, float]:
        """Rule ``"outcomes"`` over N rows: the W maximising sum_i (1 + A_i(min(W, M_i))) / (overhead + t_verify(W
        + 1)), with the batch-1 rule's exploration (every
        :data:`~dartree.decode.cost_acceptance.OUTCOME_EXPLORE`-th call twice the width). Returns (W, expected
        tokens per row)."""
        n = len(ests)
        top = max(min(len(e), self.max_budget) for e in ests)
        self._explore += 1
        sunk = self.round_overhead()
        gains = [self.outcome_gains(e) for e in ests]
        best_b, best_rate = 0, (n / (sunk + self.verify_time(1)) if lo == 0 else -1.0)
        for b in range(1, top + 1):
            rate = sum(1.0 + g[min(b, len(g) - 1)] for g in gains) / (sunk + self.verify_time(b + 1))
            if rate > best_rate:
                best_b, best_rate = b, rate
        if self._explore >= OUTCOME_EXPLORE and best_b < top:
            self._explore = 0
            best_b = min(top, max(2 * best_b, best_b + 1))
        return best_b, sum(1.0 + g[min(best_b, len(g) - 1)] for g in gains) / n

    def record_rows(self, trees: Sequence[Tree], accepted: Sequence[torch.Tensor], chain_pos: Sequence | None = None,
                    ngrams: Sequence[int] | None = None, seconds: float | None = None) -> None:
        """Account one verified batch round (:meth:`CostModel.record` for N rows): the width in the histograms, the
        round's committed tokens per row and its seconds in the drafted (or undrafted) rounds' statistics, and
        each row's tree in the acceptance calibration and outcomes (:meth:`CostModel.learn`).

        Args:
            trees: the N verified trees. accepted: N [A_i] int64 accepted node indices, root (0) first.
            chain_pos, ngrams: per row, as :meth:`CostModel.record` (None: no lookup).
            seconds: the round's wall time, draft to commit (None: modelled).
        Raises:
            ValueError: lists of different lengths.
        """
        n = len(trees)
        chain_pos = [None] * n if chain_pos is None else list(chain_pos)
        ngrams = [0] * n if ngrams is None else list(ngrams)
        if not (len(accepted) == len(chain_pos) == len(ngrams) == n) or n == 0:
            raise ValueError(f"record_rows: {n} trees, {len(accepted)} accepted paths, {len(chain_pos)} chain "
                             f"positions and {len(ngrams)} n-grams; give one of each per row")
        w = max(t.size for t in trees)
        self.chosen[w] = self.chosen.get(w, 0) + 1
        per = self.chosen_rows.setdefault(self.rows, {})
        per[w] = per.get(w, 0) + 1
        drafted = self._pending is not None and self._pending[0]
        tokens = sum(int(a.numel()) for a in accepted) / n
        self._observe_round(tokens, seconds)
        _log_round(self.rounds_rows, self.rows, drafted, tokens, self.costs[-1] if drafted else 0.0)
        for tree, acc, cp, ng in zip(trees, accepted, chain_pos, ngrams):
            self.learn(tree, acc, cp, ng, drafted)

    def summary(self) -> dict:
        """:meth:`CostModel.summary` with the row table, and per row count the widths chosen, the draft correction
        and the rounds drafted and plain (:func:`_rounds_summary`)."""
        corr = {**{n: w["draft_corr"] for n, w in self._windows.items() if n > 1},
                **({self.rows: self.draft_corr} if self.rows > 1 else {})}
        return {**super().summary(), "rows_now": self.rows, "row_costs": self.row_costs.summary(),
                "draft_corr_by_rows": {int(n): c for n, c in sorted(corr.items())},
                "chosen_by_rows": {int(n): {int(w): c for w, c in sorted(h.items())}
                                   for n, h in sorted(self.chosen_rows.items())},
                "rounds_by_rows": _rounds_summary(self.rounds_rows)}


def _log_round(log: dict, rows: int, drafted: bool, tokens: float, cost: float) -> None:
    """Add a round of ``rows`` rows to ``log`` ({N: [drafted rounds, plain rounds, the drafted rounds' committed tokens
    per row summed, their costs in batched AR steps summed]}): what the policy decided per row count and what it got."""
    entry = log.setdefault(rows, [0, 0, 0.0, 0.0])
    entry[0 if drafted else 1] += 1
    if drafted:
        entry[2] += tokens
        entry[3] += cost


def _rounds_summary(log: dict) -> dict:
    """:func:`_log_round`'s log for reports: per row count the rounds drafted and plain, the drafted rounds' mean
    committed tokens per row and mean cost in batched AR steps (a plain step: 1 token per row for 1 step)."""
    return {int(n): {"drafted": d, "plain": p, "drafted_tokens_per_row": t / d if d else None,
                     "drafted_ar_steps": c / d if d else None} for n, (d, p, t, c) in sorted(log.items())}


def _width_by_scores(verify_time: Callable[[int], float], ests: list[torch.Tensor], lo: int) -> tuple[int, float]:
    """Rule ``"scores"`` over N rows (lookup chains, or ``rule="scores"``): the W maximising sum_i (1 + the
    calibrated estimates of row i's min(W, M_i) best nodes) / t_verify(W + 1) (draft and build already paid), W at
    least ``lo`` (``verify_time``: T tokens per row -> seconds at the batch's rows). Returns (W, expected tokens per
    row)."""
    n = len(ests)
    gains = [torch.cumsum(e, 0).tolist() for e in ests]
    best_b, best_rate, best_exp = 0, n / verify_time(1), float(n)
    for b in range(1, max(len(g) for g in gains) + 1):
        exp_tok = sum(1.0 + (float(g[min(b, len(g)) - 1]) if g else 0.0) for g in gains)
        rate = exp_tok / verify_time(b + 1)
        if rate > best_rate or b == lo:
            best_b, best_rate, best_exp = b, rate, exp_tok
    return best_b, best_exp / n


class _AutoRow:
    """A row's own part of the batch's auto budget: it drafts ``nodes`` = B_max and shares the model's lookup
    statistics; the batch policy learns from its rounds (:meth:`AutoRowBudgets.observe`), so :meth:`observe` does
    nothing."""

    def __init__(self, model: BatchCostModel):
        self.nodes, self.lookup_stats = model.max_budget, model.lookup

    def recorded_budget(self, tree: Tree) -> int:
        """The round's budget for ``DecodeStats.budgets``: the nodes the row kept (0: its root alone)."""
        return tree.size

    def observe(self, *args, **kwargs) -> None:
        """Nothing: the batch policy learns from the round."""


class AutoRowBudgets:
    """``budget="auto"`` for a batch: the :class:`BatchCostModel` decides per round whether the batch drafts
    (:meth:`drafts`), the width every row's tree is cut to (:meth:`choose`) and learns from the round
    (:meth:`observe`). It replaces :class:`~dartree.decode.batched.RowBudgets` through the same calls.

    Args:
        model: the calibrated, seeded batch model (updated in place; shared across decodes).
        beta: the builder's depth bonus (<= 0; 0.0 for a builder that does not rank by it).
        clock: the loop's clock (seconds), read once after the build to time it.
    Raises:
        TypeError: ``model`` is not a :class:`BatchCostModel` (a batch-1 model cannot time N rows), with the fix.
    """

    def __init__(self, model: BatchCostModel, beta: float, clock: Callable[[], float]):
        if not isinstance(model, BatchCostModel):
            raise TypeError(f"cost_model is a {type(model).__name__}; a batch needs a BatchCostModel "
                            "(BatchCostModel.from_model(model, RowCosts()) or batch_policy(...))")
        self.model, self.beta, self.clock = model, beta, clock
        model.mark_gap()

    def new_row(self) -> _AutoRow:
        """The part of a request entering the batch."""
        return _AutoRow(self.model)

    def drafts(self, rows: int) -> bool:
        """Whether this round of ``rows`` rows runs the drafter (False: a plain batched AR step, or lookup chains
        alone): :meth:`CostModel.should_draft` at that row count."""
        self.model.set_rows(rows)
        return self.model.should_draft()

    def choose(self, policies: Sequence, trees: list[Tree], chain_pos: list, build_started: float,
               drafted: bool = True) -> tuple[list[Tree], list]:
        """Every row's tree cut to the width :meth:`BatchCostModel.choose_rows` picks (a drafted round first reports
        the build's time, the clock now minus ``build_started``); an undrafted round without chains verifies the
        roots alone. Returns (trees, chain positions)."""
        cm = self.model
        if drafted:
            cm.observe_build(self.clock() - build_started)
        elif all(c is None for c in chain_pos):
            return trees, chain_pos
        beta = self.beta if drafted else 0.0
        w, _ = cm.choose_rows(trees, beta, chain_pos, drafted)
        out = [prune_to(t, w, beta, c) if c is not None else (prune_to(t, w, beta), None)
               for t, c in zip(trees, chain_pos)]
        return [t for t, _ in out], [c for _, c in out]

    def observe(self, trees: list[Tree], vers: list, chain_pos: list, ngrams: list, drafted: bool, *,
                draft_s: float, verify_s: float, round_s: float) -> None:
        """The timed stages (verify of N rows at the shared width, the draft when one ran) into the model's speed,
        then the round's outcome (:meth:`BatchCostModel.record_rows`)."""
        cm = self.model
        cm.observe_verify(max(t.size for t in trees) + 1, verify_s)
        if drafted:
            cm.observe_draft(draft_s)
        cm.record_rows(trees, [v.accepted for v in vers], chain_pos, ngrams, seconds=round_s)


def batch_policy(target, drafter, head, prompts: Sequence[Sequence[int]], settings: DecodeSettings, *,
                 rows: int) -> BatchCostModel:
    """The cost model of a batched ``budget="auto"`` call given none, built the way the batch-1 one is
    (:func:`dartree.decode.generate.speculative_generate` without ``cost_model``): the batch-1 curve calibrated
    (:func:`~dartree.decode.budget.calibrate`) and the row table measured (:meth:`RowCosts.measure` at
    :func:`~dartree.decode.row_costs.batch_rows` (``rows``)) on the longest prompt, every path of the setting warmed
    and the policy seeded by a pass over that prompt's first tokens (:func:`~dartree.decode.generate.seed_policy`).

    Args:
        prompts: the N prompts' ids. rows: the rows decoded together.
        settings: the call's :class:`~dartree.decode.settings.DecodeSettings` (its ``max_new_tokens`` one int, the
            longest cap). Others as ``batched_generate``.
    Returns:
        A seeded :class:`BatchCostModel`.
    Raises:
        ValueError / TypeError: a setting :func:`~dartree.decode.generate.speculative_generate` refuses (from the
            warm-up or the seeding pass).
    """
    ids = max(prompts, key=len)
    ids = (list(ids) * 4)[: max(4, len(ids))]  # calibration needs a few context tokens; their values do not matter
    cm = BatchCostModel.from_model(calibrate(target, drafter, ids), RowCosts())
    cm.row_costs.measure(target, drafter, ids, batch_rows(rows), max_budget=cm.max_budget)
    warm_paths(target, drafter, head, ids, [settings.with_(budget="auto")], max_budget=cm.max_budget)
    seed_policy(cm, target, drafter, head, ids, settings, new_tokens=min(SEED_TOKENS, max(8, settings.max_new_tokens)),
                source="the longest prompt")
    return cm


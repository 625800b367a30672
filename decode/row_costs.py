"""What a verify and a draft cost with N rows in the forward: the row table of the batch-aware auto budget.

A batched verify (:func:`dartree.decode.batch_rounds.verify_batch`) runs one target forward over N rows padded to a
shared width T (root + the widest row's tree), so its time is a function of both: t_verify(N, T). On a GPU adding
rows is nearly free until the arithmetic fills the device; on a CPU every row x token shows. The budget
(:class:`dartree.decode.batch_budget.BatchCostModel`) needs the curve's shape in N, and takes it from this table:
for each row count N it holds the ratio t_verify(N, T) / t_verify(1, T) at the calibrated sizes T and the ratio of a
drafter forward over N rows to one over a single row, both measured in the decoding process with the same forwards
the batch runs (N copies of a context's cache, N chain trees of T - 1 nodes; N drafter blocks over a cached context).
Each row count is measured interleaved with N = 1 in the same passes, every N-row forward right after its one-row
twin, and a ratio is the median over ``reps`` passes of the paired ratios (the VM's speed drifts between passes but
hardly between two adjacent forwards; the least disturbed forward of each size alone, as the batch-1 curve is timed,
let one lucky one-row draft halve a draft ratio: 2.9x held against 5.6x timed alone at 8 rows). So the ratios do not
depend on when they were measured, and a table can grow by row counts as batches of new sizes come
(:meth:`RowCosts.measure`, cached per row count by the decoder that owns it). What the table still misses (a drafter
forward over rows of different context lengths, say) the batch model corrects online from the timed batched drafts
(:class:`~dartree.decode.batch_budget.BatchCostModel`).

Between calibrated sizes the ratios are interpolated linearly (in T, then in N); past the largest N they are
extrapolated linearly in N from the last two (never below the last one), past the largest T held at the last T's.

Shapes and units: N rows (>= 1), T verify tokens per row (root included, >= 1); seconds; ratios are unitless.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dartree.decode.batch_rounds import compile_batch, draft_blocks
from dartree.decode.budget import CALIBRATION_SIZES
from dartree.decode.trees import Tree
from dartree.models.batch_cache import BatchKV, RowDraftCache


def _interp(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise-linear interpolation of sorted (x, y) ``points`` at ``x``; held at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


@dataclass
class RowCosts:
    """Measured cost ratios of forwards over N rows against one row.

    Attributes:
        verify: {N: {T: t_verify(N, T) / t_verify(1, T)}}, N >= 2 and T ascending; at least 1 and made
            non-decreasing in T and in N (more rows never cost less, and the more so the more tokens each row
            verifies: one row's forward is bound by reading the weights, N rows' by the arithmetic), whatever the
            noise of a measurement says; so t_verify(N, T) is non-decreasing in T as the one-row curve is.
        draft: {N: t_draft(N) / t_draft(1)} for the same N, the same way.
        seconds: {N: {"verify": {T: seconds}, "draft": seconds, "one_row": the same of the one-row twins}}, medians
            as measured, for reports.
    """

    verify: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    @property
    def rows(self) -> list[int]:
        """The row counts measured (1 is implicit: its ratios are 1)."""
        return sorted(self.verify)

    def factor(self, rows: int, tokens: int) -> float:
        """t_verify(``rows``, ``tokens``) / t_verify(1, ``tokens``): 1.0 exactly for one row (or an empty table),
        interpolated between measured row counts and sizes, extrapolated linearly past the largest row count.

        Raises:
            ValueError: ``rows`` < 1.
        """
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1 (rows in the verify forward)")
        if rows == 1 or not self.verify:
            return 1.0
        pts = [(1, 1.0)] + [(n, _interp(sorted(self.verify[n].items()), tokens)) for n in self.rows]
        return self._in_rows(pts, rows)

    def draft_factor(self, rows: int) -> float:
        """t_draft(``rows``) / t_draft(1), as :meth:`factor` (1.0 for one row or an empty table).

        Raises:
            ValueError: ``rows`` < 1.
        """
        if rows < 1:
            raise ValueError(f"rows={rows} must be >= 1 (rows in the drafter forward)")
        if rows == 1 or not self.draft:
            return 1.0
        return self._in_rows([(1, 1.0)] + [(n, self.draft[n]) for n in self.rows], rows)

    @staticmethod
    def _in_rows(pts: list[tuple[int, float]], rows: int) -> float:
        """Interpolate (N, ratio) points at ``rows``; past the last N, the line through the last two (at least the
        last ratio)."""
        if rows <= pts[-1][0]:
            return _interp(pts, rows)
        (n0, r0), (n1, r1) = pts[-2], pts[-1]
        return max(r1, r1 + (r1 - r0) * (rows - n1) / (n1 - n0))

    def missing(self, rows: Sequence[int]) -> list[int]:
        """The row counts of ``rows`` above 1 not measured yet, ascending."""
        return sorted({int(n) for n in rows if int(n) > 1} - set(self.verify))

    @torch.inference_mode()
    def measure(self, target, drafter, context_ids: Sequence[int], rows: Sequence[int], *, max_budget: int = 16,
                reps: int = 5) -> list[int]:
        """Measure the row counts of ``rows`` not in the table yet (:meth:`missing`) on ``context_ids`` and add them.

        For every pass (pass 0 warms up), every row count N (1 first) and every size T of
        :data:`~dartree.decode.budget.CALIBRATION_SIZES` and ``max_budget + 1``: one verify forward of N rows (each
        the context's cache, a chain of T - 1 nodes compiled by :func:`~dartree.decode.batch_rounds.compile_batch`;
        the cache rolled back after it), then one drafter forward of N blocks over a cached context
        (:func:`~dartree.decode.batch_rounds.draft_blocks`, two new context positions per row), each N-row forward
        right after the same forward over one row. A ratio is the median over the ``reps`` timed passes of the
        N-row forward's time over its one-row twin's.

        Args:
            target: the :class:`~dartree.models.target.Target` (its capture layers the drafter's).
            drafter: the :class:`~dartree.models.drafter.DFlashDrafter`.
            context_ids: [T0] committed token ids (T0 >= 4), e.g. the calibration prompt.
            rows: the row counts the batches will run at (e.g. (2, 4, 8)); 1 and those measured already are skipped.
            max_budget: B_max, the largest tree per row the policy considers.
            reps: timed forwards per size (>= 1).
        Returns:
            The row counts measured by this call (empty when none was missing).
        Raises:
            ValueError: fewer than 4 context tokens, ``max_budget`` or ``reps`` below 1, a row count below 1.
        """
        ids = [int(t) for t in context_ids]
        if len(ids) < 4:
            raise ValueError(f"RowCosts.measure needs at least 4 context tokens, got {len(ids)}")
        if max_budget < 1 or reps < 1:
            raise ValueError(f"max_budget={max_budget} and reps={reps} must both be >= 1")
        if any(int(n) < 1 for n in rows):
            raise ValueError(f"rows={list(rows)}: every row count must be >= 1")
        new = self.missing(rows)
        if not new:
            return []
        ratios, secs = _time_rows(target, drafter, ids, new, sorted(set(CALIBRATION_SIZES) | {max_budget + 1}), reps)
        for n in new:  # more rows never cost less than one, and the more so the longer the verify: ratios at least
            running = 1.0  # 1 and non-decreasing in T (noise can say otherwise), so t(N, T) stays non-decreasing in T
            self.verify[n] = {}
            for t in sorted(ratios[n]["verify"]):
                running = self.verify[n][t] = max(running, ratios[n]["verify"][t])
            self.draft[n] = max(1.0, ratios[n]["draft"])
            self.seconds[n] = secs[n]
        prev = None
        for n in self.rows:  # more rows never cost less: running max in N at every size
            if prev is not None:
                self.verify[n] = {t: max(v, _interp(sorted(self.verify[prev].items()), t))
                                  for t, v in self.verify[n].items()}
                self.draft[n] = max(self.draft[n], self.draft[prev])
            prev = n
        return new

    def summary(self) -> dict:
        """JSON-ready: per measured row count, the verify ratios by size, the draft ratio and the seconds."""
        return {int(n): {"verify_ratio": {int(t): r for t, r in sorted(self.verify[n].items())},
                         "draft_ratio": self.draft[n], "seconds": self.seconds.get(n)} for n in self.rows}


@torch.inference_mode()
def _time_rows(target, drafter, ids: list, counts: list, sizes: list, reps: int) -> tuple[dict, dict]:
    """The timing passes of :meth:`RowCosts.measure` for the row counts ``counts`` (each > 1) at the verify sizes
    ``sizes``: after a warm-up pass, ``reps`` passes in which every N-row forward (a verify at every size, then a
    drafter forward) runs right after its one-row twin. Returns ({N: {"verify": {T: median paired ratio}, "draft":
    median paired ratio}}, {N: {"verify": {T: median seconds}, "draft": median seconds, "one_row": the same of the
    one-row twins}} for reports)."""
    cache, start = target.new_cache(), len(ids) - 1
    feats = target.forward(torch.tensor([ids[:-1]], device=target.device), cache=cache).features[0]
    kvs = {}
    for n in [1] + list(counts):
        kvs[n] = BatchKV(target)
        for _ in range(n):
            kvs[n].add_row(cache)
    trees = {t: Tree(torch.full((t - 1,), ids[-1], dtype=torch.long), torch.arange(t - 1, dtype=torch.long),
                     torch.arange(1, t, dtype=torch.long), torch.zeros(t - 1)) for t in sizes}

    def verify(n: int, t: int) -> float:
        kv = kvs[n]
        t0 = time.perf_counter()
        inp = compile_batch([trees[t]] * n, [ids[-1]] * n, kv.lens, kv.width, target.dtype, target.device)
        target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask, cache=kv.cache)
        elapsed = time.perf_counter() - t0
        kv.truncate([start] * n)
        return elapsed

    def draft(n: int) -> float:
        dc = RowDraftCache(len(drafter.layers))
        for _ in range(n):
            dc.add_row()
        draft_blocks(target, drafter, [ids[-1]] * n, [start - 2] * n, [feats[: start - 2]] * n, dc)
        t0 = time.perf_counter()
        draft_blocks(target, drafter, [ids[-1]] * n, [start] * n, [feats[start - 2: start]] * n, dc)
        return time.perf_counter() - t0

    times: dict = {n: {"verify": {t: [] for t in sizes}, "draft": [], "one_row": {"verify": {t: [] for t in sizes},
                                                                                  "draft": []}} for n in counts}
    for r in range(reps + 1):
        for n in counts:
            rec = times[n]
            for t in sizes:
                one, many = verify(1, t), verify(n, t)
                if r:
                    rec["one_row"]["verify"][t].append(one)
                    rec["verify"][t].append(many)
            one, many = draft(1), draft(n)
            if r:
                rec["one_row"]["draft"].append(one)
                rec["draft"].append(many)
    ratios, secs = {}, {}
    for n, rec in times.items():
        ratios[n] = {"verify": {t: paired_ratio(rec["verify"][t], rec["one_row"]["verify"][t]) for t in sizes},
                     "draft": paired_ratio(rec["draft"], rec["one_row"]["draft"])}
        secs[n] = {"verify": {t: statistics.median(v) for t, v in rec["verify"].items()},
                   "draft": statistics.median(rec["draft"]),
                   "one_row": {"verify": {t: statistics.median(v) for t, v in rec["one_row"]["verify"].items()},
                               "draft": statistics.median(rec["one_row"]["draft"])}}
    return ratios, secs


def paired_ratio(many: Sequence[float], one: Sequence[float]) -> float:
    """The median of ``many[i] / one[i]``: the cost ratio of two forwards timed one right after the other in each of
    several passes. A slow or fast pass moves both of its times and leaves its ratio; one lucky forward moves one
    ratio of several, not the estimate (the ratio of each side's fastest time would take it whole).

    Args:
        many, one: seconds (> 0), the same number of passes (>= 1).
    Raises:
        ValueError: different lengths, none, or a time that is not positive.
    """
    if len(many) != len(one) or not many or min(min(many), min(one)) <= 0:
        raise ValueError(f"paired_ratio: {len(many)} and {len(one)} times (all > 0, one of each per pass); "
                         "give the same number of passes on both sides")
    return statistics.median(a / b for a, b in zip(many, one))


def batch_rows(batch: int) -> list[int]:
    """The row counts a batch of ``batch`` rows runs at as its rows finish, to calibrate: the powers of two below it
    and ``batch`` itself (1 excluded: its ratios are 1), e.g. 6 -> [2, 4, 6].

    Raises:
        ValueError: ``batch`` < 1.
    """
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1 (rows decoded together)")
    out, n = [], 2
    while n < batch:
        out.append(n)
        n *= 2
    return out + ([batch] if batch > 1 else [])

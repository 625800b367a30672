"""The acceptance side of the cost model (:class:`~dartree.decode.budget.CostModel`): what the drafter's path
probabilities promise, calibrated online, and what each budget accepted in the rounds so far.

``c(p)`` calibrates the drafter's probabilities online, per probability bin: each verified node falls in a bin
of its predicted p = exp(s); the bin's realised acceptance frequency (nodes on the accepted path / nodes), shrunk
towards the global ratio c * p (realised / predicted accepted drafts over all rounds, prior 1) with a prior of
:data:`BIN_PRIOR_NODES` nodes, and made non-decreasing in p (pool-adjacent-violators), maps p to the calibrated
p^ by linear interpolation between bin means; so rate(b) (:mod:`dartree.decode.budget`) uses sum_{i <= b} p^_i.
A single global scalar over-trusts the confident nodes and under-trusts the doubtful ones when the drafter's
miscalibration is not uniform (a reliability diagram, Guo et al. 2017, "On Calibration of Modern Neural Networks").

The per-round rule rate(b) (``rule="scores"``) trusts the drafter's path probabilities round by round, and they say
little about a single round: on recorded rounds it came below the best fixed budget (docs/budget.md, "Replays").
The default rule (``rule="outcomes"``) learns instead what each budget b accepts from the rounds' outcomes:
at temperature 0 the accepted path of a round's top-b sub-tree is the longest prefix of the verified tree's accepted
path whose nodes all rank among its b best (DARTree Lemma 1; :mod:`dartree.decode.replay`), and in distribution the
same holds when sampling, so one round verified at V tells what every b <= V would have accepted. Per b the rule keeps
discounted sums of those accepted drafts and verifies the b that maximises (1 + mean_b + :data:`OUTCOME_Z` standard
errors) / (t_draft + t_build + t_verify(b + 1)): the rate of a whole round at that fixed budget, draft and build
included, since it compares budgets as policies (a renewal-reward ratio), not one round's marginal nodes. A budget
never verified yet is tried first, which gives every smaller one its evidence; a larger budget is tried again while
its optimistic rate is the best (bandits with side observations: Mannor & Shamir 2011). Rounds with grafted lookup
chains use the per-round rule (their nodes carry learnt estimates, not drafter probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dartree.decode.lookup import LookupStats
from dartree.decode.trees import Tree

# edges of the predicted-probability bins of the acceptance calibration (last edge above 1 so p = 1 falls inside)
PROB_BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0 + 1e-6)
BIN_PRIOR_NODES = 8.0
# The "outcomes" budget rule (CostModel.choose): the width, in standard errors of each increment (binomial), of the
# optimism that makes the rule try a larger budget than its best (each try also tells what every smaller budget would
# have accepted). The constants of this rule were picked on replays of recorded rounds (docs/budget.md, "Replays").
OUTCOME_Z = 0.3
# ... and every OUTCOME_EXPLORE-th drafted round verifies twice its best budget (at least one more node), so the
# larger budgets' outcomes stay current at the price of a slightly dearer round
OUTCOME_EXPLORE = 8
# ... and the weight, in rounds, of the tree's own calibrated estimates that each budget's outcomes are shrunk towards
OUTCOME_PRIOR = 2.0
# ... and their discount per round: a memory of about 200 rounds, longer than the drafted rounds' (DRAFT_DISCOUNT,
# dartree.decode.cost_decision), since a large budget's increments are seen only in the rounds verified at it or more
OUTCOME_DISCOUNT = 0.995
# The rules CostModel.choose knows: "outcomes" (default) and "scores" (the per-round calibrated path probabilities)
BUDGET_RULES = ("outcomes", "scores")


def _pav(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) regression of ``values`` by pool-adjacent-violators (Ayer et al. 1955)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for m, _, n in blocks:
        out.extend([m] * int(n))
    return out


@dataclass
class AcceptancePart:
    """The acceptance fields and methods of :class:`~dartree.decode.budget.CostModel`: the per-bin calibration
    ``c(p)``, the lookup chains' statistics and rule ``"outcomes"``'s per-budget sums (a base class it composes with
    :class:`~dartree.decode.cost_timing.TimingPart` and :class:`~dartree.decode.cost_decision.DecisionPart`; not
    used alone).

    Attributes: ``calib_pred``, ``calib_real``, ``bin_n``, ``bin_pred``, ``bin_real``, :attr:`lookup`,
    :attr:`rule`, ``out_n`` and ``out_tok``, as :class:`~dartree.decode.budget.CostModel` describes them.
    """

    calib_pred: float = 4.0
    calib_real: float = 4.0
    bin_n: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    bin_pred: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    bin_real: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    lookup: LookupStats = field(default_factory=LookupStats)
    rule: str = "outcomes"
    out_n: list = field(default_factory=list)
    out_tok: list = field(default_factory=list)
    _beta: float = field(default=0.0, repr=False, compare=False)
    _explore: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rule not in BUDGET_RULES:
            raise ValueError(f"rule={self.rule!r}: use one of {', '.join(BUDGET_RULES)}")
        for name in ("out_n", "out_tok"):
            if len(getattr(self, name)) != self.max_budget + 1:
                setattr(self, name, [0.0] * (self.max_budget + 1))

    @property
    def calibration(self) -> float:
        """c = realised / predicted accepted drafts over the verified rounds (prior: 1, weight 4 rounds)."""
        return self.calib_real / max(self.calib_pred, 1e-9)

    def calibration_curve(self) -> tuple[list[float], list[float]]:
        """The per-bin calibration map as knots (predicted p, calibrated p^), both non-decreasing, from (0, 0).

        Each bin's knot sits at its mean predicted p (the bin's midpoint before it has nodes); its value is the
        realised acceptance frequency shrunk towards ``c * p`` with :data:`BIN_PRIOR_NODES` prior nodes, then made
        non-decreasing over the bins by pool-adjacent-violators and capped at 1. A last knot at p = 1 carries the
        last bin's ratio.
        """
        c, m0 = self.calibration, BIN_PRIOR_NODES
        xs, fs, ws = [], [], []
        for k in range(len(PROB_BINS) - 1):
            mid = 0.5 * (PROB_BINS[k] + min(PROB_BINS[k + 1], 1.0))
            pbar = (self.bin_pred[k] + mid) / (self.bin_n[k] + 1.0)
            xs.append(pbar)
            fs.append((self.bin_real[k] + m0 * c * pbar) / (self.bin_n[k] + m0))
            ws.append(self.bin_n[k] + m0)
        fs = [min(f, 1.0) for f in _pav(fs, ws)]
        # past the last bin's mean: the last bin's ratio, up to p = 1
        return [0.0] + xs + [1.0], [0.0] + fs + [min(1.0, fs[-1] / xs[-1])]

    def calibrated(self, p: torch.Tensor) -> torch.Tensor:
        """p^ = c(p): predicted acceptance probabilities [M] (float32, in [0, 1]) mapped through
        :meth:`calibration_curve` by linear interpolation."""
        xs, fs = self.calibration_curve()
        x = torch.tensor(xs, dtype=p.dtype, device=p.device)
        f = torch.tensor(fs, dtype=p.dtype, device=p.device)
        i = torch.bucketize(p, x[1:-1])  # knot interval: x[i] <= p < x[i + 1] (i = last: beyond the last knot)
        x0, x1, f0, f1 = x[i], x[(i + 1).clamp(max=len(xs) - 1)], f[i], f[(i + 1).clamp(max=len(xs) - 1)]
        t = ((p - x0) / (x1 - x0).clamp(min=1e-9)).clamp(0.0, 1.0)
        return f0 + t * (f1 - f0)

    def _choose_by_outcomes(self, est: list[float], lo: int = 0) -> tuple[int, float]:
        """Rule ``"outcomes"`` for a drafted tree whose nodes, best first, have calibrated acceptance estimates
        ``est`` (M >= 1 of them): the b <= M maximising (1 + A_b) / (t_draft + t_build + t_verify(b + 1)), A_b as
        :meth:`outcome_gains` gives it. Every :data:`OUTCOME_EXPLORE`-th call verifies twice that b (at least one
        node more), so that the larger budgets' outcomes stay current. b = 0 (1 token in t_draft + t_build +
        t_verify(1)) is a candidate too, unless ``lo`` (1 in a probe) says at least one node. Returns (b, 1 + A_b)."""
        top = min(len(est), self.max_budget)
        self._explore += 1
        sunk = self.round_overhead()
        gains = self.outcome_gains(est)
        best_b, best_rate = 0, (1.0 / (sunk + self.verify_time(1)) if lo == 0 else -1.0)
        for b in range(1, top + 1):
            rate = (1.0 + gains[b]) / (sunk + self.verify_time(b + 1))
            if rate > best_rate:
                best_b, best_rate = b, rate
        if self._explore >= OUTCOME_EXPLORE and best_b < top:
            self._explore = 0
            best_b = min(top, max(2 * best_b, best_b + 1))
        return best_b, 1.0 + gains[best_b]

    def outcome_gains(self, est: list[float]) -> list[float]:
        """The optimistic drafts accepted A_b of the top-b sub-trees of one drafted tree, b = 0 .. min(M,
        ``max_budget``), under rule ``"outcomes"``: A_b = sum over j <= b of the increment d_j (the drafts the top-j
        sub-tree accepted beyond the top-(j - 1) one, :meth:`_record_outcomes`: a paired difference, far less noisy
        than each budget's own mean) plus :data:`OUTCOME_Z` of its standard errors. Each d_j is the mean over the
        rounds verified at j or more, shrunk towards this tree's own ``est[j - 1]`` (its j-th best node's calibrated
        acceptance probability) with a prior of :data:`OUTCOME_PRIOR` rounds, clipped to [0, 1] and made
        non-increasing in j; so the rule starts as the per-round one and a budget not tried for long falls back to
        what the drafter promises. Returns [A_0 = 0, A_1, ...] (drafts, floats)."""
        top = min(len(est), self.max_budget)
        w0 = OUTCOME_PRIOR
        ws = [self.out_n[b] + w0 for b in range(1, top + 1)]
        ds = [min(max((self.out_tok[b] + w0 * est[b - 1]) / ws[b - 1], 0.0), 1.0) for b in range(1, top + 1)]
        ds = [-v for v in _pav([-v for v in ds], ws)]  # the j-th best node adds no more than the (j - 1)-th
        total, gains = 0.0, [0.0]
        for b in range(1, top + 1):
            d = ds[b - 1]
            total += d + OUTCOME_Z * (d * (1.0 - d) / ws[b - 1]) ** 0.5
            gains.append(total)
        return gains

    def _record_outcomes(self, tree: Tree, accepted: torch.Tensor) -> None:
        """Add what every budget b <= V would have accepted in a drafted round verified at V = ``tree.size`` nodes
        (the leading nodes of the accepted path that all rank among the b best by ``score + beta * depth``, the
        ranking :func:`prune_to` keeps; DARTree Lemma 1) to the sums of rule ``"outcomes"``, as increments: per b,
        the drafts the top-b sub-tree accepted beyond the top-(b - 1) one."""
        adj = tree.score.detach().float().cpu() + self._beta * tree.depth.cpu().float()
        order = torch.sort(adj, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        path = rank[accepted.cpu()[1:] - 1]  # the accepted nodes' ranks, in path order
        worst = torch.cummax(path, 0).values.tolist() if path.numel() else []
        prev = 0
        for b in range(1, min(tree.size, self.max_budget) + 1):
            k = sum(1 for w in worst if w < b)
            self.out_n[b] += 1.0
            self.out_tok[b] += k - prev
            prev = k

    def learn(self, tree: Tree, accepted: torch.Tensor, chain_pos: torch.Tensor | None = None, ngram: int = 0,
              drafted: bool = True) -> None:
        """The acceptance part of :meth:`record`: what one verified tree teaches the calibration (each drafter node's
        predicted p = exp(score) against whether it was accepted, per :data:`PROB_BINS` bin), the lookup chain
        statistics and, for a drafted tree without a chain under rule ``"outcomes"``, each budget's outcome
        (:meth:`_record_outcomes`). Arguments as :meth:`record`; ``drafted``: whether the round ran the drafter.
        A batch (:class:`~dartree.decode.batch_budget.BatchCostModel`) calls it once per row."""
        m = tree.size
        if m == 0:
            return
        if drafted and chain_pos is None and self.rule == "outcomes":
            self._record_outcomes(tree, accepted)
        p = torch.exp(tree.score.detach().float().cpu()).clamp(max=1.0)
        hit = torch.zeros(m)
        hit[accepted.cpu()[1:] - 1] = 1.0
        if chain_pos is not None:
            self.lookup.record(chain_pos, accepted, ngram)
            own = chain_pos == 0
            p, hit = p[own], hit[own]
        self.calib_pred += float(p.sum())
        self.calib_real += float(hit.sum())
        nb = len(PROB_BINS) - 1
        k = torch.bucketize(p, torch.tensor(PROB_BINS[1:-1]), right=True)
        for name, w in (("bin_n", None), ("bin_pred", p), ("bin_real", hit)):
            add = torch.bincount(k, weights=w, minlength=nb).tolist()
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), add)])

    def _fade_outcomes(self) -> None:
        """Discount each budget's outcome sums (``out_n``, ``out_tok``) by :data:`OUTCOME_DISCOUNT`: one round went
        by (:meth:`~dartree.decode.cost_decision.DecisionPart.should_draft` calls it once per round)."""
        for name in ("out_n", "out_tok"):
            setattr(self, name, [v * OUTCOME_DISCOUNT for v in getattr(self, name)])

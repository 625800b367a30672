"""Cost-model verification budget (``--budget auto``): choose each round's tree size B for tokens per second.

One speculative round costs t_draft + t_build + t_verify(B + 1) and commits 1 + (accepted drafts) tokens;
a plain AR step costs t_AR and commits 1. With the tree's own path probabilities as acceptance estimates
(a node's path score s is a sum of log q~ over its path, so exp(s) estimates the probability that the target
accepts the whole path; the expected number of accepted drafts of a prefix-closed tree is the sum of exp(s)
over its nodes), the expected rate of a tree made of the b best nodes is

    rate(b) = (1 + c * sum_{i <= b} exp(s_i)) / t_verify(b + 1)          (draft and build are already paid)

and the round verifies the b* that maximises it (b* = 0 is a plain AR step on the already-drafted round).
``c(p)`` calibrates the drafter's probabilities online, per probability bin: each verified node falls in a bin
of its predicted p = exp(s); the bin's realised acceptance frequency (nodes on the accepted path / nodes), shrunk
towards the global ratio c * p (realised / predicted accepted drafts over all rounds, prior 1) with a prior of
:data:`BIN_PRIOR_NODES` nodes, and made non-decreasing in p (pool-adjacent-violators), maps p to the calibrated
p^ by linear interpolation between bin means; so rate(b) uses sum_{i <= b} p^_i. A single global scalar
over-trusts the confident nodes and under-trusts the doubtful ones when the drafter's miscalibration is not
uniform (a reliability diagram, Guo et al. 2017, "On Calibration of Modern Neural Networks").

That per-round rule (``rule="scores"``) trusts the drafter's path probabilities round by round, and they say
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

Before drafting, the round is skipped for a plain AR step (no draft, no tree) when even an optimistic estimate of
the drafted rounds' rate is below AR's: tokens the target accepted per AR step of the rounds as the loop timed them
(draft to commit), a discounted mean over about the last 100 rounds plus one standard error (discounted UCB,
Garivier & Moulines 2011), against the 1-token forwards the loop timed over the same rounds (one plain AR step
after every :data:`ANCHOR_EVERY` drafted rounds keeps them current). Every round's seconds count in AR steps of its
own moment (seconds / t_verify(1), the calibrated 1-token forward times the online scale :attr:`CostModel.speed`,
which every verify forward moves), so a drafted round timed in a slow minute is set against AR steps of that
minute, not against AR steps timed minutes earlier or later. While drafting pays, the bound is above AR and every
round drafts; while it does not, skipped rounds discount the drafted rounds' weight, the standard error grows, and a
probe round drafts again (rarely when drafting loses by far, often when it loses narrowly); a probe verifies at
least one node even where :meth:`CostModel.choose` would keep none, since a probe that verifies nothing measures
only the draft's cost and teaches the acceptance calibration nothing.

The skip rule counts the tokens the target accepted, not the calibrated promise: the calibration pools every
context, so where the drafter does worse than on average it promises too much.

No few rounds can lock drafting out. Every timing sample is winsorised at :data:`OUTLIER_CLIP` times what the model
expected of it, and the drafted round's cost that the bound divides by is the median of the last
:data:`COST_WINDOW` rounds' costs (:meth:`CostModel.round_cost`), so rounds that paid a one-time cost or met a burst
of other load barely move it; while drafting looks behind, a probe drafts at least every :meth:`CostModel.probe_gap`
rounds (its cost bounded by a share of the AR steps around it), so the policy keeps looking whatever its statistics
say. The policy starts from evidence, not from the first timed rounds: :func:`dartree.decode.generate.seed_policy`
drafts and verifies a calibration prompt with the run's own builder before anything is timed, and
:meth:`CostModel.finish_seeding` keeps that pass's acceptance calibration, round costs and tokens per round as a
prior worth :data:`PRIOR_ROUNDS` rounds.

The rule is the adaptive verification budget that DARTree (arXiv 2608.13524, conclusion) leaves as future work; it
generalises DSpark's confidence-scheduled chain length (arXiv 2607.05147, Algorithm 1) from a chain to any tree
builder. The timings are calibrated at start-up with a few forwards (:func:`calibrate`), in the process that
decodes. The failures each safeguard answers and the replays behind the constants are in docs/budget.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dartree.decode.draft import draft_block
from dartree.decode.lookup import LookupStats
from dartree.decode.trees import Tree, select_top_b_keep
from dartree.decode.verify import compile_tree
from dartree.models.drafter import DraftCache
from dartree.models.target import compact_cache

CALIBRATION_SIZES = (1, 2, 3, 5, 9, 17)
# edges of the predicted-probability bins of the acceptance calibration (last edge above 1 so p = 1 falls inside)
PROB_BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0 + 1e-6)
BIN_PRIOR_NODES = 8.0
# EMA weight of the online timing updates (observe_verify / observe_draft): about the last 10 rounds
SPEED_EMA = 0.1
# Discount per round of the drafted rounds' statistics (should_draft): a memory of about 100 rounds (tokens),
# skipped rounds included, so an arm left alone regains its uncertainty and is tried again (discounted UCB,
# Garivier & Moulines 2011, "On Upper-Confidence Bound Policies for Switching Bandit Problems").
DRAFT_DISCOUNT = 0.99
# Width of the upper confidence bound in standard errors of the mean committed tokens per drafted round, and the
# prior standard deviation (tokens) with its weight in rounds, used while few rounds are in (simulations:
# docs/budget.md).
UCB_Z = 1.0
SD_PRIOR, SD_PRIOR_ROUNDS = 1.0, 2.0
# At most this many drafted rounds in a row: then one round skips the drafter, a plain AR step (or a lookup chain)
# whose 1-token forward measures what AR costs now, next to the drafted rounds in time (a run that drafts every round
# would never time one). Costs at most 1/16 of drafting's gain.
ANCHOR_EVERY = 16
# ... and after ANCHOR_EVERY_CLEAR drafted rounds while drafting wins clearly: the drafted rounds' mean rate at least
# CLEAR_MARGIN times the alternative's. The calibration pass already timed AR steps beside its drafted rounds, and a
# drift of the verify curve's shape that the rarer anchors catch later would have to exceed the margin to flip the
# decision; each anchor costs about (1 - 1 / gain) of a round: 0.9% of the time at ANCHOR_EVERY = 16 and a gain of
# 1.17, 0.2% at 64.
ANCHOR_EVERY_CLEAR, CLEAR_MARGIN = 64, 1.1
# The "outcomes" budget rule (CostModel.choose): the width, in standard errors of each increment (binomial), of the
# optimism that makes the rule try a larger budget than its best (each try also tells what every smaller budget would
# have accepted). The constants of this rule were picked on replays of recorded rounds (docs/budget.md, "Replays").
OUTCOME_Z = 0.3
# ... and every OUTCOME_EXPLORE-th drafted round verifies twice its best budget (at least one more node), so the
# larger budgets' outcomes stay current at the price of a slightly dearer round
OUTCOME_EXPLORE = 8
# ... and the weight, in rounds, of the tree's own calibrated estimates that each budget's outcomes are shrunk towards
OUTCOME_PRIOR = 2.0
# ... and their discount per round: a memory of about 200 rounds, longer than the drafted rounds' (DRAFT_DISCOUNT),
# since a large budget's increments are seen only in the rounds verified at it or more
OUTCOME_DISCOUNT = 0.995
# The rules CostModel.choose knows: "outcomes" (default) and "scores" (the per-round calibrated path probabilities)
BUDGET_RULES = ("outcomes", "scores")
# EMA weight of the per-size correction of the calibrated verify curve (observe_verify), per pair of consecutive
# verifies of 1 and of T > 1 tokens: the pair's ratio t(T) / t(1) is free of the machine's speed, so a slowdown moves
# only the scale, not the curve's shape
SHAPE_EMA = 0.1
# A pair's residual ratio is clipped to [1 / PAIR_CLIP, PAIR_CLIP]: a pair that straddles a jump of the machine's speed
# (a 1-token forward in a slow stretch, the T-token verify right after it calmed) says nothing about the curve's shape
PAIR_CLIP = 1.5
# Winsorising: a timing sample counts as at most OUTLIER_CLIP times what the model expected of it (and at least 1 /
# OUTLIER_CLIP): a verify forward's residual against the curve, a draft or build time against its estimate, a round's
# or an AR step's cost in AR steps against its modelled cost. A round that pays a one-time cost (numba loading, a new
# oneDNN shape, first-call allocation) or meets a burst of other load then moves the model like a round 3x dearer,
# not like one 50x dearer; a lasting slowdown still reaches the model, over a few rounds more.
OUTLIER_CLIP = 3.0
# The cost of a drafted round that should_draft sets the tokens against: the median (in AR steps of each round's
# moment) of the last COST_WINDOW drafted rounds, padded with the modelled cost while fewer are in; up to
# (COST_WINDOW - 1) // 2 outlying rounds in a row leave it where it was.
COST_WINDOW = 9
# Weight, in drafted rounds, of the calibration pass's evidence (seed_policy in dartree.decode.generate: rounds drafted
# and verified on a calibration prompt before anything is timed); it fades like any round (DRAFT_DISCOUNT).
PRIOR_ROUNDS = 8.0
# While drafting looks behind, a probe drafts after at most max(PROBE_MIN_GAP, PROBE_RATIO * (c - 1)) rounds without
# the drafter, c the modelled cost in AR steps of a drafted round verifying one node: the forced probes then cost at
# most 1 / PROBE_RATIO of the time of the AR steps between them, and no state of the statistics stops the policy from
# looking again (the discounted bound alone can take hundreds of rounds to probe after a run of costly rounds).
PROBE_MIN_GAP, PROBE_RATIO = 16, 20.0
# In the calibration pass every SEED_AR_EVERY-th round is a plain AR step: the alternative, timed by the same loop in
# the same minutes as the drafted rounds it is weighed against
SEED_AR_EVERY = 3


def _clip(ratio: float, k: float) -> float:
    """``ratio`` winsorised to [1 / k, k]."""
    return min(max(ratio, 1.0 / k), k)


def _median(vals: list[float]) -> float:
    """The median of a non-empty list."""
    v = sorted(vals)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


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
class CostModel:
    """Measured costs of one target/drafter pair and the online acceptance calibration.

    Attributes:
        t_ar: seconds of one plain AR step (a one-token target forward) at calibration.
        t_draft: seconds of one drafter forward with its base logits (draft stage; start-up figure, then EMA).
        t_build: seconds of building a tree (a constant per round; measured in the loop, EMA).
        verify_s: {T: seconds} of a verify forward of T tokens (root included), T ascending, T = 1 first.
        max_budget: largest tree the policy considers (B_max); the builder drafts at most this many nodes.
        calib_pred: sum of predicted accepted drafts over verified rounds (for the global ``c``).
        calib_real: sum of realised accepted drafts over the same rounds.
        bin_n, bin_pred, bin_real: per :data:`PROB_BINS` bin, verified drafter nodes, their summed predicted p
            and how many of them were accepted (for the per-bin calibration ``c(p)``).
        lookup: acceptance by position of grafted prompt-lookup chains (:mod:`dartree.decode.lookup`); their
            nodes' scores are already these estimates and skip ``c(p)``.
        draft_n, draft_tok, draft_tok2, draft_s, draft_u: discounted sums (factor :data:`DRAFT_DISCOUNT` per round,
            skipped rounds included) over the drafted rounds of 1, the tokens committed, their square, their seconds
            (measured by the loop, draft to commit; modelled when the caller gives none) and the same seconds in AR
            steps of their moment (each divided by :meth:`verify_time` (1) when it was recorded); :attr:`spec_rate`
            is draft_tok / draft_s, :meth:`should_draft` reads draft_tok / draft_u.
        undrafted_n, undrafted_tok, undrafted_s, undrafted_u: the same for rounds without the drafter (a lookup chain
            alone, or a plain AR step when the lookup found nothing); unused without lookup.
        ar_n, ar_s, ar_u: discounted count, seconds and AR steps of their moment of the 1-token verify forwards the
            loop timed (plain AR steps and drafted rounds that kept no node): AR's rate now is ar_n / ar_s tokens
            per second, ar_n / ar_u per AR step (1 when the calibrated curve's shape is right).
        since_anchor: drafted rounds since the last round without the drafter or 1-token forward
            (:data:`ANCHOR_EVERY`).
        chosen: histogram {B: rounds} of the budgets chosen (0: AR step), for reports.
        speed: online scale of the calibrated verify curve (EMA of measured / calibrated verify seconds,
            :meth:`observe_verify`); ``t_draft`` follows the measured drafts the same way (:meth:`observe_draft`).
        shape: {calibrated size T: correction} learnt in the loop for sizes T > 1 from consecutive 1-token and
            T-token verifies (:meth:`observe_verify`). ``t_ar`` stays the start-up figure; decisions use
            ``verify_time(1)``.
        costs: the last :data:`COST_WINDOW` drafted rounds' costs in AR steps of their moment (winsorised at
            :data:`OUTLIER_CLIP` times their modelled cost); their median is :meth:`round_cost`.
        skipped: rounds in a row without the drafter (:meth:`probe_gap` forces a probe after that many).
        probes: drafted rounds the policy ran while drafting looked behind (the bound's own and the forced ones).
        prior: what the policy started from, after :meth:`finish_seeding` (the calibration pass: its rounds, their
            tokens and AR steps per round, the weight kept); None without a pass.
        rule: how :meth:`choose` sizes a drafted round: ``"outcomes"`` (default: each fixed budget's acceptance
            learnt from the rounds' outcomes) or ``"scores"`` (the per-round calibrated path probabilities).
        out_n, out_tok: per budget b (index b, 0..``max_budget``), discounted sums over the drafted rounds verified
            at b or more of 1 and of the drafts their top-b sub-tree accepted beyond their top-(b - 1) one (rule
            ``"outcomes"``; discounted like the drafted rounds' statistics).
    """

    t_ar: float
    t_draft: float
    verify_s: dict
    max_budget: int = 16
    t_build: float = 0.0
    calib_pred: float = 4.0
    calib_real: float = 4.0
    bin_n: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    bin_pred: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    bin_real: list = field(default_factory=lambda: [0.0] * (len(PROB_BINS) - 1))
    lookup: LookupStats = field(default_factory=LookupStats)
    draft_n: float = 0.0
    draft_tok: float = 0.0
    draft_tok2: float = 0.0
    draft_s: float = 0.0
    draft_u: float = 0.0
    undrafted_n: float = 0.0
    undrafted_tok: float = 0.0
    undrafted_s: float = 0.0
    undrafted_u: float = 0.0
    ar_n: float = 0.0
    ar_s: float = 0.0
    ar_u: float = 0.0
    since_anchor: int = 0
    chosen: dict = field(default_factory=dict)
    speed: float = 1.0
    shape: dict = field(default_factory=dict)
    _pts: list | None = field(default=None, repr=False, compare=False)
    _pending: tuple | None = field(default=None, repr=False, compare=False)
    _last_verify: tuple | None = field(default=None, repr=False, compare=False)
    _probe: bool = field(default=False, repr=False, compare=False)
    _lost: bool = field(default=False, repr=False, compare=False)
    costs: list = field(default_factory=list)
    skipped: int = 0
    probes: int = 0
    prior: dict | None = None
    rule: str = "outcomes"
    out_n: list = field(default_factory=list)
    out_tok: list = field(default_factory=list)
    _beta: float = field(default=0.0, repr=False, compare=False)
    _explore: int = field(default=0, repr=False, compare=False)
    _modelled_steps: float = field(default=0.0, repr=False, compare=False)
    _force: int = field(default=0, repr=False, compare=False)
    _seed_ar: int = field(default=0, repr=False, compare=False)
    _seeded: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rule not in BUDGET_RULES:
            raise ValueError(f"rule={self.rule!r}: use one of {', '.join(BUDGET_RULES)}")
        for name in ("out_n", "out_tok"):
            if len(getattr(self, name)) != self.max_budget + 1:
                setattr(self, name, [0.0] * (self.max_budget + 1))

    @property
    def spec_rate(self) -> float | None:
        """Tokens per second of the drafted rounds (discounted; seconds as the loop timed them), or None before any."""
        return self.draft_tok / self.draft_s if self.draft_n > 0 else None

    @property
    def undrafted_rate(self) -> float | None:
        """Tokens per second of the rounds without the drafter (lookup rounds), the same way, or None."""
        return self.undrafted_tok / self.undrafted_s if self.undrafted_n > 0 else None

    @property
    def ar_rate(self) -> float:
        """Tokens per second of a plain AR step now: the discounted mean of the loop's timed 1-token forwards, or
        1 / :meth:`verify_time` (1) before any."""
        return self.ar_n / self.ar_s if self.ar_n > 0 and self.ar_s > 0 else 1.0 / self.verify_time(1)

    def draft_bound(self, per_ar_step: bool = False, z: float = UCB_Z) -> float | None:
        """Upper confidence bound of the drafted rounds' rate: (mean tokens + :data:`UCB_Z` standard errors) over the
        mean cost of a drafted round, the standard deviation shrunk towards :meth:`sd_prior`; None before any.

        Args:
            per_ar_step: False: tokens per second (the bound of :attr:`spec_rate`); True: tokens per AR step of
                each round's own moment (``draft_u``), what :meth:`should_draft` compares.
            z: standard errors added (negative: the lower bound).
        """
        n = self.draft_n
        if n <= 0:
            return None
        mean = self.draft_tok / n
        var = max(self.draft_tok2 / n - mean * mean, 0.0)
        sd = ((var * n + self.sd_prior() ** 2 * SD_PRIOR_ROUNDS) / (n + SD_PRIOR_ROUNDS)) ** 0.5
        return (mean + z * sd / n ** 0.5) / (self.round_cost() if per_ar_step else self.draft_s / n)

    def sd_prior(self) -> float:
        """The prior standard deviation (tokens) of a drafted round's committed tokens: :data:`SD_PRIOR` (a batch's
        model divides it by the square root of its rows: its rounds' tokens are means over the rows)."""
        return SD_PRIOR

    def round_cost(self) -> float:
        """What a drafted round costs now, in AR steps of its moment: the median of the last :data:`COST_WINDOW`
        drafted rounds' (winsorised) costs; while fewer are in, the window is padded with the latest round's modelled
        cost or the median of those in, whichever is lower (the discounted mean cost ``draft_u / draft_n`` before
        any round has a cost). A robust location (Huber 1964): a few rounds that paid a one-time cost do not move
        it, a lasting change moves it within half a window, and a probe restarts the window with its own cost (what
        drafting costs now, after a stretch without drafting)."""
        if not self.costs:
            return self.draft_u / self.draft_n if self.draft_n > 0 else self._modelled_steps
        vals = sorted(self.costs)
        if len(vals) < COST_WINDOW:
            vals = sorted(vals + [min(self._modelled_steps, _median(vals))] * (COST_WINDOW - len(vals)))
        return _median(vals)

    def round_overhead(self) -> float:
        """Seconds a drafted round spends before its verify: t_draft + t_build (a batch's model scales both by its
        rows, :class:`~dartree.decode.batch_budget.BatchCostModel`)."""
        return self.t_draft + self.t_build

    def probe_gap(self, alternative: float = 1.0) -> int:
        """Rounds without the drafter after which :meth:`should_draft` drafts a probe even while drafting looks
        behind: max(:data:`PROBE_MIN_GAP`, :data:`PROBE_RATIO` x (c - 1 / a)), c = (t_draft + t_build +
        t_verify(2)) / t_verify(1) the modelled cost of a one-node drafted round in AR steps, a = ``alternative``
        the tokens per AR step of the rounds without the drafter (1 for plain AR steps). A probe commits at least
        one token where the alternative would have committed c x a, so the forced probes lose at most
        1 / PROBE_RATIO of the tokens of the rounds between them."""
        c = (self.round_overhead() + self.verify_time(2)) / self.verify_time(1)
        return max(PROBE_MIN_GAP, int(PROBE_RATIO * max(c - 1.0 / max(alternative, 1e-9), 0.0) + 0.999999))

    def _knots(self) -> list[tuple[int, float]]:
        """The calibrated sizes with their times corrected by :attr:`shape`, made non-decreasing in T (cached:
        :meth:`choose` reads the curve once per candidate budget every round; :meth:`observe_verify` resets it)."""
        if self._pts is None:
            pts, running = [], 0.0
            for t, sec in sorted(self.verify_s.items()):
                running = max(running, sec * self.shape.get(t, 1.0))
                pts.append((t, running))
            self._pts = pts
        return self._pts

    def verify_time(self, tokens: int) -> float:
        """t_verify(T) in seconds for T >= 1 tokens: the calibrated curve, each size corrected by the in-loop
        :attr:`shape` (piecewise-linear in T between sizes, linear extrapolation past the largest one), times
        :attr:`speed`, the online scale."""
        pts = self._knots()
        if tokens <= pts[0][0]:
            return self.speed * pts[0][1]
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return self.speed * (s0 + (s1 - s0) * (tokens - t0) / (t1 - t0))
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        return self.speed * (s1 + (s1 - s0) * (tokens - t1) / (t1 - t0))

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """Fold one timed verify stage of ``tokens`` tree tokens (root included), ``seconds`` long, into the model.

        The residual r = measured / predicted updates :attr:`speed` (EMA weight :data:`SPEED_EMA`), since on a shared
        VM the same forward drifts within minutes and a start-up calibration alone goes stale. A 1-token forward is
        also an AR step of this moment (``ar_n``, ``ar_s``, ``ar_u``). The shape of the curve is learnt from pairs
        (:meth:`_learn_shape`), since the loop's verify stage can cost more AR steps than start-up calibration
        measured."""
        if seconds <= 0:
            return
        ratio = _clip(seconds / max(self.verify_time(tokens), 1e-12), OUTLIER_CLIP)
        self.speed *= 1.0 + SPEED_EMA * (ratio - 1.0)
        if tokens == 1:  # a plain AR step's forward (or a drafted round that kept no node): what AR costs now
            steps = _clip(seconds / self.verify_time(1), OUTLIER_CLIP)  # winsorised like every round
            self.ar_n += 1.0
            self.ar_s += steps * self.verify_time(1)
            self.ar_u += steps
            self.since_anchor = 0
        self._learn_shape(tokens, seconds)

    def _learn_shape(self, tokens: int, seconds: float) -> None:
        """Update the correction of the calibrated size at or below T (:attr:`shape`, weight :data:`SHAPE_EMA`) from
        a verify of T > 1 tokens and a 1-token forward timed one right after the other (either order): their ratio
        t(T) / t(1) against the modelled one, which no change of the machine's speed moves (T = 1 is the reference
        and keeps 1). Other consecutive pairs, and the first verify after :meth:`mark_gap`, teach nothing."""
        prev, self._last_verify = self._last_verify, (tokens, seconds)
        if prev is None or (prev[0] == 1) == (tokens == 1):
            return
        (big, s_big), (_, s_one) = sorted([prev, (tokens, seconds)], reverse=True)
        knot = max((t for t in self.verify_s if t <= big), default=1)
        if knot > 1:
            residual = min(max((s_big / s_one) / (self.verify_time(big) / self.verify_time(1)), 1 / PAIR_CLIP), PAIR_CLIP)
            self.shape[knot] = self.shape.get(knot, 1.0) * (1.0 + SHAPE_EMA * (residual - 1.0))
            self._pts = None

    def mark_gap(self) -> None:
        """Say that the next verify does not follow the last one in time (a new decode: a prefill, and maybe other
        methods' decodes, came between), so :meth:`_learn_shape` does not pair them."""
        self._last_verify = None

    def observe_draft(self, seconds: float) -> None:
        """Fold one timed draft stage of ``seconds`` into ``t_draft`` (EMA, weight :data:`SPEED_EMA`; the sample
        winsorised at :data:`OUTLIER_CLIP` times ``t_draft``), so the draft cost follows the same drift as the verify
        scale."""
        if seconds > 0:
            seconds = self.t_draft * _clip(seconds / self.t_draft, OUTLIER_CLIP) if self.t_draft > 0 else seconds
            self.t_draft = (1 - SPEED_EMA) * self.t_draft + SPEED_EMA * seconds

    @property
    def calibration(self) -> float:
        """c = realised / predicted accepted drafts over the verified rounds (prior: 1, weight 4 rounds)."""
        return self.calib_real / max(self.calib_pred, 1e-9)

    def fresh(self) -> "CostModel":
        """A copy with the same timings and nothing learnt yet (calibration, draft statistics, histogram), for another
        method that shares this start-up measurement."""
        return CostModel(t_ar=self.t_ar, t_draft=self.t_draft, verify_s=dict(self.verify_s),
                         max_budget=self.max_budget, t_build=self.t_build, speed=self.speed, shape=dict(self.shape),
                         rule=self.rule)

    def start_seeding(self, rounds: int, ar_every: int = SEED_AR_EVERY) -> None:
        """Begin a calibration pass: the next ``rounds`` calls of :meth:`should_draft` draft, except every
        ``ar_every``-th, a plain AR step (0: none), and none is a probe; so that the pass teaches the acceptance
        calibration, the drafted rounds' statistics and the AR steps' cost what drafting gives with this builder
        against AR, before any timed round (:func:`dartree.decode.generate.seed_policy`)."""
        self._force, self._seed_ar, self._seeded = int(rounds), int(ar_every), 0

    def finish_seeding(self, source: str, weight: float = PRIOR_ROUNDS) -> dict:
        """End the calibration pass: keep its evidence as the policy's starting point and return what that is.

        The pass's drafted-round sums, and its AR steps' sums, are scaled down to at most ``weight`` rounds each (a
        prior that the run's own rounds outweigh within a few dozen rounds, and that fades by :data:`DRAFT_DISCOUNT`
        like any round); its acceptance calibration (``calib_*``, the per-bin counts, the lookup statistics), its
        round costs (:attr:`costs`) and its timing updates stay as they are; its budgets leave the histogram.

        Args:
            source: what the pass ran on, for reports (e.g. ``"calibration prompt (64 tokens)"``).
            weight: the prior's weight in drafted rounds (default :data:`PRIOR_ROUNDS`).
        Returns:
            :attr:`prior`: {"source", "rounds" (drafted in the pass), "weight", "tokens_per_round",
            "ar_steps_per_round" (the winsorised median, :meth:`round_cost`), "ar_step" (what the pass's plain AR
            steps cost in the same units; 1 when the calibrated curve is right), "calibration" (c), "budgets"}.
        """
        n, rounds = self.draft_n, self._seeded
        tokens = self.draft_tok / n if n > 0 else None
        for names, count in ((("draft_n", "draft_tok", "draft_tok2", "draft_s", "draft_u"), n),
                             (("ar_n", "ar_s", "ar_u"), self.ar_n)):
            for name in names if count > weight else ():
                setattr(self, name, getattr(self, name) * weight / count)
        for b, count in enumerate(list(self.out_n)):  # each budget's outcomes: a prior of at most `weight` rounds
            if count > weight:
                for name in ("out_n", "out_tok"):
                    getattr(self, name)[b] *= weight / count
        self.prior = {"source": source, "rounds": rounds, "weight": min(n, weight), "tokens_per_round": tokens,
                      "ar_steps_per_round": self.round_cost() if n > 0 else None, "calibration": self.calibration,
                      "ar_step": self.ar_u / self.ar_n if self.ar_n > 0 else None,
                      "budgets": {int(b): c for b, c in sorted(self.chosen.items())}}
        self.chosen, self._force, self.since_anchor, self.skipped = {}, 0, 0, 0
        self._probe = self._lost = False
        self._pending = None
        self.mark_gap()
        return self.prior

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

    def should_draft(self) -> bool:
        """Whether this round drafts (False: a plain AR step, or a lookup chain alone).

        True while the upper confidence bound of the drafted rounds' rate (:meth:`draft_bound`: the discounted mean
        tokens of a drafted round plus :data:`UCB_Z` standard errors, over :meth:`round_cost`) is at least the rate of
        the alternative (the timed 1-token forwards, or the undrafted lookup rounds, whichever is higher), and before
        any drafted round, except that after :data:`ANCHOR_EVERY` drafted rounds in a row (:data:`ANCHOR_EVERY_CLEAR`
        while the drafted rounds' mean rate beats the alternative by :data:`CLEAR_MARGIN`) one round skips the
        drafter, so that AR's cost is measured now. While the bound is below, a probe drafts once the bound rises
        again or after :meth:`probe_gap` rounds without the drafter, whichever comes first. All rates are tokens per
        AR step of each round's own moment, so a change of the machine's speed between the rounds compared does not
        decide. Every call discounts the statistics by :data:`DRAFT_DISCOUNT` (discounted UCB, Garivier & Moulines
        2011). During a calibration pass (:meth:`start_seeding`) every round drafts."""
        ar = self.ar_n / self.ar_u if self.ar_n > 0 and self.ar_u > 0 else 1.0
        lookup = self.undrafted_tok / self.undrafted_u if self.undrafted_n > 0 and self.undrafted_u > 0 else 0.0
        alternative = max(ar, lookup)
        bound = self.draft_bound(per_ar_step=True)
        mean = self.draft_bound(per_ar_step=True, z=0.0)
        every = ANCHOR_EVERY_CLEAR if mean is not None and mean >= CLEAR_MARGIN * alternative else ANCHOR_EVERY
        for name in ("draft_n", "draft_tok", "draft_tok2", "draft_s", "draft_u", "undrafted_n", "undrafted_tok",
                     "undrafted_s", "undrafted_u", "ar_n", "ar_s", "ar_u"):
            setattr(self, name, getattr(self, name) * DRAFT_DISCOUNT)
        for name in ("out_n", "out_tok"):
            setattr(self, name, [v * OUTCOME_DISCOUNT for v in getattr(self, name)])
        if self._force > 0:  # the calibration pass: rounds draft (every SEED_AR_EVERY-th an AR step), none probes
            self._force -= 1
            self.since_anchor, self.skipped, self._probe, self._lost = 0, 0, False, False
            draft = not (self._seed_ar and self._force % self._seed_ar == 0)
            self._seeded += int(draft)
            return draft
        wins = bound is None or bound >= alternative
        forced = not wins and self.skipped + 1 >= self.probe_gap(alternative)
        draft = (wins and self.since_anchor < every) or forced
        self.since_anchor = self.since_anchor + 1 if draft else 0
        self.skipped = 0 if draft else self.skipped + 1
        self._probe = draft and (self._lost or forced)
        self.probes += int(self._probe)
        self._lost = not wins
        return draft

    def choose(self, tree: Tree, beta: float = 0.0, chain_pos: torch.Tensor | None = None,
               drafted: bool = True) -> tuple[int, float]:
        """The budget b* of a built tree (nodes kept = the b* best by ``score + beta * depth``).

        Args:
            tree: the round's tree built with ``max_budget`` nodes; ``tree.score`` [M] path log-probabilities
                (nats, <= 0, non-increasing along paths).
            beta: the builder's depth bonus (<= 0) used to rank nodes, as its own top-B does.
            chain_pos: [M] int64 lookup chain position per node (0: a drafter node), or None.
            drafted: False for a lookup-only tree of a round that skipped the drafter: it does not count
                towards the drafted rounds' rate (:meth:`should_draft`). The round's outcome waits for
                :meth:`record`, which adds its tokens and seconds to that rate.
        Returns:
            (b*, the expected committed tokens of that tree, calibrated); b* >= 1 in a probe (the first drafted round
            after :meth:`should_draft` found drafting behind), so that it measures what drafting accepts now.
        """
        m = tree.size
        probe, self._probe = drafted and self._probe, False
        lo = int(probe and m > 0)
        self._beta = beta
        if m == 0:
            self._expect(drafted, 0, probe)
            return 0, 1.0
        adj = tree.score.float() + beta * tree.depth.float()
        order = torch.sort(adj, descending=True, stable=True).indices
        p = torch.exp(tree.score.float()[order]).clamp(max=1.0)
        est = self.calibrated(p)
        if drafted and chain_pos is None and self.rule == "outcomes":
            best_b, best_exp = self._choose_by_outcomes(est.tolist(), lo)
            self._expect(drafted, best_b, probe)
            return best_b, best_exp
        if chain_pos is not None:  # lookup nodes: their score is already the learnt estimate
            est = torch.where(chain_pos[order] > 0, p, est)
        gain = torch.cumsum(est, 0)
        best_b, best_rate, best_exp = 0, 1.0 / self.verify_time(1), 1.0
        for b in range(1, m + 1):
            exp_tok = 1.0 + float(gain[b - 1])
            rate = exp_tok / self.verify_time(b + 1)
            if rate > best_rate or b == lo:
                best_b, best_rate, best_exp = b, rate, exp_tok
        self._expect(drafted, best_b, probe)
        return best_b, best_exp

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

    def _expect(self, drafted: bool, b: int, probe: bool = False) -> None:
        """Note the modelled seconds and AR steps of the round :meth:`choose` just sized (b nodes kept; draft and
        build included for a drafted one; ``probe``: a probe round): :meth:`record` adds them, or the round's
        measured seconds winsorised against them, with the tokens it really committed to the sums
        :meth:`should_draft` reads."""
        sec = (self.round_overhead() if drafted else 0.0) + self.verify_time(b + 1)
        self._pending = (drafted, sec, sec / self.verify_time(1), probe)

    def _observe_round(self, tokens: float, seconds: float | None) -> None:
        """Add the round :meth:`choose` sized, which committed ``tokens`` in ``seconds`` (None: its modelled
        seconds), to the drafted or undrafted statistics; its cost in AR steps of this moment is winsorised at
        :data:`OUTLIER_CLIP` times its modelled cost."""
        if self._pending is None:
            return
        drafted, sec, modelled, probe = self._pending
        self._pending = None
        steps = modelled
        if seconds is not None and seconds > 0:
            steps = modelled * _clip(seconds / self.verify_time(1) / modelled, OUTLIER_CLIP)
            sec = steps * self.verify_time(1)
        if drafted:
            self.draft_n += 1.0
            self.draft_tok += tokens
            self.draft_tok2 += tokens * tokens
            self.draft_s += sec
            self.draft_u += steps
            # a probe measures what drafting costs now: it restarts the window, so costs measured before drafting
            # stopped (a slow stretch, one-time costs) do not outvote the present (a costly probe keeps it off)
            self.costs = [steps] if probe else (self.costs + [steps])[-COST_WINDOW:]
            self._modelled_steps = modelled
        else:
            self.undrafted_n += 1.0
            self.undrafted_tok += tokens
            self.undrafted_s += sec
            self.undrafted_u += steps

    def record(self, tree: Tree, accepted: torch.Tensor, chain_pos: torch.Tensor | None = None,
               ngram: int = 0, seconds: float | None = None) -> None:
        """Account one verified round: its budget (``tree.size``) in the histogram and, for a drafted round, each
        drafter node's predicted p = exp(score) against whether it was accepted (lookup chain nodes go to
        :attr:`lookup` instead).

        Args:
            tree: the verified tree (M nodes; M = 0 for a plain AR step).
            accepted: [A] int64 accepted node indices, root (0) first, tree node i at index i + 1
                (:class:`~dartree.decode.verify.Verification`).
            chain_pos: [M] int64 lookup chain position per node (0: a drafter node), or None.
            ngram: the matched n-gram size of the round's lookup chain (0: none).
            seconds: the round's measured wall time, draft to commit (None: the modelled time of :meth:`choose`);
                it counts in AR steps of the model's :meth:`verify_time` (1) now, so call :meth:`observe_verify`
                with the round's verify first.
        """
        m = tree.size
        self.chosen[m] = self.chosen.get(m, 0) + 1
        drafted = self._pending is not None and self._pending[0]
        self._observe_round(float(accepted.numel()), seconds)  # root + accepted drafts = accepted drafts + the bonus token
        self.learn(tree, accepted, chain_pos, ngram, drafted)

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

    def observe_build(self, seconds: float) -> None:
        """Fold one measured tree-build time (``seconds``) into ``t_build`` (EMA, weight 0.2; the first one sets it,
        later ones are winsorised at :data:`OUTLIER_CLIP` times ``t_build``)."""
        if self.t_build <= 0.0:
            self.t_build = seconds
        else:
            self.t_build = 0.8 * self.t_build + 0.2 * self.t_build * _clip(seconds / self.t_build, OUTLIER_CLIP)

    def summary(self) -> dict:
        """JSON-ready figures: timings (ms), calibration c, the budget histogram, the drafted round's cost in AR
        steps, the probes and what the policy started from (:attr:`prior`)."""
        return {"t_ar_ms": 1000 * self.t_ar, "t_draft_ms": 1000 * self.t_draft, "t_build_ms": 1000 * self.t_build,
                "speed": self.speed, "verify_shape": {int(t): c for t, c in sorted(self.shape.items())},
                "verify_ms": {int(t): 1000 * s for t, s in sorted(self.verify_s.items())},
                "calibration": self.calibration, "max_budget": self.max_budget,
                "drafted_rate_per_s": self.spec_rate, "undrafted_rate_per_s": self.undrafted_rate,
                "drafted_tokens_per_ar_step": self.draft_tok / self.draft_u if self.draft_u > 0 else None,
                "calibration_bins": {"edges": list(PROB_BINS[:-1]) + [1.0], "nodes": [int(n) for n in self.bin_n],
                                     "predicted": self.bin_pred, "accepted": self.bin_real},
                "chosen_budgets": {int(b): n for b, n in sorted(self.chosen.items())},
                "round_cost_ar_steps": self.round_cost() if self.draft_n > 0 else None, "probes": self.probes,
                "prior": self.prior, "lookup_acceptance": self.lookup.summary(), "rule": self.rule,
                "budget_outcomes": {b: {"rounds": self.out_n[b], "increment": self.out_tok[b] / self.out_n[b]}
                                    for b in range(1, len(self.out_n)) if self.out_n[b] > 1e-9}}


def prune_to(tree: Tree, budget: int, beta: float = 0.0, chain_pos: torch.Tensor | None = None):
    """The ``budget`` best nodes of ``tree`` by ``score + beta * depth`` (prefix-closed for beta <= 0 since path
    scores never increase along a path; DARTree Lemma 1), re-indexed topologically. With ``chain_pos`` [M]
    (lookup chain positions, :mod:`dartree.decode.lookup`) returns (tree, the kept nodes' chain positions)."""
    pruned, keep = select_top_b_keep(tree, budget, beta)
    return pruned if chain_pos is None else (pruned, chain_pos[keep])


@torch.inference_mode()
def calibrate(target, drafter, context_ids, *, max_budget: int = 16, reps: int = 5) -> CostModel:
    """Measure t_AR, t_verify(T) for T in :data:`CALIBRATION_SIZES` (and ``max_budget + 1``) and t_draft with a
    few forwards on ``context_ids`` (the fastest of ``reps`` after one warm-up each, since other load only adds
    time; the sizes interleaved within each pass, so a drift of the machine's speed shifts them alike; t_verify
    made non-decreasing in T), in the calling process.

    Args:
        target: a :class:`dartree.models.target.Target` whose capture layers are the drafter's.
        drafter: the :class:`dartree.models.drafter.DFlashDrafter`.
        context_ids: [T0] committed token ids (T0 >= 2), e.g. the first prompt.
        max_budget: B_max, the largest tree considered.
        reps: timed repetitions per size.
    Returns:
        A fresh :class:`CostModel`.
    Raises:
        ValueError: fewer than 2 context tokens, or max_budget < 1.
    """
    ids = [int(t) for t in context_ids]
    if len(ids) < 2:
        raise ValueError(f"calibrate needs at least 2 context tokens, got {len(ids)}")
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    cache = target.new_cache()
    start = len(ids) - 1
    out = target.forward(torch.tensor([ids[:-1]], device=target.device), cache=cache, logits_slice=slice(-1, None))
    feats = out.features[0]
    sizes = sorted(set(CALIBRATION_SIZES) | {max_budget + 1})
    trees = {t: Tree(torch.full((t - 1,), ids[-1], dtype=torch.long), torch.arange(t - 1, dtype=torch.long),
                     torch.arange(1, t, dtype=torch.long), torch.zeros(t - 1)) for t in sizes}
    times: dict[int, list[float]] = {t: [] for t in sizes}
    # sizes interleaved, one forward of each per pass (pass 0 warms up): a machine whose speed drifts during the
    # calibration then shifts every size alike instead of distorting the curve's shape
    for r in range(reps + 1):
        for t in sizes:
            t0 = time.perf_counter()
            if t == 1:  # as the loop's plain AR step: the root alone, no mask
                target.forward(torch.tensor([[ids[-1]]], device=target.device),
                               position_ids=torch.tensor([[start]], device=target.device), cache=cache)
            else:
                inp = compile_tree(trees[t], ids[-1], start, dtype=target.dtype, device=target.device)
                target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                               cache=cache)
            dt = time.perf_counter() - t0
            compact_cache(cache, start, torch.zeros(0, dtype=torch.long))
            if r:
                times[t].append(dt)
    verify_s = {t: min(times[t]) for t in sizes}  # the least-disturbed forward: other load only ever adds time
    running = 0.0
    for t in sorted(verify_s):  # a longer verify never costs less (noise can say otherwise): running max
        running = verify_s[t] = max(verify_s[t], running)
    draft_times = []
    for r in range(reps + 1):
        dcache = DraftCache(len(drafter.layers))
        # the steady-state draft: context already cached, a few new positions appended
        draft_block(target, drafter, ids[-1], start - 2, feats[: start - 2], dcache)
        t0 = time.perf_counter()
        draft_block(target, drafter, ids[-1], start, feats[start - 2: start], dcache)
        dt = time.perf_counter() - t0
        if r:
            draft_times.append(dt)
    return CostModel(t_ar=verify_s[1], t_draft=min(draft_times), verify_s=verify_s,
                     max_budget=int(max_budget))


def expected_rate(model: CostModel, tau: float, budget: int) -> float:
    """Tokens per second a method with acceptance length ``tau`` and ``budget`` nodes would reach under the
    model (a planning aid for reports): tau / (t_draft + t_build + t_verify(budget + 1))."""
    if budget <= 0:
        return 1.0 / model.t_ar
    return tau / (model.t_draft + model.t_build + model.verify_time(budget + 1))



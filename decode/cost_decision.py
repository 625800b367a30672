"""The draft decision of the cost model (:class:`~dartree.decode.budget.CostModel`): whether a round drafts at all,
or is a plain AR step (no draft, no tree).

Before drafting, the round is skipped for a plain AR step (no draft, no tree) when even an optimistic estimate of
the drafted rounds' rate is below AR's: tokens the target accepted per AR step of the rounds as the loop timed them
(draft to commit), a discounted mean over about the last 100 rounds plus one standard error (discounted UCB,
Garivier & Moulines 2011), against the 1-token forwards the loop timed over the same rounds (one plain AR step
after every :data:`ANCHOR_EVERY` drafted rounds keeps them current). Every round's seconds count in AR steps of its
own moment (seconds / t_verify(1), the calibrated 1-token forward times the online scale
:attr:`~dartree.decode.cost_timing.TimingPart.speed`, which every verify forward moves), so a drafted round timed in
a slow minute is set against AR steps of that minute, not against AR steps timed minutes earlier or later. While
drafting pays, the bound is above AR and every round drafts; while it does not, skipped rounds discount the drafted
rounds' weight, the standard error grows, and a probe round drafts again (rarely when drafting loses by far, often
when it loses narrowly); a probe verifies at least one node even where
:meth:`~dartree.decode.budget.CostModel.choose` would keep none, since a probe that verifies nothing measures only the
draft's cost and teaches the acceptance calibration nothing.

The skip rule counts the tokens the target accepted, not the calibrated promise: the calibration pools every
context, so where the drafter does worse than on average it promises too much.

No few rounds can lock drafting out. Every timing sample is winsorised at
:data:`~dartree.decode.cost_timing.OUTLIER_CLIP` times what the model expected of it, and the drafted round's cost
that the bound divides by is the median of the last :data:`COST_WINDOW` rounds' costs
(:meth:`DecisionPart.round_cost`), so rounds that paid a one-time cost or met a burst of other load barely move it;
while drafting looks behind, a probe drafts at least every :meth:`DecisionPart.probe_gap` rounds (its cost bounded
by a share of the AR steps around it), so the policy keeps looking whatever its statistics say. The policy starts
from evidence, not from the first timed rounds: :func:`dartree.decode.generate.seed_policy` drafts and verifies a
calibration prompt with the run's own builder before anything is timed, and :meth:`DecisionPart.finish_seeding`
keeps that pass's acceptance calibration, round costs and tokens per round as a prior worth :data:`PRIOR_ROUNDS`
rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dartree.decode.cost_timing import OUTLIER_CLIP, _clip

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


def _median(vals: list[float]) -> float:
    """The median of a non-empty list."""
    v = sorted(vals)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


@dataclass
class DecisionPart:
    """The draft decision's fields and methods of :class:`~dartree.decode.budget.CostModel`: the drafted and
    undrafted rounds' discounted statistics, the recent round costs, the probes and the seeded prior (a base class it
    composes with :class:`~dartree.decode.cost_acceptance.AcceptancePart` and
    :class:`~dartree.decode.cost_timing.TimingPart`; not used alone).

    Attributes: ``draft_n``, ``draft_tok``, ``draft_tok2``, ``draft_s``, ``draft_u``, ``undrafted_n``,
    ``undrafted_tok``, ``undrafted_s``, ``undrafted_u``, :attr:`since_anchor`, :attr:`chosen`, :attr:`costs`,
    :attr:`skipped`, :attr:`probes` and :attr:`prior`, as :class:`~dartree.decode.budget.CostModel` describes them.
    """

    draft_n: float = 0.0
    draft_tok: float = 0.0
    draft_tok2: float = 0.0
    draft_s: float = 0.0
    draft_u: float = 0.0
    undrafted_n: float = 0.0
    undrafted_tok: float = 0.0
    undrafted_s: float = 0.0
    undrafted_u: float = 0.0
    since_anchor: int = 0
    chosen: dict = field(default_factory=dict)
    costs: list = field(default_factory=list)
    skipped: int = 0
    probes: int = 0
    prior: dict | None = None
    _pending: tuple | None = field(default=None, repr=False, compare=False)
    _probe: bool = field(default=False, repr=False, compare=False)
    _lost: bool = field(default=False, repr=False, compare=False)
    _modelled_steps: float = field(default=0.0, repr=False, compare=False)
    _force: int = field(default=0, repr=False, compare=False)
    _seed_ar: int = field(default=0, repr=False, compare=False)
    _seeded: int = field(default=0, repr=False, compare=False)

    @property
    def spec_rate(self) -> float | None:
        """Tokens per second of the drafted rounds (discounted; seconds as the loop timed them), or None before any."""
        return self.draft_tok / self.draft_s if self.draft_n > 0 else None

    @property
    def undrafted_rate(self) -> float | None:
        """Tokens per second of the rounds without the drafter (lookup rounds), the same way, or None."""
        return self.undrafted_tok / self.undrafted_s if self.undrafted_n > 0 else None

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

    def probe_gap(self, alternative: float = 1.0) -> int:
        """Rounds without the drafter after which :meth:`should_draft` drafts a probe even while drafting looks
        behind: max(:data:`PROBE_MIN_GAP`, :data:`PROBE_RATIO` x (c - 1 / a)), c = (t_draft + t_build +
        t_verify(2)) / t_verify(1) the modelled cost of a one-node drafted round in AR steps, a = ``alternative``
        the tokens per AR step of the rounds without the drafter (1 for plain AR steps). A probe commits at least
        one token where the alternative would have committed c x a, so the forced probes lose at most
        1 / PROBE_RATIO of the tokens of the rounds between them."""
        c = (self.round_overhead() + self.verify_time(2)) / self.verify_time(1)
        return max(PROBE_MIN_GAP, int(PROBE_RATIO * max(c - 1.0 / max(alternative, 1e-9), 0.0) + 0.999999))

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
        self._fade_outcomes()
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

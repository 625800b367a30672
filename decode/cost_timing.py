"""The timing side of the cost model (:class:`~dartree.decode.budget.CostModel`): what a verify forward of T tokens,
a draft and a tree build cost now, in seconds.

The start-up calibration (:func:`~dartree.decode.budget.calibrate`) measures t_AR, the verify curve t_verify(T) at a
few sizes T and t_draft, in the process that decodes. The loop then keeps them current, since on a shared machine the
same forward drifts within minutes and a start-up calibration alone goes stale: every timed verify moves an online
scale of the whole curve (:attr:`TimingPart.speed`), consecutive 1-token and T-token verifies correct the curve's
shape per calibrated size (:attr:`TimingPart.shape`: their ratio t(T) / t(1) is free of the machine's speed), and the
timed drafts and builds follow t_draft and t_build. A 1-token verify is also a plain AR step of its moment
(``ar_n``, ``ar_s``, ``ar_u``): what the alternative to drafting costs now
(:mod:`dartree.decode.cost_decision`). Every timing sample is winsorised at :data:`OUTLIER_CLIP` times what the model
expected of it, so a round that paid a one-time cost or met a burst of other load barely moves the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# EMA weight of the online timing updates (observe_verify / observe_draft): about the last 10 rounds
SPEED_EMA = 0.1
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


def _clip(ratio: float, k: float) -> float:
    """``ratio`` winsorised to [1 / k, k]."""
    return min(max(ratio, 1.0 / k), k)


@dataclass
class TimingPart:
    """The timing fields and methods of :class:`~dartree.decode.budget.CostModel` (a base class it composes with
    :class:`~dartree.decode.cost_acceptance.AcceptancePart` and :class:`~dartree.decode.cost_decision.DecisionPart`;
    not used alone).

    Attributes: ``t_ar``, ``t_draft``, ``verify_s``, ``max_budget``, ``t_build``, ``ar_n``, ``ar_s``, ``ar_u``,
    :attr:`speed` and :attr:`shape`, as :class:`~dartree.decode.budget.CostModel` describes them.
    """

    t_ar: float
    t_draft: float
    verify_s: dict
    max_budget: int = 16
    t_build: float = 0.0
    ar_n: float = 0.0
    ar_s: float = 0.0
    ar_u: float = 0.0
    speed: float = 1.0
    shape: dict = field(default_factory=dict)
    _pts: list | None = field(default=None, repr=False, compare=False)
    _last_verify: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def ar_rate(self) -> float:
        """Tokens per second of a plain AR step now: the discounted mean of the loop's timed 1-token forwards, or
        1 / :meth:`verify_time` (1) before any."""
        return self.ar_n / self.ar_s if self.ar_n > 0 and self.ar_s > 0 else 1.0 / self.verify_time(1)

    def round_overhead(self) -> float:
        """Seconds a drafted round spends before its verify: t_draft + t_build (a batch's model scales both by its
        rows, :class:`~dartree.decode.batch_budget.BatchCostModel`)."""
        return self.t_draft + self.t_build

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

    def observe_build(self, seconds: float) -> None:
        """Fold one measured tree-build time (``seconds``) into ``t_build`` (EMA, weight 0.2; the first one sets it,
        later ones are winsorised at :data:`OUTLIER_CLIP` times ``t_build``)."""
        if self.t_build <= 0.0:
            self.t_build = seconds
        else:
            self.t_build = 0.8 * self.t_build + 0.2 * self.t_build * _clip(seconds / self.t_build, OUTLIER_CLIP)

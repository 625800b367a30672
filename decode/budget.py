"""Cost-model verification budget (``--budget auto``): choose each round's tree size B for tokens per second.

One speculative round costs t_draft + t_build + t_verify(B + 1) and commits 1 + (accepted drafts) tokens;
a plain AR step costs t_AR and commits 1. With the tree's own path probabilities as acceptance estimates
(a node's path score s is a sum of log q~ over its path, so exp(s) estimates the probability that the target
accepts the whole path; the expected number of accepted drafts of a prefix-closed tree is the sum of exp(s)
over its nodes), the expected rate of a tree made of the b best nodes is

    rate(b) = (1 + c * sum_{i <= b} exp(s_i)) / t_verify(b + 1)          (draft and build are already paid)

and the round verifies the b* that maximises it (b* = 0 is a plain AR step on the already-drafted round).

:class:`CostModel` composes three parts, each in its own module with the part of the policy it holds:

- :mod:`dartree.decode.cost_timing` (:class:`~dartree.decode.cost_timing.TimingPart`): the costs, t_verify(T),
  t_draft and t_build, calibrated at start-up and followed online;
- :mod:`dartree.decode.cost_acceptance` (:class:`~dartree.decode.cost_acceptance.AcceptancePart`): the calibration
  ``c(p)`` of the drafter's probabilities and the default budget rule, ``"outcomes"``, which learns what each budget
  accepts from the rounds' outcomes;
- :mod:`dartree.decode.cost_decision` (:class:`~dartree.decode.cost_decision.DecisionPart`): whether a round drafts
  at all (the skip rule, its probes and anchors, the seeded prior).

:meth:`CostModel.choose` sizes a built tree with the rule, and :meth:`CostModel.record` feeds the verified round back
to all three.

The rule is the adaptive verification budget that DARTree (arXiv 2608.13524, conclusion) leaves as future work; it
generalises DSpark's confidence-scheduled chain length (arXiv 2607.05147, Algorithm 1) from a chain to any tree
builder. The timings are calibrated at start-up with a few forwards (:func:`calibrate`), in the process that
decodes. The failures each safeguard answers and the replays behind the constants are in docs/budget.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dartree.decode.cost_acceptance import PROB_BINS, AcceptancePart
from dartree.decode.cost_decision import DecisionPart
from dartree.decode.cost_timing import TimingPart
from dartree.decode.draft import draft_block
from dartree.decode.trees import Tree, select_top_b_keep
from dartree.decode.verify import compile_tree
from dartree.models.drafter import DraftCache
from dartree.models.target import compact_cache

# the verify sizes T (tokens, root included) that calibrate times, besides max_budget + 1
CALIBRATION_SIZES = (1, 2, 3, 5, 9, 17)


@dataclass
class CostModel(DecisionPart, AcceptancePart, TimingPart):
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

    def fresh(self) -> "CostModel":
        """A copy with the same timings and nothing learnt yet (calibration, draft statistics, histogram), for another
        method that shares this start-up measurement."""
        return CostModel(t_ar=self.t_ar, t_draft=self.t_draft, verify_s=dict(self.verify_s),
                         max_budget=self.max_budget, t_build=self.t_build, speed=self.speed, shape=dict(self.shape),
                         rule=self.rule)

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

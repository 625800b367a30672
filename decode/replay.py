"""Replay recorded speculative rounds at smaller budgets and under the ``--budget auto`` policy.

At temperature 0 with exact-match verification the target's greedy token at a tree node depends only on the node's
path, not on which other nodes were verified with it. So the accepted path of a round's top-b sub-tree (the b best
nodes by ``score + beta * depth``, prefix-closed for beta <= 0, DARTree Lemma 1;
:func:`~dartree.decode.budget.prune_to`) is the longest prefix of the full tree's accepted path whose nodes are all
among those b. One decode at budget B_max therefore gives, round by round, exactly what every budget b <= B_max would
have accepted in that round.

A whole decode at b would start its later rounds from other contexts, so the replayed tau of a budget is the mean
over the recorded rounds, which assumes that a round's acceptance does not depend on the rounds before it. With the
packaged drafter it hardly does: the next round accepted 0.59 drafts on average after a round that accepted none and
0.64 after one that accepted some (1,300 pruned B = 8 rounds).

Round times are modelled: ``round_s(b)`` seconds for a drafted round that verifies b nodes (draft, build and commit
included) and ``t_ar`` for a plain AR step. ``decode/bench.py --replay`` takes them from the same run's measured
stages and verify curve.
"""

from __future__ import annotations

from typing import Callable

import torch

from dartree.decode.budget import CostModel
from dartree.decode.trees import Tree, select_top_b_keep


def recorded_round(rec: dict) -> tuple[Tree, list[int]]:
    """A round recorded by ``speculative_generate`` with ``DecodeSettings(record_trees=True)`` as (tree, accepted path).

    Args:
        rec: dict with ``tokens``, ``parents``, ``depth``, ``score`` (lists, M entries) and ``accepted`` (node
            indices, root 0 first, tree node i at index i + 1).
    Returns:
        (Tree with int64 tokens/parents/depth and float32 score [M], accepted tree-node indices 0..M-1 in path order).
    Raises:
        KeyError: the record has no ``score`` (recorded before scores were kept); record it again.
    """
    if "score" not in rec:
        raise KeyError("recorded round has no 'score': record it with this version's speculative_generate and "
                       "DecodeSettings(record_trees=True)")
    tree = Tree(torch.tensor(rec["tokens"], dtype=torch.long), torch.tensor(rec["parents"], dtype=torch.long),
                torch.tensor(rec["depth"], dtype=torch.long), torch.tensor(rec["score"], dtype=torch.float32))
    return tree, [int(a) - 1 for a in rec["accepted"][1:]]


def accepted_at(tree: Tree, path: list[int], budget: int, beta: float) -> tuple[Tree, torch.Tensor]:
    """The round's top-``budget`` sub-tree and what it would have accepted.

    Args:
        tree: the verified tree (M nodes).
        path: its accepted tree-node indices (0..M-1), root excluded, in path order.
        budget: nodes kept (b >= 0); b >= M keeps the whole tree.
        beta: the depth bonus the nodes are ranked with (<= 0), as the builder's own top-B.
    Returns:
        (the sub-tree as :func:`~dartree.decode.budget.prune_to` returns it, its accepted node indices [A] int64,
        root (0) first, sub-tree node i at index i + 1, as :class:`~dartree.decode.verify.Verification` has them).
    Raises:
        ValueError: beta > 0 (from the selection).
    """
    sub, keep = select_top_b_keep(tree, budget, beta)  # the selection prune_to makes in the decode loop
    where = {int(k): i for i, k in enumerate(keep.tolist())}
    acc = [0]
    for node in path:
        if node not in where:
            break
        acc.append(where[node] + 1)
    return sub, torch.tensor(acc, dtype=torch.long)


def replay_fixed(rounds: list[tuple[Tree, list[int]]], budget: int, beta: float,
                 round_s: Callable[[int], float]) -> dict:
    """Every recorded round verified at one fixed budget.

    Args:
        rounds: (tree, accepted path) per round (:func:`recorded_round`), trees built with at least ``budget`` nodes.
        budget: nodes verified per round (>= 1).
        beta: the builder's depth bonus.
        round_s: modelled seconds of a drafted round that verifies b nodes.
    Returns:
        {"tau": committed tokens per round, "tokens", "seconds", "rate": tokens per second}.
    """
    tokens = sum(int(accepted_at(t, p, budget, beta)[1].numel()) for t, p in rounds)
    seconds = len(rounds) * round_s(budget)
    return {"tau": tokens / max(1, len(rounds)), "tokens": tokens, "seconds": seconds,
            "rate": tokens / seconds if seconds else float("nan")}


def replay_auto(rounds: list[tuple[Tree, list[int]]], cm: CostModel, beta: float,
                round_s: Callable[[int], float], t_ar: float) -> dict:
    """The ``--budget auto`` policy (:class:`~dartree.decode.budget.CostModel`) over the recorded rounds.

    Each round runs as ``speculative_generate`` runs it: :meth:`~CostModel.should_draft` first (a round that skips
    the drafter is a plain AR step: 1 token in ``t_ar`` seconds, and takes that recorded round's place), then
    :meth:`~CostModel.choose` sizes the recorded tree, the sub-tree's replayed acceptance and modelled seconds go to
    :meth:`~CostModel.record`, and the verify and draft times to the online timing updates.

    Args:
        rounds: (tree, accepted path) per round, trees built with ``cm.max_budget`` nodes.
        cm: a calibrated cost model (updated in place; pass ``fresh()`` copies to compare runs).
        beta: the builder's depth bonus.
        round_s: modelled seconds of a drafted round that verifies b nodes (b = 0 included: drafted, nothing kept).
        t_ar: seconds of a plain AR step.
    Returns:
        {"tau", "tokens", "seconds", "rate", "chosen": {b: rounds}} (b = 0: AR steps, anchors included).
    """
    tokens, seconds = 0, 0.0
    for tree, path in rounds:
        if not cm.should_draft():
            cm.record(Tree.empty(), torch.zeros(1, dtype=torch.long), seconds=t_ar)
            cm.observe_verify(1, t_ar)
            tokens, seconds = tokens + 1, seconds + t_ar
            continue
        b, _ = cm.choose(tree, beta)
        sub, acc = accepted_at(tree, path, b, beta)
        s = round_s(b)
        cm.record(sub, acc, seconds=s)
        cm.observe_verify(b + 1, cm.verify_time(b + 1))
        tokens, seconds = tokens + int(acc.numel()), seconds + s
    return {"tau": tokens / max(1, len(rounds)), "tokens": tokens, "seconds": seconds,
            "rate": tokens / seconds if seconds else float("nan"),
            "chosen": {int(b): n for b, n in sorted(cm.chosen.items())}}


def replay_hindsight(rounds: list[tuple[Tree, list[int]]], max_budget: int, beta: float,
                     round_s: Callable[[int], float], t_ar: float, iters: int = 8) -> dict:
    """An upper bound for any per-round budget rule: each round verifies the b (0..``max_budget``; 0 is a plain AR
    step of ``t_ar`` seconds, no draft) that maximises committed tokens - R * seconds knowing what every b accepts,
    where R is the rate this rule reaches (Dinkelbach's iteration for the best ratio of sums, ``iters`` steps from
    the best fixed budget's rate). The gap between it and the best fixed budget is what a perfect per-round
    predictor of acceptance could add.

    Args:
        rounds: (tree, accepted path) per round, trees built with ``max_budget`` nodes.
        max_budget: the largest budget considered (>= 1).
        beta: the builder's depth bonus.
        round_s: modelled seconds of a drafted round that verifies b nodes.
        t_ar: seconds of a plain AR step.
        iters: Dinkelbach iterations.
    Returns:
        {"tau", "tokens", "seconds", "rate", "chosen": {b: rounds}} (rate and tau NaN without rounds).
    """
    if not rounds:
        return {"tau": float("nan"), "tokens": 0, "seconds": 0.0, "rate": float("nan"), "chosen": {}}
    acc = [[int(accepted_at(t, p, b, beta)[1].numel()) for b in range(max_budget + 1)] for t, p in rounds]
    cost = [t_ar] + [round_s(b) for b in range(1, max_budget + 1)]
    rate = max(sum(a[b] for a in acc) / (len(acc) * cost[b]) for b in range(1, max_budget + 1))
    out = {"tau": 0.0, "tokens": 0, "seconds": 0.0, "rate": rate, "chosen": {}}
    for _ in range(iters):
        chosen: dict = {}
        tokens, seconds = 0, 0.0
        for a in acc:
            b = max(range(max_budget + 1), key=lambda j: a[j] - rate * cost[j])
            chosen[b] = chosen.get(b, 0) + 1
            tokens, seconds = tokens + a[b], seconds + cost[b]
        rate = tokens / seconds
        out = {"tau": tokens / len(acc), "tokens": tokens, "seconds": seconds, "rate": rate,
               "chosen": dict(sorted(chosen.items()))}
    return out

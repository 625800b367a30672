"""Replaying recorded rounds at smaller budgets (decode/replay.py) gives what a decode at that budget accepts.

The claim the replay rests on (exactness at T = 0): at T = 0 the top-b sub-tree of a verified tree accepts the
longest prefix of the full tree's accepted path that lies inside it. Checked against real verification: a decode at
budget b whose first round verifies exactly that sub-tree accepts what the replay says, for every b.
"""

import pytest
import torch

from conftest import VOCAB, make_drafter, make_head
from dartree.decode.budget import CostModel
from dartree.decode.builders import BUILDERS
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.replay import accepted_at, recorded_round, replay_auto, replay_fixed, replay_hindsight
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree, select_top_b


class MixedOracle:
    """First round: an 8-node tree around the target's continuation r1..r4 with wrong siblings ranked between its
    nodes, cut to the requested budget by score (beta = 0); later rounds: no draft. By score the nodes rank
    w1, w1's child, r1, w2, r2, r3, w4, r4, so the first round accepts 0, 0, 1, 1, 2, 3, 3, 4 drafts at b = 1..8."""

    EXPECTED = [0, 0, 1, 1, 2, 3, 3, 4]

    def __init__(self, seq):
        self.seq, self.calls = seq, 0

    def __call__(self, block, head, root_id, budget, **_):
        self.calls += 1
        if self.calls > 1:
            return Tree.empty()
        assert root_id == self.seq[0]
        r = self.seq[1:5]
        w = [(t + 1) % VOCAB for t in r]
        toks = [w[0], r[0], 5, r[1], w[1], r[2], r[3], w[3]]
        parents = [0, 0, 1, 2, 2, 4, 6, 6]
        depth = [1, 1, 2, 2, 2, 3, 4, 4]
        score = [-0.1, -0.5, -0.3, -0.9, -0.7, -1.0, -2.0, -1.5]
        full = Tree(torch.tensor(toks), torch.tensor(parents), torch.tensor(depth), torch.tensor(score))
        return select_top_b(full, budget, 0.0)


@pytest.fixture
def mixed_oracle():
    holder = {}
    BUILDERS["test-mixed-oracle"] = lambda *a, **k: holder["oracle"](*a, **k)
    yield holder
    del BUILDERS["test-mixed-oracle"]


def test_replayed_budgets_accept_what_a_decode_at_that_budget_accepts(target, mixed_oracle):
    prompt = [40, 41, 42, 43]
    ref = autoregressive_generate(target, prompt, max_new_tokens=20, stop_ids=()).tokens
    mixed_oracle["oracle"] = MixedOracle(ref)
    full = speculative_generate(target, make_drafter(), make_head("identity"), prompt,
                                DecodeSettings(builder="test-mixed-oracle", budget=8, max_new_tokens=12, stop_ids=(),
                                               record_trees=True))
    assert full.tokens == ref[:12]
    tree, path = recorded_round(full.stats.trees[0])
    assert tree.size == 8 and len(path) == 4
    for b in range(1, 9):
        mixed_oracle["oracle"] = MixedOracle(ref)
        real = speculative_generate(target, make_drafter(), make_head("identity"), prompt,
                                    DecodeSettings(builder="test-mixed-oracle", budget=b, max_new_tokens=12,
                                                   stop_ids=(), record_trees=True))
        assert real.tokens == ref[:12]
        sub, acc = accepted_at(tree, path, b, 0.0)
        assert acc.numel() - 1 == real.stats.accepted_depths[0] == MixedOracle.EXPECTED[b - 1]
        # the replay's sub-tree is the tree that decode verified, and its accepted indices are that decode's
        rec = real.stats.trees[0]
        assert sub.tokens.tolist() == rec["tokens"] and sub.parents.tolist() == rec["parents"]
        assert acc.tolist() == rec["accepted"]


@pytest.mark.parametrize("budget", [2, 5])
def test_replay_of_the_pruned_builder_matches_its_first_rounds(target, prompts, budget):
    # the real builder: a decode at budget b verifies the top-b of the tree a decode at 12 builds, so its first round
    # (same context) accepts what the replay of the 12-node round says
    drafter, head = make_drafter(), make_head("markov")
    for p in prompts[:6]:
        settings = DecodeSettings(builder="pruned", max_new_tokens=6, stop_ids=(), record_trees=True,
                                  builder_params={"k": 8})
        big = speculative_generate(target, drafter, head, p, settings.with_(budget=12))
        small = speculative_generate(target, drafter, head, p, settings.with_(budget=budget))
        tree, path = recorded_round(big.stats.trees[0])
        sub, acc = accepted_at(tree, path, budget, -0.2)
        assert sub.tokens.tolist() == small.stats.trees[0]["tokens"]
        assert acc.tolist() == small.stats.trees[0]["accepted"]


def _rounds():
    # three chain rounds of 4 nodes (scores strictly falling along the chain) accepting 0, 2 and 4 drafts
    def chain(n_acc):
        tree = Tree(torch.arange(10, 14), torch.arange(4), torch.arange(1, 5), -torch.arange(1, 5).float())
        return tree, list(range(n_acc))
    return [chain(0), chain(2), chain(4)]


def test_replay_fixed_counts_the_prefix_inside_each_budget():
    rounds = _rounds()
    cost = lambda b: 1.0 + 0.5 * b  # noqa: E731
    got = {b: replay_fixed(rounds, b, 0.0, cost) for b in (1, 2, 4)}
    # accepted drafts per round at b = 1: 0, 1, 1; b = 2: 0, 2, 2; b = 4: 0, 2, 4 (plus one bonus token each)
    assert [got[b]["tokens"] for b in (1, 2, 4)] == [5, 7, 9]
    assert got[2]["tau"] == pytest.approx(7 / 3)
    assert got[4]["seconds"] == pytest.approx(9.0) and got[4]["rate"] == pytest.approx(1.0)


def test_hindsight_bounds_every_fixed_budget_and_the_auto_policy():
    rounds = _rounds() * 20
    cost = lambda b: 1.1 + 0.05 * b  # noqa: E731
    fixed = max(replay_fixed(rounds, b, 0.0, cost)["rate"] for b in range(1, 5))
    cm = CostModel(t_ar=1.0, t_draft=1.1, verify_s={t: 1.0 + 0.05 * (t - 1) for t in (1, 2, 3, 5)}, max_budget=4)
    auto = replay_auto(rounds, cm, 0.0, cost, t_ar=1.0)
    hind = replay_hindsight(rounds, 4, 0.0, cost, t_ar=1.0)
    assert sum(auto["chosen"].values()) == len(rounds)
    # in hindsight: an AR step for the round that accepts nothing (1 token in 1.0 instead of 1 in 1.15+), 2 nodes for
    # the 2-draft round, 4 for the 4-draft one
    assert hind["chosen"] == {0: 20, 2: 20, 4: 20}
    assert hind["rate"] == pytest.approx((20 + 60 + 100) / (20 * 1.0 + 20 * 1.2 + 20 * 1.3))
    assert hind["rate"] >= fixed and hind["rate"] >= auto["rate"]
    # drafting pays here (fixed B = 4: 180 tokens in 78 s against AR's 1 per second), and auto drafts most rounds
    assert auto["rate"] > 1.5 and auto["chosen"].get(0, 0) < len(rounds) // 4


def test_a_round_recorded_without_scores_is_refused_with_the_fix():
    with pytest.raises(KeyError, match="record_trees"):
        recorded_round({"tokens": [3], "parents": [0], "depth": [1], "accepted": [0]})

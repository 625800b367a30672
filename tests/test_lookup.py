"""Prompt-lookup chains grafted onto draft trees (decode/lookup.py): the n-gram match itself, the graft's tree
invariants (shared prefixes merge, topological order, scores non-increasing along paths so top-B stays
prefix-closed) and losslessness of every builder with the graft, fixed and auto budgets (output equals greedy AR)."""

import math

import pytest
import torch

from conftest import make_drafter, make_head
from dartree.decode.budget import CostModel
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.lookup import LookupStats, graft_chain, lookup_match
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree, select_top_b_keep

STOP = 1


def t(*xs):
    return torch.tensor(xs, dtype=torch.long)


def lookup_chain(*args, **kw):
    return lookup_match(*args, **kw)[0]


def test_lookup_chain_takes_the_longest_recent_ngram():
    # "5 6 7" recurs: the most recent earlier occurrence (index 5) is followed by 9 9; the 1-gram alone would
    # point elsewhere
    ctx = t(5, 6, 7, 8, 8, 5, 6, 7, 9, 9, 4, 5, 6, 7)
    assert lookup_chain(ctx, 4).tolist() == [9, 9, 4, 5]
    assert lookup_chain(ctx, 1).tolist() == [9]
    assert lookup_match(ctx, 2)[1] == 3 and lookup_match(t(3, 2, 1, 3), 5)[1] == 1 and lookup_match(ctx, 0)[1] == 0
    # only a 1-gram matches: 3 was last followed by 2
    assert lookup_chain(t(3, 2, 1, 3), 5).tolist() == [2, 1, 3]
    # nothing recurs, or nothing asked
    assert lookup_chain(t(1, 2, 3, 4), 5).numel() == 0 and lookup_chain(ctx, 0).numel() == 0
    assert lookup_chain(t(7), 3).numel() == 0
    # min_ngram 2: a lone 1-gram match is not enough
    assert lookup_chain(t(3, 2, 1, 3), 5, max_ngram=3, min_ngram=2).numel() == 0
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        lookup_chain(ctx, 3, max_ngram=1, min_ngram=2)


def test_graft_merges_shared_prefix_and_keeps_scores_monotone():
    # drafter tree: root -> 10 (node 1) -> 11 (node 2); root -> 20 (node 3)
    tree = Tree(t(10, 11, 20), t(0, 1, 0), t(1, 2, 1), torch.log(torch.tensor([0.6, 0.3, 0.2])))
    chain, probs = t(10, 12, 13), torch.tensor([0.9, 0.5, 0.25])
    merged, pos = graft_chain(tree, chain, probs)
    # 10 is shared (boosted to the chain's 0.9); 12 and 13 are new, under node 1 and then under 12
    assert merged.tokens.tolist() == [10, 11, 20, 12, 13]
    assert merged.parents.tolist() == [0, 1, 0, 1, 4] and merged.depth.tolist() == [1, 2, 1, 2, 3]
    assert pos.tolist() == [1, 0, 0, 2, 3]
    assert math.isclose(float(merged.score[0]), math.log(0.9), rel_tol=1e-6)
    for i, p in enumerate(merged.parents.tolist()):  # parents come first, scores never rise along a path
        assert p <= i and (p == 0 or merged.score[i] <= merged.score[p - 1] + 1e-7)
    # a chain that leaves the drafter's tree under a weak node is capped at that node's score
    merged2, _ = graft_chain(tree, t(20, 21), torch.tensor([0.1, 0.08]))
    assert merged2.tokens.tolist()[-1] == 21 and float(merged2.score[-1]) <= math.log(0.2) + 1e-6
    # top-B of the union stays prefix-closed and the chain positions follow the selection
    kept, keep = select_top_b_keep(merged, 3, -0.2)
    assert torch.all(kept.parents < torch.arange(1, 4)) and pos[keep].tolist() == [1, 0, 2]
    # an empty chain leaves the tree as it was
    same, pos0 = graft_chain(tree, t(), torch.zeros(0))
    assert same is tree and pos0.tolist() == [0, 0, 0]


def test_lookup_stats_learn_conditional_acceptance():
    st = LookupStats()
    assert st.path_probs(3).tolist() == pytest.approx([0.5, 0.35, 0.245])  # priors: 0.5, then 0.7 per step
    # chain of 3 verified 10 times: positions 1, 2 always accepted, position 3 never
    for _ in range(10):
        st.record(t(1, 2, 3, 0), t(0, 1, 2))
    got = st.path_probs(3)
    p1, c2, c3 = (10 + 1.0) / 12, (10 + 1.4) / 12, (0 + 1.4) / 12
    assert got.tolist() == pytest.approx([p1, p1 * c2, p1 * c2 * c3])
    assert st.summary() == {"n=0": {1: [10, 10], 2: [10, 10], 3: [10, 0]}}
    # a round that rejects position 1 teaches nothing about position 2 given position 1: only position 1 counts
    st.record(t(1, 2, 3), t(0))
    assert st.summary()["n=0"] == {1: [11, 10], 2: [10, 10], 3: [10, 0]}
    # ... so rejections at position 1 leave the deeper conditionals where the evidence put them
    fresh = LookupStats()
    for _ in range(6):
        fresh.record(t(1, 2), t(0))
    assert fresh.conditional(2) == pytest.approx(0.7) and fresh.conditional(1) == pytest.approx(1.0 / 8)
    # by matched n-gram size: 3-gram matches always right at position 1, 1-gram matches never; each size
    # shrinks towards the pooled position estimate
    st = LookupStats()
    for _ in range(20):
        st.record(t(1), t(0, 1), ngram=3)
        st.record(t(1), t(0), ngram=1)
    pooled = (20 + 1.0) / 42
    assert st.path_probs(1, 3)[0] == pytest.approx((20 + 2 * pooled) / 22)
    assert st.path_probs(1, 1)[0] == pytest.approx((0 + 2 * pooled) / 22)
    assert st.path_probs(1)[0] == pytest.approx(pooled)


@pytest.mark.parametrize("builder", ["chain", "pruned", "ddtree", "pctree", "fixed"])
@pytest.mark.parametrize("budget", [4, "auto"])
def test_lookup_graft_is_lossless_and_accepts_repeats(target, prompts, builder, budget):
    drafter, head = make_drafter(), make_head("markov", target)
    total = {0: 0, 1: 0}
    for p in prompts[:3]:
        want = autoregressive_generate(target, p, max_new_tokens=48, stop_ids=[STOP]).tokens
        for lk in (0, 6):
            cm = CostModel(t_ar=1.0, t_draft=0.1, verify_s={1: 1.0, 2: 1.02, 5: 1.1, 9: 1.2, 17: 1.5, 33: 2.0},
                           max_budget=16) if budget == "auto" else None
            got = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, budget=budget,
                                                                                max_new_tokens=48, stop_ids=[STOP],
                                                                                lookup=lk), cost_model=cm)
            assert got.tokens == want
            total[lk > 0] += sum(got.stats.accepted_depths)
            if cm is not None and lk:
                assert sum(cm.lookup.verified.values()) > 0  # lookup nodes were verified
    # a random tiny target's greedy text falls into loops that the lookup predicts: more drafts accepted
    assert total[1] > total[0]


def test_lookup_argument_errors(target, prompts):
    drafter, head = make_drafter(), make_head("markov", target)
    with pytest.raises(ValueError, match="lookup must be an int >= 0"):
        speculative_generate(target, drafter, head, prompts[0], DecodeSettings(max_new_tokens=4, lookup=-1))
    with pytest.raises(ValueError, match="acceptance='match'"):
        speculative_generate(target, drafter, head, prompts[0], DecodeSettings(builder="chain", max_new_tokens=4,
                                                                               lookup=4, temperature=1.0,
                                                                               acceptance="rejection"),
                             generator=torch.Generator().manual_seed(0))


def test_rounds_that_skip_the_drafter_still_verify_the_lookup_chain(target, prompts):
    # a draft that costs 50 AR steps: the cost model skips the drafter nearly every round (as in
    # test_decode_speed), but a lookup chain costs nothing to draft, so those rounds verify it instead of a lone
    # root; the output still equals AR
    drafter, head = make_drafter(), make_head("markov", target)
    p = prompts[0]
    want = autoregressive_generate(target, p, max_new_tokens=60, stop_ids=()).tokens
    cm = CostModel(t_ar=1.0, t_draft=50.0, verify_s={1: 1.0, 2: 1.02, 5: 1.1, 9: 1.2, 17: 1.5}, max_budget=16)
    got = speculative_generate(target, drafter, head, p, DecodeSettings(builder="pruned", budget="auto",
                                                                        max_new_tokens=60, stop_ids=(), lookup=8),
                               cost_model=cm)
    assert got.tokens == want
    st = got.stats
    assert sum(b > 0 for b in st.budgets) > 7  # more verified trees than the at most 7 drafted rounds
    assert sum(st.accepted_depths) > 0 and sum(cm.lookup.accepted.values()) > 0

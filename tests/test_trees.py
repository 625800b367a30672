"""Tree builders (TESTING.md class I): determinism, budgets, prefix closure, width, edge cases."""

import pytest
import torch

from conftest import make_markov
from dartree.decode.trees import DraftBlock, Tree, build_supertree, candidates, get_builder, select_top_b
from dartree.models.heads import IdentityHead


def _block(p=6, v=96, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return DraftBlock(torch.randn(p, 32, generator=g), torch.randn(p, v, generator=g) * scale)


def _prefix_closed(tree: Tree) -> bool:
    par = tree.parents.tolist()
    dep = [0] + tree.depth.tolist()
    return all(0 <= p < i + 1 and dep[i + 1] == dep[p] + 1 for i, p in enumerate(par))


@pytest.mark.parametrize("builder", ["chain", "pruned"])
@pytest.mark.parametrize("budget", [0, 1, 5, 17, 64])
def test_budget_respected_and_prefix_closed(builder, budget):
    for head in (IdentityHead(), make_markov()):
        t = get_builder(builder)(_block(), head, 7, budget, k=16, width=4)
        assert t.size <= budget and _prefix_closed(t)
        assert t.size == min(budget, 6 if builder == "chain" else 6 * 4)


def test_equal_scores_give_the_same_tree_with_low_ids_first():
    block = DraftBlock(torch.zeros(4, 32), torch.zeros(4, 50))
    trees = [get_builder("pruned")(block, IdentityHead(), 3, 6, k=5, width=3) for _ in range(3)]
    for t in trees[1:]:
        assert torch.equal(t.tokens, trees[0].tokens) and torch.equal(t.parents, trees[0].parents)
    assert trees[0].tokens[:3].tolist() == [0, 1, 2]  # depth 1: the lowest ids among the tied candidates
    ids, _ = candidates(torch.zeros(2, 50), 4)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2


def test_supertree_width_per_depth_and_scores_non_increasing():
    sup = build_supertree(_block(), make_markov(), 7, k=16, quota=lambda d, avail: min(5, avail))
    assert torch.bincount(sup.depth).tolist()[1:] == [5] * 6
    full = torch.cat([torch.zeros(1), sup.score])
    assert bool((sup.score <= full[sup.parents] + 1e-6).all())


def test_top_b_ranks_by_score_plus_beta_depth():
    # root -> a (depth 1, -0.1), a -> b (depth 2, -0.2), root -> c (depth 1, -0.25)
    t = Tree(torch.tensor([10, 11, 12]), torch.tensor([0, 1, 0]), torch.tensor([1, 2, 1]),
             torch.tensor([-0.1, -0.2, -0.25]))
    assert select_top_b(t, 2, 0.0).tokens.tolist() == [10, 11]
    assert select_top_b(t, 2, -0.2).tokens.tolist() == [10, 12]  # b: -0.6 < c: -0.45
    with pytest.raises(ValueError, match="beta"):
        select_top_b(t, 2, 0.1)


def test_pruned_width_1_is_the_chain_and_k1_v_smaller_than_k():
    head = make_markov()
    block = _block()
    chain = get_builder("chain")(block, head, 7, 6, k=16)
    w1 = get_builder("pruned")(block, head, 7, 64, k=16, width=1)
    assert torch.equal(chain.tokens, w1.tokens) and torch.equal(chain.parents, w1.parents)
    k1 = get_builder("pruned")(block, head, 7, 64, k=1, width=12)
    assert k1.size == 6 and torch.equal(k1.tokens, block.base_logits.argmax(-1))
    small = DraftBlock(torch.randn(3, 32), torch.randn(3, 5))
    t = get_builder("pruned")(small, IdentityHead(), 1, 64, k=64, width=12)
    assert t.size == 5 + 12 + 12 and _prefix_closed(t)


def test_bad_builder_parameters_are_errors():
    with pytest.raises(TypeError, match="widht"):
        get_builder("pruned")(_block(), IdentityHead(), 7, 8, widht=4)
    with pytest.raises(ValueError, match="width"):
        get_builder("pruned")(_block(), IdentityHead(), 7, 8, width=0)
    with pytest.raises(ValueError, match="K must be"):
        get_builder("chain")(_block(), IdentityHead(), 7, 8, k=0)
    with pytest.raises(ValueError, match="beta"):
        get_builder("pruned")(_block(), IdentityHead(), 7, 8, beta=0.5)


def test_ddtree_equals_brute_force_top_b_prefixes():
    import itertools

    g = torch.Generator().manual_seed(4)
    p, v = 3, 4
    block = DraftBlock(torch.zeros(p, 32), torch.randn(p, v, generator=g) * 2)
    lp = torch.log_softmax(block.base_logits, -1)
    prefixes = []
    for d in range(1, p + 1):
        for path in itertools.product(range(v), repeat=d):
            prefixes.append((float(sum(lp[i, t] for i, t in enumerate(path))), path))
    for budget in (1, 5, 13, 40, 84):
        want = {path for _, path in sorted(prefixes, key=lambda x: -x[0])[:budget]}
        t = get_builder("ddtree")(block, IdentityHead(), 0, budget)
        got, paths = set(), {0: ()}
        for i, (tok, par) in enumerate(zip(t.tokens.tolist(), t.parents.tolist()), start=1):
            paths[i] = paths[par] + (tok,)
            got.add(paths[i])
        assert got == want and t.size == min(budget, len(prefixes)) and _prefix_closed(t)


def test_dartree_fixed_spends_the_budget_evenly():
    t = get_builder("fixed")(_block(p=16), make_markov(), 7, 64, k=16)
    assert t.size == 64 and torch.bincount(t.depth).tolist()[1:] == [4] * 16 and _prefix_closed(t)
    t = get_builder("dartree-fixed")(_block(p=6), IdentityHead(), 7, 10, k=16)
    assert t.size == 10 and torch.bincount(t.depth).tolist()[1:] == [2, 2, 2, 2, 1, 1]

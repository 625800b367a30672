"""Tree builders: determinism, budgets, prefix closure, width, edge cases."""

import numpy as np
import pytest
import torch

from conftest import make_markov
from dartree.decode.builders import get_builder
from dartree.decode.builders.supertree import build_supertree
from dartree.decode.trees import DraftBlock, Tree, candidates, select_top_b
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


def _paths(tree: Tree) -> dict:
    """token path (root excluded) -> score, for every node."""
    out, paths = {}, {0: ()}
    for i, (tok, par, sc) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), tree.score.tolist()), 1):
        paths[i] = paths[par] + (tok,)
        out[paths[i]] = sc
    return out


def _best_first_over(tree: Tree, budget: int, beta: float) -> set:
    """Independent best-first selection over an existing tree: pop the best node whose parent is taken."""
    import heapq

    kids: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents.tolist(), 1):
        kids.setdefault(par, []).append(i)
    adj = [0.0] + (tree.score + beta * tree.depth.float()).tolist()
    heap = [(-adj[c], c) for c in kids.get(0, [])]
    heapq.heapify(heap)
    taken = []
    while heap and len(taken) < budget:
        _, c = heapq.heappop(heap)
        taken.append(c)
        for ch in kids.get(c, []):
            heapq.heappush(heap, (-adj[ch], ch))
    paths = list(_paths(tree))
    return {paths[c - 1] for c in taken}


@pytest.mark.parametrize("beta", [0.0, -0.1, -0.5])
@pytest.mark.parametrize("budget", [1, 7, 20, 40])
def test_lemma1_top_b_equals_best_first_and_is_prefix_closed(beta, budget):
    """DARTree Lemma 1: with beta <= 0, global top-B over the supertree = best-first heap selection."""
    for seed in range(3):
        head = make_markov(seed, scale=1.0)
        sup = build_supertree(_block(seed=seed), head, 7, k=16, quota=lambda d, avail: min(8, avail))
        top = select_top_b(sup, budget, beta)
        assert _prefix_closed(top) and top.size == min(budget, sup.size)
        assert set(_paths(top)) == _best_first_over(sup, budget, beta)


def test_positive_beta_is_refused_by_every_builder_that_ranks_by_depth():
    for name in ("pruned", "heap-sequential"):
        with pytest.raises(ValueError, match="prefix-closure"):
            get_builder(name)(_block(), make_markov(), 7, 8, beta=0.1)


@torch.no_grad()
def _brute_force_corrected(block, head, root, k, budget, beta):
    """All nodes of the K-ary corrected tree (scores from head.score directly), top-B by score + beta*depth."""
    ids, vals = candidates(block.base_logits, k)
    nodes = []

    def rec(state, path, score, d):
        if d == ids.shape[0]:
            return
        g = head.score(ids[d : d + 1], block.hidden[d : d + 1], state, vals[d : d + 1])[0]
        logq = torch.log_softmax(g, -1)
        for j in range(ids.shape[1]):
            tok = int(ids[d, j])
            sc = score + float(logq[j])
            nodes.append((sc + beta * (d + 1), path + (tok,)))
            rec(head.advance(state, torch.tensor([tok]), block.hidden[d : d + 1]), path + (tok,), sc, d + 1)

    rec(head.init_state(torch.tensor([root])), (), 0.0, 0)
    return {p for _, p in sorted(nodes, key=lambda x: -x[0])[:budget]}


@pytest.mark.parametrize("budget", [1, 5, 12, 30])
def test_heap_sequential_is_the_exact_top_b_of_the_corrected_tree(budget):
    for seed in range(2):
        block, head = _block(p=3, v=40, seed=seed), make_markov(seed, scale=1.0)
        t = get_builder("heap-sequential")(block, head, 7, budget, k=4, beta=-0.1)
        assert set(_paths(t)) == _brute_force_corrected(block, head, 7, 4, budget, -0.1)
        assert _prefix_closed(t) and t.size == budget


@pytest.mark.parametrize("budget", [1, 8, 20])
def test_heap_sequential_equals_pruned_when_width_covers_the_budget(budget):
    for seed in range(3):
        block, head = _block(seed=seed), make_markov(seed, scale=1.0)
        heap = get_builder("heap-sequential")(block, head, 7, budget, k=16, beta=-0.2)
        pruned = get_builder("pruned")(block, head, 7, budget, k=16, width=budget, beta=-0.2)
        hp, pp = _paths(heap), _paths(pruned)
        assert set(hp) == set(pp)
        for path, sc in hp.items():
            assert abs(sc - pp[path]) < 1e-5


@torch.no_grad()
def test_pctree_k1_is_the_chain_and_matches_a_literal_parent_conditioned_expansion():
    block, head = _block(p=6), make_markov(1, scale=1.0)
    chain = get_builder("chain")(block, head, 7, 6, k=16)
    k1 = get_builder("pctree")(block, head, 7, 64, k=16, children=1)
    assert torch.equal(chain.tokens, k1.tokens) and torch.equal(chain.parents, k1.parents)
    # literal reading: each kept parent takes its own top-k children, then the layer keeps the k best paths
    kc, budget = 3, 14
    ids, vals = candidates(block.base_logits, 16)
    frontier = [((), 0.0, head.init_state(torch.tensor([7])))]
    want, left = [], budget
    for d in range(6):
        offers = []
        for fi, (path, sc, st) in enumerate(frontier):
            g = head.score(ids[d : d + 1], block.hidden[d : d + 1], st, vals[d : d + 1])[0]
            logq = torch.log_softmax(g, -1)
            top = torch.sort(logq, descending=True, stable=True).indices[:kc]
            offers += [(sc + float(logq[j]), fi, r, int(ids[d, j]), st) for r, j in enumerate(top.tolist())]
        offers.sort(key=lambda o: (-o[0], o[1], o[2]))
        kept = offers[: min(kc, left)]
        left -= len(kept)
        want += [frontier[o[1]][0] + (o[3],) for o in kept]
        frontier = [(frontier[o[1]][0] + (o[3],), o[0],
                     head.advance(o[4], torch.tensor([o[3]]), block.hidden[d : d + 1])) for o in kept]
        if not left:
            break
    t = get_builder("pctree")(block, head, 7, budget, k=16, children=kc)
    assert list(_paths(t)) == want and t.size == budget
    assert torch.bincount(t.depth).tolist()[1:] == [3, 3, 3, 3, 2]


@pytest.mark.parametrize("builder", ["chain", "pruned", "fixed", "pctree", "heap-sequential", "ddtree"])
def test_edge_cases_budget_k_and_small_vocab(builder):
    b = get_builder(builder)
    head = make_markov()
    block = _block()
    assert b(block, head, 7, 0, k=16).size == 0
    one = b(block, head, 7, 1, k=16)
    assert one.size == 1 and one.depth.tolist() == [1] and one.parents.tolist() == [0]
    k1 = b(block, head, 7, 8, k=1)
    assert _prefix_closed(k1) and k1.size <= 8
    if builder != "ddtree":  # a single candidate per depth: the tree is the base argmax chain
        assert k1.tokens.tolist() == block.base_logits.argmax(-1)[: k1.size].tolist()
    small = DraftBlock(torch.randn(3, 32), torch.randn(3, 5))  # V = 5 < K
    t = b(small, IdentityHead(), 1, 64, k=64, width=12)
    assert _prefix_closed(t) and 1 <= t.size <= 64
    again = b(small, IdentityHead(), 1, 64, k=64, width=12)
    assert torch.equal(t.tokens, again.tokens) and torch.equal(t.parents, again.parents)


@pytest.mark.parametrize("name", ["identity", "markov", "gated_markov", "selector"])
@pytest.mark.parametrize("builder,budget", [("chain", 6), ("pruned", 9), ("fixed", 9), ("pctree", 9)])
def test_pair_tables_give_the_per_depth_frontier_tree(name, builder, budget):
    """First-order heads take the pair-table path (pair_log_probs); it must build the tree the generic per-depth
    frontier scoring builds (same nodes, scores equal up to matmul rounding)."""
    from conftest import VOCAB, make_head
    from dartree.decode.builders.supertree import pair_log_probs
    from dartree.decode.trees import block_candidates

    head = make_head(name, seed=2, scale=1.0)
    assert head.first_order
    block = _block(p=6, v=VOCAB, seed=5)
    fast = get_builder(builder)(block, head, 7, budget, k=16, width=3)
    head.first_order = False  # the instance falls back to the per-depth frontier scoring
    slow = get_builder(builder)(block, head, 7, budget, k=16, width=3)
    assert fast.size == slow.size > 0
    for f in ("tokens", "parents", "depth"):
        assert torch.equal(getattr(fast, f), getattr(slow, f)), f
    torch.testing.assert_close(fast.score, slow.score, atol=1e-5, rtol=1e-5)
    # the table row of a parent is log_softmax over C_d of g(C_d, H_d, r(parent token)) from head.score itself
    ids, vals = block_candidates(block, 16)
    head.first_order = True
    lq = pair_log_probs(block, head, 7, ids, vals)
    d, j = 3, 5
    st = head.advance(None, ids[d - 1, j : j + 1], block.hidden[d - 1 : d])
    g = head.score(ids[d][None], block.hidden[d][None], st, vals[d][None])
    torch.testing.assert_close(lq[d, j], torch.log_softmax(g[0], -1), atol=1e-5, rtol=1e-5)


def test_pair_tables_refuse_recurrent_heads(target):
    from conftest import make_head
    from dartree.decode.builders.supertree import pair_log_probs
    from dartree.decode.trees import block_candidates

    for name in ("rnn", "gru"):
        head = make_head(name, target)
        assert not head.first_order
        block = _block(v=target.vocab_size)
        ids, vals = block_candidates(block, 8)
        with pytest.raises(ValueError, match="first-order"):
            pair_log_probs(block, head, 7, ids, vals)


def test_top_q_stable_equals_a_stable_sort_with_ties():
    """The partition-based selection of the CPU builders picks and orders exactly as a stable descending sort
    (ties to the lower index), with and without ties, for every q."""
    from dartree.decode.trees import _top_q_stable

    rng = np.random.default_rng(0)
    for t in range(600):
        n = int(rng.integers(1, 80))
        x = (rng.integers(0, 4, n) if t % 2 else rng.standard_normal(n)).astype(np.float32)
        for q in (0, 1, int(rng.integers(1, n + 1)), n, n + 3):
            assert np.array_equal(_top_q_stable(x, q), np.argsort(-x, kind="stable")[:q]), (t, q)


def test_select_top_b_cpu_path_equals_the_torch_rule():
    """select_top_b_keep's NumPy path (CPU tensors) keeps the nodes the torch rule keeps (stable top-B of
    score + beta * depth), re-indexed topologically."""
    from dartree.decode.trees import _stable_topk, select_top_b_keep

    block = _block(p=6, seed=9)
    sup = get_builder("fixed")(block, make_markov(), 7, 40, k=16)
    for budget in (1, 5, 17, sup.size - 1):
        for beta in (0.0, -0.2, -1.0):
            tree, keep = select_top_b_keep(sup, budget, beta)
            want = _stable_topk(sup.score + beta * sup.depth.float(), budget).sort().values
            assert torch.equal(keep, want) and tree.size == budget
            assert torch.equal(tree.tokens, sup.tokens[want]) and _prefix_closed(tree)


def test_identity_chain_fast_path_equals_the_candidate_path():
    """The identity head's chain (DFlash's own) from one topk equals the general first-order chain exactly: tokens,
    parents, depths and scores, with ties at the maximum, bf16-valued logits, a draft vocabulary, K >= V, and a
    maximum tied more than K times (handed back to the general path)."""
    from dartree.decode.builders.chain import _chain_first_order, _chain_identity, build_chain
    from dartree.decode.trees import block_candidates

    head = IdentityHead()
    g = torch.Generator().manual_seed(5)
    tied = torch.randint(0, 4, (7, 300), generator=g).float()  # the maximum ties many times in every row
    bf16 = (torch.randn(7, 300, generator=g) * 3).bfloat16().float()
    blocks = [_block(p=7, v=300, seed=1), DraftBlock(torch.zeros(7, 32), bf16), DraftBlock(torch.zeros(7, 32), tied),
              DraftBlock(torch.zeros(3, 32), torch.randn(3, 5, generator=g)),
              DraftBlock(torch.zeros(7, 32), torch.randn(7, 300, generator=g), torch.arange(1000, 1300))]
    for block in blocks:
        x = block.base_logits
        n_max = int((x == x.max(-1, keepdim=True).values).sum(-1).max())
        for k in (1, 4, 64, 400):
            ids, vals = block_candidates(block, k)
            want = _chain_first_order(block, head, 2, ids, vals)
            fast = _chain_identity(block, k)
            # handed back exactly when some row's maximum fills all K candidates (and K < V)
            assert (fast is None) == (k < x.shape[1] and n_max >= k)
            if fast is None:
                fast = build_chain(block, head, 2, x.shape[0], k=k)
            for a, b in zip((fast.tokens, fast.parents, fast.depth, fast.score),
                            (want.tokens, want.parents, want.depth, want.score)):
                assert torch.equal(a, b), k
            assert torch.equal(build_chain(block, head, 2, x.shape[0], k=k).tokens, want.tokens)
    assert int(blocks[4].vocab[0]) == 1000 and int(_chain_identity(blocks[4], 4).tokens.min()) >= 1000


def test_compiled_expansion_equals_the_numpy_twin():
    """The numba depth loop (dartree.kernels.tree_expand) builds exactly the tree of its NumPy twin: tokens,
    parents, depths and fp32 scores bit-equal, over heavy ties (log q~ on a 0.5 grid), every quota rule the builders
    use (pruned's width, DARTree-fixed's spread budget, PCTree's children), with and without the pruned early stop;
    a NaN table is refused with a clear error."""
    from dartree.decode.builders.supertree import _expand_first_order, _expand_first_order_np

    rng = np.random.default_rng(3)
    for t in range(120):
        p_len, kk = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        raw = -rng.integers(0, 5, (p_len, kk, kk)) * 0.5 if t % 2 else -rng.exponential(1.0, (p_len, kk, kk))
        lq = torch.from_numpy(raw.astype(np.float32))
        ids = torch.from_numpy(rng.integers(0, 500, (p_len, kk)))
        width, budget = int(rng.integers(1, 20)), int(rng.integers(1, 40))

        def quotas():
            used = [0]

            def fixed(d, avail):
                q = min(-(-(budget - used[0]) // (p_len - d)), avail)
                used[0] += q
                return q

            def pctree(d, avail):
                q = max(0, min(width, budget - used[0], avail))
                used[0] += q
                return q

            return {"pruned": lambda d, avail: min(width, avail), "fixed": fixed, "pctree": pctree}

        for rule in ("pruned", "fixed", "pctree"):
            for prune in ((None,) if rule != "pruned" else (None, (budget, 0.0), (budget, -0.2), (budget, -1.0))):
                got = _expand_first_order(lq, ids, quotas()[rule], prune)
                want = _expand_first_order_np(lq, ids, quotas()[rule], prune)
                assert got.size == want.size, (t, rule, prune)
                for f in ("tokens", "parents", "depth", "score"):
                    assert torch.equal(getattr(got, f), getattr(want, f)), (t, rule, prune, f)
    bad = lq.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _expand_first_order(bad, ids, lambda d, avail: min(3, avail), (4, -0.2))


def test_compiled_top_b_equals_the_torch_rule_with_ties():
    """select_top_b_keep's compiled CPU path keeps what the torch rule keeps (stable top-B of score + beta * depth in
    fp32, ties to the earlier node) when scores tie within and across depths, re-indexed and prefix-closed."""
    from dartree.decode.trees import _stable_topk, select_top_b_keep

    for seed in range(6):
        sup = get_builder("fixed")(_block(p=6, seed=seed), make_markov(), 7, 40, k=16)
        for grid in (0.0, 0.25, 1.0):
            scores = sup.score if grid == 0 else torch.floor(sup.score / grid) * grid  # monotone: paths stay non-increasing
            tree0 = Tree(sup.tokens, sup.parents, sup.depth, scores)
            for budget in (1, 3, 8, 17, tree0.size - 1):
                for beta in (0.0, -0.2, -0.5):
                    tree, keep = select_top_b_keep(tree0, budget, beta)
                    want = _stable_topk(scores + beta * sup.depth.float(), budget).sort().values
                    assert torch.equal(keep, want), (seed, grid, budget, beta)
                    assert torch.equal(tree.tokens, sup.tokens[want]) and _prefix_closed(tree)


def test_every_builder_has_one_name_and_the_aliases_resolve_to_it():
    from dartree.decode.builders import BUILDER_ALIASES, BUILDERS, builder_name, get_builder, register_builder

    assert len({id(fn) for fn in BUILDERS.values()}) == len(BUILDERS)  # no builder under two names
    assert sorted(BUILDERS) == ["chain", "ddtree", "fixed", "heap-sequential", "pctree", "pruned"]
    assert builder_name("dartree-pruned") == "pruned" and builder_name("dartree-fixed") == "fixed"
    assert get_builder("dartree-pruned") is BUILDERS["pruned"] and set(BUILDER_ALIASES).isdisjoint(BUILDERS)
    with pytest.raises(ValueError, match=r"unknown tree builder 'beam'.*aliases: dartree-fixed = fixed"):
        builder_name("beam")
    with pytest.raises(ValueError, match="'dartree-pruned' is already registered"):
        register_builder("dartree-pruned")(lambda *a, **k: None)
    assert "dartree-pruned" not in BUILDERS

"""The batch-aware auto budget (decode/batch_budget.py, decode/row_costs.py): costs timed by rows as well as nodes
per row, the width every row's tree is cut to shrinking as the batch's verify cost per row x node grows, the batch-1
choice at one row, and lossless batches at ``budget="auto"`` (every builder, refills, rows of different lengths,
rounds with and without the drafter, lookup chains, bf16 in the row-invariant mode)."""

import random

import pytest
import torch

from conftest import VOCAB, make_drafter, make_head, make_markov
from dartree.decode.batch_budget import AutoRowBudgets, BatchCostModel
from dartree.decode.batched import batched_generate
from dartree.decode.budget import CostModel, prune_to
from dartree.decode.generate import autoregressive_generate
from dartree.decode.row_costs import RowCosts, batch_rows, paired_ratio
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree
from dartree.models.target import tiny_target

STOP = 1
LENGTHS = (2, 57, 5, 23, 3, 40, 9, 14)
BUILDERS = {"chain": {}, "pruned": {"k": 8, "width": 4}, "ddtree": {}, "pctree": {"k": 8, "children": 3},
            "fixed": {"k": 8}, "heap-sequential": {"k": 8}}
CURVE = {1: 0.040, 2: 0.041, 3: 0.042, 5: 0.044, 9: 0.048, 17: 0.056}  # one row: an AR step 40 ms, 1 ms per node
SIZES = sorted(CURVE)


def _prompts(lengths=LENGTHS, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _table(per_row_node: float, rows=(2, 4, 8)) -> RowCosts:
    """A synthetic row table: t(N, T) = t(1, T) + per_row_node x (N - 1) x T seconds, so each extra row x token of a
    verify costs ``per_row_node``; a draft over N rows costs 1 + 0.1 (N - 1) of one row's."""
    return RowCosts(verify={n: {t: (CURVE[t] + per_row_node * (n - 1) * t) / CURVE[t] for t in SIZES} for n in rows},
                    draft={n: 1.0 + 0.1 * (n - 1) for n in rows})


def _model(table: RowCosts | None = None, rule: str = "outcomes") -> BatchCostModel:
    return BatchCostModel(t_ar=CURVE[1], t_draft=0.005, verify_s=dict(CURVE), max_budget=16, rule=rule,
                          row_costs=table if table is not None else RowCosts())


def _chain_and_siblings(p: float, q: float = 0.08, depth: int = 8) -> Tree:
    """A chain of ``depth`` nodes, each accepted with probability ``p`` given its parent, and under every chain node a
    doubtful sibling (``q``): for ``p`` = 0.7 its 7 best nodes are the chain's, so a budget of 7 or fewer keeps a
    chain."""
    tokens, parents, depths, scores = [], [], [], []
    for d in range(1, depth + 1):
        parent = 0 if d == 1 else 2 * (d - 1) - 1  # the previous chain node (1-based index)
        base = 0.0 if d == 1 else scores[parent - 1]
        tokens += [2 + d, 50 + d]
        parents += [parent, parent]
        depths += [d, d]
        scores += [base + float(torch.log(torch.tensor(p))), base + float(torch.log(torch.tensor(q)))]
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.tensor(scores))


def test_row_table_factors_are_one_at_one_row_and_interpolate_in_rows_and_sizes():
    table = RowCosts(verify={2: {1: 1.5, 9: 2.5}, 4: {1: 2.0, 9: 4.5}}, draft={2: 1.2, 4: 1.6})
    assert table.factor(1, 5) == 1.0 and table.draft_factor(1) == 1.0 and RowCosts().factor(8, 9) == 1.0
    assert table.factor(2, 1) == 1.5 and table.factor(2, 5) == pytest.approx(2.0)  # halfway between T = 1 and 9
    assert table.factor(3, 9) == pytest.approx(3.5) and table.factor(4, 17) == 4.5  # held past the largest T
    assert table.factor(6, 9) == pytest.approx(6.5)  # past N = 4: the line through N = 2 and 4
    assert table.draft_factor(3) == pytest.approx(1.4) and table.draft_factor(8) == pytest.approx(2.4)
    assert table.missing([1, 2, 3, 4, 8]) == [3, 8]
    assert batch_rows(1) == [] and batch_rows(6) == [2, 4, 6] and batch_rows(8) == [2, 4, 8]
    with pytest.raises(ValueError, match=r"^rows=0 must be >= 1"):
        table.factor(0, 3)
    with pytest.raises(ValueError, match=r"^batch=0 must be >= 1"):
        batch_rows(0)


def test_the_model_times_verifies_by_rows_and_nodes_per_row():
    cm = _model(_table(0.002))
    assert cm.verify_time(9) == pytest.approx(0.048)
    cm.set_rows(4)
    assert cm.verify_time(9) == pytest.approx(0.048 + 0.002 * 3 * 9)  # 3 extra rows of 9 tokens
    assert cm.verify_time(1) == pytest.approx(0.040 + 0.002 * 3)
    assert cm.round_overhead() == pytest.approx(0.005 * 1.3)  # one drafter forward over 4 rows, builds not timed yet
    cm.observe_build(0.004)  # the batch's build stage: 4 trees
    assert cm.t_build == pytest.approx(0.001) and cm.round_overhead() == pytest.approx(0.005 * 1.3 + 0.004)
    cm.observe_draft(0.005 * 1.3)  # a draft over 4 rows as the table says: one row's t_draft unchanged
    assert cm.t_draft == pytest.approx(0.005)
    with pytest.raises(ValueError, match=r"^rows=0 must be >= 1"):
        cm.set_rows(0)


def test_the_width_shrinks_towards_a_chain_then_to_none_as_a_row_node_costs_more():
    """A synthetic row table in which each extra row x token of a verify costs c seconds: at 4 and 8 rows the chosen
    width falls as c grows (the few best nodes, a chain), at one row the table does not matter, and a doubtful
    drafter's trees are dropped (width 0: the roots alone) once rows are dear."""
    costs = (0.0, 0.0005, 0.002, 0.008, 0.02)
    widths = {}
    for n in (1, 4, 8):
        for c in costs:
            cm = _model(_table(c))
            cm.set_rows(n)
            widths[n, c], exp = cm.choose_rows([_chain_and_siblings(0.7)] * n)
            assert exp > 1.0
    assert [widths[1, c] for c in costs] == [11] * 5  # one row: the same choice whatever the rows would cost
    assert [widths[4, c] for c in costs] == [11, 6, 4, 2, 1]
    assert [widths[8, c] for c in costs] == [11, 5, 3, 1, 1]
    kept = prune_to(_chain_and_siblings(0.7), widths[4, 0.0005])
    assert kept.depth.tolist() == [1, 2, 3, 4, 5, 6] and kept.tokens.tolist() == [3, 4, 5, 6, 7, 8]  # a chain
    doubtful = {}
    for c in (0.0, 0.002, 0.02):
        cm = _model(_table(c))
        cm.set_rows(4)
        doubtful[c] = cm.choose_rows([_chain_and_siblings(0.3, 0.05)] * 4)
    assert {c: w for c, (w, _) in doubtful.items()} == {0.0: 5, 0.002: 1, 0.02: 0} and doubtful[0.02][1] == 1.0


def test_a_drafted_round_costs_more_batched_ar_steps_at_more_rows_so_drafting_stops_paying():
    cm = _model(_table(0.004))
    costs = {n: cm.modelled_cost(n, 4) for n in (1, 2, 4, 8)}
    assert costs[1] == pytest.approx((0.005 + 0.044) / 0.040)  # draft + verify(5), in one-row AR steps
    assert costs[8] == pytest.approx((0.005 * 1.7 + 0.044 + 0.004 * 7 * 5) / (0.040 + 0.004 * 7))
    assert costs[1] < costs[2] < costs[4] < costs[8]
    p3 = float(torch.log(torch.tensor(0.3)))
    chain = Tree(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 4]),
                 torch.tensor([p3, 2 * p3, 3 * p3, 4 * p3]))
    for n, drafting in ((1, True), (8, False)):
        m = _model(_table(0.004))
        m.set_rows(n)
        for r in range(40):  # drafted rounds committing 1.3 tokens per row on average, at their modelled cost
            m.should_draft()
            w, _ = m.choose_rows([chain] * n)
            kept = prune_to(chain, w)
            hits = [(r * n + i) % 10 < 3 and w > 0 for i in range(n)]  # 3 rows in 10 accept the first node
            m.record_rows([kept] * n, [torch.tensor([0, 1] if h else [0]) for h in hits])
        log = m.summary()["rounds_by_rows"][n]  # what was decided at n rows and what it got
        assert log["drafted"] + log["plain"] == 40 and log["drafted"] >= 1
        assert 1.0 <= log["drafted_tokens_per_row"] <= 1.5 and log["drafted_ar_steps"] >= m.modelled_cost(n, 0) > 1.0
        decisions = [m.should_draft() for _ in range(20)]
        assert (sum(decisions) >= 18 if drafting else sum(decisions) <= 2), (n, decisions)


def test_set_rows_keeps_each_row_counts_costs_ar_steps_and_scale():
    cm = _model(_table(0.004))
    cm.costs, cm._modelled_steps, cm.ar_n, cm.ar_u, cm.speed = [1.2, 1.3, 1.25], 1.25, 5.0, 5.5, 1.1
    cm.set_rows(4)
    ratio = cm.modelled_cost(4, 1) / cm.modelled_cost(1, 1)
    assert ratio > 1.0 and cm.costs == pytest.approx([1.2 * ratio, 1.3 * ratio, 1.25 * ratio])
    assert cm.ar_n == 0.0 and cm.speed == 1.1  # no AR step timed at 4 rows yet; the scale carried over
    cm.costs, cm.ar_n, cm.speed = [3.0], 2.0, 1.4
    cm.set_rows(1)
    assert (cm.costs, cm.ar_n, cm.ar_u, cm.speed, cm.rows) == ([1.2, 1.3, 1.25], 5.0, 5.5, 1.1, 1)
    cm.set_rows(4)
    assert (cm.costs, cm.ar_n, cm.speed) == ([3.0], 2.0, 1.4)


def test_a_row_ratio_is_the_median_of_paired_passes():
    one = [0.0065, 0.0066, 0.0130, 0.0033, 0.0067]  # pass 3 ran at half speed; pass 4's one-row forward was lucky
    many = [0.0364, 0.0370, 0.0730, 0.0360, 0.0372]
    assert paired_ratio(many, one) == pytest.approx(0.0370 / 0.0066)  # the median pass: 5.6x
    assert min(many) / min(one) == pytest.approx(10.9, abs=0.1)  # fastest against fastest: the lucky one decides
    with pytest.raises(ValueError, match="same number of passes"):
        paired_ratio(many, one[:3])
    with pytest.raises(ValueError, match="same number of passes"):
        paired_ratio([0.01, 0.0], [0.01, 0.01])


def test_timed_drafts_over_rows_correct_the_row_tables_draft_ratio_per_row_count():
    cm = _model(_table(0.004))  # the table says a draft over 8 rows costs 1.7 one-row drafts (5 ms: 8.5 ms)
    cm.observe_draft(0.006)  # at one row: the one-row draft time itself
    assert cm.t_draft == pytest.approx(0.0051) and cm.draft_corr == 1.0
    cm.set_rows(8)
    base = cm.round_overhead() - cm.t_build * 8
    assert base == pytest.approx(0.0051 * 1.7)
    for _ in range(12):  # drafts over 8 rows timed at 3x what the table says
        cm.observe_draft(3.0 * 0.0051 * 1.7)
    assert cm.draft_corr == pytest.approx(3.0, rel=0.02) and cm.t_draft == pytest.approx(0.0051)
    assert cm.round_overhead() - cm.t_build * 8 == pytest.approx(3.0 * base, rel=0.02)
    cm.observe_draft(100.0)  # one stalled draft moves it by at most the EMA weight of a 3x outlier
    assert cm.draft_corr == pytest.approx(3.0 * (1 + 0.3 * 2), rel=0.02)
    corr8 = cm.draft_corr
    cm.set_rows(4)  # a new row count starts from the present correction
    assert cm.draft_corr == corr8
    cm.observe_draft(0.0051 * 1.3)  # timed as the table says at 4 rows
    assert cm.draft_corr == pytest.approx(corr8 + 0.3 * (max(1.0, corr8 / 3.0) - corr8))
    corr4 = cm.draft_corr
    cm.set_rows(8)
    assert cm.draft_corr == corr8 and cm.summary()["draft_corr_by_rows"] == {4: corr4, 8: corr8}
    cm.set_rows(1)
    assert cm.round_overhead() == pytest.approx(0.0051 + cm.t_build)  # one row: the batch-1 overhead


def test_a_new_row_count_times_a_plain_step_before_its_first_draft_decision():
    cm = _model(_table(0.004))
    cm.draft_n, cm.draft_tok, cm.draft_tok2, cm.draft_u, cm.costs = 8.0, 16.0, 34.0, 8.0, [1.0] * 9  # drafting pays
    assert cm.should_draft()
    cm.set_rows(4)
    assert not cm.should_draft()  # the first round at 4 rows: a plain step, whose 1-token forward is timed
    cm.observe_verify(1, 0.06)
    assert cm.ar_n == 1.0 and cm.should_draft()
    cm.set_rows(1)
    cm.set_rows(4)  # a row count seen before keeps what it timed (discounted once): no plain step forced
    assert cm.ar_n == pytest.approx(0.99) and cm.should_draft()
    cm.set_rows(8)
    cm.start_seeding(3, ar_every=0)  # a calibration pass drafts every round, even at a new row count
    assert [cm.should_draft() for _ in range(3)] == [True, True, True]
    assert not cm.should_draft()  # then the plain step


def test_at_n_rows_probes_come_n_times_rarer_and_the_bound_is_as_wide_as_the_row_rounds_make_it():
    cm, one = _model(_table(0.004)), _model(_table(0.004))
    assert cm.probe_gap() == one.probe_gap() and cm.sd_prior() == 1.0  # one row: the batch-1 figures
    cm.set_rows(4)
    batch1_rule = CostModel.probe_gap(cm)  # the batch-1 formula with the costs of 4 rows
    assert cm.probe_gap() == 4 * batch1_rule and batch1_rule >= 16
    assert cm.sd_prior() == pytest.approx(0.5)
    for m in (cm, one):  # one drafted round committing 1.25 tokens (per row) at 2 AR steps
        m._pending = (True, 0.0, 2.0, False)
        m._observe_round(1.25, None)
    # with one round in, the prior dominates the spread: the bound of 4 rows is half as far above the mean
    assert (cm.draft_bound(True) - cm.draft_bound(True, z=0.0)) == pytest.approx(
        0.5 * (one.draft_bound(True) - one.draft_bound(True, z=0.0)))
    gaps = []
    for _ in range(2):  # drafting stays behind (the bound below an AR step's token): probes only, 4 x 16+ apart
        skipped = 0
        while not cm.should_draft():
            skipped += 1
        gaps.append(skipped)
        cm._pending = (True, 0.0, 2.0, True)
        cm._observe_round(1.0, None)
    assert gaps[1] + 1 >= 4 * 16


def _rand_tree(g: torch.Generator, m: int) -> Tree:
    parents, scores = [], []
    for i in range(m):
        q = int(torch.randint(0, i + 1, (1,), generator=g))
        parents.append(q)
        scores.append((0.0 if q == 0 else scores[q - 1]) - float(torch.rand(1, generator=g)) * 1.5)
    depth = []
    for q in parents:
        depth.append(1 if q == 0 else depth[q - 1] + 1)
    return Tree(torch.arange(m) + 2, torch.tensor(parents), torch.tensor(depth), torch.tensor(scores))


@pytest.mark.parametrize("rule", ["outcomes", "scores"])
def test_at_one_row_the_batch_policy_makes_the_batch_1_choices(rule):
    """The batch model at one row, driven as the batched loop drives it, against the batch-1 model driven as
    speculative_generate drives it, over 400 rounds of random trees, accepted paths, lookup chains and timings:
    every draft decision and every budget equal, and the same state at the end."""
    one = CostModel(t_ar=CURVE[1], t_draft=0.005, verify_s=dict(CURVE), max_budget=16, rule=rule)
    batch = BatchCostModel.from_model(one, _table(0.004))  # a row table that would matter at more rows
    g, rng = torch.Generator().manual_seed(0), random.Random(1)
    for m in (one, batch):
        m.start_seeding(20)
    for r in range(400):
        if r == 20:
            assert one.finish_seeding("x") == batch.finish_seeding("x")
        drafts = one.should_draft()
        assert drafts == batch.should_draft(), r
        tree = _rand_tree(g, rng.randint(1, 16)) if drafts else Tree.empty()
        chain = torch.tensor([0] * (tree.size - 1) + [1]) if tree.size and rng.random() < 0.2 else None
        b, e = one.choose(tree, -0.1, chain, drafts)
        assert batch.choose_rows([tree], -0.1, [chain], drafts) == (b, e), r
        keep = prune_to(tree, b, -0.1)
        path, node = [0], 0
        while True:
            kids = [i + 1 for i in range(keep.size) if int(keep.parents[i]) == node]
            if not kids or rng.random() < 0.4:
                break
            node = rng.choice(kids)
            path.append(node)
        acc = torch.tensor(path)
        vs, ds = rng.uniform(0.03, 0.2), rng.uniform(0.003, 0.03)
        for m in (one, batch):
            m.observe_verify(keep.size + 1, vs)
            if drafts:
                m.observe_draft(ds)
                m.observe_build(0.002)
        one.record(keep, acc, None, 0, seconds=vs + ds)
        batch.record_rows([keep], [acc], None, None, seconds=vs + ds)
    s1, sb = one.summary(), batch.summary()
    assert {k: v for k, v in sb.items() if k in s1} == s1
    assert sum(s1["chosen_budgets"].values()) == 380 and len(s1["chosen_budgets"]) > 3  # after the 20 seeding rounds


def _ar(target, prompt, n):
    return autoregressive_generate(target, prompt, max_new_tokens=n, stop_ids=[STOP]).tokens


def _seeded(table: RowCosts) -> BatchCostModel:
    """A model that drafts every round but every third (a plain batched step), whatever the timings say."""
    cm = _model(table)
    cm.start_seeding(1 << 30)
    return cm


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_builder_is_lossless_at_auto_at_batch_1_2_4_8(target, builder):
    """Rows of very different lengths, a queue longer than the batch (refills), per-row caps (rows finishing at
    different rounds); rounds that draft and cut every tree to the chosen width and rounds that verify the roots
    alone."""
    drafter, head = make_drafter(), make_markov()
    prompts, caps = _prompts(), [24, 5, 30, 1, 17, 24, 9, 24]
    want = [_ar(target, p, c) for p, c in zip(prompts, caps)]
    for cheap in (True, False):
        cm = _seeded(_table(0.0 if cheap else 0.05))
        for b in (1, 2, 4, 8):
            out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder=builder, budget="auto",
                                                                                  builder_params=BUILDERS[builder],
                                                                                  max_new_tokens=caps, stop_ids=[STOP]),
                                   batch_size=b, cost_model=cm)
            assert [o.tokens for o in out] == want, (cheap, b)
            assert max(out.rows) == min(b, 7)  # the prompt with cap 1 is done at its prefill
            budgets = [x for o in out for x in o.stats.budgets]
            assert 0 in budgets and max(budgets) > 0  # plain batched steps and drafted trees
            for o in out:  # every row's rounds: one budget each, its trees cut to it
                assert o.stats.tree_nodes == o.stats.budgets
        assert {1, 2, 4, 7} <= set(cm.chosen_rows)  # widths chosen at every batch size's row count (8 holds 7)


def test_auto_shares_one_width_per_round_and_shrinks_it_with_the_rows(target):
    drafter, head = make_drafter(), make_head("gated_markov")
    prompts = _prompts()
    widths = {}
    for c in (0.0, 0.05):
        cm = _model(_table(c))
        out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder="pruned", budget="auto",
                                                                              builder_params=BUILDERS["pruned"],
                                                                              max_new_tokens=20, stop_ids=[STOP]),
                               batch_size=8, cost_model=cm)
        assert [o.tokens for o in out] == [_ar(target, p, 20) for p in prompts]
        for k, w in enumerate(out.widths):  # each round's forward is the widest kept tree + 1
            sizes = [o.stats.tree_nodes[k] for o in out if k < len(o.stats.tree_nodes)]
            assert w == max(sizes) + 1
        widths[c] = cm.chosen_rows.get(8, {})
    assert max(widths[0.0]) > 0 and set(widths[0.05]) == {0}  # dear rows: no node is worth verifying


def test_auto_with_lookup_chains_and_rounds_without_the_drafter_is_lossless(target):
    drafter, head = make_drafter(), make_head("rnn")
    base = _prompts((12, 30, 7, 19), seed=5)
    prompts = [p + p[: len(p) // 2] for p in base]  # repeats: the lookup finds chains
    cm = _seeded(_table(0.002))
    out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder="ddtree", budget="auto",
                                                                          max_new_tokens=30, stop_ids=[STOP], lookup=6),
                           batch_size=3, cost_model=cm)
    assert [o.tokens for o in out] == [_ar(target, p, 30) for p in prompts]
    verified = sum(v for v in cm.lookup.verified.values())
    assert verified > 0 and sum(cm.lookup.accepted.values()) > 0  # chains were grafted, verified and learnt from


@pytest.mark.slow
@pytest.mark.parametrize("builder,head_name", [("pctree", "markov"), ("fixed", "gru"), ("heap-sequential", "rnn"),
                                               ("pruned", "identity")])
def test_bf16_rows_at_auto_equal_their_ar_output_in_the_row_invariant_mode(builder, head_name):
    """bf16 at batch 1, 2, 4 and 8 for the builders and heads the fixed-budget bf16 test leaves out (it runs chain,
    pruned and ddtree with the selector head), each at ``budget="auto"``."""
    from dartree.models.invariant import choose_invariant_linear, row_invariant

    tg = tiny_target(vocab_size=VOCAB, layer_ids=[1, 2], dtype=torch.bfloat16)
    try:
        choose_invariant_linear(tg.model)
    except ValueError as exc:
        pytest.skip(f"no row-invariant bf16 linear on this CPU: {exc}")
    drafter, head = make_drafter().to(torch.bfloat16), make_head(head_name, tg).to(torch.bfloat16)
    prompts = _prompts((2, 57, 5, 23, 9))
    with row_invariant(tg):
        want = [_ar(tg, p, 16) for p in prompts]
        cm = _seeded(_table(0.001))
        for b in (1, 2, 4, 8):
            out = batched_generate(tg, drafter, head, prompts, DecodeSettings(builder=builder, budget="auto",
                                                                              builder_params=BUILDERS[builder],
                                                                              max_new_tokens=16, stop_ids=[STOP]),
                                   batch_size=b, cost_model=cm)
            assert [o.tokens for o in out] == want, b


def test_the_row_table_is_measured_on_the_target_per_row_count(target):
    drafter = make_drafter()
    table = RowCosts()
    ids = _prompts((30,))[0]
    assert table.measure(target, drafter, ids, [1, 2, 4], max_budget=8, reps=1) == [2, 4]
    assert table.rows == [2, 4] and set(table.verify[2]) == {1, 2, 3, 5, 9, 17}
    for n in (2, 4):
        ratios = [table.verify[n][t] for t in sorted(table.verify[n])]
        assert ratios[0] >= 1.0 and ratios == sorted(ratios) and table.draft[n] >= 1.0  # non-decreasing in T
        secs = table.seconds[n]
        assert set(secs["verify"]) == set(secs["one_row"]["verify"]) == set(table.verify[n])
        assert min(secs["verify"].values()) > 0 and secs["draft"] > 0 and secs["one_row"]["draft"] > 0
        assert all(table.verify[4][t] >= table.verify[2][t] for t in table.verify[2])  # more rows: never cheaper
    assert table.measure(target, drafter, ids, [2, 4], max_budget=8, reps=1) == []  # cached per row count
    assert table.measure(target, drafter, ids, [2, 3], max_budget=8, reps=1) == [3]
    assert table.rows == [2, 3, 4]
    with pytest.raises(ValueError, match="at least 4 context tokens"):
        RowCosts().measure(target, drafter, [3, 4], [2])


def test_a_batch_needs_a_batch_cost_model(target):
    with pytest.raises(TypeError, match=r"^cost_model is a CostModel; a batch needs a BatchCostModel"):
        AutoRowBudgets(CostModel(t_ar=0.04, t_draft=0.005, verify_s=dict(CURVE)), 0.0, lambda: 0.0)
    with pytest.raises(TypeError, match=r"^cost_model is a CostModel"):
        batched_generate(target, make_drafter(), make_markov(), _prompts()[:2], DecodeSettings(budget="auto",
                                                                                               max_new_tokens=4),
                         cost_model=CostModel(t_ar=0.04, t_draft=0.005, verify_s=dict(CURVE)))


def test_the_api_batches_at_auto_and_measures_each_row_count_once(target):
    from dartree.decode.assembly import Assembly
    from dartree.models.checkpoint import DraftModel
    from dartree.speculator import SpeculativeDecoder

    spec = SpeculativeDecoder(Assembly(target, DraftModel(make_drafter(), make_markov(), {}), torch.float32,
                                       "fp32 (test)"))
    prompts, caps = _prompts()[:5], [12, 3, 20, 0, 9]
    out = spec.generate(prompts, max_new_tokens=caps, tree="ddtree")  # T = 0: budget "auto" by default
    assert [g.tokens for g in out] == [_ar(target, p, c) for p, c in zip(prompts, caps)]
    assert spec.row_costs.rows == [2, 4, 5] and out[0].setup_s > 0.0  # the batch's row counts, measured
    key = ("ddtree", 0, ())
    model = spec.batch_models[key]
    assert isinstance(model, BatchCostModel) and model.row_costs is spec.row_costs
    assert model.prior == spec.cost_models[key].prior and model.prior is not spec.cost_models[key].prior
    assert sum(sum(h.values()) for h in model.chosen_rows.values()) > 0  # it decided the rounds
    again = spec.generate_batch(prompts[:4], max_new_tokens=8, tree="ddtree", batch_size=4)
    assert again[0].setup_s == 0.0 and spec.row_costs.rows == [2, 4, 5]  # nothing measured again
    spec.generate_batch(_prompts()[:8], max_new_tokens=4, tree="ddtree")
    assert spec.row_costs.rows == [2, 4, 5, 8]  # only the new row count
    fixed = spec.generate_batch(prompts, max_new_tokens=caps, tree="ddtree", budget=6)
    assert [g.tokens for g in fixed] == [g.tokens for g in out] and key in spec.batch_models

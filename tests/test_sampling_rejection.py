"""T > 0, acceptance="rejection": sampled chain drafts + standard speculative sampling.

Distribution tests (chi-square, fixed seeds, p > 1e-3), never exact-match tests: the emitted tokens must be
distributed as the target's own samples softmax(z / T); plus "same seed, same output", the argument checks,
and the point of the rule: a draft whose q is close to p is accepted more often than under exact matching.
"""

import pytest
import torch

from conftest import make_drafter, make_markov
from dartree.decode.generate import speculative_generate
from dartree.decode.sampling import (SampledChain, check_acceptance, rejection_accept, rejection_verify,
                                     sample_chain_tokens)
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree, block_candidates, DraftBlock
from dartree.decode.verify import walk
from dartree.models.families.dspark import MarkovHead
from dartree.models.target import cache_length, compact_cache, tiny_target

CHI2_P1E3 = {35: 66.619}  # chi-square critical values at p = 1e-3, by degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def _toy(v: int = 6, m: int = 3, k: int = 3, seed: int = 0):
    """A Markov toy target (next-token logits Z[prev] [V, V]) and a Markov drafter head over the same V with
    per-depth base logits [M, V]; the draft sees only K < V candidates, so q misses part of p's support."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(v, v, generator=g) * 0.8
    torch.manual_seed(seed)
    head = MarkovHead(v, 4).eval()
    torch.nn.init.normal_(head.w2.weight, std=0.7)
    block = DraftBlock(hidden=torch.zeros(m, 4), base_logits=torch.randn(m, v, generator=g))
    cand, base = block_candidates(block, k, backend="torch")
    return z, head, block, cand, base


def _round(z, head, block, cand, base, roots, temp, gen):
    """One batched round for N rows: sample chains, the toy target's p along them, rejection verify.
    Returns the first two committed tokens per row ([N, 2] int64; -1 where the round committed only one)."""
    with torch.no_grad():
        toks, q = sample_chain_tokens(head, cand, base, block.hidden, roots, temp, gen)
    path = torch.cat([roots[:, None], toks], dim=1)  # [N, M+1]
    p = torch.softmax(z[path] / temp, dim=-1)  # [N, M+1, V]: the toy target's p at every node
    acc, bonus = rejection_accept(p, cand, q, toks, gen)
    emitted = torch.cat([toks, torch.full_like(bonus[:, None], -1)], dim=1)  # accepted drafts, then the bonus
    emitted[torch.arange(roots.numel()), acc] = bonus
    emitted[torch.arange(toks.shape[1] + 1) > acc[:, None]] = -1
    return emitted[:, :2]


@pytest.mark.parametrize("temp", [0.7, 1.0])
def test_first_two_emitted_tokens_are_distributed_as_target_samples(temp):
    # 20k independent requests from root 2; the first two committed tokens (a second round where the first
    # one rejected everything) must follow p(a | 2) p(b | a) over all V x V pairs
    z, head, block, cand, base = _toy()
    v, n, root = z.shape[0], 20000, 2
    gen = torch.Generator().manual_seed(11)
    first2 = _round(z, head, block, cand, base, torch.full((n,), root), temp, gen)
    short = first2[:, 1] < 0
    first2[short, 1] = _round(z, head, block, cand, base, first2[short, 0], temp, gen)[:, 0]
    assert 0.05 < short.float().mean() < 0.95  # both paths (accepted draft, second round) are exercised
    counts = torch.bincount(first2[:, 0] * v + first2[:, 1], minlength=v * v).float()
    p = torch.softmax(z / temp, dim=-1)
    probs = (p[root][:, None] * p).reshape(-1)
    assert probs.min() * n > 5
    assert _chi2(counts, probs) < CHI2_P1E3[35], (counts.reshape(v, v) / n, probs.reshape(v, v))


def test_rejection_accept_edge_cases():
    # q = p exactly: everything accepted, bonus from p at the last node; disjoint support: all rejected and
    # the bonus avoids the draft's token; a token outside its candidates is refused
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # [1, M+1 = 2, V = 3]
    acc, bonus = rejection_accept(p, torch.tensor([[0, 1]]), torch.tensor([[[0.5, 0.5]]]), torch.tensor([[1]]), gen)
    assert acc.tolist() == [1] and bonus.tolist() == [2]
    p = torch.tensor([[[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]]])
    for _ in range(20):
        acc, bonus = rejection_accept(p, torch.tensor([[0]]), torch.tensor([[[1.0]]]), torch.tensor([[0]]), gen)
        assert acc.tolist() == [0] and bonus.item() in (1, 2)
    with pytest.raises(ValueError, match="not among"):
        rejection_accept(p, torch.tensor([[1]]), torch.tensor([[[1.0]]]), torch.tensor([[0]]), gen)


def test_rejection_accepts_more_than_matching_when_q_is_close_to_p():
    # a near-flat target and a draft q close to it: rejection keeps min(p, q) mass per depth, exact matching of
    # the deterministic (argmax) draft only p(argmax); both walks measured on the same target distributions
    v, m, n, temp = 8, 4, 4000, 1.0
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(v, generator=g) * 0.3
    p = torch.softmax(logits, -1).expand(n, m + 1, v).contiguous()
    q = torch.softmax(logits + torch.randn(v, generator=g) * 0.1, -1).expand(n, m, v).contiguous()
    cand = torch.arange(v).expand(m, v)
    toks = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(n, m)
    acc, _ = rejection_accept(p, cand, q, toks, g)
    chain = Tree(q[0].argmax(-1), torch.arange(m), torch.arange(1, m + 1), torch.zeros(m))
    matched = [len(walk(chain, torch.multinomial(p[0], 1, generator=g).squeeze(-1).tolist())) - 1 for _ in range(n)]
    rej, match = acc.float().mean().item(), sum(matched) / n
    assert rej > 2.5 and match < 0.5, (rej, match)


def test_rejection_verify_equals_rejection_accept_on_a_plain_forward():
    # through the real tree inputs, cached target forward and cache compaction: rejection_verify decides exactly
    # as rejection_accept (whose output distribution the chi-square test pins) on the probabilities of a plain
    # uncached forward of prefix + root + chain, draws the same random numbers, and leaves the cache at start + A
    tg = tiny_target(vocab_size=4, hidden_size=16, num_layers=2, seed=3)
    with torch.no_grad():
        tg.model.lm_head.weight.mul_(0.3)
    prefix, root, temp = [1, 2, 3, 0, 2], 1, 0.8
    cand, q = torch.tensor([[0, 2], [1, 3], [0, 1]]), torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.5, 0.5]])
    cache = tg.new_cache()
    tg.forward(torch.tensor([prefix]), cache=cache)
    gen, ref_gen = torch.Generator().manual_seed(0), torch.Generator()
    seen = set()
    for _ in range(16):
        toks = cand.gather(1, torch.multinomial(q, 1, generator=gen)).squeeze(1)
        chain = SampledChain(Tree(toks, torch.arange(3), torch.arange(1, 4), torch.zeros(3)), cand, q)
        with torch.no_grad():
            z = tg.forward(torch.tensor([prefix + [root] + toks.tolist()])).logits[0, len(prefix):]
        ref_gen.set_state(gen.get_state())
        acc, bonus = rejection_accept(torch.softmax(z / temp, -1)[None], cand, q[None], toks[None], ref_gen)
        v = rejection_verify(tg, chain, root, len(prefix), cache, temp, gen)
        a = int(acc[0])
        assert (v.tokens, v.bonus_id, v.accepted.tolist()) == (toks[:a].tolist(), int(bonus[0]), list(range(a + 1)))
        assert cache_length(cache) == len(prefix) + a + 1 and v.features.shape[0] == a + 1
        seen.add(a)
        compact_cache(cache, len(prefix), torch.zeros(0, dtype=torch.long))  # back to the prefix
    assert len(seen) >= 2  # both rejections and acceptances happened


def test_rejection_generate_same_seed_same_output(target, prompts):
    drafter, head = make_drafter(), make_markov()
    for p in prompts[:2]:
        runs = [speculative_generate(target, drafter, head, p, DecodeSettings(builder="chain", max_new_tokens=20,
                                                                              temperature=1.0, acceptance="rejection"),
                                     generator=torch.Generator().manual_seed(5))
                for _ in range(2)]
        assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) > 0
        st = runs[0].stats
        assert sum(st.accept_lengths) + 1 == len(runs[0].tokens) <= 20  # + the first token, from prefill
    short = speculative_generate(target, drafter, head, prompts[0], DecodeSettings(builder="chain", budget=2,
                                                                                   max_new_tokens=12, temperature=0.7,
                                                                                   acceptance="rejection"),
                                 generator=torch.Generator().manual_seed(1))
    assert max(short.stats.accept_lengths) <= 3 and len(short.tokens) <= 12


def test_rejection_with_auto_budget_records_every_verified_node(target, prompts, monkeypatch):
    # budget="auto" at T > 0: the cost model sizes each sampled chain; the calibration counts exactly the
    # verified nodes and the accepted ones; same seed and same measured times, same output. The loop's clock is
    # replaced by one that advances 1 ms per reading: the policy learns from the times it measures, so on the real
    # clock two runs may size a round differently and draw a different (equally distributed) sample.
    import types

    from dartree.decode import generate
    from dartree.decode.budget import CostModel

    drafter, head = make_drafter(), make_markov()
    outs, models = [], []
    for _ in range(2):
        ticks = iter(range(10**6))
        monkeypatch.setattr(generate, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
        cm = CostModel(t_ar=1.0, t_draft=0.1, verify_s={1: 1.0, 2: 1.02, 5: 1.1, 9: 1.2, 17: 1.5}, max_budget=8)
        outs.append(speculative_generate(target, drafter, head, prompts[1], DecodeSettings(builder="chain",
                                                                                           budget="auto",
                                                                                           max_new_tokens=30,
                                                                                           temperature=0.8,
                                                                                           acceptance="rejection"),
                                         cost_model=cm, generator=torch.Generator().manual_seed(3)))
        models.append(cm)
    assert outs[0].tokens == outs[1].tokens
    st, cm = outs[0].stats, models[0]
    assert all(0 <= b <= 8 for b in st.budgets) and sum(cm.chosen.values()) == st.rounds
    assert sum(cm.bin_n) == sum(st.tree_nodes) > 0
    assert sum(cm.bin_real) == sum(st.accepted_depths)


@pytest.mark.parametrize("builder, temp, rule", [("pruned", 1.0, "rejection"), ("chain", 0.0, "rejection"),
                                                  ("chain", 1.0, "nope")])
def test_rejection_needs_chain_and_positive_temperature(target, prompts, builder, temp, rule):
    with pytest.raises(ValueError, match="acceptance"):
        speculative_generate(target, make_drafter(), make_markov(), prompts[0], DecodeSettings(builder=builder,
                                                                                               max_new_tokens=4,
                                                                                               temperature=temp,
                                                                                               acceptance=rule),
                             generator=torch.Generator().manual_seed(0))
    assert check_acceptance("match", builder, temp) == "match"


@pytest.mark.parametrize("argv", [["--tree", "pruned", "--temperature", "1.0"], ["--tree", "chain"]])
def test_eval_cli_refuses_rejection_without_chain_and_temperature(argv, capsys):
    from dartree.decode.harness.eval import main

    assert main(argv + ["--acceptance", "rejection", "--limit", "1"]) == 2
    assert "--acceptance rejection needs --tree chain" in capsys.readouterr().err


def test_sample_chain_shapes_budget_zero_and_draft_vocabulary():
    from dartree.decode.sampling import sample_chain

    g = torch.Generator().manual_seed(0)
    vocab = torch.tensor([2, 5, 7, 11, 13])
    block = DraftBlock(hidden=torch.zeros(4, 8), base_logits=torch.randn(4, 5, generator=g), vocab=vocab)
    head = make_markov()
    assert sample_chain(block, head, 3, 0, temperature=1.0, generator=g).tree.size == 0
    ch = sample_chain(block, head, 3, 3, temperature=0.7, generator=g, k=2, width=9)
    assert ch.tree.size == 3 and ch.cand.shape == ch.q.shape == (3, 2)
    assert ch.tree.parents.tolist() == [0, 1, 2] and ch.tree.depth.tolist() == [1, 2, 3]
    assert all(int(t) in row.tolist() for t, row in zip(ch.tree.tokens, ch.cand))  # drafted from its candidates
    assert set(ch.cand.reshape(-1).tolist()) <= set(vocab.tolist())
    torch.testing.assert_close(ch.q.sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        sample_chain(block, head, 3, 3, temperature=0.0, generator=g)


def test_sample_chain_runs_every_head(head):
    # every head behind g(C, H, r), stateful ones advanced along the sampled tokens; a seed fixes the chain
    from dartree.decode.sampling import sample_chain

    g = torch.Generator().manual_seed(4)
    block = DraftBlock(hidden=torch.randn(4, 32, generator=g), base_logits=torch.randn(4, 96, generator=g) * 2)
    chains = [sample_chain(block, head, 5, 4, temperature=0.9, generator=torch.Generator().manual_seed(1), k=8)
              for _ in range(2)]
    assert torch.equal(chains[0].tree.tokens, chains[1].tree.tokens) and chains[0].tree.size == 4
    torch.testing.assert_close(chains[0].q.sum(-1), torch.ones(4))
    assert bool((chains[0].cand == chains[0].tree.tokens[:, None]).any(-1).all())
    # q is softmax(g / T) of the head unrolled along the sampled tokens (the state follows the draft)
    ch, st = chains[0], head.init_state(torch.tensor([5]))
    with torch.no_grad():
        for d in range(4):
            c, h = ch.cand[d][None], block.hidden[d][None]
            want = torch.softmax(head.score(c, h, st, block.base_logits[d][c]).float() / 0.9, -1)[0]
            torch.testing.assert_close(ch.q[d], want)
            st = head.advance(st, ch.tree.tokens[d][None], h)

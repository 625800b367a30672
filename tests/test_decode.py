"""Decoding: losslessness, tree positions and masks, KV bookkeeping, stop ids and length limits.

Several tokens committed per round, greedy bit-equality with AR, tree positions and the KV cache, and evaluation
hygiene, on a tiny random Qwen3 target in fp32.
"""

import pytest
import torch

from conftest import VOCAB, make_drafter, make_markov
from dartree.decode.builders import BUILDERS
from dartree.decode.generate import autoregressive_generate, draft_block, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree
from dartree.decode.verify import ancestor_matrix, compile_tree, verify
from dartree.models.drafter import DraftCache
from dartree.models.heads import IdentityHead
from dartree.models.target import cache_length, tiny_target

STOP = 1


def ar(target, prompt, n=40, stops=(STOP,)):
    return autoregressive_generate(target, prompt, max_new_tokens=n, stop_ids=stops).tokens


@pytest.mark.parametrize("builder,budget,params", [
    ("chain", None, {}),
    ("pruned", 12, {"k": 8, "width": 4}),
    ("pruned", 32, {"k": 16, "width": 12, "beta": -0.2}),
    ("pruned", 1, {}),
    ("fixed", 16, {"k": 8}),
    ("ddtree", 12, {}),
    ("pctree", 12, {"k": 8, "children": 3}),
    ("heap-sequential", 12, {"k": 8}),
])
def test_greedy_speculative_equals_target_greedy(target, drafter, head, prompts, builder, budget, params):
    for p in prompts:
        want = ar(target, p)
        got = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, max_new_tokens=40,
                                                                            stop_ids=[STOP], budget=budget,
                                                                            builder_params=params))
        assert got.tokens == want
        st = got.stats
        assert st.new_tokens == len(want) and sum(st.accept_lengths) + 1 == len(want)
        assert all(n <= (budget or drafter.cfg.num_proposals) for n in st.tree_nodes)


def test_budget_1_and_32_give_identical_output(target, drafter, prompts):
    head = make_markov()
    for p in prompts[:5]:
        a = speculative_generate(target, drafter, head, p,
                                 DecodeSettings(builder="pruned", budget=1, max_new_tokens=30))
        b = speculative_generate(target, drafter, head, p, DecodeSettings(builder="pruned", budget=32,
                                                                          max_new_tokens=30))
        assert a.tokens == b.tokens


def test_tree_positions_and_logits_match_plain_forward():
    # tree [root r; children a, b; c under b] (siblings share a position), sdpa and eager
    for impl in ("sdpa", "eager"):
        tg = tiny_target(attn_implementation=impl)
        prefix = [5, 17, 33, 2, 60]
        n = len(prefix)
        r, a, b, c = 11, 40, 41, 42
        tree = Tree(torch.tensor([a, b, c]), torch.tensor([0, 0, 2]), torch.tensor([1, 1, 2]), torch.zeros(3))
        inp = compile_tree(tree, r, n, dtype=torch.float32)
        assert inp.position_ids.tolist() == [[n, n + 1, n + 1, n + 2]]
        m = inp.attention_mask[0, 0]
        assert (m[:, :n] == 0).all()
        vis = m[:, n:] == 0
        assert vis.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
        assert m.dtype == torch.float32 and m.min() == torch.finfo(torch.float32).min
        cache = tg.new_cache()
        tg.forward(torch.tensor([prefix]), cache=cache)
        out = tg.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask, cache=cache)
        for node, path in ((1, [r, a]), (2, [r, b]), (3, [r, b, c])):
            ref = tg.forward(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(out.logits[0, node], ref, atol=1e-5, rtol=1.3e-6)


def test_ancestor_matrix_rejects_bad_order():
    with pytest.raises(ValueError, match="precede"):
        ancestor_matrix(torch.tensor([0, 3, 1]))


@pytest.mark.parametrize("n_good,extra", [(3, 2), (0, 1), (5, 0)])
def test_cache_after_partial_full_rejection_and_full_acceptance(target, n_good, extra):
    prompt = [7, 8, 9, 10]
    ref = ar(target, prompt, n=12, stops=())
    n = len(prompt)
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache=cache)  # committed: prompt; root = ref[0] at position n
    wrong = [(ref[1 + n_good + i] + 1) % VOCAB for i in range(extra)]
    toks = ref[1 : 1 + n_good] + wrong
    m = len(toks)
    tree = Tree(torch.tensor(toks), torch.arange(m), torch.arange(1, m + 1), torch.zeros(m))
    v = verify(target, tree, ref[0], n, cache)
    assert v.tokens == ref[1 : 1 + n_good] and v.bonus_id == ref[1 + n_good]
    committed = prompt + ref[: 1 + n_good]
    assert cache_length(cache) == len(committed)
    assert v.features.shape[0] == 1 + n_good
    nxt = target.forward(torch.tensor([[v.bonus_id]]), cache=cache).logits[0, -1]
    fresh = target.forward(torch.tensor([committed + [v.bonus_id]])).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, atol=1e-5, rtol=1.3e-6)


def test_drafter_cache_holds_only_context(target, drafter):
    prompt = [4, 5, 6, 7, 8]
    feats = target.forward(torch.tensor([prompt])).features[0]
    dc = DraftCache(len(drafter.layers))
    b1 = draft_block(target, drafter, 9, len(prompt), feats, dc)
    assert dc.length == len(prompt)
    # drafting again from the same cache (no new context) gives the same block: no block K/V was kept
    b2 = draft_block(target, drafter, 9, len(prompt), feats[:0], dc)
    assert dc.length == len(prompt)
    torch.testing.assert_close(b1.base_logits, b2.base_logits)
    with pytest.raises(ValueError, match="anchor"):
        draft_block(target, drafter, 9, len(prompt) + 2, feats[:0], dc)


class Oracle:
    """A test builder that proposes the known target continuation (or a wrong token, with wrong=True)."""

    def __init__(self, seq, wrong=False):
        self.seq, self.wrong, self.pos = seq, wrong, 0

    def __call__(self, block, head, root_id, budget, **_):
        assert self.seq[self.pos] == root_id
        if self.wrong:
            toks = [(self.seq[self.pos + 1] + 1) % VOCAB]
            self.pos += 1
        else:
            toks = self.seq[self.pos + 1 : self.pos + 1 + budget]
            self.pos += len(toks) + 1
        m = len(toks)
        return Tree(torch.tensor(toks, dtype=torch.long), torch.arange(m), torch.arange(1, m + 1), torch.zeros(m))


@pytest.fixture
def oracle_builder():
    holder = {}

    def build(*a, **k):
        return holder["oracle"](*a, **k)

    BUILDERS["test-oracle"] = build
    yield holder
    del BUILDERS["test-oracle"]


def _first_new_index(seq, lo):
    for i in range(lo, len(seq)):
        if seq[i] not in seq[:i]:
            return i
    pytest.skip("no fresh token in the reference run")


@pytest.mark.parametrize("where", ["mid_block", "first_token", "bonus"])
def test_stop_token_accepted_mid_block(target, drafter, oracle_builder, where):
    prompt = [12, 13, 14, 15]
    ref = ar(target, prompt, n=60, stops=())
    budget = 7
    idx = {"mid_block": _first_new_index(ref, 3), "first_token": 0, "bonus": _first_new_index(ref, 2)}[where]
    if where == "bonus":
        budget = idx - 1  # round 1 drafts ref[1..idx-1]; ref[idx] is its bonus token
    elif where == "mid_block":
        assert idx < budget + 1, "the stop must fall inside the first drafted block"
    stop = ref[idx]
    want = ar(target, prompt, n=60, stops=(stop, 95))
    assert want == ref[: idx + 1]
    oracle_builder["oracle"] = Oracle(ref)
    got = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder="test-oracle",
                                                                                       budget=budget, max_new_tokens=60,
                                                                                       stop_ids=[stop, 95]))
    assert got.tokens == want
    assert sum(got.stats.accept_lengths) + 1 == len(want)


@pytest.mark.parametrize("max_new", [0, 1, 7, 8, 9, 15, 16, 17])
def test_max_new_tokens_exact_around_block_size(target, drafter, oracle_builder, max_new):
    prompt = [21, 22, 23]
    ref = ar(target, prompt, n=40, stops=())
    oracle_builder["oracle"] = Oracle(ref)
    got = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder="test-oracle", budget=7,
                                                                                       max_new_tokens=max_new))
    assert got.tokens == ref[:max_new]
    assert got.stats.new_tokens == max_new
    rnd = speculative_generate(target, drafter, make_markov(), prompt, DecodeSettings(builder="pruned", budget=12,
                                                                                      max_new_tokens=max_new))
    assert rnd.tokens == ref[:max_new]


def test_tau_is_one_when_always_wrong_and_max_when_always_right(target, drafter, oracle_builder):
    prompt = [30, 31, 32]
    ref = ar(target, prompt, n=80, stops=())
    oracle_builder["oracle"] = Oracle(ref, wrong=True)
    bad = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder="test-oracle", budget=7,
                                                                                       max_new_tokens=33))
    assert bad.tokens == ref[:33] and bad.stats.tau == 1.0
    oracle_builder["oracle"] = Oracle(ref)
    good = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder="test-oracle", budget=7,
                                                                                        max_new_tokens=33))
    assert good.tokens == ref[:33] and good.stats.tau == 8.0  # 7 drafts + bonus every round, 4 rounds


def test_layer_mismatch_and_unknown_builder_are_clear(target, drafter):
    with pytest.raises(ValueError, match=r"^unknown tree builder 'nope'; available: \['chain', "):
        speculative_generate(target, drafter, IdentityHead(), [3, 4], DecodeSettings(builder="nope", max_new_tokens=4))
    other = tiny_target(layer_ids=[0])
    with pytest.raises(ValueError, match="set_layer_ids"):
        speculative_generate(other, drafter, IdentityHead(), [3, 4], DecodeSettings(builder="chain", max_new_tokens=4))


@pytest.mark.parametrize("block_size", [8, 5])
def test_zlab_proposal_offset_and_other_block_sizes_are_lossless(target, prompts, block_size):
    # z-lab DFlash convention: block positions 1..L-1 are the P = L - 1 proposals
    drafter = make_drafter(block_size=block_size, proposal_offset=1)
    assert drafter.cfg.num_proposals == block_size - 1
    for p in prompts[:3]:
        for builder in ("chain", "pruned", "fixed", "ddtree", "pctree", "heap-sequential"):
            got = speculative_generate(target, drafter, make_markov(), p, DecodeSettings(builder=builder, budget=10,
                                                                                         max_new_tokens=30,
                                                                                         stop_ids=[STOP]))
            assert got.tokens == ar(target, p, n=30)
            assert all(n <= 10 for n in got.stats.tree_nodes)


class SiblingOracle(Oracle):
    """Depth 1 holds a wrong sibling before the right token, and the right continuation hangs under the
    second child: the accepted path [0, 2, 3, ...] is not contiguous, so KV compaction must gather."""

    def __call__(self, block, head, root_id, budget, **_):
        assert self.seq[self.pos] == root_id
        right = self.seq[self.pos + 1 : self.pos + budget]
        wrong = (right[0] + 1) % VOCAB
        toks = [wrong] + right
        m = len(toks)
        parents = [0, 0] + list(range(2, m))
        depth = [1, 1] + list(range(2, m))
        self.pos += len(right) + 1
        return Tree(torch.tensor(toks), torch.tensor(parents), torch.tensor(depth), torch.zeros(m))


def test_non_contiguous_accepted_path_is_lossless(target, drafter, oracle_builder):
    prompt = [40, 41, 42, 43]
    ref = ar(target, prompt, n=60, stops=())
    oracle_builder["oracle"] = SiblingOracle(ref)
    got = speculative_generate(target, drafter, IdentityHead(), prompt, DecodeSettings(builder="test-oracle", budget=6,
                                                                                       max_new_tokens=43))
    assert got.tokens == ref[:43]
    assert got.stats.accept_lengths[:3] == [6, 6, 6]  # 5 accepted drafts + bonus, every round


def test_ar_stepper_and_lockstep_pairing(target, drafter, prompts):
    """ARStepper is the AR loop one step at a time (same tokens, one accept length per step); run in lockstep with a
    speculative decode (``lockstep=ar.run_to``) it is called after every round with the tokens generated so far, stays
    level with them, and its time is left out of the speculative loop's decode_s."""
    import time as _time

    from dartree.decode.generate import ARStepper

    head = make_markov()
    p = prompts[0]
    want = ar(target, p, n=30)
    st = ARStepper(target, p, max_new_tokens=30, stop_ids=[STOP])
    st.run_to(5)
    assert st.tokens == want[:len(st.tokens)] and len(st.tokens) >= min(5, len(want))
    while not st.step():
        pass
    assert st.tokens == want and st.done and len(st.stats.accept_lengths) == len(want) - 1
    assert st.stats.decode_s > 0 and st.step() is True and st.tokens == want  # done: a step does nothing

    pair, calls, pause = ARStepper(target, p, max_new_tokens=30, stop_ids=[STOP]), [], 0.02

    def hook(n):
        calls.append((n, len(pair.tokens)))
        pair.run_to(n)
        _time.sleep(pause)

    t0 = _time.perf_counter()
    got = speculative_generate(target, drafter, head, p, DecodeSettings(builder="pruned", budget=6, max_new_tokens=30,
                                                                        stop_ids=[STOP]), lockstep=hook)
    wall = _time.perf_counter() - t0
    assert got.tokens == want and pair.tokens == want[:len(pair.tokens)]
    counts = [n for n, _ in calls]
    assert len(calls) == got.stats.rounds and counts == sorted(counts) and counts[-1] == len(want)
    assert counts == [1 + sum(got.stats.accept_lengths[: i + 1]) for i in range(len(counts))]
    assert all(before <= n for n, before in calls) and len(pair.tokens) == len(want)
    assert got.stats.decode_s < wall - pause * len(calls)  # the hook's sleeps are not the loop's time
    with pytest.raises(TypeError, match="lockstep"):
        speculative_generate(target, drafter, head, p, DecodeSettings(builder="chain", max_new_tokens=4), lockstep=3)

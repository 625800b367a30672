"""Batched decoding (decode/batched.py): every row lossless on its own, whatever its neighbours and their padding.

Tiny random Qwen3 targets in fp32 (and bf16 in the row-invariant mode), prompts of very different lengths, every
builder x every head (DSpine's, acting between the drafter's layers, included) at batch 1, 2, 4 and 8 against each
prompt's own AR output; finished rows and refills from a queue longer than the batch; a stop id inside an accepted
path; per-row caps; the rows' logits and drafts against their batch-1 twins; T > 0 first tokens chi-square tested
against the target's distribution.
"""

import pytest
import torch

from conftest import VOCAB, make_drafter, make_head, make_markov
from dartree.decode.batch_rounds import compile_batch, draft_blocks, verify_batch
from dartree.decode.batched import batched_generate
from dartree.decode.draft import draft_block
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import Tree
from dartree.decode.verify import verify
from dartree.models.batch_cache import BatchKV, RowDraftCache, compact_rows
from dartree.models.drafter import DraftCache
from dartree.models.target import tiny_target

STOP = 1
LENGTHS = (2, 57, 5, 23, 3, 40, 9, 14)  # very different prompt lengths
BUILDERS = {"chain": (None, {}), "pruned": (12, {"k": 8, "width": 4}), "ddtree": (12, {}),
            "pctree": (12, {"k": 8, "children": 3}), "fixed": (12, {"k": 8}), "heap-sequential": (12, {"k": 8})}


def _prompts(lengths=LENGTHS, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


_AR = {}


def ar(target, prompt, n=24, stops=(STOP,)):
    # tiny targets of one name and dtype are the same model; the attention implementation tells the mode
    key = (target.name, target.dtype, target.model.config._attn_implementation, tuple(prompt), n, tuple(stops))
    if key not in _AR:
        _AR[key] = autoregressive_generate(target, prompt, max_new_tokens=n, stop_ids=stops).tokens
    return _AR[key]


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_builder_and_head_is_lossless_at_batch_1_2_4_8(target, drafter, head, builder):
    prompts = _prompts()
    want = [ar(target, p) for p in prompts]
    budget, params = BUILDERS[builder]
    for b in (1, 2, 4, 8):
        out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder=builder, budget=budget,
                                                                              builder_params=params, max_new_tokens=24,
                                                                              stop_ids=[STOP]), batch_size=b)
        assert [o.tokens for o in out] == want, b
        assert max(out.rows) == b and len(out.widths) == out.forwards
        for o, w in zip(out, want):
            st = o.stats
            assert st.new_tokens == len(w) and sum(st.accept_lengths) + 1 == len(w)
            assert all(n <= (budget or drafter.cfg.num_proposals) for n in st.tree_nodes)


def _dspine_pair(target):
    """A DSpine drafter (causal block, z-lab proposal offset) and its head acting between the layers, bound."""
    from dartree.models.drafter import DFlashDrafter, DrafterConfig
    from dartree.models.families.dspine import DSpineHead

    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                          num_kv_heads=2, head_dim=8, target_layer_ids=[1, 2], mask_token_id=0,
                                          block_size=8, proposal_offset=1, causal_block=True)).eval()
    head = DSpineHead(VOCAB, 32, 2, transfer_rank=8, message_size=8, top_k=4)
    head.init_codes(target.lm_head.weight.detach())
    with torch.no_grad():  # writes and predecessor gate away from zero, so the injection acts
        for w in [*head.injection.writes, head.injection.predecessor_gate]:
            w.weight.normal_(std=0.5)
    head.eval().bind_models(drafter, target.lm_head.weight)
    return drafter, head


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_builder_over_a_head_between_the_layers_is_lossless_at_batch_1_2_4_8(target, builder):
    """DSpine's head acts between the drafter's layers (its hook over all N blocks of the one forward)."""
    drafter, head = _dspine_pair(target)
    prompts = _prompts()
    want = [ar(target, p) for p in prompts]
    budget, params = BUILDERS[builder]
    for b in (1, 2, 4, 8):
        out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder=builder, budget=budget,
                                                                              builder_params=params, max_new_tokens=24,
                                                                              stop_ids=[STOP]), batch_size=b)
        assert [o.tokens for o in out] == want, b
    one = speculative_generate(target, drafter, head, prompts[1], DecodeSettings(builder=builder, budget=budget,
                                                                                 builder_params=params,
                                                                                 max_new_tokens=24, stop_ids=[STOP]))
    alone = batched_generate(target, drafter, head, prompts[1:2], DecodeSettings(builder=builder, budget=budget,
                                                                                 builder_params=params,
                                                                                 max_new_tokens=24, stop_ids=[STOP]))
    assert alone[0].stats.accept_lengths == one.stats.accept_lengths  # a batch of one is batch 1's decode


def test_dflash2_convolutions_and_a_reduced_draft_vocabulary_are_lossless_in_a_batch(target):
    from dartree.models.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                                          num_kv_heads=2, head_dim=8, target_layer_ids=[1, 2], mask_token_id=0,
                                          block_size=8, conv_kernel_size=3, conv_group_size=8,
                                          draft_vocab_size=40)).eval()
    with torch.no_grad():
        for m in drafter.modules():
            if hasattr(m, "kernel_projection"):  # the convolutions away from the identity, so they act
                m.kernel_projection.weight.normal_(std=0.3)
        drafter.draft_vocab.copy_(torch.randperm(VOCAB)[:40])
    prompts = _prompts()
    out = batched_generate(target, drafter, make_markov(), prompts, DecodeSettings(builder="pruned", budget=12,
                                                                                   builder_params={"k": 8},
                                                                                   max_new_tokens=24, stop_ids=[STOP]),
                           batch_size=4)
    assert [o.tokens for o in out] == [ar(target, p) for p in prompts]


def test_batch_1_runs_the_rounds_of_speculative_generate(target, drafter):
    """One row at a time is the one-prompt loop itself (its widths the trees' sizes + 1); and the batched loop left
    with one row (its neighbour done at its prefill: no hole, no padding) runs batch 1's drafts, trees and accept
    lengths too."""
    head = make_markov()
    for p in _prompts()[:3]:
        for builder in ("pruned", "ddtree"):
            budget, params = BUILDERS[builder]
            one = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, budget=budget,
                                                                                builder_params=params,
                                                                                max_new_tokens=24, stop_ids=[STOP],
                                                                                record_trees=True))
            alone = batched_generate(target, drafter, head, [p, p], DecodeSettings(builder=builder, budget=budget,
                                                                                   builder_params=params,
                                                                                   max_new_tokens=24, stop_ids=[STOP],
                                                                                   record_trees=True), batch_size=1)
            assert [o.tokens for o in alone] == [one.tokens, one.tokens]
            assert alone.widths == [n + 1 for n in one.stats.tree_nodes] * 2 and set(alone.rows) == {1}
            looped = batched_generate(target, drafter, head, [p, _prompts()[4]], DecodeSettings(builder=builder,
                                                                                                budget=budget,
                                                                                                builder_params=params,
                                                                                                max_new_tokens=[24, 1],
                                                                                                stop_ids=[STOP],
                                                                                                record_trees=True))
            got = looped[0]
            assert len(looped[1].tokens) == 1 and set(looped.rows) == {1}
            assert got.tokens == one.tokens
            assert got.stats.accept_lengths == one.stats.accept_lengths
            assert got.stats.trees == one.stats.trees


def test_per_row_caps_finished_rows_and_refills_from_a_longer_queue(target, drafter):
    prompts, caps = _prompts(), [0, 1, 5, 40, 13, 2, 30, 8]
    head = make_head("gated_markov")
    out = batched_generate(target, drafter, head, prompts, DecodeSettings(builder="pruned", budget=12,
                                                                          max_new_tokens=caps, stop_ids=[STOP],
                                                                          lookup=4, builder_params={"k": 8}),
                           batch_size=3)
    assert [o.tokens for o in out] == [ar(target, p, n=c) for p, c in zip(prompts, caps)]
    assert out[0].tokens == [] and len(out[1].tokens) == 1 and out[1].stats.rounds == 0  # done at the prefill
    assert max(out.rows) == 3 and out.rows[-1] < 3  # refilled while the queue lasted, then rows left


def test_a_stop_id_inside_an_accepted_path_ends_its_row_while_the_others_go_on(target, drafter):
    prompts = _prompts(seed=3)
    head = make_markov()
    settings = DecodeSettings(builder="pruned", budget=12, builder_params={"k": 8}, lookup=8, max_new_tokens=40)
    free = batched_generate(target, drafter, head, prompts, settings.with_(stop_ids=[]), batch_size=4)
    picks = []  # (row, round, index of the stop in the row's tokens, tokens of the round up to it)
    for r, o in enumerate(free):
        s = 1
        for k, n in enumerate(o.stats.accept_lengths):
            # an accepted draft token (not the round's bonus, the last) that the row has not emitted before
            picks += [(r, k, s + j, j + 1) for j in range(n - 1) if o.tokens[s + j] not in o.tokens[: s + j]]
            s += n
    assert picks, "no round accepted a fresh draft token: the test needs one"
    r, k, s, cut = picks[0]
    stop = free[r].tokens[s]
    out = batched_generate(target, drafter, head, prompts, settings.with_(stop_ids=[stop]), batch_size=4)
    assert [o.tokens for o in out] == [ar(target, p, n=40, stops=(stop,)) for p in prompts]
    assert out[r].tokens == free[r].tokens[: s + 1] and out[r].stats.rounds == k + 1
    assert out[r].stats.accept_lengths[-1] == cut < free[r].stats.accept_lengths[k]  # cut inside the path
    assert max(o.stats.rounds for o in out) > k + 1  # other rows decoded on


def test_a_rows_output_is_the_same_whatever_its_neighbours(target, drafter):
    head = make_head("rnn")
    p = _prompts()[2]
    want = ar(target, p, n=30)
    short = batched_generate(target, drafter, head, [[4, 5], p, [6]], DecodeSettings(budget=6, max_new_tokens=30,
                                                                                     stop_ids=[STOP]))
    long = batched_generate(target, drafter, head, _prompts((60, 71), seed=2) + [p], DecodeSettings(budget=20,
                                                                                                    max_new_tokens=30,
                                                                                                    stop_ids=[STOP],
                                                                                                    builder_params={"width": 8}))
    assert short[1].tokens == long[2].tokens == want


def _tree(tokens, parents):
    depth = []
    for q in parents:
        depth.append(1 if q == 0 else depth[q - 1] + 1)
    m = len(tokens)
    return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                torch.tensor(depth, dtype=torch.long), torch.zeros(m))


def _oracle_tree(kind, right):
    """A tree holding the right continuation ``right`` (the accepted path) among wrong nodes, by kind."""
    wrong = lambda t, k=1: (t + k) % VOCAB  # noqa: E731 (never equal to t)
    if kind == "empty":
        return _tree([], []), 0
    if kind == "chain":
        return _tree(right, list(range(len(right)))), len(right)
    if kind == "sibling":  # a wrong sibling first: the accepted path [0, 2, 3, ...] is not contiguous
        toks = [wrong(right[0])] + right
        return _tree(toks, [0, 0] + list(range(2, len(toks)))), len(right)
    # wide: five wrong siblings (with children of their own), then the right token, a wrong and a right grandchild
    toks, par = [wrong(right[0], k) for k in range(1, 6)], [0] * 5
    toks += [wrong(right[1], 2), wrong(right[1], 3), right[0], wrong(right[1]), right[1]]
    par += [1, 1, 0, 8, 8]
    return _tree(toks, par), 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_verify_rows_compute_their_batch_1_logits_and_keep_their_paths(dtype, monkeypatch):
    """Rows of very different lengths and trees (an AR step, a long chain, a sibling before the path, a wide tree)
    over several rounds: each row's logits equal its batch-1 verify's (bit for bit in bf16 in the row-invariant
    mode, to fp32 rounding otherwise), it commits the target's tokens, and its cache stays its own."""
    import contextlib

    from dartree.models.invariant import choose_invariant_linear, row_invariant

    tg = tiny_target(vocab_size=VOCAB, layer_ids=[1, 2], dtype=dtype)
    mode = contextlib.nullcontext()
    if dtype == torch.bfloat16:
        try:
            choose_invariant_linear(tg.model)
        except ValueError as exc:
            pytest.skip(f"no row-invariant bf16 linear on this CPU: {exc}")
        mode = row_invariant(tg)
    prompts, kinds = _prompts((3, 61, 8, 30)), ["empty", "chain", "sibling", "wide"]
    with mode:
        refs = [ar(tg, p, n=60, stops=()) for p in prompts]
        kv, singles, done = BatchKV(tg), [], [0] * 4  # done: ref tokens committed (the root is ref[done])
        for p in prompts:
            c = tg.new_cache()
            tg.forward(torch.tensor([p]), cache=c)
            kv.add_row(c)  # a copy: the prefill cache goes on as the row's batch-1 twin
            singles.append(c)
        calls, real = [], tg.forward
        monkeypatch.setattr(tg, "forward", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
        for rnd in range(4):
            trees, n_ok = zip(*[_oracle_tree(kind, refs[i][done[i] + 1: done[i] + 1 + (9 if kind == "chain" else 4)])
                                for i, kind in enumerate(kinds)])
            roots = [refs[i][done[i]] for i in range(4)]
            starts = list(kv.lens)
            vers = verify_batch(tg, trees, roots, kv)
            logits = calls[-1].logits
            assert logits.shape[1] == max(t.size for t in trees) + 1  # one shared width
            for i, tree in enumerate(trees):
                one = verify(tg, tree, roots[i], starts[i], singles[i])  # the row's batch-1 twin
                got, want = logits[i, : tree.size + 1], calls[-1].logits[0]
                if dtype == torch.bfloat16:
                    assert torch.equal(got, want), (rnd, i)
                else:
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)
                assert vers[i].tokens == one.tokens == refs[i][done[i] + 1: done[i] + 1 + n_ok[i]], (rnd, i)
                assert vers[i].bonus_id == one.bonus_id == refs[i][done[i] + 1 + n_ok[i]]
                assert torch.equal(vers[i].accepted, one.accepted)
                done[i] += n_ok[i] + 1
            assert kv.lens == [len(p) + d for p, d in zip(prompts, done)]


def test_draft_blocks_give_each_row_its_batch_1_draft(target, drafter):
    """Rows whose drafter caches hold different lengths and whose new context differs in length: each row's block
    equals the batch-1 draft over the same context (the hole and the padded context are masked out)."""
    prompts = _prompts((4, 33, 12))
    feats = [target.forward(torch.tensor([p])).features[0] for p in prompts]
    dc, singles = RowDraftCache(len(drafter.layers)), []
    for _ in prompts:
        dc.add_row()
    cuts = [2, 30, 5]  # first round: the first cut positions; second round: the rest
    draft_blocks(target, drafter, [p[c] for p, c in zip(prompts, cuts)], cuts, [f[:c] for f, c in zip(feats, cuts)],
                 dc)
    assert dc.lens == cuts
    starts = [len(p) for p in prompts]
    blocks = draft_blocks(target, drafter, [7, 8, 9], starts, [f[c:] for f, c in zip(feats, cuts)], dc)
    assert dc.lens == starts and dc.width == max(starts)
    for i, (f, anchor) in enumerate(zip(feats, [7, 8, 9])):
        one = draft_block(target, drafter, anchor, starts[i], f, DraftCache(len(drafter.layers)))
        torch.testing.assert_close(blocks[i].base_logits, one.base_logits, atol=2e-5, rtol=1e-5)
    dc.reset_row(1)
    dc.keep_rows([2, 1])
    assert dc.lens == [starts[2], 0] and dc.width == starts[2]


def test_compact_rows_moves_each_rows_kept_entries_and_crops():
    t = torch.arange(3 * 1 * 9 * 1, dtype=torch.float32).view(3, 1, 9, 1)  # past = 5, 4 appended columns
    before = t.clone()
    out = compact_rows(t, [2, 5, 0], [torch.tensor([0, 2]), torch.tensor([0, 1, 3]), torch.tensor([1])], past=5)
    assert out.shape == (3, 1, 8, 1)
    assert out[0, 0, :4, 0].tolist() == before[0, 0, [0, 1, 5, 7], 0].tolist()
    assert out[1, 0, :8, 0].tolist() == before[1, 0, [0, 1, 2, 3, 4, 5, 6, 8], 0].tolist()
    assert out[2, 0, :1, 0].tolist() == before[2, 0, [6], 0].tolist()
    with pytest.raises(ValueError, match="outside the 4 appended columns"):
        compact_rows(before.clone(), [0, 0, 0], [torch.tensor([4]), torch.tensor([0]), torch.tensor([0])], past=5)


CHI2_DF3_P1E3 = 16.266  # chi-square critical value, 3 degrees of freedom, p = 1e-3


def test_t_above_0_each_rows_first_token_is_distributed_as_the_targets_sample():
    tg = tiny_target(vocab_size=4, hidden_size=16, num_layers=2, seed=3)
    with torch.no_grad():
        tg.model.lm_head.weight.mul_(0.3)  # a spread-out distribution over the 4 tokens
    prefixes, roots, temp, n = [[1, 2, 3, 0, 2], [3], [2, 0, 1, 3, 3, 2, 1, 0, 2, 2, 3, 1]], [1, 2, 0], 0.8, 1500
    trees = [_tree([2], [0]), _tree([3, 0, 3, 1, 2], [0, 0, 0, 1, 3]), _tree([], [])]  # a chain, siblings, none
    kv = BatchKV(tg)
    for p in prefixes:
        c = tg.new_cache()
        tg.forward(torch.tensor([p]), cache=c)
        kv.add_row(c)
    gen, counts = torch.Generator().manual_seed(0), torch.zeros(3, 4)
    inputs = compile_batch(trees, roots, kv.lens, kv.width, tg.dtype)
    for _ in range(n):
        for i, v in enumerate(verify_batch(tg, trees, roots, kv, temperature=temp, generator=gen, inputs=inputs)):
            counts[i, v.tokens[0] if v.tokens else v.bonus_id] += 1
        kv.truncate([len(p) for p in prefixes])  # back to the prefixes
    for i, (p, r) in enumerate(zip(prefixes, roots)):
        probs = torch.softmax(tg.forward(torch.tensor([p + [r]])).logits[0, -1] / temp, -1)
        assert probs.min() > 0.03
        exp = probs * n
        assert float(((counts[i] - exp) ** 2 / exp).sum()) < CHI2_DF3_P1E3, (i, counts[i] / n, probs)


def test_t_above_0_a_seed_fixes_the_batch(target, drafter):
    head = make_markov()
    runs = [batched_generate(target, drafter, head, _prompts()[:4], DecodeSettings(budget=8, max_new_tokens=20,
                                                                                   temperature=1.0),
                             generator=torch.Generator().manual_seed(5), batch_size=2) for _ in range(2)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert all(len(o.tokens) > 0 for o in runs[0])


def test_bf16_in_the_row_invariant_mode_every_row_equals_its_ar_output():
    from dartree.models.invariant import choose_invariant_linear, row_invariant

    tg = tiny_target(vocab_size=VOCAB, layer_ids=[1, 2], dtype=torch.bfloat16)
    try:
        choose_invariant_linear(tg.model)
    except ValueError as exc:
        pytest.skip(f"no row-invariant bf16 linear on this CPU: {exc}")
    drafter, head = make_drafter().to(torch.bfloat16), make_head("selector").to(torch.bfloat16)
    prompts = _prompts()
    with row_invariant(tg):
        want = [ar(tg, p) for p in prompts]
        for builder in ("chain", "pruned", "ddtree"):
            budget, params = BUILDERS[builder]
            for b in (1, 2, 4, 8):
                out = batched_generate(tg, drafter, head, prompts, DecodeSettings(builder=builder, budget=budget,
                                                                                  builder_params=params,
                                                                                  max_new_tokens=24, stop_ids=[STOP]),
                                       batch_size=b)
                assert [o.tokens for o in out] == want, (builder, b)


def test_bad_batched_arguments_are_named_before_any_forward(target, drafter):
    head, prompts = make_markov(), _prompts()[:3]
    cases = [
        (dict(budget=-1), ValueError, r"^budget=-1 must be >= 0 \(tree nodes per round"),
        (dict(max_new_tokens=[4, 5]), ValueError, "max_new_tokens holds 2 caps for 3 prompts"),
        (dict(max_new_tokens=[4, 5.0, 3]), TypeError, r"max_new_tokens\[1\]=5.0 must be an integer"),
        (dict(batch_size=0), ValueError, "batch_size=0 must be an int >= 1"),
        (dict(acceptance_free=1), TypeError, "acceptance_free"),
    ]
    for kw, exc, msg in cases:
        args = {"max_new_tokens": 4, **kw}
        call = {k: args.pop(k) for k in ("batch_size",) if k in args}
        with pytest.raises(exc, match=msg):
            batched_generate(target, drafter, head, prompts, DecodeSettings(**args), **call)
    with pytest.raises(ValueError, match=r"^prompts\[1\] is empty; give at least one token id$"):
        batched_generate(target, drafter, head, [[3, 4], [], [5]], DecodeSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"^prompts\[2\] holds id 96 outside the target's vocabulary"):
        batched_generate(target, drafter, head, [[3, 4], [5], [6, 96]], DecodeSettings(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"^unknown tree builder 'nope'"):  # not a prompt's problem: no index
        batched_generate(target, drafter, head, prompts, DecodeSettings(builder="nope", max_new_tokens=4))
    with pytest.raises(ValueError, match=r"^prompts is empty"):
        batched_generate(target, drafter, head, [], DecodeSettings(max_new_tokens=4))
    with pytest.raises(TypeError, match="give a list of prompts"):
        batched_generate(target, drafter, head, torch.tensor([[3, 4], [5, 6]]), DecodeSettings(max_new_tokens=4))


def test_the_api_generates_a_list_for_a_list_of_prompts(target, drafter):
    from dartree.decode.assembly import Assembly
    from dartree.models.checkpoint import DraftModel
    from dartree.speculator import Generation, SpeculativeDecoder, is_prompt_list

    spec = SpeculativeDecoder(Assembly(target, DraftModel(drafter, make_markov(), {}), torch.float32, "fp32 (test)"))
    prompts = _prompts()[:5]
    caps = [12, 3, 20, 0, 9]
    out = spec.generate(prompts, max_new_tokens=caps, tree="ddtree", budget=10)
    assert isinstance(out, list) and all(isinstance(g, Generation) for g in out)
    assert [g.tokens for g in out] == [spec.generate_ar(p, max_new_tokens=c).tokens for p, c in zip(prompts, caps)]
    assert [g.prompt_ids for g in out] == prompts and out[0].setup_s > 0.0
    assert all(g.seconds > 0 for g, c in zip(out, caps) if c)
    again = spec.generate_batch(prompts[:1], max_new_tokens=12, tree="ddtree", budget=10, batch_size=1)
    assert [g.tokens for g in again] == [out[0].tokens] and again[0].setup_s == 0.0  # warmed by the first call
    single = spec.generate([prompts[0]], max_new_tokens=12, tree="ddtree", budget=10)  # [[ids]]: one prompt
    assert isinstance(single, Generation) and single.tokens == out[0].tokens
    assert is_prompt_list(["a", "b"]) and is_prompt_list([[{"role": "user", "content": "hi"}]])
    assert is_prompt_list([[3, 4], [5]]) and not is_prompt_list([[3, 4]]) and not is_prompt_list([3, 4])
    assert not is_prompt_list([{"role": "user", "content": "hi"}]) and not is_prompt_list("ab")
    with pytest.raises(TypeError, match=r"^prompts\[1\]: prompt\[0\]="):
        spec.generate([[3, 4], [2.5]], max_new_tokens=4)

"""Regeneration of training responses: continuous batching equals plain greedy decoding, resume, prompt mix."""

import json
from collections import Counter

import pytest
import torch

from dartree.decode.generate import autoregressive_generate
from dartree.training.answers import DataSpec, regenerate_responses
from dartree.training.dialogues import draw_conversations, looks_like_code, sharegpt_dialogues
from dartree.training.regen import continuous_greedy

MAX_NEW = 10


def _prompts(n=13, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (1 + (7 * i) % 19,), generator=g).tolist() for i in range(n)]


def _greedy(target, prompts, stop):
    out = []
    for p in prompts:
        toks = autoregressive_generate(target, p, max_new_tokens=MAX_NEW, stop_ids=[stop] if stop >= 0 else []).tokens
        out.append(list(toks))
    return out


@pytest.fixture(scope="module")
def stop_and_reference(target):
    prompts = _prompts()
    free = _greedy(target, prompts, stop=-1)
    # a token the model often emits, so several rows stop early and their slots are refilled
    stop = Counter(t for row in free for t in row[1:]).most_common(1)[0][0]
    return prompts, stop, _greedy(target, prompts, stop)


@pytest.mark.parametrize("slots", [1, 4, 13, 32])
def test_continuous_greedy_equals_one_prompt_at_a_time(target, stop_and_reference, slots):
    prompts, stop, ref = stop_and_reference
    assert any(len(r) < MAX_NEW for r in ref) and any(len(r) == MAX_NEW for r in ref)  # both endings occur
    got = dict(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=slots))
    assert sorted(got) == list(range(len(prompts)))
    for i, row in enumerate(ref):
        assert got[i] == row, (i, got[i], row)


def test_prefill_groups_and_fed_continuations_keep_every_row_greedy(target, stop_and_reference, monkeypatch):
    import dartree.training.regen as regen

    prompts, stop, ref = stop_and_reference
    monkeypatch.setattr(regen, "PREFILL_TOKENS", 20)  # prompts of 1-19 tokens: many small prefill groups
    got = dict(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=13))
    assert all(got[i] == row for i, row in enumerate(ref))
    # feed + follow: row j's answer continues in its slot as row j2 = prompt + answer + extra; the continuation
    # equals greedy decoding of the whole history from scratch
    rows = [list(p) for p in prompts[:4]]
    queue = [0, 1, 2, 3]
    extra = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]

    def follow(j, resp):
        if j >= 4:
            return None
        rows.append(rows[j] + list(resp) + extra[j])
        return len(rows) - 1, extra[j]

    out = dict(continuous_greedy(target.model, rows, max_new_tokens=MAX_NEW, stop_id=stop, slots=3, order=queue,
                                 feed=True, max_len=80, follow=follow))
    assert sorted(out) == list(range(8))
    for j in range(8):
        assert out[j] == _greedy(target, [rows[j]], stop)[0], j
    with pytest.raises(ValueError, match="feed=True"):
        list(continuous_greedy(target.model, rows, max_new_tokens=2, stop_id=stop, order=(0,), feed=True))


def test_continuous_greedy_generates_only_the_given_order(target, stop_and_reference):
    prompts, stop, ref = stop_and_reference
    got = list(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=3,
                                 order=[5, 0, 9]))
    assert sorted(i for i, _ in got) == [0, 5, 9]
    assert all(row == ref[i] for i, row in got)


def test_continuous_greedy_packs_linears_only_while_it_runs(target, stop_and_reference):
    from dartree.models.packed import is_packed, pack_linears

    prompts, stop, ref = stop_and_reference
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    gen = continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=4, linear="onednn")
    first = next(gen)
    assert all(is_packed(m) for m in linears)  # inside: every linear runs prepacked weights
    got = dict([first, *gen])
    assert not any(is_packed(m) for m in linears)  # restored when the generator ends
    assert [got[i] for i in range(len(prompts))] == ref
    aten = dict(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=4, linear="aten"))
    assert aten == got
    # a caller's own packing is left as it was
    pack_linears(target.model.lm_head, "onednn")
    try:
        list(continuous_greedy(target.model, prompts[:2], max_new_tokens=2, stop_id=stop, slots=2))
        assert is_packed(target.model.lm_head) and not is_packed(linears[0])
    finally:
        pack_linears(target.model, "aten")
    with pytest.raises(ValueError, match="linear backend"):
        list(continuous_greedy(target.model, prompts, max_new_tokens=2, stop_id=stop, linear="mkl"))


@pytest.mark.parametrize("min_free,prefill_tokens", [(4, 20), (13, 4096), (2, 1)])
def test_a_refill_threshold_and_other_prefill_sizes_keep_every_row_greedy(target, stop_and_reference, min_free,
                                                                          prefill_tokens):
    """The GPU schedule (refill only once min_free slots are free, larger or smaller prefill forwards) changes when
    rows enter, never their tokens: each still equals one-prompt-at-a-time greedy decoding (fp32)."""
    prompts, stop, ref = stop_and_reference
    got = dict(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=6,
                                 min_free=min_free, prefill_tokens=prefill_tokens))
    assert sorted(got) == list(range(len(prompts)))
    assert [got[i] for i in range(len(prompts))] == ref


def test_a_refill_threshold_waits_for_free_slots(target, stop_and_reference, monkeypatch):
    """With min_free=3 of 4 slots, no prefill runs while only 1 or 2 slots are free (and rows remain queued)."""
    import dartree.training.regen as regen

    prompts, stop, _ = stop_and_reference
    seen = []
    real = regen._SlotRun.refill

    def spy(run, free):
        seen.append((len(free), sum(o >= 0 for o in run.owner), len(run.pending)))
        return real(run, free)

    monkeypatch.setattr(regen._SlotRun, "refill", spy)
    list(continuous_greedy(target.model, prompts, max_new_tokens=MAX_NEW, stop_id=stop, slots=4, min_free=3))
    assert seen[0] == (4, 0, len(prompts))  # the first fill
    assert len(seen) > 2 and all(free >= 3 or busy == 0 for free, busy, _ in seen[1:])


def test_continuous_greedy_rejects_bad_arguments(target):
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(continuous_greedy(target.model, [[3, 4]], max_new_tokens=0, stop_id=1))
    with pytest.raises(ValueError, match="at least one token"):
        list(continuous_greedy(target.model, [[3, 4], []], max_new_tokens=2, stop_id=1))
    with pytest.raises(ValueError, match="min_free"):
        list(continuous_greedy(target.model, [[3, 4]], max_new_tokens=2, stop_id=1, min_free=0))


def test_regenerate_responses_resumes_after_a_torn_write(target, stop_and_reference, tmp_path):
    prompts, stop, ref = stop_and_reference
    spec = DataSpec(num_prompts=len(prompts), max_new_tokens=MAX_NEW, batch_size=4)
    whole = regenerate_responses(target, spec, tmp_path / "whole", prompts=prompts, stop_id=stop)
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(prompts)))
    assert [r["response_ids"] for r in rows] == ref and [r["prompt_ids"] for r in rows] == prompts
    assert [r["loss_mask"] for r in rows] == [[1] * len(x) for x in ref] and {r["turns"] for r in rows} == {1}
    # a killed run: four complete lines, then half a line (rows without "turn", as single-turn runs wrote them
    # before the one pipeline: turn 0)
    cut = tmp_path / "cut"
    cut.mkdir()
    lines = [json.dumps({"index": r["index"], "prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]})
             for r in rows]
    (cut / "responses.partial.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:17])
    again = regenerate_responses(target, spec, cut, prompts=prompts, stop_id=stop)
    assert again.read_text() == whole.read_text()
    assert not (cut / "responses.partial.jsonl").exists()
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        regenerate_responses(target, DataSpec(max_new_tokens=0), tmp_path / "z", prompts=prompts, stop_id=stop)
    with pytest.raises(ValueError, match="holdout_set=fixed draws its own held-out conversations"):
        regenerate_responses(target, spec, prompts=prompts, stop_id=stop, holdout_set="fixed", holdout=2)
    with pytest.raises(ValueError, match="source 'hf' / holdout_set 'tail' unknown; use data.source=sharegpt"):
        regenerate_responses(target, spec, source="hf", stop_id=stop)


def test_the_draw_mixes_code_conversations_beside_chat():
    pool = sharegpt_dialogues(1)
    mixed = draw_conversations(pool, 40, 0, code_fraction=0.25)
    assert len(mixed) == 40 == len(set(mixed))
    assert sum(looks_like_code(pool[i][0]) for i in mixed) == 10
    assert mixed == draw_conversations(pool, 40, 0, code_fraction=0.25)  # deterministic
    assert draw_conversations(pool, 40, 3) == draw_conversations(pool, 80, 3)[:40]  # no code share: a prefix
    assert looks_like_code("Write a Python function that reverses a list")
    assert not looks_like_code("What is the capital of France?")
    with pytest.raises(ValueError, match="code_fraction"):
        draw_conversations(pool, 4, 0, code_fraction=1.5)
    with pytest.raises(ValueError, match=f"asked for {len(pool) + 1} ShareGPT prompts but only {len(pool)} are "
                                         "usable; lower data.num_prompts"):
        draw_conversations(pool, len(pool) + 1, 0)

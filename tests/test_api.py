"""The Python API (``dartree.load`` -> ``SpeculativeDecoder.generate``): the README's example runs as written, the
output equals the target's greedy output, and bad arguments are named."""

import re
from pathlib import Path

import pytest
import torch

import dartree

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def spec():
    return dartree.load(threads=1, dtype="float32")


def test_the_readmes_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    example = next(b for b in blocks if "dartree.load(" in b)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip(), "the example prints the answer and its stats"


def test_generate_equals_the_targets_greedy_output_with_stats(spec):
    prompt = "List three uses of a paperclip."
    ar = spec.generate_ar(prompt, max_new_tokens=40)
    for tree in ("pruned", "chain"):
        out = spec.generate(prompt, max_new_tokens=40, tree=tree)
        assert out.tokens == ar.tokens, tree
        assert out.text == spec.target.tokenizer.decode(out.tokens, skip_special_tokens=True)
        assert out.raw_text == spec.target.tokenizer.decode(out.tokens)
        assert out.stats.rounds == len(out.stats.accept_lengths) > 0
        assert out.stats.tau == pytest.approx(sum(out.stats.accept_lengths) / out.stats.rounds)
        assert sum(out.stats.accept_lengths) == len(out.tokens) - 1  # the first token comes from the prefill
        assert out.tokens_per_s == pytest.approx(len(out.tokens) / out.seconds)
    assert set(ar.stats.accept_lengths) == {1} and ar.prompt_ids == out.prompt_ids  # one token per AR step


def test_load_prepares_the_default_setting_and_a_new_setting_is_prepared_outside_the_timing(spec):
    # load() warmed DARTree-pruned with the auto budget and seeded its policy: the first timed call has no setup
    prior = spec.cost_models[("pruned", 0, ())].prior
    assert prior["rounds"] > 0 and prior["tokens_per_round"] >= 1.0 and 0 < prior["weight"] <= 8
    prompt = "Give two facts about the moon."
    first = spec.generate(prompt, max_new_tokens=24)
    assert first.setup_s == 0.0 and all(0 <= b <= spec.draft.drafter.cfg.num_proposals for b in first.stats.budgets)
    # a setting used for the first time is prepared before the timing starts, once
    new = spec.generate(prompt, max_new_tokens=24, tree="chain", lookup=4)
    again = spec.generate(prompt, max_new_tokens=24, tree="chain", lookup=4)
    assert new.setup_s > 0.0 and again.setup_s == 0.0 and new.tokens == again.tokens == first.tokens
    assert spec.cost_models[("chain", 4, ())].prior["rounds"] > 0
    # above temperature 0 the default budget is the drafter's P, so a seed fixes the output
    hot = spec.generate(prompt, max_new_tokens=12, temperature=0.7, seed=3)
    assert set(hot.stats.budgets) == {spec.draft.drafter.cfg.num_proposals}


def test_prompts_as_text_messages_or_ids_agree(spec):
    text = "Name a prime number."
    ids = spec.prompt_ids(text)
    assert spec.prompt_ids([{"role": "user", "content": text}]) == ids
    assert spec.prompt_ids(ids) == ids
    raw = spec.prompt_ids(text, chat=False)
    assert raw == spec.target.tokenizer(text)["input_ids"] and raw != ids
    a = spec.generate(ids, max_new_tokens=12)
    b = spec.generate([{"role": "user", "content": text}], max_new_tokens=12, tree="chain", budget=4)
    assert a.tokens == b.tokens


def test_sampling_is_seeded_and_bad_arguments_are_named(spec):
    a = spec.generate("Tell me a fact.", max_new_tokens=16, temperature=0.8, seed=5, budget=6)
    b = spec.generate("Tell me a fact.", max_new_tokens=16, temperature=0.8, seed=5, budget=6)
    assert a.tokens == b.tokens
    with pytest.raises(ValueError, match=r"^unknown tree builder 'no-such-tree'; available: \['chain', "):
        spec.generate("x", max_new_tokens=4, tree="no-such-tree")
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.generate("x", max_new_tokens=-1)
    with pytest.raises(ValueError, match="chat messages need the chat template"):
        spec.prompt_ids([{"role": "user", "content": "x"}], chat=False)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dartree.load(dtype="fp8")
    with pytest.raises(ValueError, match="cannot load the target"):
        dartree.load(target=str(REPO / "no-such-target"))
    with pytest.raises(ValueError, match="invariant must be one of auto, on, off, got 'always'"):
        dartree.load(invariant="always")
    with pytest.raises(AttributeError, match="no attribute 'lod'"):
        dartree.lod  # noqa: B018


def test_bad_arguments_are_one_named_line_before_any_set_up(spec, monkeypatch):
    # every argument is checked before the warm-up (which takes seconds for a new setting), named with its value
    def no_set_up(**kwargs):
        raise AssertionError("the warm-up ran before the arguments were checked")

    monkeypatch.setattr(spec, "warm_up", no_set_up)
    aliases = r" \(aliases: dartree-fixed = fixed, dartree-pruned = pruned\)$"
    for kwargs, exc, pattern in [
        (dict(temperature="hot"), TypeError, r"^temperature='hot' must be a number >= 0"),
        (dict(lookup="yes"), TypeError, r"^lookup must be an int >= 0, got 'yes'"),
        (dict(lookup=-1), ValueError, r"^lookup must be an int >= 0, got -1"),
        (dict(max_new_tokens=-1), ValueError, r"^max_new_tokens=-1 must be >= 0"),
        (dict(max_new_tokens=-1, tree="chain", budget=5, lookup=2), ValueError, r"^max_new_tokens=-1"),
        (dict(tree="chian"), ValueError, r"^unknown tree builder 'chian'; available: \['chain', .*\]" + aliases),
        (dict(budget=-2), ValueError, r"^budget=-2 must be >= 0"),
        (dict(prompt=[{"x": 1}]), ValueError,
         r'^prompt\[0\]=\{\'x\': 1\} is not a chat message: .*"role" and "content"'),
        (dict(prompt=123), TypeError, r"^prompt=123 \(int\) is not a prompt; give text \(a str\), chat messages"),
        (dict(prompt=[5, "a"]), TypeError, r"^prompt\[1\]='a' \(str\) is not a token id"),
    ]:
        kwargs = {"prompt": "x", "max_new_tokens": 4, **kwargs}
        with pytest.raises(exc, match=pattern) as err:
            spec.generate(kwargs.pop("prompt"), **kwargs)
        assert "\n" not in str(err.value), kwargs
    with pytest.raises(ValueError, match=r"^max_new_tokens=-1 must be >= 0") as err:
        spec.generate_ar("x", max_new_tokens=-1)
    with pytest.raises(TypeError, match=r"^temperature='hot'"):
        spec.generate_ar("x", max_new_tokens=4, temperature="hot")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"^unknown tree builder 'chian'; available: \['chain', .*\]" + aliases):
        spec.warm_up(tree="chian")
    with pytest.raises(TypeError, match=r"^lookup must be an int >= 0, got 'yes'"):
        spec.warm_up(lookup="yes")
    # load checks its own arguments before loading anything
    with pytest.raises(ValueError, match=r"^threads=0 must be >= 1"):
        dartree.load(threads=0)
    with pytest.raises(ValueError, match=r"^unknown dtype 'fp16' in load\(dtype='fp16'\); use dtype= one of auto, "
                                         r"bfloat16, float16, float32$"):
        dartree.load(dtype="fp16")


def test_a_budget_above_what_a_chain_can_hold_warms_only_the_sizes_it_can_take(spec, monkeypatch):
    # a chain holds at most P nodes: budget=40 warms verify sizes 1 .. P + 1 as budget=P does (it warmed 1 .. 41, and
    # a budget of 10**6 hung), through the warm-up eval uses too (warm_paths); the output is unchanged
    import dartree.speculator as api

    seen = []

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs)["verify_sizes"])
        return {"verify_sizes": seen[-1]}

    real = api.warm_paths
    monkeypatch.setattr(api, "warm_paths", spy)
    prompt = "Name a prime number."
    out = spec.generate(prompt, tree="chain", budget=40, max_new_tokens=8)
    assert seen == [list(range(1, spec.draft.drafter.cfg.num_proposals + 2))] and out.setup_s > 0
    assert out.tokens == spec.generate_ar(prompt, max_new_tokens=8).tokens


def test_generation_config_sampling_is_refused_by_name(spec, monkeypatch):
    monkeypatch.setattr(spec.target.model.generation_config, "top_k", 20, raising=False)
    with pytest.raises(ValueError, match="top_k=20.*ignore_generation_config=True"):
        spec.generate("x", max_new_tokens=4, temperature=1.0)
    out = spec.generate("x", max_new_tokens=4, temperature=1.0, ignore_generation_config=True)
    assert 1 <= len(out.tokens) <= 4


def test_the_row_invariant_mode_by_default_in_bf16_and_on_request_in_fp32(spec):
    # fp32, auto: today's kernels; a bf16 decoder (auto) and invariant="on" run the row-invariant mode, in which
    # generate equals generate_ar by construction
    assert spec.invariant is None and spec.invariant_note.startswith("row-invariant verify: off (auto: float32")
    on = dartree.load(threads=1, invariant="on")
    assert on.invariant is not None and on.invariant_note.startswith("row-invariant verify: on")
    prompt = "Write a haiku about rain."
    assert on.generate(prompt, max_new_tokens=24).tokens == on.generate_ar(prompt, max_new_tokens=24).tokens
    on.modes.close()
    assert on.target.model.config._attn_implementation != "dartree_row_invariant"
    assert on.invariant is None and on.invariant_note == "row-invariant verify: off (decoder.modes closed)"
    from dartree.models.invariant import choose_invariant_linear

    bf16 = dartree.load(threads=1, dtype="bfloat16")
    try:
        choose_invariant_linear(bf16.target.model)
    except ValueError as exc:
        assert bf16.invariant is None and str(exc) in bf16.invariant_note
        return
    assert bf16.invariant is not None
    for tree in ("pruned", "chain"):
        assert bf16.generate(prompt, max_new_tokens=32, tree=tree).tokens == \
            bf16.generate_ar(prompt, max_new_tokens=32).tokens, tree


def test_load_auto_dtype_is_measured_and_exact_in_the_mode_it_picks():
    from dartree.base.dtypes import native_bf16

    auto = dartree.load(threads=1)  # the API's default: dtype="auto"
    if native_bf16()[0]:
        assert auto.dtype_note.startswith("auto: measured at start-up") or "only float32 is exact" in auto.dtype_note
        assert "bfloat16" in auto.dtype_note and "float32" in auto.dtype_note
    else:
        assert auto.dtype == torch.float32 and "no native bf16" in auto.dtype_note
    assert (auto.invariant is not None) == (auto.dtype == torch.bfloat16)  # bf16 only in the row-invariant mode
    prompt = "Name two rivers in Europe."
    for tree in ("pruned", "chain"):
        assert auto.generate(prompt, max_new_tokens=32, tree=tree).tokens == \
            auto.generate_ar(prompt, max_new_tokens=32).tokens, tree
    off = dartree.load(threads=1, invariant="off")
    assert off.dtype == torch.float32 and off.invariant is None


def test_generated_text_is_text_without_the_end_of_turn_token(spec):
    out = spec.generate("Say hello.", max_new_tokens=64)
    end = spec.target.tokenizer.convert_ids_to_tokens(out.tokens[-1])
    assert out.tokens[-1] in spec.stop_ids and end == "<|im_end|>"  # it stopped at the end of its turn
    assert out.raw_text.endswith("<|im_end|>") and not out.text.endswith("<|im_end|>")
    assert "<|im_end|>" not in out.text and out.text.strip() and out.raw_text.startswith(out.text)


def test_the_readmes_decode_settings_example_equals_generate(spec):
    """The README's lower-level example (speculative_generate with a DecodeSettings) runs as written on the loaded
    decoder and gives generate's tokens for the same setting, and ``spec.settings`` is the setting generate uses."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    example = next(b for b in blocks if "DecodeSettings(" in b)
    ns = {"spec": spec}
    exec(compile(example, "README.md", "exec"), ns)
    want = spec.generate("Name three rivers.", max_new_tokens=64, tree="pruned", budget=8).tokens
    assert ns["out"].tokens == want == ns["wide"].tokens and len(want) > 10
    assert ns["settings"].with_(stop_ids=tuple(spec.stop_ids)) == spec.settings(tree="pruned", budget=8,
                                                                                max_new_tokens=64)
    assert ns["wide"].stats.budgets != ns["out"].stats.budgets  # the variant really verified other trees

"""A target's own generation settings (dartree.models.generation): several end ids, sampling settings, context
length, chat-template options; decoders and the data stage stop where the target's own ``generate`` stops."""

import types

import pytest
import torch

from conftest import LAYERS, make_drafter, make_markov
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.models.generation import context_length, sampling_settings, stop_ids
from dartree.models.target import Target, resolve_target_path
from dartree.models.chat import chat_prompt_ids, check_chat_template
from dartree.training.answers import DataSpec, load_responses, regenerate_responses
from dartree.training.dialogues import dialogue_tokens
from dartree.training.regen import continuous_greedy

MAX_NEW = 40
PROMPT = [5, 17, 33, 8, 61, 22, 9]


def tiny_hf_target(kind: str, seed: int = 0) -> Target:
    """A tiny random Llama- or Phi-3-style target (vocab 96, 4 layers, context 128) built in code, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
                  pad_token_id=0, eos_token_id=1)
    if kind == "llama":
        cfg, cls = LlamaConfig(**common, head_dim=8), LlamaForCausalLM
    else:
        cfg, cls = Phi3Config(**common, sliding_window=None), Phi3ForCausalLM
    cfg._attn_implementation = "sdpa"
    model = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return Target(model, None, LAYERS, name=f"tiny-{kind}")


def _hf_greedy(target: Target, prompt: list, **kw) -> list:
    """The target's own ``generate(do_sample=False)`` continuation of ``prompt`` (prompt excluded)."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "phi3"])
def multi_eos(request):
    """(target whose generation_config names 3 end ids, the ids, its own generate's greedy output): two ids the
    greedy continuation emits (the earlier one first at position >= 4) and one it never emits."""
    target = tiny_hf_target(request.param)
    target.model.generation_config.eos_token_id = None
    free = _hf_greedy(target, PROMPT)
    firsts = [t for i, t in enumerate(free) if i >= 4 and t not in free[:i]]
    assert len(free) == MAX_NEW and len(firsts) >= 2, free
    unused = next(t for t in range(2, 96) if t not in free)
    ends = [firsts[1], unused, firsts[0]]
    target.model.generation_config.eos_token_id = ends
    want = _hf_greedy(target, PROMPT)
    assert want == free[: free.index(firsts[0]) + 1] and len(want) < MAX_NEW  # generate stopped at an end id
    return target, ends, want


def test_stop_ids_are_every_end_id_of_the_generation_config(multi_eos):
    target, ends, _ = multi_eos
    assert stop_ids(target) == ends


def test_decoders_stop_where_the_targets_own_generate_stops(multi_eos):
    """AR and speculative decoding (every end id of the generation config) equal ``model.generate(do_sample=False)``;
    the old rule (one end id) decodes past the point where the target's own generate stops."""
    target, ends, want = multi_eos
    stops = stop_ids(target)
    assert autoregressive_generate(target, PROMPT, max_new_tokens=MAX_NEW, stop_ids=stops).tokens == want
    for builder in ("chain", "pruned"):
        got = speculative_generate(target, make_drafter(), make_markov(), PROMPT, DecodeSettings(builder=builder,
                                                                                                 max_new_tokens=MAX_NEW,
                                                                                                 stop_ids=stops,
                                                                                                 budget=6)).tokens
        assert got == want, builder
    assert autoregressive_generate(target, PROMPT, max_new_tokens=MAX_NEW, stop_ids=[ends[0]]).tokens != want


def test_continuous_greedy_and_regeneration_stop_at_every_end_id(multi_eos, tmp_path):
    """The data stage: continuous_greedy with stop_ids (and with the old stop_id keyword), and
    regenerate_responses with no stop id given (the target's own, here without a tokenizer)."""
    target, ends, want = multi_eos
    (got,) = [r for _, r in continuous_greedy(target.model, [PROMPT], max_new_tokens=MAX_NEW,
                                                stop_ids=stop_ids(target), slots=2)]
    assert got == want
    (one,) = [r for _, r in continuous_greedy(target.model, [PROMPT], max_new_tokens=MAX_NEW, stop_id=ends[0])]
    assert one == autoregressive_generate(target, PROMPT, max_new_tokens=MAX_NEW, stop_ids=[ends[0]]).tokens
    with pytest.raises(ValueError, match="stop_ids"):
        list(continuous_greedy(target.model, [PROMPT], max_new_tokens=MAX_NEW))
    spec = DataSpec(num_prompts=1, max_new_tokens=MAX_NEW, batch_size=2)
    path = regenerate_responses(target, spec, tmp_path, prompts=[PROMPT])
    assert load_responses(path)[0]["response_ids"] == want


def test_stop_ids_add_the_tokenizers_end_id_and_refuse_bad_ones():
    target = tiny_hf_target("llama")
    target.tokenizer = types.SimpleNamespace(eos_token_id=9)
    target.model.generation_config.eos_token_id = 4
    assert stop_ids(target) == [4, 9]
    target.model.generation_config.eos_token_id = [9, 3]
    assert stop_ids(target) == [9, 3]  # no duplicate
    target.model.generation_config.eos_token_id = [3, "7"]
    with pytest.raises(ValueError, match=r"generation_config.eos_token_id=\[3, '7'\] holds '7' \(str\)"):
        stop_ids(target)
    target.model.generation_config.eos_token_id = 3
    target.tokenizer = types.SimpleNamespace(eos_token_id=500)
    with pytest.raises(ValueError, match=r"tokenizer.eos_token_id=500 holds 500 .*\[0, 96\)"):
        stop_ids(target)


def test_sampling_settings_name_what_changes_a_sample_beyond_the_temperature():
    target = tiny_hf_target("llama")
    g = target.model.generation_config
    assert sampling_settings(target) == {}
    g.do_sample, g.temperature, g.top_k, g.top_p, g.repetition_penalty = True, 0.6, 20, 0.95, 1.0
    assert sampling_settings(target) == {"top_k": 20, "top_p": 0.95}  # temperature is the caller's; 1.0 does nothing
    g.top_p, g.min_p, g.repetition_penalty = 1.0, 0.05, 1.05
    assert sampling_settings(target) == {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_a_prompt_past_the_context_is_refused_where_it_enters(kind):
    """prompt + max_new_tokens > max_position_embeddings: one line naming the lengths, the context and the fix,
    before any forward, for AR and speculative decoding (was decoded silently past the context)."""
    target = tiny_hf_target(kind)
    assert context_length(target) == 128
    long = (PROMPT * 15)[:100]
    msg = (r"prompt_ids has 100 tokens; with max_new_tokens=40 the decode needs 140 positions, over the target's "
           r"context of 128 \(max_position_embeddings\): lower max_new_tokens to at most 28 or shorten the prompt")
    with pytest.raises(ValueError, match=msg):
        autoregressive_generate(target, long, max_new_tokens=40)
    with pytest.raises(ValueError, match=msg):
        speculative_generate(target, make_drafter(), make_markov(), long, DecodeSettings(max_new_tokens=40))
    with pytest.raises(ValueError, match="shorten the prompt to at most 88 tokens"):
        autoregressive_generate(target, PROMPT * 20, max_new_tokens=40)
    assert len(autoregressive_generate(target, long, max_new_tokens=28).tokens) <= 28  # fits exactly: decodes


def test_dialogue_tokens_drop_a_template_turn_end_after_any_end_id():
    segs = [[10, 11], [5, 12], [7, 14], [5, 15]]
    ids, mask = dialogue_tokens(segs, [[20, 5], [21, 7], [22, 7]], [5, 7])
    # answers 1 and 2 end with the end id their next segment opens with: that copy goes; answer 3 ends with 7 but
    # segment 3 opens with 5 (another end token), which stays
    assert ids == [10, 11, 20, 5, 12, 21, 7, 14, 22, 7, 5, 15]
    assert mask == [0, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0]
    assert dialogue_tokens(segs[:2], [[20, 5]], 5) == ([10, 11, 20, 5, 12], [0, 0, 1, 1, 0])  # one id, as before


@pytest.fixture(scope="module")
def smollm2_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2"))


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_named(smollm2_tok):
    tok = smollm2_tok
    plain = chat_prompt_ids(tok, "Hi")
    saved = tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                             "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                             "{% endif %}")
        off = chat_prompt_ids(tok, "Hi", {"enable_thinking": False})
        assert off[: len(chat_prompt_ids(tok, "Hi"))] == chat_prompt_ids(tok, "Hi")
        assert tok.decode(off).endswith("<think></think>") and not tok.decode(chat_prompt_ids(tok, "Hi")).endswith(
            "</think>")
        with pytest.raises(ValueError, match=r"\['tokenize'\] are apply_chat_template's own arguments"):
            chat_prompt_ids(tok, "Hi", {"tokenize": True})
        with pytest.raises(ValueError, match="must be an object of named values"):
            check_chat_template(tok, ["enable_thinking"])
        tok.chat_template = None
        with pytest.raises(ValueError, match=r"^the target's tokenizer has no chat template \(a base model\?\)$"):
            chat_prompt_ids(tok, "Hi")
    finally:
        tok.chat_template = saved
    assert chat_prompt_ids(tok, "Hi") == plain


def test_recipe_chat_template_kwargs_enter_the_data_hash_only_when_set():
    """data.chat_template_kwargs: {} by default; the cache keys of existing data sets are unchanged (pinned hashes
    from before the option), and a non-empty value (or several stop ids) makes new ones."""
    from dataclasses import replace

    from dartree.models.target import tiny_target
    from dartree.training.checks import template_kwargs
    from dartree.training.answers import dialogue_key, key_hash, responses_key
    from dartree.training.recipe import load_recipe

    assert template_kwargs(load_recipe(["recipe=tiny_dspark"])) == {}
    cfg = load_recipe(["recipe=tiny_dspark", "data.chat_template_kwargs={enable_thinking: false}"])
    assert template_kwargs(cfg) == {"enable_thinking": False}
    target, spec = tiny_target(), DataSpec(num_prompts=4, max_new_tokens=8)
    assert key_hash(responses_key(target, spec, [1], [[3, 4, 5]])) == "1a15939f7ebf7bbb"  # as before the option
    assert key_hash(dialogue_key(target, spec, "random", [1])) == "32b94fdc598d3116"
    kw = replace(spec, chat_template_kwargs={"enable_thinking": False})
    assert responses_key(target, kw, [1])["chat_template_kwargs"] == {"enable_thinking": False}
    assert dialogue_key(target, kw, "random", [1])["chat_template_kwargs"] == {"enable_thinking": False}
    assert responses_key(target, spec, [1, 7])["stop_ids"] == [1, 7]
    assert dialogue_key(target, spec, "random", [1, 7])["stop_id"] == [1, 7]


def test_training_passes_chat_template_kwargs_and_refuses_a_base_model(monkeypatch, smollm2_tok):
    """prepare_data hands data.chat_template_kwargs (in its DataSettings) to the data stage (which renders the template with them), and
    check_against_target refuses ShareGPT data for a tokenizer without a chat template in one line."""
    import dartree.training.build as train_mod
    from dartree.models.target import tiny_target
    from dartree.training.checks import check_against_target
    from dartree.training.dialogues import dialogue_segments
    from dartree.training.recipe import RecipeError, load_recipe
    from dartree.training.settings import data_settings, run_settings

    cfg = load_recipe(["recipe=tiny_dspark", "data.source=sharegpt",
                       "data.chat_template_kwargs={enable_thinking: false}"])
    seen = {}

    def stop(target, spec, **kw):
        seen["kwargs"] = spec.chat_template_kwargs
        raise ValueError("stopped here")

    monkeypatch.setattr(train_mod, "regenerate_responses", stop)
    with pytest.raises(RecipeError, match="data: stopped here"):
        train_mod.prepare_data(data_settings(cfg), tiny_target())
    assert seen["kwargs"] == {"enable_thinking": False}
    tok, saved = smollm2_tok, smollm2_tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant:{% if not enable_thinking %} /no_think"
                             "{% endif %}{% endif %}")
        (seg,) = dialogue_segments(tok, ["Hi"], 64, {"enable_thinking": False})
        assert tok.decode(seg).endswith("assistant: /no_think")
        target = tiny_target()
        target.tokenizer = types.SimpleNamespace(chat_template=None)
        with pytest.raises(RecipeError, match=r"has no chat template .*use a chat model as the target, or "
                                              r"data.source=random \(data.chat_template_kwargs="):
            check_against_target(run_settings(cfg), target)
    finally:
        tok.chat_template = saved

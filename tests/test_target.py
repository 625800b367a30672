"""Target adapter: feature capture convention and KV-cache compaction."""

import pytest
import torch

from dartree.decode.settings import DecodeSettings
from dartree.models.target import cache_length, compact_cache, tiny_target


def test_captured_features_equal_hidden_states_l_plus_1(target):
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    out = target.forward(ids)
    ref = target.model(ids, output_hidden_states=True)
    want = torch.cat([ref.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    torch.testing.assert_close(out.features, want)
    torch.testing.assert_close(out.logits, ref.logits.float())


def test_bad_layer_id_is_named():
    with pytest.raises(ValueError, match=r"\[7\]"):
        tiny_target(layer_ids=[1, 7])


def test_compact_cache_keeps_selected_tail_entries(target):
    cache = target.new_cache()
    ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    target.forward(ids, cache=cache)
    before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    compact_cache(cache, 4, torch.tensor([0, 2, 5]))
    assert cache_length(cache) == 7
    for (k, v), layer in zip(before, cache.layers):
        torch.testing.assert_close(layer.keys, torch.cat([k[..., :4, :], k[..., [4, 6, 9], :]], dim=-2))
        torch.testing.assert_close(layer.values, torch.cat([v[..., :4, :], v[..., [4, 6, 9], :]], dim=-2))
    with pytest.raises(ValueError, match="outside"):
        compact_cache(cache, 4, torch.tensor([0, 5]))
    # in place: kept entries that overlap their destination (tail 1, 2 -> 0, 1) move intact
    target.forward(torch.tensor([[3, 4, 5]]), cache=cache)
    before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    compact_cache(cache, 7, torch.tensor([1, 2]))
    assert cache_length(cache) == 9
    for (k, v), layer in zip(before, cache.layers):
        torch.testing.assert_close(layer.keys, torch.cat([k[..., :7, :], k[..., [8, 9], :]], dim=-2))
        torch.testing.assert_close(layer.values, torch.cat([v[..., :7, :], v[..., [8, 9], :]], dim=-2))


def _rope_target(kind: str):
    """A tiny random Llama (dynamic NTK rope) or Phi-3 (LongRoPE) target whose rope switches at 24 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    from dartree.models.target import Target

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1, pad_token_id=1, bos_token_id=None)
    if kind == "dynamic":
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=24, **common,
                                             rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    else:  # Phi-3 128k style: short factors up to original_max_position_embeddings, long factors past it
        model = Phi3ForCausalLM(Phi3Config(max_position_embeddings=96, original_max_position_embeddings=24, **common,
                                           rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                         "long_factor": [3.0, 4.0, 5.0, 6.0]}))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return Target(model, None, [1, 2], name=f"tiny-{kind}")


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_by_name_where_a_tree_could_switch_it(kind):
    """A verify tree's deepest node switches dynamic-NTK / LongRoPE scaling for the whole forward before AR decoding
    would (measured: with an oracle drafter both gave a different continuation than AR from the switch on), so
    speculative decoding is refused once the decode can reach the switch length, and equals AR below it."""
    from conftest import make_drafter, make_markov
    from dartree.decode.generate import autoregressive_generate, speculative_generate

    target, prompt = _rope_target(kind), [5, 17, 33, 2, 60, 7, 9]
    settings = DecodeSettings(builder="pruned", budget=8, stop_ids=())
    # 7 prompt + 17 new tokens fit in 24 positions, but a verify tree 8 deep past the 17th token does not
    with pytest.raises(ValueError, match=rf"rope_type '{kind}'.*more than 24 positions.*can reach 32"):
        speculative_generate(target, make_drafter(), make_markov(), prompt, settings.with_(max_new_tokens=17))
    # 7 prompt + 9 new + 8 proposals = 24: no forward spans past the switch, the rope is the plain one
    want = autoregressive_generate(target, prompt, max_new_tokens=9, stop_ids=()).tokens
    got = speculative_generate(target, make_drafter(), make_markov(), prompt, settings.with_(max_new_tokens=9))
    assert got.tokens == want and got.stats.rounds >= 2


def test_sliding_window_target_is_refused_before_the_prefill():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import make_drafter, make_markov
    from dartree.decode.generate import speculative_generate
    from dartree.models.target import Target

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, sliding_window=6, use_sliding_window=True,
                      max_window_layers=2, tie_word_embeddings=False)
    target = Target(Qwen3ForCausalLM(cfg), None, [1, 2], name="tiny-swa")
    calls = []
    target.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"DynamicSlidingWindowLayer.*sliding_window=6"):
        speculative_generate(target, make_drafter(), make_markov(), [5, 6, 7], DecodeSettings(max_new_tokens=8,
                                                                                              builder="chain"))
    assert calls == []  # refused before any forward

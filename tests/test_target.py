"""Target adapter: feature capture convention and KV-cache compaction (TESTING.md classes D and E)."""

import pytest
import torch

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

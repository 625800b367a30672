"""DFlash 2 on the dartree side: the grouped dynamic causal convolution, the candidate-selector head and the
decoders over them (stops inside a block, greedy equality with AR, tree positions). Parity with the
publishers' own classes is in test_publishers.py.

Hand-computed values pin the convolution formula y[t, c] = sum_o (base[o, c] + dyn[t, o, group(c)]) x[t-o, c]
inside each block; the rest compare dartree paths with each other (teacher-forced training rows vs per-block
inference, DFlash -> DFlash 2 initialisation, every builder vs plain AR decoding).
"""

import pytest
import torch

from conftest import LAYERS, VOCAB, make_drafter, make_head
from dartree.decode.builders import BUILDERS
from dartree.decode.builders.chain import build_chain
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import DraftBlock, head_k
from dartree.models.drafter import (
    BlockAttention,
    DFlashDrafter,
    DrafterConfig,
    GroupedDynamicCausalConv,
    grouped_dynamic_conv,
)

STOP = 1


def make_dflash2(block_size: int = 8, seed: int = 0, kernel: int = 3, group: int = 8, scale: float = 0.3):
    """A tiny DFlash 2 drafter whose convolutions are randomised (they start as the identity)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        target_layer_ids=list(LAYERS), mask_token_id=0, block_size=block_size, proposal_offset=1,
                        conv_kernel_size=kernel, conv_group_size=group)
    d = DFlashDrafter(cfg)
    with torch.no_grad():
        for m in d.modules():
            if isinstance(m, GroupedDynamicCausalConv):
                m.base_kernel.add_(torch.randn_like(m.base_kernel) * scale)
                m.kernel_projection.weight.normal_(0, scale)
    return d.eval()


def test_convolution_matches_hand_computed_values():
    # D = 4 channels in G = 2 groups of 2, k = 2 taps, one block of 3 positions
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]])
    base = torch.tensor([[1.0, 0.5, 2.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    dyn = torch.zeros(1, 3, 2, 2)
    dyn[0, 1, 1, 0] = 10.0  # position 1, tap 1, group 0 (channels 0, 1)
    dyn[0, 2, 0, 1] = -1.0  # position 2, tap 0, group 1 (channels 2, 3)
    y = grouped_dynamic_conv(x, dyn, base, block_len=3)
    want = torch.tensor([
        [1 * 1.0, 2 * 0.5, 3 * 2.0, 4 * 0.0],  # position 0: no earlier token in the block
        [5 * 1.0 + 1 * (0.1 + 10), 6 * 0.5 + 2 * (0.2 + 10), 7 * 2.0 + 3 * 0.3, 8 * 0.0 + 4 * 0.4],
        [9 * 1.0 + 5 * 0.1, 10 * 0.5 + 6 * 0.2, 11 * (2.0 - 1) + 7 * 0.3, 12 * (0.0 - 1) + 8 * 0.4],
    ])
    torch.testing.assert_close(y[0], want)
    # a second block in the same row never reads the first one: its position 0 is tap 0 only
    y2 = grouped_dynamic_conv(torch.cat([x, x], dim=1), torch.cat([dyn, dyn], dim=1), base, block_len=3)
    torch.testing.assert_close(y2[0, 3:], want)


def test_fresh_convolutions_are_the_identity_so_dflash_init_is_unchanged():
    torch.manual_seed(3)
    plain = make_drafter(block_size=8, proposal_offset=1)
    cfg = DrafterConfig(**{**plain.cfg.to_dict(), "conv_kernel_size": 2, "conv_group_size": 8})
    conv = DFlashDrafter(cfg).eval()
    sd = {**conv.state_dict(), **plain.state_dict()}
    conv.load_state_dict(sd)
    x, ctx = torch.randn(2, 8, 32), torch.randn(2, 5, len(LAYERS) * 32)
    q_pos, c_pos = torch.arange(5, 13).expand(2, -1), torch.arange(5).expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(conv(x, q_pos, ctx, c_pos), plain(x, q_pos, ctx, c_pos))
        randomised = make_dflash2(kernel=2)
        randomised.load_state_dict({**randomised.state_dict(), **plain.state_dict()})
        assert not torch.allclose(randomised(x, q_pos, ctx, c_pos), plain(x, q_pos, ctx, c_pos), atol=1e-3)


def test_training_rows_equal_per_block_inference():
    """Training runs A blocks in one row (BlockAttention); each block's hidden states must equal that block drafted
    alone at inference, so the convolution must not cross block boundaries."""
    d = make_dflash2(block_size=4, kernel=3)
    s, L = 12, 4
    feats = torch.randn(1, s, len(LAYERS) * 32)
    anchors = torch.tensor([2, 5, 9])
    x = torch.randn(1, anchors.numel() * L, 32)
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    with torch.no_grad():
        rows = d(x, q_pos, feats, torch.arange(s)[None], mask=BlockAttention.from_anchors(anchors, s, L))
        for n, a in enumerate(anchors.tolist()):
            alone = d(x[:, n * L:(n + 1) * L], q_pos[:, n * L:(n + 1) * L], feats[:, :a], torch.arange(a)[None])
            torch.testing.assert_close(rows[:, n * L:(n + 1) * L], alone, atol=1e-5, rtol=1e-5)


def test_bad_convolution_configs_are_named():
    base = make_drafter().cfg.to_dict()
    with pytest.raises(ValueError, match="conv_group_size 5 does not divide hidden_size 32"):
        DrafterConfig(**{**base, "conv_kernel_size": 2, "conv_group_size": 5}).validate()
    with pytest.raises(ValueError, match="conv_kernel_size 9 exceeds block_size 8"):
        DrafterConfig(**{**base, "conv_kernel_size": 9}).validate()
    with pytest.raises(ValueError, match="conv_kernel_size=-1"):
        DrafterConfig(**{**base, "conv_kernel_size": -1}).validate()


def test_selector_caps_candidates_and_chain_picks_its_argmax(target):
    head = make_head("selector", target)
    assert head.max_candidates == 6 and head_k(64, head) == 6 and head_k(4, head) == 4
    torch.manual_seed(5)
    p = 5
    hidden, base = torch.randn(p, 32), torch.randn(p, VOCAB) * 3
    tree = build_chain(DraftBlock(hidden, base), head, 7, p, k=64)
    prev = 7
    for d in range(p):
        top = torch.topk(base[d], 6).indices  # the selector reranks the top-6 of U only
        g = head.score(top[None], hidden[d][None], head.init_state(torch.tensor([prev])), base[d, top][None])[0]
        prev = int(top[g.argmax()])
        assert int(tree.tokens[d]) == prev
    assert not torch.equal(tree.tokens, base.argmax(-1))  # the correction changed the chain here


@pytest.mark.parametrize("builder,budget,params", [
    ("chain", None, {}),
    ("pruned", 12, {"k": 64, "width": 4}),
    ("fixed", 16, {"k": 8}),
    ("ddtree", 12, {}),
    ("pctree", 12, {"k": 8, "children": 3}),
    ("heap-sequential", 10, {"k": 8}),
])
def test_every_builder_over_dflash2_equals_target_greedy(target, prompts, builder, budget, params):
    assert builder in BUILDERS
    drafter, head = make_dflash2(), make_head("selector", target)
    for p in prompts[:6]:
        want = autoregressive_generate(target, p, max_new_tokens=30, stop_ids=[STOP]).tokens
        got = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, max_new_tokens=30,
                                                                            stop_ids=[STOP], budget=budget,
                                                                            builder_params=params))
        assert got.tokens == want
        assert sum(got.stats.accept_lengths) + 1 == len(want)

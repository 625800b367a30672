"""The shipped reference drafter on the packaged default target (real weights, fp32): lossless, and it helps."""

from pathlib import Path

import pytest
import torch

from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.prompts import load_prompts
from dartree.models.checkpoint import load_dartree
from dartree.models.target import load_target
from dartree.training.data import chat_prompt_ids

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "dspark_b16"


@pytest.fixture(scope="module")
def real():
    target = load_target("smollm2", dtype=torch.float32)
    dm = load_dartree(CKPT, target=target)
    target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    return target, dm


def test_shipped_drafter_is_lossless_on_default_target(real):
    target, dm = real
    stop = [target.tokenizer.eos_token_id]
    committed = rounds = 0
    for p in load_prompts("gsm8k", 2) + load_prompts("humaneval", 1):
        ids = chat_prompt_ids(target.tokenizer, p.text)
        want = autoregressive_generate(target, ids, max_new_tokens=48, stop_ids=stop).tokens
        for builder, budget in (("chain", None), ("pruned", 16)):
            out = speculative_generate(target, dm.drafter, dm.head, ids, builder=builder, budget=budget,
                                       max_new_tokens=48, stop_ids=stop)
            assert out.tokens == want, (p.id, builder)
            committed += sum(out.stats.accept_lengths)
            rounds += out.stats.rounds
    # a trained drafter must beat an untrained one (tau exactly 1.0) clearly
    assert committed / rounds > 1.1


def test_prepacked_linears_are_lossless_on_default_target(real):
    """`--linear onednn` (eval's auto on this CPU): every output still equals AR's, AR itself unchanged."""
    from dartree.models.packed import onednn_linear_supported, pack_linears

    if not onednn_linear_supported()[0]:
        pytest.skip("this torch build has no oneDNN")
    target, dm = real
    stop = [target.tokenizer.eos_token_id]
    prompts = [chat_prompt_ids(target.tokenizer, p.text) for p in load_prompts("mtbench", 1) + load_prompts("gsm8k", 1)]
    want = [autoregressive_generate(target, ids, max_new_tokens=40, stop_ids=stop).tokens for ids in prompts]
    modules = (target.model, dm.drafter, dm.head)
    try:
        assert sum(pack_linears(m) for m in modules) > 200
        for ids, w in zip(prompts, want):
            assert autoregressive_generate(target, ids, max_new_tokens=40, stop_ids=stop).tokens == w
            for builder, budget in (("chain", None), ("pruned", 8)):
                out = speculative_generate(target, dm.drafter, dm.head, ids, builder=builder, budget=budget,
                                           max_new_tokens=40, stop_ids=stop)
                assert out.tokens == w, builder
    finally:
        for m in modules:
            pack_linears(m, "aten")

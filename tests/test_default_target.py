"""The shipped reference drafter on the packaged default target (real weights, fp32): lossless, and it helps."""

from pathlib import Path

import pytest
import torch

from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.harness.prompts import load_prompts
from dartree.decode.settings import DecodeSettings
from dartree.models.checkpoint import load_dartree
from dartree.models.target import load_target
from dartree.models.chat import chat_prompt_ids

CKPT = Path(__file__).resolve().parents[1] / "checkpoints" / "dspark_b16"


@pytest.fixture(scope="module")
def real():
    target = load_target("smollm2", dtype=torch.float32)
    dm = load_dartree(CKPT, target=target)
    target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    return target, dm


@pytest.mark.slow
def test_shipped_drafter_is_lossless_on_default_target(real):
    target, dm = real
    stop = [target.tokenizer.eos_token_id]
    committed = rounds = 0
    for p in load_prompts("gsm8k", 2) + load_prompts("humaneval", 1):
        ids = chat_prompt_ids(target.tokenizer, p.text)
        want = autoregressive_generate(target, ids, max_new_tokens=48, stop_ids=stop).tokens
        for builder, budget in (("chain", None), ("pruned", 16)):
            out = speculative_generate(target, dm.drafter, dm.head, ids, DecodeSettings(builder=builder, budget=budget,
                                                                                        max_new_tokens=48,
                                                                                        stop_ids=stop))
            assert out.tokens == want, (p.id, builder)
            committed += sum(out.stats.accept_lengths)
            rounds += out.stats.rounds
    # a trained drafter must beat an untrained one (tau exactly 1.0) clearly
    assert committed / rounds > 1.1


@pytest.mark.slow
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
                out = speculative_generate(target, dm.drafter, dm.head, ids, DecodeSettings(builder=builder,
                                                                                            budget=budget,
                                                                                            max_new_tokens=40,
                                                                                            stop_ids=stop))
                assert out.tokens == w, builder
    finally:
        for m in modules:
            pack_linears(m, "aten")


@pytest.mark.slow
def test_shipped_zlab_drafter_runs_in_zlabs_loop_as_in_ours(real):
    """checkpoints/dflash_b16_zlab exports to z-lab's layout; z-lab's own dflash_generate on the default target
    commits exactly our chain loop's tokens (= AR's) in exactly the same rounds."""
    pytest.importorskip("dflash")
    from dartree.decode.harness.peers import load_zlab_drafter, zlab_dflash

    target, _ = real
    ckpt = CKPT.parent / "dflash_b16_zlab"
    dm = load_dartree(ckpt, target=target)
    assert dm.drafter.cfg.qk_norm and dm.drafter.cfg.draft_vocab_size == 0 and dm.head.type_name == "identity"
    zlab, why = load_zlab_drafter(ckpt, target)
    assert zlab is not None, why
    stop = [target.tokenizer.eos_token_id]
    rounds = committed = 0
    for p in load_prompts("humaneval", 1) + load_prompts("mtbench", 1):
        ids = chat_prompt_ids(target.tokenizer, p.text)
        want = autoregressive_generate(target, ids, max_new_tokens=32, stop_ids=stop).tokens
        ours = speculative_generate(target, dm.drafter, dm.head, ids, DecodeSettings(builder="chain", budget=None,
                                                                                     max_new_tokens=32, stop_ids=stop))
        theirs = zlab_dflash(target, zlab, ids, max_new_tokens=32, stop_ids=stop)
        assert ours.tokens == want and theirs.tokens == want, p.id
        assert theirs.accept_lengths == ours.stats.accept_lengths, p.id  # round by round
        rounds += ours.stats.rounds
        committed += sum(ours.stats.accept_lengths)
    assert committed / rounds > 1.0  # the drafter proposes accepted tokens


@pytest.mark.slow
def test_shipped_dspine_drafter_is_lossless_on_default_target(real):
    """checkpoints/dspine_b16 (causal block, injection, transition scores) decodes the packaged target losslessly
    under the chain and the pruned tree, and its trained chain accepts more than an untrained one."""
    target = real[0]
    dm = load_dartree(CKPT.with_name("dspine_b16"), target=target)
    assert dm.config["head"]["type"] == "dspine" and dm.drafter.cfg.target_layer_ids == target.layer_ids
    stop = [target.tokenizer.eos_token_id]
    committed = rounds = 0
    for p in load_prompts("gsm8k", 1) + load_prompts("mtbench", 1):
        ids = chat_prompt_ids(target.tokenizer, p.text)
        want = autoregressive_generate(target, ids, max_new_tokens=32, stop_ids=stop).tokens
        for builder, budget in (("chain", None), ("pruned", 16)):
            out = speculative_generate(target, dm.drafter, dm.head, ids, DecodeSettings(builder=builder, budget=budget,
                                                                                        max_new_tokens=32,
                                                                                        stop_ids=stop))
            assert out.tokens == want, (p.id, builder)
            committed += sum(out.stats.accept_lengths)
            rounds += out.stats.rounds
    assert committed / rounds > 1.02

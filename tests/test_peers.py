"""Peer decoders (transformers generate, transformers prompt lookup, z-lab dflash_generate) on the tiny random target:
greedy outputs equal dartree's AR loop in fp32, rounds are counted per target forward, an unexportable drafter is
skipped with its reason, and the eval CLI reports the peers as rows."""

import json

import pytest
import torch
from conftest import VOCAB, make_drafter, make_markov
from test_eval_cli import tiny_folder  # noqa: F401  (fixture: a tiny Llama target folder with a tokenizer)

from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.harness.peers import hf_generate, hf_prompt_lookup, load_zlab_drafter, run_peer, zlab_dflash
from dartree.decode.settings import DecodeSettings
from dartree.models.checkpoint import load_dartree, save_dartree
from dartree.models.heads import IdentityHead
from dartree.models.target import tiny_target

STOP = [1]


def _prompts(n: int = 4) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        p = torch.randint(2, VOCAB, (4 + i,), generator=g).tolist()
        out.append(p + p)
    return out


@pytest.mark.parametrize("peer", [hf_generate, hf_prompt_lookup])
def test_hf_peers_equal_ar_and_count_forwards(target, peer):
    longest = 0
    for p in _prompts():
        ar = autoregressive_generate(target, p, max_new_tokens=40, stop_ids=STOP)
        o = peer(target, p, max_new_tokens=40, stop_ids=STOP)
        assert o.skipped is None and o.tokens == ar.tokens
        assert sum(o.accept_lengths) == len(o.tokens) - 1 and all(n >= 1 for n in o.accept_lengths)
        assert o.forwards <= len(o.tokens) and o.decode_s > 0 and o.prefill_s > 0
        longest = max(longest, max(o.accept_lengths))
    if peer is hf_generate:
        assert longest == 1  # one token per forward
    else:
        assert longest >= 2  # prompt lookup did commit several tokens in one forward


@pytest.mark.parametrize("peer", ["hf-generate", "hf-prompt-lookup"])
def test_hf_peers_stop_mid_block_and_honour_max_new_tokens(target, peer):
    p = _prompts()[1]
    ref = autoregressive_generate(target, p, max_new_tokens=30, stop_ids=STOP).tokens
    assert len(ref) == 30 and 1 not in ref
    stop = ref[5]
    want = ref[: ref.index(stop) + 1]
    o = run_peer(peer, target, p, max_new_tokens=30, stop_ids=[stop])
    assert o.tokens == want and sum(o.accept_lengths) == len(want) - 1
    for n in (1, 2, 9):
        o = run_peer(peer, target, p, max_new_tokens=n, stop_ids=STOP)
        assert o.tokens == ref[:n] and sum(o.accept_lengths) == n - 1


@pytest.fixture(scope="module")
def zlab_case(tmp_path_factory):
    """A target and a plain DFlash drafter (identity head, proposal offset 1, qk_norm) saved in fp32, with one
    lm_head row aligned to the drafter's MASK direction so that drafts are sometimes accepted (as in
    test_publishers)."""
    tgt = tiny_target(seed=3, vocab_size=VOCAB, layer_ids=[1, 2])
    dr = make_drafter(proposal_offset=1)
    with torch.no_grad():
        for lay in dr.layers:
            lay.o_proj.weight.mul_(0.05)
            lay.down_proj.weight.mul_(0.05)
        u = dr.norm(tgt.embed_tokens.weight[0:1])[0]
        tgt.lm_head.weight[7] = 6.0 * u / u.norm()
    folder = save_dartree(tmp_path_factory.mktemp("zl") / "ck", dr, IdentityHead(), tgt.identity(), dtype=torch.float32)
    return tgt, folder


def test_zlab_dflash_equals_ar_and_our_chain(zlab_case):
    tgt, folder = zlab_case
    zl, why = load_zlab_drafter(folder, tgt)
    assert why is None and type(zl).__name__ == "DFlashDraftModel"
    dm = load_dartree(folder, target=tgt, dtype=torch.float32)
    seen = []
    g = torch.Generator().manual_seed(7)
    for i in range(3):
        p = torch.randint(2, VOCAB, (4 + i,), generator=g).tolist()
        ar = autoregressive_generate(tgt, p, max_new_tokens=30, stop_ids=STOP)
        o = zlab_dflash(tgt, zl, p, max_new_tokens=30, stop_ids=STOP)
        chain = speculative_generate(tgt, dm.drafter, dm.head, p, DecodeSettings(builder="chain", max_new_tokens=30,
                                                                                 stop_ids=STOP))
        assert o.tokens == ar.tokens
        assert o.accept_lengths == chain.stats.accept_lengths  # same rounds as dartree's chain on the same weights
        seen += o.accept_lengths
    assert max(seen) >= 3 and min(seen) == 1


def test_unexportable_drafter_is_skipped_with_its_reason(tmp_path, target):
    folder = save_dartree(tmp_path / "mk", make_drafter(), make_markov(), target.identity(), dtype=torch.float32)
    zl, why = load_zlab_drafter(folder, target)
    assert zl is None and "head type 'markov'" in why and "zlab-dflash" in why
    o = zlab_dflash(target, None, [2, 3, 4], max_new_tokens=4, stop_ids=STOP)
    assert o.skipped and o.tokens == [] and o.forwards == 0
    with pytest.raises(KeyError, match="available: hf-generate"):
        run_peer("vllm", target, [2, 3], max_new_tokens=2, stop_ids=STOP)


def test_ar_bf16_peer_is_the_ar_loop_on_a_bf16_copy(target):
    from dartree.decode.harness.peers import ar_bf16

    twin = tiny_target(vocab_size=VOCAB, dtype=torch.bfloat16)
    assert twin.dtype == torch.bfloat16
    for p in _prompts(2):
        want = autoregressive_generate(twin, p, max_new_tokens=20, stop_ids=STOP)
        o = run_peer("ar-bf16", target, p, max_new_tokens=20, stop_ids=STOP, bf16_twin=twin)
        assert o.skipped is None and o.tokens == want.tokens and o.accept_lengths == [1] * (len(o.tokens) - 1)
        assert o.decode_s > 0 and o.prefill_s > 0
    assert ar_bf16(None, [2, 3], max_new_tokens=2, stop_ids=STOP).skipped


def test_eval_reports_peer_rows(tiny_folder, tmp_path):  # noqa: F811
    from dartree.decode.harness.eval import main

    out = tmp_path / "rep"
    argv = ["--target", str(tiny_folder / "target"), "--checkpoint", str(tiny_folder / "ckpt"), "--tree", "chain",
            "--budget", "4", "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "12", "--no-plots",
            "--peers", "hf-generate", "hf-prompt-lookup", "ar-bf16", "zlab-dflash", "--out", str(out)]
    # fp32 explicitly: --dtype auto is bf16 on a CPU with native bf16 (AMX), where ar-bf16 is the run's own AR row
    assert main(argv + ["--dtype", "float32"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["methods"]) == {"ar", "chain", "hf-generate", "hf-prompt-lookup", "ar-bf16"}
    bf = rep["per_prompt"]["ar-bf16"][0]
    assert rep["methods"]["ar-bf16"]["tau"] == 1.0 and bf["decode_s"] > 0 and bf["mismatch"] in (True, False)
    if bf["mismatch"]:  # a split from fp32 AR is reported with the fp32 target's top-2 margin there
        assert bf["first_divergence"] >= 0 and bf["margin_at_divergence"] >= 0
    for m in ("hf-generate", "hf-prompt-lookup"):
        row = rep["methods"][m]
        assert row["peer"] is True and row["lossless"] is True and row["mismatches"] == 0
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["tau"] >= 1.0
        assert rep["datasets"]["gsm8k"][m]["prompts"] == 1
        (pp,) = rep["per_prompt"][m]
        assert pp["new_tokens"] == rep["per_prompt"]["ar"][0]["new_tokens"]
    assert rep["methods"]["hf-generate"]["tau"] == 1.0
    assert "head type 'markov'" in rep["peers_skipped"]["zlab-dflash"]  # the tiny checkpoint has a Markov head
    md = (out / "report.md").read_text()
    assert "| hf-prompt-lookup |" in md and "zlab-dflash: cannot export" in md

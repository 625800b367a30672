"""Parity against the publishers' own packages (installed by ``make setup`` with ``--no-deps``): z-lab ``dflash``
0.1.0 (DFlash and DFlash 2), ``specforge`` 0.2.0 and vLLM's ``speculators`` 0.9.0 (dflash, dflash2, dspark).

For each publisher and head variant: a tiny random model is built with the publisher's class, saved the
publisher's way (z-lab / speculators ``save_pretrained``; SpecForge ``CheckpointManager.save`` + ``export_to_hf``),
converted with ``convert``, and the publisher's forward is compared with dartree's at every block position:
block hidden states, base logits and corrected logits (fp32, atol 1e-5); for DFlash 2 also the candidate
selector's scores over its top-k candidates (dartree's ``head.score`` and ``block_logits``) and z-lab's own
``propose`` (its T=0 path and its T=1 candidate probabilities). The dartree checkpoint is exported back
and loaded with the publisher's loader (no missing or unexpected keys, equal outputs). z-lab's ``dflash_generate``
at T=0 and dartree's chain decoder give the same tokens and per-round acceptance lengths. Nothing a model class
calls is stubbed; only z-lab's stats timer (``torch.cuda.synchronize``, absent on a CPU build) is replaced.

The maximum differences are recorded in ``PARITY`` and printed at the end (``-s``) for the issue's parity table.
"""

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

dflash_model = pytest.importorskip("dflash.model", reason="make setup installs dflash==0.1.0 --no-deps")
pytest.importorskip("specforge", reason="make setup installs specforge==0.2.0 --no-deps")
pytest.importorskip("speculators", reason="make setup installs speculators==0.9.0 --no-deps")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dartree.convert.exporter import export  # noqa: E402
from dartree.convert.importer import convert, detect_format_why  # noqa: E402
from dartree.decode.generate import speculative_generate  # noqa: E402
from dartree.decode.settings import DecodeSettings
from dartree.models.checkpoint import CheckpointError, load_dartree  # noqa: E402
from dartree.models.target import Target  # noqa: E402

V, D, NT, B, MASK = 256, 64, 4, 8, 0
IDS = [1, 3]  # 3 is the target's last layer: hidden_states[4] is after the final norm
ATOL = 1e-5
PARITY: dict = {}


def _note(publisher: str, variant: str, **diffs) -> None:
    row = PARITY.setdefault((publisher, variant), {})
    for k, v in diffs.items():
        row[k] = max(row.get(k, 0.0), float(v))


def _maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _close(a, b, what):
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=1e-5, msg=lambda m: f"{what}: {m}")
    return _maxdiff(a, b)


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny random Qwen3 target (hidden 64, 4 layers, vocab 256) saved as a Hugging Face folder (the verifier
    speculators reloads embeddings and heads from)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=NT, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def target(hf_target):
    model, folder = hf_target
    return Target(model, None, IDS, name=str(folder))


def _qwen3_fields(**extra) -> dict:
    return dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                rope_theta=10000.0, **extra)


def _sequence(seed: int, n: int = 14) -> torch.Tensor:
    return torch.randint(2, V, (1, n), generator=torch.Generator().manual_seed(seed))


def _ours(dm, target, seq, p):
    """dartree's block at anchor position p of seq [1, T]: (hidden [B, D], base [B, V], corrected over the
    proposals [P, V], confidence [P] or None), teacher-forced with the true tokens of seq."""
    feats = target.forward(seq[:, :p]).features  # [1, p, nL*D]
    block = torch.full((1, B), dm.drafter.cfg.mask_token_id, dtype=torch.long)
    block[0, 0] = seq[0, p]
    x = target.embed(block).float()
    h = dm.drafter(x, torch.arange(p, p + B)[None], feats, torch.arange(p)[None])[0]
    base = dm.drafter.base_logits(h, target.lm_head)
    off = dm.drafter.cfg.proposal_offset
    prev = seq[:, p: p + B - off]
    corr = dm.head.block_logits(prev, h[None, off:], base[None, off:])[0]
    conf = None
    if getattr(dm.head, "confidence_head", False):
        states = dm.head.block_states(prev, h[None, off:])[0]
        conf = dm.head.confidence_logits(h[off:], states)
    return h, base, corr, conf


# ---------------------------------------------------------------------------------------------------- z-lab
def _zlab_hidden(m, hf, seq, p):
    out = hf(seq[:, :p], output_hidden_states=True)
    feats = dflash_model.extract_context_feature(out.hidden_states, m.target_layer_ids)
    block = torch.full((1, B), m.mask_token_id, dtype=torch.long)
    block[0, 0] = seq[0, p]
    noise = dflash_model._raw_input_embeddings(hf, block, 1.0)
    h = m(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(0, p + B)[None])[0]
    return feats, h, m.compute_logits(h, hf.lm_head)


@torch.no_grad()
def test_zlab_dflash_converts_exports_and_decodes_like_zlab(tmp_path, hf_target, target, monkeypatch):
    hf, _ = hf_target
    cfg = Qwen3Config(**_qwen3_fields(block_size=B, num_target_layers=NT,
                                      dflash_config={"mask_token_id": MASK, "target_layer_ids": IDS}))
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(1)
    m = dflash_model.DFlashDraftModel(cfg).float().eval()
    m.save_pretrained(tmp_path / "zl")
    assert detect_format_why(json.loads((tmp_path / "zl/config.json").read_text()), tmp_path / "zl")[0] == "zlab-dflash"
    dm = load_dartree(convert(tmp_path / "zl", tmp_path / "dt", target=target), target=target)
    worst = {"features": 0.0, "hidden": 0.0, "base": 0.0, "corrected": 0.0}
    for seed, p in ((2, 5), (3, 9)):
        seq = _sequence(seed)
        feats, h_ref, logits_ref = _zlab_hidden(m, hf, seq, p)
        worst["features"] = max(worst["features"], _close(target.forward(seq[:, :p]).features, feats, "features"))
        h, base, corr, _ = _ours(dm, target, seq, p)
        worst["hidden"] = max(worst["hidden"], _close(h, h_ref, "hidden"))
        worst["base"] = max(worst["base"], _close(base[1:], logits_ref[1:], "base logits"))  # z-lab: positions 1..B-1
        worst["corrected"] = max(worst["corrected"], _close(corr, logits_ref[1:], "corrected logits"))
    _note("z-lab dflash", "DFlashDraftModel", **worst)

    back = export(tmp_path / "dt", tmp_path / "back", to="zlab-dflash")
    m2, info = dflash_model.DFlashDraftModel.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    seq = _sequence(4)
    assert torch.equal(_zlab_hidden(m2.float().eval(), hf, seq, 6)[1], _zlab_hidden(m, hf, seq, 6)[1])

    # T=0 decoding: z-lab's dflash_generate vs dartree's chain over the same weights. The drafter's attention and
    # MLP outputs are shrunk and one lm_head row is made to dominate the draft hidden direction, so drafts agree
    # with the target some of the time and acceptance lengths vary.
    hf2 = Qwen3ForCausalLM(hf.config).eval()
    hf2.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for lay in m.layers:
            lay.self_attn.o_proj.weight.mul_(0.05)
            lay.mlp.down_proj.weight.mul_(0.05)
        u = m.norm(torch.nn.functional.embedding(torch.tensor([MASK]), hf2.model.embed_tokens.weight))[0]
        hf2.lm_head.weight[7] = 6.0 * u / u.norm()
    m.save_pretrained(tmp_path / "zl2")
    tgt2 = Target(hf2, None, IDS, name="decode-target")
    dm2 = load_dartree(convert(tmp_path / "zl2", tmp_path / "dt2", target=tgt2), target=tgt2)
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # stats timer only (CPU build)
    lengths_seen = []
    for seed in (5, 6):
        prompt = _sequence(seed, 6)
        ref = dflash_model.dflash_generate(m, hf2, prompt, 24, None, return_stats=True)
        ours = speculative_generate(tgt2, dm2.drafter, dm2.head, prompt[0].tolist(), DecodeSettings(builder="chain",
                                                                                                    max_new_tokens=24))
        assert ours.tokens == ref.output_ids[0, prompt.shape[1]:].tolist()
        assert ours.stats.accept_lengths == ref.acceptance_lengths
        lengths_seen += ref.acceptance_lengths
    assert max(lengths_seen) >= 4 and min(lengths_seen) == 1  # the comparison covers real acceptances


# ---------------------------------------------------------------------------------------------- z-lab DFlash 2
D2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
D2_VARIANT = "DFlash2DraftModel(k=3, g=16, R=8, top_k=4)"


def _randomise_dflash2(named_parameters, seed: int, sel_std: float = 0.5) -> None:
    """Make DFlash 2's convolutions and selector matter: base kernels 1 + noise at tap 0 and noise elsewhere, kernel
    projections and selector weights random (z-lab leaves the base kernels uninitialised, speculators makes the
    convolutions the identity and the selector near zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, prm in named_parameters:
            if n.endswith("base_kernel"):
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
                prm[:, 0] += 1.0
            elif "kernel_projection" in n:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.1)
            elif n.startswith("candidate_selector"):
                prm.copy_(torch.randn(prm.shape, generator=g) * sel_std)


def _zlab2_model(seed: int, sel_std: float = 0.5):
    cfg = Qwen3Config(**_qwen3_fields(block_size=B, num_target_layers=NT,
                                      dflash_config={"mask_token_id": MASK, "target_layer_ids": IDS, **D2}))
    cfg.architectures = ["DFlash2DraftModel"]
    torch.manual_seed(seed)
    m = dflash_model.DFlash2DraftModel(cfg).float().eval()
    _randomise_dflash2(m.named_parameters(), seed, sel_std)
    return m


def _zlab_selector_scores(sel, h, logits, prev):
    """z-lab's selector scores of its top-k candidates, teacher-forced (``CandidateSelector.select``'s score through
    its own modules): h [P, D], logits [P, V], prev [P] (the token before each proposal) -> (cand [P, K], [P, K])."""
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)
    ctx = sel.predecessor_codebook(prev) * sel.hidden_projection(h)  # [P, R]
    return cand, unary + torch.einsum("pr,pkr->pk", ctx, sel.successor_codebook(cand))


def _our_selector_scores(head, h, base, prev, cand):
    """dartree's g(C, H, r) (``head.score``) over the candidates cand [P, K], the state unrolled with ``init_state`` /
    ``advance`` along prev [P]; h [P, D], base [P, V] -> [P, K] fp32."""
    st, out = head.init_state(prev[:1]), []
    for j in range(prev.shape[0]):
        if j:
            st = head.advance(st, prev[j:j + 1], h[j:j + 1])
        out.append(head.score(cand[j:j + 1], h[j:j + 1], st, base[j:j + 1].gather(-1, cand[j:j + 1])))
    return torch.cat(out)


def _same_candidates(base, cand, what):
    """dartree's top-k of its base logits [P, V] are the publisher's candidates cand [P, K] (as sets)."""
    ours = torch.topk(base, cand.shape[-1], dim=-1).indices
    assert torch.equal(ours.sort(-1).values, cand.sort(-1).values), what


@torch.no_grad()
def _teach_selector(m, hf2, prompts, alpha: float = 0.1) -> None:
    """Make z-lab DFlash 2 drafts that the target accepts some of the time, through the selector (in place).

    The target ``hf2`` is damped towards a bigram model (its attention and MLP outputs times ``alpha``) whose greedy
    tokens mostly fall in S = {7, 8, 9, 10}: those lm_head rows point along the drafter's MASK direction, the others
    shrink. The drafter ``m`` is damped too, so the top-4 of its base logits is S at every position and the
    selector decides among them: its hidden projection reads ~1 per rank from the drafter's block hidden, the
    successor code of S[i] is e_i, and the predecessor code of each token x is 100 * e_i for the S token the target
    most often emits after x along its greedy continuations of ``prompts``.
    """
    for lay in m.layers:
        lay.self_attn.o_proj.weight.mul_(0.05)
        lay.mlp.down_proj.weight.mul_(0.05)
    for lay in hf2.model.layers:
        lay.self_attn.o_proj.weight.mul_(alpha)
        lay.mlp.down_proj.weight.mul_(alpha)
    s_ids = [7, 8, 9, 10]
    u = m.norm(torch.nn.functional.embedding(torch.tensor([MASK]), hf2.model.embed_tokens.weight))[0]
    g = torch.Generator().manual_seed(5)
    hf2.lm_head.weight.mul_(0.01)
    hf2.lm_head.weight[s_ids] = 3.0 * (u / u.norm() + torch.randn(len(s_ids), D, generator=g) / D ** 0.5)
    after: dict = {}
    for ids in prompts:
        for _ in range(24):
            nxt = hf2(ids).logits[0, -1].argmax()
            if int(nxt) in s_ids:
                after.setdefault(int(ids[0, -1]), []).append(int(nxt))
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    _, h, _ = _zlab_hidden(m, hf2, prompts[0], prompts[0].shape[1] - 1)
    sel = m.candidate_selector
    d = h[1:].mean(0)
    sel.hidden_projection.weight.copy_(d.expand_as(sel.hidden_projection.weight) / d.pow(2).sum())
    sel.successor_codebook.weight.mul_(0.05)
    sel.predecessor_codebook.weight.mul_(0.05)
    for i, tok in enumerate(s_ids):
        sel.successor_codebook.weight[tok, i] = 1.0
    for x, seen in after.items():
        sel.predecessor_codebook.weight[x, s_ids.index(max(set(seen), key=seen.count))] = 100.0


@torch.no_grad()
def test_zlab_dflash2_converts_exports_and_decodes_like_zlab(tmp_path, hf_target, target, monkeypatch):
    hf, _ = hf_target
    m = _zlab2_model(21)
    m.save_pretrained(tmp_path / "zl")  # z-lab's own spelling: candidate_selector.*_codebook.weight
    cfg_json = json.loads((tmp_path / "zl/config.json").read_text())
    fmt, why = detect_format_why(cfg_json, tmp_path / "zl")
    assert fmt == "zlab-dflash2" and "DFlash2DraftModel" in why, why
    dm = load_dartree(convert(tmp_path / "zl", tmp_path / "dt", target=target), target=target)
    assert dm.drafter.cfg.conv_kernel_size == 3 and dm.drafter.cfg.conv_group_size == 16
    assert dm.drafter.cfg.proposal_offset == 1
    assert dm.config["head"] == {"type": "selector", "vocab_size": V, "rank": 8, "hidden_size": D, "top_k": 4}
    sel = m.candidate_selector
    worst = {"hidden": 0.0, "base": 0.0, "corrected": 0.0, "selector": 0.0, "selector q": 0.0}
    for seed, p in ((22, 4), (23, 6)):
        seq = _sequence(seed)
        _, h_ref, logits_ref = _zlab_hidden(m, hf, seq, p)
        h, base, corr, _ = _ours(dm, target, seq, p)
        worst["hidden"] = max(worst["hidden"], _close(h, h_ref, "hidden"))
        worst["base"] = max(worst["base"], _close(base[1:], logits_ref[1:], "base logits"))  # proposals: 1..B-1
        prev = seq[0, p: p + B - 1]  # the token before each proposal: the anchor, then the true tokens
        cand, s_ref = _zlab_selector_scores(sel, h_ref[1:], logits_ref[1:], prev)
        _same_candidates(base[1:], cand, "top-k candidates")
        worst["selector"] = max(worst["selector"], _close(_our_selector_scores(dm.head, h[1:], base[1:], prev, cand),
                                                          s_ref, "selector scores (head.score)"))
        worst["corrected"] = max(worst["corrected"], _close(corr.gather(-1, cand), s_ref, "corrected (block_logits)"))
        # z-lab's own select (propose): at T=0 its greedy path is dartree's, at T=1 its candidate distribution along
        # its sampled path is the softmax of dartree's g over the same candidates
        path0, _, _ = m.propose(h_ref[None, 1:], seq[:, p], hf.lm_head, 0.0)
        st, ours0 = dm.head.init_state(seq[:, p]), []
        for j in range(B - 1):
            c = torch.topk(base[1 + j], sel.top_k).indices[None]
            tok = c[0, dm.head.score(c, h[1 + j][None], st, base[1 + j][c]).argmax(-1)]
            ours0.append(int(tok))
            st = dm.head.advance(st, tok, h[1 + j][None])
        assert ours0 == path0[0].tolist()
        torch.manual_seed(seed)
        path1, cand1, q1 = m.propose(h_ref[None, 1:], seq[:, p], hf.lm_head, 1.0)
        prev1 = torch.cat([seq[0, p:p + 1], path1[0, :-1]])
        ours_q = _our_selector_scores(dm.head, h[1:], base[1:], prev1, cand1[0]).softmax(-1)
        worst["selector q"] = max(worst["selector q"], _close(ours_q, q1[0], "selector candidate probabilities"))
    _note("z-lab dflash2", D2_VARIANT, **worst)

    back = export(tmp_path / "dt", tmp_path / "back", to="zlab-dflash2")
    names = set(load_file(str(back / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    assert not any(n.endswith("codebook.weight") for n in names)  # the published spelling
    exported = json.loads((back / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert {k: exported["dflash_config"][k] for k in D2} == D2
    m2, info = dflash_model.DFlash2DraftModel.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    m2 = m2.float().eval()
    for (a, b) in zip(m2.state_dict().items(), m.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    seq = _sequence(24)
    assert torch.equal(_zlab_hidden(m2, hf, seq, 6)[1], _zlab_hidden(m, hf, seq, 6)[1])
    again = load_dartree(convert(back, tmp_path / "dt-again", target=target), target=target)
    assert again.config["drafter"] == dm.config["drafter"] and again.config["head"] == dm.config["head"]

    # T=0 decoding: z-lab's dflash_generate (DFlash 2: the selector picks the drafts) vs dartree's chain over the
    # same weights, on a drafter whose selector was taught the target's transitions (_teach_selector), so that
    # acceptance lengths vary and the accepted drafts are the selector's picks, not the base argmax.
    m, hf2 = _zlab2_model(25), Qwen3ForCausalLM(hf.config).eval()
    hf2.load_state_dict(hf.state_dict())
    prompts = [_sequence(seed, 6) for seed in (26, 27)]
    _teach_selector(m, hf2, prompts)
    m.save_pretrained(tmp_path / "zl2")
    tgt2 = Target(hf2, None, IDS, name="decode-target")
    dm2 = load_dartree(convert(tmp_path / "zl2", tmp_path / "dt2", target=tgt2), target=tgt2)
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # stats timer only (CPU build)
    flips, propose = [], m.propose

    def counting_propose(hidden, anchor_ids, output_head, temperature):  # z-lab's own, plus a count of reranked drafts
        out = propose(hidden, anchor_ids, output_head, temperature)
        flips.append(int((out[0] != m.compute_logits(hidden, output_head).argmax(-1)).sum()))
        return out

    monkeypatch.setattr(m, "propose", counting_propose)
    lengths_seen = []
    for prompt in prompts:
        ref = dflash_model.dflash_generate(m, hf2, prompt, 24, None, return_stats=True)
        ours = speculative_generate(tgt2, dm2.drafter, dm2.head, prompt[0].tolist(), DecodeSettings(builder="chain",
                                                                                                    max_new_tokens=24))
        assert ours.tokens == ref.output_ids[0, prompt.shape[1]:].tolist()
        assert ours.stats.accept_lengths == ref.acceptance_lengths
        lengths_seen += ref.acceptance_lengths
    assert max(lengths_seen) >= 4 and min(lengths_seen) == 1, lengths_seen  # the comparison covers real acceptances
    assert sum(flips) > 0  # ... of drafts the selector chose over the base argmax (107 of them when written)


# ------------------------------------------------------------------------------------------------ SpecForge
_SF = [
    ("DFlashDraftModel", {}),
    ("DominoDraftModel", {"projector_type": "domino", "emb_dim": 24, "gru_hidden_dim": 20, "pure_draft_prefix_len": 1,
                          "shift_label": True}),
    ("DominoDraftModel", {"projector_type": "domino", "emb_dim": 24, "gru_hidden_dim": 20, "pure_draft_prefix_len": 1,
                          "shift_label": False}),
    ("DSparkDraftModel", {"markov_rank": 12, "markov_head_type": "gated", "confidence_head_alpha": 1.0}),
    ("DSparkDraftModel", {"markov_rank": 12, "markov_head_type": "rnn", "enable_confidence_head": True}),
    ("DSparkDraftModel", {"markov_rank": 12, "markov_head_type": "vanilla", "enable_confidence_head": True,
                          "confidence_head_with_markov": True}),
]


def _sf_outputs(m, hf, seq, p):
    """SpecForge's block at anchor p: hidden [B, D], base [B, V], final logits [B, V], confidence [B] or None."""
    out = hf(seq[:, :p], output_hidden_states=True)
    from specforge.modeling.draft.dflash import extract_context_feature

    feats = extract_context_feature(out.hidden_states, m.target_layer_ids)
    block = seq[:, p: p + B].clone()  # teacher-forced: [anchor, x_1 .. x_{B-1}]
    noisy = torch.full_like(block, m.mask_token_id)
    noisy[0, 0] = block[0, 0]
    h = m(target_hidden=feats, noise_embedding=hf.model.embed_tokens(noisy),
          position_ids=torch.arange(0, p + B)[None])[0]
    base = hf.lm_head(h)
    conf = None
    if type(m).__name__ == "DominoDraftModel":
        fin = m.apply_logits_head(base[None, None], prev_token_embeddings=hf.model.embed_tokens(block)[:, None],
                                  hidden_states=h[None, None])[0, 0]
    elif type(m).__name__ == "DSparkDraftModel":
        fin = m.apply_logits_head(base[None], prev_token_ids=block, hidden_states=h[None])[0]
        c = m.predict_confidence(h[None], prev_token_ids=block)
        conf = None if c is None else c[0]
    else:
        fin = base
    return h, base, fin, conf


@pytest.mark.parametrize("arch,extra", _SF, ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in e.items() if k != 'projector_type')}"
                                                 for a, e in _SF])
@torch.no_grad()
def test_specforge_saved_its_way_converts_and_reloads_strictly(tmp_path, hf_target, target, arch, extra):
    from specforge.export import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.checkpoint import CheckpointManager

    hf, _ = hf_target
    raw = {**_qwen3_fields(), "architectures": [arch], "model_type": "qwen3", "block_size": B, "num_target_layers": NT,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, **extra}}
    (tmp_path / "draft.json").write_text(json.dumps(raw))
    torch.manual_seed(2)
    m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(tmp_path / "draft.json"))).eval()
    with torch.no_grad():  # make every head matter (SpecForge's init leaves some near zero)
        for n, prm in m.named_parameters():
            if n.startswith(("prefix_gru", "embed_proj", "markov_head", "confidence_head")):
                prm.normal_(0, 0.3)
    ckpt = CheckpointManager(str(tmp_path / "run"), "unit").save({"draft_state_dict": m.state_dict()}, step=1)
    export_to_hf(ckpt, str(tmp_path / "draft.json"), str(tmp_path / "hf"))  # SpecForge writes bf16
    pub = AutoDraftModel.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()  # fp32 RoPE buffers

    dm = load_dartree(convert(tmp_path / "hf", tmp_path / "dt", target=target), target=target)
    variant = arch + "(" + ", ".join(f"{k}={v}" for k, v in extra.items() if k != "projector_type") + ")"
    worst = {"hidden": 0.0, "base": 0.0, "corrected": 0.0}
    for seed, p in ((7, 4), (8, 6)):
        seq = _sequence(seed)
        h_ref, base_ref, fin_ref, conf_ref = _sf_outputs(pub, hf, seq, p)
        h, base, corr, conf = _ours(dm, target, seq, p)
        off = dm.drafter.cfg.proposal_offset
        worst["hidden"] = max(worst["hidden"], _close(h, h_ref, "hidden"))
        worst["base"] = max(worst["base"], _close(base, base_ref, "base logits"))
        worst["corrected"] = max(worst["corrected"], _close(corr, fin_ref[off:], "corrected logits"))
        assert (conf is None) == (conf_ref is None)
        if conf is not None:
            worst["confidence"] = max(worst.get("confidence", 0.0), _close(conf, conf_ref[off:], "confidence"))
    _note("SpecForge", variant, **worst)

    fmt = {"DFlashDraftModel": "zlab-dflash", "DominoDraftModel": "specforge-domino",
           "DSparkDraftModel": "specforge-dspark"}[arch]
    back = export(tmp_path / "dt", tmp_path / "back", to=fmt)
    again, info = AutoDraftModel.from_pretrained(str(back), output_loading_info=True, dtype=torch.float32)
    assert type(again).__name__ == arch
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    seq = _sequence(9)
    for a, b in zip(_sf_outputs(again.eval(), hf, seq, 5), _sf_outputs(pub, hf, seq, 5)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_specforge_config_defaults_are_specforges(tmp_path, target):
    """confidence_head_alpha > 0 builds the confidence head; confidence_head_with_markov defaults to false; a missing
    markov_rank is 0; a missing mask_token_id is resolved from the target's tokenizer or the error names the fix."""
    from dartree.convert.specforge import parse_dspark
    from dartree.convert.zlab import parse_dflash

    base = {**_qwen3_fields(), "block_size": B, "num_target_layers": NT}

    def head(**dc):
        return parse_dspark({**base, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS,
                                                       "projector_type": "dspark", **dc}}, "x").head

    assert head(markov_rank=4, confidence_head_alpha=1.0) == {
        "type": "markov", "vocab_size": V, "rank": 4, "hidden_size": D, "confidence_head": True,
        "confidence_with_markov": False}
    assert head(markov_rank=4, enable_confidence_head=True)["confidence_with_markov"] is False
    assert head(markov_head_type="gated") == {"type": "identity"}
    cfg = {**base, "dflash_config": {"target_layer_ids": IDS}}
    with pytest.raises(CheckpointError, match=r"no dflash_config\.mask_token_id.*pass --target"):
        parse_dflash(cfg, "x")

    class Tok:
        mask_token_id, pad_token_id, eos_token_id, unk_token_id = None, 5, 1, None

        def __len__(self):
            return 250  # rows 250..255 of the embedding are unused: SpecForge picks the first

    assert parse_dflash(cfg, "x", target=type("T", (), {"tokenizer": Tok()})()).drafter["mask_token_id"] == 250


# ---------------------------------------------------------------------------------------------- speculators
_SPEC = [
    ("dflash", {"sample_from_anchor": False}, 0),
    ("dspark", {"markov_rank": 12, "markov_head_type": "vanilla"}, 0),
    ("dspark", {"markov_rank": 12, "markov_head_type": "gated", "enable_confidence_head": False}, 0),
    ("dspark", {"markov_rank": 12, "markov_head_type": "rnn", "confidence_head_with_markov": False}, 0),
    ("dspark", {"markov_rank": 12, "markov_head_type": "vanilla", "sample_from_anchor": False}, 96),
]


def _spec_model(kind, extra, n_draft, verifier, tmp_path):
    from speculators import SpeculatorModelConfig
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dspark import DSparkDraftModel

    sfa = extra.get("sample_from_anchor", kind == "dspark")
    d = {"speculators_model_type": kind, "transformer_layer_config": {"model_type": "qwen3", **_qwen3_fields()},
         "draft_vocab_size": n_draft or V, "block_size": B, "aux_hidden_state_layer_ids": [i + 1 for i in IDS],
         "mask_token_id": MASK, **extra,
         "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B if sfa else B - 1}],
                                "verifier": {"name_or_path": str(verifier), "architectures": ["Qwen3ForCausalLM"]}}}
    cfg = SpeculatorModelConfig.from_dict(d)
    cfg.transformer_layer_config._attn_implementation = "eager"
    torch.manual_seed(3)
    m = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel, "dspark": DSparkDraftModel}[kind](cfg)
    if n_draft:
        ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(4))[:n_draft]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        m.load_vocab_mappings(t2d, ids - torch.arange(n_draft))
    m.load_verifier_weights()
    with torch.no_grad():
        for n, prm in m.named_parameters():
            if n.startswith(("markov_head", "confidence_head")):
                prm.normal_(0, 0.3)
    if kind == "dflash2":  # speculators starts the convolutions as the identity and the selector near zero
        _randomise_dflash2(m.named_parameters(), 31)
    m.save_pretrained(tmp_path)
    return m.float().eval()


def _spec_outputs(m, hf, seq, p):
    """speculators' own training forward (``_backbone_forward``) with one anchor at p: hidden [B, D], logits [B, N]
    over its draft vocabulary, corrected logits [B, N] and confidence [B] (or None)."""
    out = hf(seq, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in m.target_layer_ids], dim=-1)
    mask = torch.zeros_like(seq)
    mask[0, p] = 1
    h, logits, _, _, idx = m._backbone_forward(aux, seq, mask, out.hidden_states[-1], torch.zeros_like(seq),
                                               max_anchors=1)
    assert idx.tolist() == list(range(p, p + B)), f"speculators anchors only at p < T - B; p={p} was not taken"
    h, logits = h[0], logits[0]
    block = seq[0, idx].view(1, B)
    prev = block if m.config.sample_from_anchor else torch.cat([block[:, :1], block[:, :-1]], dim=1)
    fin, conf = logits, None
    if getattr(m, "markov_head", None) is not None:
        fin = logits + m.markov_head.block_bias(prev_token_ids=prev, hidden_states=h[None])[0]
    if getattr(m, "confidence_head", None) is not None:
        feats = h[None]
        if m.config.confidence_head_with_markov:
            feats = torch.cat([feats, m.markov_head.prev_embeddings(prev)], dim=-1)
        conf = m.confidence_head(feats)[0]
    return h, logits, fin, conf


def _export_back_to_speculators(tmp_path, target):
    """Export ``tmp_path/dt`` to speculators and check it holds exactly the tensors speculators saved in
    ``tmp_path/spec`` (same keys, equal values), says that the verifier it records is this machine's folder, and
    writes rope_theta where transformers 4 reads it as well as where speculators' classes put it (transformers 5);
    returns (export folder, its config.json dict)."""
    from safetensors.torch import load_file

    with pytest.warns(UserWarning, match=r"records the verifier as '.*', a local path .*pass --verifier ORG/MODEL"):
        back = export(tmp_path / "dt", tmp_path / "back", to="speculators", target=target)
    orig, got = load_file(str(tmp_path / "spec/model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(got) == sorted(orig)  # exactly the keys speculators itself saves
    assert all(torch.equal(got[k].float(), orig[k].float()) for k in orig)
    cfg = json.loads((back / "config.json").read_text())
    tl, spec_tl = cfg["transformer_layer_config"], json.loads((tmp_path / "spec/config.json").read_text())[
        "transformer_layer_config"]
    assert tl["rope_theta"] == tl["rope_parameters"]["rope_theta"] == spec_tl["rope_parameters"]["rope_theta"] == 10000.0
    return back, cfg


@pytest.mark.parametrize("kind,extra,n_draft", _SPEC, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in e.items())}-vocab{n or V}"
                                                           for k, e, n in _SPEC])
@torch.no_grad()
def test_speculators_saved_its_way_converts_and_exports_back(tmp_path, hf_target, target, kind, extra, n_draft):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    hf, verifier = hf_target
    pub = _spec_model(kind, extra, n_draft, verifier, tmp_path / "spec")
    assert detect_format_why(json.loads((tmp_path / "spec/config.json").read_text()), tmp_path / "spec")[0] == "speculators"
    dm = load_dartree(convert(tmp_path / "spec", tmp_path / "dt", target=target), target=target)
    off = dm.drafter.cfg.proposal_offset
    assert off == (0 if pub.config.sample_from_anchor else 1)
    ids = torch.arange(V) if not n_draft else torch.arange(n_draft) + pub.d2t
    variant = kind + "(" + ", ".join(f"{k}={v}" for k, v in extra.items()) + f", vocab {n_draft or V})"
    worst = {"hidden": 0.0, "base": 0.0, "corrected": 0.0}
    for seed, p in ((10, 3), (11, 5)):
        seq = _sequence(seed)
        h_ref, logits_ref, fin_ref, conf_ref = _spec_outputs(pub, hf, seq, p)
        h, base, corr, conf = _ours(dm, target, seq, p)
        worst["hidden"] = max(worst["hidden"], _close(h, h_ref, "hidden"))
        worst["base"] = max(worst["base"], _close(base[:, ids], logits_ref, "base logits"))
        if n_draft:  # tokens outside the draft vocabulary are never proposed
            outside = torch.ones(V, dtype=torch.bool)
            outside[ids] = False
            assert bool(torch.isneginf(base[:, outside]).all())
        worst["corrected"] = max(worst["corrected"], _close(corr[:, ids], fin_ref[off:], "corrected logits"))
        assert (conf is None) == (conf_ref is None)
        if conf is not None:
            worst["confidence"] = max(worst.get("confidence", 0.0), _close(conf, conf_ref[off:], "confidence"))
    _note("speculators", variant, **worst)

    back, cfg = _export_back_to_speculators(tmp_path, target)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (B if off == 0 else B - 1)
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in IDS] and cfg["mask_token_id"] == MASK
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    loaded_cfg = SpeculatorModelConfig.from_pretrained(str(back))
    loaded_cfg.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU (no flex compile)
    again = SpeculatorModel.from_pretrained(str(back), config=loaded_cfg, dtype=torch.float32)
    seq = _sequence(12)
    for a, b in zip(_spec_outputs(again.eval(), hf, seq, 4), _spec_outputs(pub, hf, seq, 4)):
        assert (a is None and b is None) or _close(a, b, "reloaded export") <= ATOL


@torch.no_grad()
def test_speculators_dflash_exports_to_zlab_only_with_the_target_layer_count(tmp_path, hf_target, target):
    """A speculators dflash source records no target layer count; z-lab's DFlashDraftModel needs
    ``num_target_layers`` to load, so ``--to zlab-dflash`` refuses without ``--target`` and, with it, writes a config
    z-lab loads strictly, with outputs equal to the source's."""
    hf, verifier = hf_target
    pub = _spec_model("dflash", {"sample_from_anchor": False}, 0, verifier, tmp_path / "spec")
    convert(tmp_path / "spec", tmp_path / "dt")
    assert json.loads((tmp_path / "dt/config.json").read_text())["target"].get("num_layers") is None
    with pytest.raises(CheckpointError, match="num_target_layers.*pass --target"):
        export(tmp_path / "dt", tmp_path / "z", to="zlab-dflash")
    assert not (tmp_path / "z").exists()
    back = export(tmp_path / "dt", tmp_path / "z", to="zlab-dflash", target=target)
    assert json.loads((back / "config.json").read_text())["num_target_layers"] == NT
    z, info = dflash_model.DFlashDraftModel.from_pretrained(str(back), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    seq = _sequence(12)
    out = hf(seq, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in IDS], dim=-1)
    h_ref = _spec_outputs(pub, hf, seq, 4)[0]
    noise = torch.nn.functional.embedding(seq[:, 4:4 + B], hf.get_input_embeddings().weight)
    noise[:, 1:] = hf.get_input_embeddings().weight[MASK]
    h = z.eval()(target_hidden=feats[:, :4], noise_embedding=noise, position_ids=torch.arange(4 + B)[None])[0]
    assert _close(h, h_ref, "z-lab load of the speculators-sourced export") <= ATOL


@pytest.mark.parametrize("sfa", [False, True], ids=["sample_from_anchor=False", "sample_from_anchor=True"])
@torch.no_grad()
def test_speculators_dflash2_converts_and_exports_back(tmp_path, hf_target, target, sfa):
    """speculators dflash2 saved its way converts (convolutions, selector head, the proposal offset from
    sample_from_anchor), matches speculators' own forward and selector scores, exports back to exactly its tensors
    and reloads with its loader; with offset 1 the conversion also exports to z-lab DFlash 2 with equal outputs."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    hf, verifier = hf_target
    pub = _spec_model("dflash2", {**D2, "sample_from_anchor": sfa}, 0, verifier, tmp_path / "spec")
    assert detect_format_why(json.loads((tmp_path / "spec/config.json").read_text()), tmp_path / "spec")[0] == "speculators"
    dm = load_dartree(convert(tmp_path / "spec", tmp_path / "dt", target=target), target=target)
    off = dm.drafter.cfg.proposal_offset
    assert off == (0 if sfa else 1)
    assert (dm.drafter.cfg.conv_kernel_size, dm.drafter.cfg.conv_group_size) == (3, 16)
    assert dm.config["head"] == {"type": "selector", "vocab_size": V, "rank": 8, "hidden_size": D, "top_k": 4}
    variant = f"dflash2(k=3, g=16, R=8, top_k=4, sample_from_anchor={sfa})"

    def reference(m, seq, p):
        """speculators' block at anchor p: hidden [B, D], logits [B, V] and its selector's (candidates [P, K],
        scores [P, K]) over the proposals, predecessors as its trainer takes them (``_predecessor_ids``)."""
        h, logits, _, _ = _spec_outputs(m, hf, seq, p)
        idx = torch.arange(p, p + B)
        prev = m._predecessor_ids(seq, idx)  # [1, B]
        cand, scores = m.candidate_selector.select(logits[None], h[None], prev)
        return h, logits, cand[0, off:], scores[0, off:]

    worst = {"hidden": 0.0, "base": 0.0, "corrected": 0.0, "selector": 0.0}
    for seed, p in ((32, 3), (33, 5)):
        seq = _sequence(seed)
        h_ref, logits_ref, cand, s_ref = reference(pub, seq, p)
        h, base, corr, _ = _ours(dm, target, seq, p)
        worst["hidden"] = max(worst["hidden"], _close(h, h_ref, "hidden"))
        worst["base"] = max(worst["base"], _close(base, logits_ref, "base logits"))
        _same_candidates(base[off:], cand, "top-k candidates")
        prev = seq[0, p: p + B - off]
        worst["selector"] = max(worst["selector"], _close(_our_selector_scores(dm.head, h[off:], base[off:], prev, cand),
                                                          s_ref, "selector scores (head.score)"))
        worst["corrected"] = max(worst["corrected"], _close(corr.gather(-1, cand), s_ref, "corrected (block_logits)"))
    _note("speculators", variant, **worst)

    back, cfg = _export_back_to_speculators(tmp_path, target)
    assert cfg["speculators_model_type"] == "dflash2" and cfg["sample_from_anchor"] == sfa
    assert {k: cfg[k] for k in D2} == D2
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (B if off == 0 else B - 1)
    loaded_cfg = SpeculatorModelConfig.from_pretrained(str(back))
    loaded_cfg.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU (no flex compile)
    again = SpeculatorModel.from_pretrained(str(back), config=loaded_cfg, dtype=torch.float32)
    assert type(again).__name__ == "DFlash2DraftModel"
    seq = _sequence(34)
    for a, b in zip(reference(again.eval(), seq, 4), reference(pub, seq, 4)):
        assert _close(a, b, "reloaded export") <= ATOL

    if off == 1:  # the same weights served by z-lab: speculators dflash2 -> dartree -> z-lab DFlash 2
        with pytest.raises(CheckpointError, match=r"no target layer count.*pass --target"):
            export(tmp_path / "dt", tmp_path / "zl", to="zlab-dflash2")  # speculators records no num_target_layers
        zl = export(tmp_path / "dt", tmp_path / "zl", to="zlab-dflash2", target=target)
        mz, info = dflash_model.DFlash2DraftModel.from_pretrained(zl, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        mz = mz.float().eval()
        cross = {"hidden": 0.0, "base": 0.0, "selector": 0.0}
        for seed, p in ((35, 4), (36, 5)):
            seq = _sequence(seed)
            h_ref, logits_ref, cand, s_ref = reference(pub, seq, p)
            _, hz, lz = _zlab_hidden(mz, hf, seq, p)
            cross["hidden"] = max(cross["hidden"], _close(hz, h_ref, "z-lab vs speculators hidden"))
            cross["base"] = max(cross["base"], _close(lz, logits_ref, "z-lab vs speculators logits"))
            cz, sz = _zlab_selector_scores(mz.candidate_selector, hz[1:], lz[1:], seq[0, p: p + B - 1])
            assert torch.equal(cz.sort(-1).values, cand.sort(-1).values)
            order = cand.argsort(-1)  # compare the two candidate lists in one order
            cross["selector"] = max(cross["selector"], _close(sz.gather(-1, cz.argsort(-1)), s_ref.gather(-1, order),
                                                              "z-lab vs speculators selector"))
        _note("speculators -> z-lab", "dflash2 -> DFlash2DraftModel (exported by dartree)", **cross)


def test_speculators_defaults_match_its_config_classes():
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkSpeculatorConfig

    from dartree.convert.vllm_speculators import DEFAULTS

    assert sorted(DEFAULTS) == ["dflash", "dflash2", "dspark"]
    for kind, cls in (("dflash", DFlashSpeculatorConfig), ("dflash2", DFlash2SpeculatorConfig),
                      ("dspark", DSparkSpeculatorConfig)):
        assert DEFAULTS[kind] == {k: cls.model_fields[k].default for k in DEFAULTS[kind]}, kind


# ---------------------------------------------------------------------------------------- inputs refused by name
@pytest.mark.parametrize("extra,pattern", [
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     r"use_sliding_window=true with max_window_layers=0.*\['sliding_attention'\]"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "use_swa": True, "swa_window_size": 4}},
     r"dflash_config\.use_swa=True / swa_window_size=4"),
])
def test_sliding_window_spellings_are_refused_by_name(extra, pattern):
    from dartree.convert.zlab import parse_dflash

    cfg = {**_qwen3_fields(), "block_size": B, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS}, **extra}
    with pytest.raises(CheckpointError, match=pattern):
        parse_dflash(cfg, "x")


def test_drafter_copies_that_differ_from_the_target_are_named(target):
    from dartree.convert.published_tensors import check_copy_of_target

    w = target.lm_head.weight.detach().clone()
    check_copy_of_target("lm_head.weight", w, target, "x")  # an exact copy passes
    w[3, 5] += 0.25
    with pytest.raises(CheckpointError, match=r"own lm_head\.weight differs .*1 of 256 rows differ, max \|difference\| 0\.25"):
        check_copy_of_target("lm_head.weight", w, target, "x")


def _d2_published(**dc) -> dict:
    """A z-lab DFlash 2 config.json (``dflash_config`` fields overridden by ``dc``; None drops one)."""
    fields = {"mask_token_id": MASK, "target_layer_ids": IDS, **D2, **dc}
    return {**_qwen3_fields(), "architectures": ["DFlash2DraftModel"], "block_size": B, "num_target_layers": NT,
            "dflash_config": {k: v for k, v in fields.items() if v is not None}}


def test_dflash2_detection_names_what_it_saw(tmp_path):
    """A DFlash 2 checkpoint is detected as zlab-dflash2 (the reason names what marked it), a speculators dflash2 one
    as speculators; a speculators type outside the DFlash family is still refused by name."""
    from safetensors.torch import save_file

    cfg = _d2_published()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"layers.0.attention_conv.base_kernel": torch.zeros(2, 3, D), "candidate_selector.hidden_projection.weight":
               torch.zeros(8, D)}, str(tmp_path / "model.safetensors"))
    fmt, why = detect_format_why(cfg, tmp_path)
    assert fmt == "zlab-dflash2"
    assert re.search(r"architectures \['DFlash2DraftModel'\].*conv_kernel_size.*candidate_selector", why), why
    no_arch = {k: v for k, v in cfg.items() if k != "architectures"}
    assert detect_format_why(no_arch, tmp_path)[0] == "zlab-dflash2"  # the fields and tensors suffice
    spec = {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"], "conv_kernel_size": 2}
    assert detect_format_why(spec, tmp_path)[0] == "speculators"
    with pytest.raises(CheckpointError, match=r"speculators checkpoint of type 'eagle3'; dartree reads speculators "
                                              r"dflash, dflash2, dspark only"):
        detect_format_why({"speculators_model_type": "eagle3"}, tmp_path)


@pytest.mark.parametrize("dc,top,pattern", [
    ({"conv_group_size": 24}, {}, r"conv_group_size=24 does not divide hidden_size 64"),
    ({"conv_kernel_size": B + 1}, {}, rf"conv_kernel_size={B + 1} exceeds block_size {B}"),
    ({"conv_kernel_size": 0}, {}, r"conv_kernel_size"),
    ({"selector_top_k": V + 1}, {}, rf"selector_top_k={V + 1} exceeds the vocabulary \({V} tokens\)"),
    ({"selector_rank": None}, {}, r"unknown config layout for zlab-dflash2: no dflash_config\.selector_rank"),
    ({"conv_kernel_size": "3"}, {}, r"conv_kernel_size"),
    ({}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, r"\['sliding_attention'\]"),
    ({"final_logit_softcapping": 30.0}, {}, r"final_logit_softcapping is not supported"),
    ({"output_multiplier": 2.0}, {}, r"output_multiplier=2.0 is not supported"),
    ({"is_causal": True}, {}, r"is_causal=true is not supported"),
], ids=["group", "kernel>block", "kernel0", "top_k>V", "no-rank", "kernel-string", "sliding", "softcap", "multiplier",
        "causal"])
def test_dflash2_what_dartree_cannot_honour_is_refused_by_name(dc, top, pattern):
    from dartree.convert.publishers import FORMAT_PAIRS

    with pytest.raises(CheckpointError, match=pattern):
        FORMAT_PAIRS["zlab-dflash2"].read({**_d2_published(**dc), **top}, {}, "x")


def test_dflash2_tensor_spellings_and_speculators_vocabulary(target):
    """Both codebook spellings read (one at a time); a speculators dflash2 config with a reduced vocabulary (which its
    own model class refuses) is refused by name."""
    from dartree.convert.publishers import FORMAT_PAIRS
    from dartree.convert.published_tensors import selector_spelling

    a = {"candidate_selector.predecessor_codebook.weight": torch.zeros(V, 8)}
    assert list(selector_spelling(a, "x")) == ["candidate_selector.predecessor_codebook"]
    with pytest.raises(CheckpointError, match=r"'candidate_selector\.predecessor_codebook' appears twice"):
        selector_spelling({**a, "candidate_selector.predecessor_codebook": torch.zeros(V, 8)}, "x")
    spec = {"speculators_model_type": "dflash2", "transformer_layer_config": {"model_type": "qwen3", **_qwen3_fields()},
            "draft_vocab_size": V // 2, "block_size": B, "aux_hidden_state_layer_ids": [i + 1 for i in IDS],
            "mask_token_id": MASK, **D2,
            "speculators_config": {"algorithm": "dflash2", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B - 1}],
                                   "verifier": {"name_or_path": "t", "architectures": ["Qwen3ForCausalLM"]}}}
    with pytest.raises(CheckpointError, match=rf"draft_vocab_size {V // 2} differs from the verifier vocabulary {V}.*"
                                              r"requires the full verifier vocabulary"):
        FORMAT_PAIRS["speculators"].read(spec, {}, "x")


def _d2_dartree(head=None, **drafter) -> dict:
    """A dartree DFlash 2 checkpoint config (z-lab's proposal offset 1), fields overridden."""
    d = dict(hidden_size=D, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             target_layer_ids=IDS, mask_token_id=MASK, block_size=B, proposal_offset=1, qk_norm=True, rms_norm_eps=1e-6,
             rope_theta=10000.0, draft_vocab_size=0, conv_kernel_size=3, conv_group_size=16)
    return {"drafter": {**d, **drafter},
            "head": head or {"type": "selector", "vocab_size": V, "rank": 8, "hidden_size": D, "top_k": 4},
            "target": {"name": "t", "vocab_size": V, "hidden_size": D, "num_layers": NT}}


@pytest.mark.parametrize("fmt,cfg,pattern", [
    ("zlab-dflash2", _d2_dartree({"type": "identity"}, conv_kernel_size=0),
     r"head type 'identity' cannot be exported as zlab-dflash2 .*choose --to zlab-dflash"),
    ("zlab-dflash2", _d2_dartree(conv_kernel_size=0), r"no DFlash 2 convolutions \(drafter\.conv_kernel_size 0\)"),
    ("zlab-dflash2", _d2_dartree(proposal_offset=0), r"zlab-dflash2 drafters use proposal_offset 1.*--to speculators"),
    ("zlab-dflash2", _d2_dartree(draft_vocab_size=100), r"reduced vocabulary of 100 tokens"),
    ("zlab-dflash2", _d2_dartree({"type": "markov", "vocab_size": V, "rank": 8}),
     r"head type 'markov' with DFlash 2 convolutions \(conv_kernel_size 3\) has no published layout"),
    ("speculators", _d2_dartree({"type": "markov", "vocab_size": V, "rank": 8}), r"has no published layout"),
    ("speculators", _d2_dartree(conv_kernel_size=0), r"no DFlash 2 convolutions"),
    ("speculators", _d2_dartree(draft_vocab_size=100), r"DFlash 2 scores the full vocabulary"),
    ("zlab-dflash", _d2_dartree({"type": "identity"}),
     r"DFlash 2 grouped convolutions \(conv_kernel_size 3\).*only the DFlash 2 layouts carry them \(with head type "
     r"'selector'\)"),
    ("zlab-dflash", _d2_dartree(), r"head type 'selector' cannot be exported as zlab-dflash.*--to zlab-dflash2"),
    ("specforge-dspark", _d2_dartree({"type": "markov", "vocab_size": V, "rank": 8}, proposal_offset=0),
     r"DFlash 2 grouped convolutions"),
], ids=["z2-identity", "z2-no-conv", "z2-offset0", "z2-vocab", "z2-markov-conv", "spec-markov-conv", "spec-no-conv",
        "spec-vocab", "zlab-conv", "zlab-selector", "dspark-conv"])
def test_dflash2_exports_refuse_what_the_layout_cannot_express(fmt, cfg, pattern):
    from dartree.convert.publishers import FORMAT_PAIRS

    with pytest.raises(CheckpointError, match=pattern) as err:
        FORMAT_PAIRS[fmt].write(cfg, {}, None)
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_target_logits_and_noise_embeddings_are_the_models_own():
    """Granite's logits_scaling is applied (the model's own logits); Gemma3's embedding scale is not applied to the
    drafter's noise embedding (z-lab's raw lookup)."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM, GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    g = GraniteForCausalLM(GraniteConfig(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0,
                                         tie_word_embeddings=False)).eval()
    tg = Target(g, None, [0, 1])
    ids = _sequence(13, 9)
    ref = g(ids, output_hidden_states=True)
    out = tg.forward(ids)
    assert torch.equal(out.logits, ref.logits.float())
    torch.testing.assert_close(out.features, torch.cat([ref.hidden_states[1], ref.hidden_states[2]], -1))  # last: post-norm
    gm = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    tgm = Target(gm, None, [0])
    assert torch.equal(tgm.embed(ids), gm.model.embed_tokens.weight[ids])
    assert not torch.allclose(tgm.embed(ids), gm.model.embed_tokens(ids))  # the module scales by sqrt(D) = 8


def test_zz_print_parity_table():
    """Prints the parity table (run with -s); every row must be within the fp32 tolerance."""
    print("\npublisher | variant | max |diff| hidden / base / corrected (/ confidence)")
    for (pub, var), row in sorted(PARITY.items()):
        print(f"{pub} | {var} | " + " / ".join(f"{k} {v:.2e}" for k, v in row.items()))
        assert all(v <= ATOL for v in row.values())

"""Parity against the publishers' own packages (installed by ``make setup`` with ``--no-deps``): z-lab ``dflash``
0.1.0, ``specforge`` 0.2.0 and vLLM's ``speculators`` 0.9.0.

For each publisher and head variant: a tiny random model is built with the publisher's class, saved the
publisher's way (z-lab / speculators ``save_pretrained``; SpecForge ``CheckpointManager.save`` + ``export_to_hf``),
converted with ``convert``, and the publisher's forward is compared with dartree's at every block position:
block hidden states, base logits and corrected logits (fp32, atol 1e-5). The dartree checkpoint is exported back
and loaded with the publisher's loader (no missing or unexpected keys, equal outputs). z-lab's ``dflash_generate``
at T=0 and dartree's chain decoder give the same tokens and per-round acceptance lengths. Nothing a model class
calls is stubbed; only z-lab's stats timer (``torch.cuda.synchronize``, absent on a CPU build) is replaced.

The maximum differences are recorded in ``PARITY`` and printed at the end (``-s``) for the issue's parity table.
"""

import json
import time

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model", reason="make setup installs dflash==0.1.0 --no-deps")
pytest.importorskip("specforge", reason="make setup installs specforge==0.2.0 --no-deps")
pytest.importorskip("speculators", reason="make setup installs speculators==0.9.0 --no-deps")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dartree.convert.from_dartree import export  # noqa: E402
from dartree.convert.to_dartree import convert, detect_format_why  # noqa: E402
from dartree.decode.generate import speculative_generate  # noqa: E402
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
        ours = speculative_generate(tgt2, dm2.drafter, dm2.head, prompt[0].tolist(), builder="chain", max_new_tokens=24)
        assert ours.tokens == ref.output_ids[0, prompt.shape[1]:].tolist()
        assert ours.stats.accept_lengths == ref.acceptance_lengths
        lengths_seen += ref.acceptance_lengths
    assert max(lengths_seen) >= 4 and min(lengths_seen) == 1  # the comparison covers real acceptances


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
    from dartree.convert.formats import parse_config

    base = {**_qwen3_fields(), "block_size": B, "num_target_layers": NT}

    def head(**dc):
        return parse_config({**base, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS,
                                                       "projector_type": "dspark", **dc}}, "specforge-dspark", "x").head

    assert head(markov_rank=4, confidence_head_alpha=1.0) == {
        "type": "markov", "vocab_size": V, "rank": 4, "hidden_size": D, "confidence_head": True,
        "confidence_with_markov": False}
    assert head(markov_rank=4, enable_confidence_head=True)["confidence_with_markov"] is False
    assert head(markov_head_type="gated") == {"type": "identity"}
    cfg = {**base, "dflash_config": {"target_layer_ids": IDS}}
    with pytest.raises(CheckpointError, match=r"no dflash_config\.mask_token_id.*pass --target"):
        parse_config(cfg, "zlab-dflash", "x")

    class Tok:
        mask_token_id, pad_token_id, eos_token_id, unk_token_id = None, 5, 1, None

        def __len__(self):
            return 250  # rows 250..255 of the embedding are unused: SpecForge picks the first

    assert parse_config(cfg, "zlab-dflash", "x", target=type("T", (), {"tokenizer": Tok()})()).drafter["mask_token_id"] == 250


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
    m = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel}[kind](cfg)
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


@pytest.mark.parametrize("kind,extra,n_draft", _SPEC, ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in e.items())}-vocab{n or V}"
                                                           for k, e, n in _SPEC])
@torch.no_grad()
def test_speculators_saved_its_way_converts_and_exports_back(tmp_path, hf_target, target, kind, extra, n_draft):
    from safetensors.torch import load_file
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

    back = export(tmp_path / "dt", tmp_path / "back", to="speculators", target=target)
    orig, got = load_file(str(tmp_path / "spec/model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(got) == sorted(orig)  # exactly the keys speculators itself saves
    assert all(torch.equal(got[k].float(), orig[k].float()) for k in orig)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (B if off == 0 else B - 1)
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in IDS] and cfg["mask_token_id"] == MASK
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    loaded_cfg = SpeculatorModelConfig.from_pretrained(str(back))
    loaded_cfg.transformer_layer_config._attn_implementation = "eager"  # dense masks on CPU (no flex compile)
    again = SpeculatorModel.from_pretrained(str(back), config=loaded_cfg, dtype=torch.float32)
    seq = _sequence(12)
    for a, b in zip(_spec_outputs(again.eval(), hf, seq, 4), _spec_outputs(pub, hf, seq, 4)):
        assert (a is None and b is None) or _close(a, b, "reloaded export") <= ATOL


def test_speculators_defaults_match_its_config_classes():
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkSpeculatorConfig

    from dartree.convert.vllm_speculators import DEFAULTS

    for kind, cls in (("dflash", DFlashSpeculatorConfig), ("dspark", DSparkSpeculatorConfig)):
        assert DEFAULTS[kind] == {k: cls.model_fields[k].default for k in DEFAULTS[kind]}, kind


# ------------------------------------------------------------------------------------- inputs that failed before
@pytest.mark.parametrize("extra,pattern", [
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     r"use_sliding_window=true with max_window_layers=0.*\['sliding_attention'\]"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "use_swa": True, "swa_window_size": 4}},
     r"dflash_config\.use_swa=True / swa_window_size=4"),
])
def test_sliding_window_spellings_are_refused_by_name(extra, pattern):
    from dartree.convert.formats import parse_config

    cfg = {**_qwen3_fields(), "block_size": B, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS}, **extra}
    with pytest.raises(CheckpointError, match=pattern):
        parse_config(cfg, "zlab-dflash", "x")


def test_drafter_copies_that_differ_from_the_target_are_named(target):
    from dartree.convert.formats import check_copy_of_target

    w = target.lm_head.weight.detach().clone()
    check_copy_of_target("lm_head.weight", w, target, "x")  # an exact copy passes
    w[3, 5] += 0.25
    with pytest.raises(CheckpointError, match=r"own lm_head\.weight differs .*1 of 256 rows differ, max \|difference\| 0\.25"):
        check_copy_of_target("lm_head.weight", w, target, "x")


def test_dflash2_detection_names_what_it_saw(tmp_path):
    from safetensors.torch import save_file

    cfg = {**_qwen3_fields(), "architectures": ["DFlash2DraftModel"], "block_size": B,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "conv_kernel_size": 3, "conv_group_size": 16,
                             "selector_rank": 8, "selector_top_k": 4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"layers.0.attention_conv.base_kernel": torch.zeros(2, 3, D), "candidate_selector.hidden_projection.weight":
               torch.zeros(8, D)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"DFlash 2 drafter .*architectures \['DFlash2DraftModel'\].*"
                                              r"conv_kernel_size.*candidate_selector"):
        detect_format_why(cfg, tmp_path)
    with pytest.raises(CheckpointError, match=r"speculators checkpoint of type 'dflash2'"):
        detect_format_why({"speculators_model_type": "dflash2"}, tmp_path)


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

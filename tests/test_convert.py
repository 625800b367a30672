"""Converters: every published drafter layout into dartree's g(C, H, r), and exporters back.

Sources are synthetic folders written here with the published tensor names and tiny shapes (no downloads).
The oracle for each layout is its published math re-written below from the equations (DFlash: z-lab/dflash
``dflash/model.py``; Domino: arXiv 2605.29707; DSpark: arXiv 2607.05147), in plain fp32 torch, independent of
dartree's heads and name maps.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import LAYERS, VOCAB, make_drafter, make_markov
from dartree.convert.exporter import export
from dartree.convert.importer import convert, detect_format_why
from dartree.decode.builders import get_builder
from dartree.decode.generate import autoregressive_generate, draft_block, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.models.checkpoint import CheckpointError, load_dartree
from dartree.models.drafter import DraftCache
from dartree.models.families.domino import GRUHead
from dartree.models.families.dspark import MarkovHead, RNNHead
from dartree.models.target import tiny_target
from dartree.training.build import save_training_checkpoint

REPO = Path(__file__).resolve().parents[1]
D, I, NH, NKV, HD, BLOCK, NT = 32, 64, 4, 2, 8, 8, 4  # tiny target: hidden 32, 4 layers, 4/2 heads of 8
E, G, R = 6, 5, 4  # Domino emb_dim / GRU width, DSpark Markov rank


# ----------------------------------------------------------------------------------------- synthetic sources
def qwen3_config(*, rope_layout: str = "t4", **dflash) -> dict:
    """A published Qwen3-style drafter config for the tiny target (transformers-4 or -5 rope layout)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False, "block_size": BLOCK,
        "head_dim": HD, "hidden_act": "silu", "hidden_size": D, "intermediate_size": I,
        "layer_types": ["full_attention"], "num_attention_heads": NH, "num_hidden_layers": 1,
        "num_key_value_heads": NKV, "num_target_layers": NT, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "vocab_size": VOCAB, "dflash_config": {"mask_token_id": 0, "target_layer_ids": list(LAYERS), **dflash},
    }
    if rope_layout == "t4":
        cfg.update(rope_theta=10000.0, rope_scaling=None)
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg


def backbone_tensors(seed: int, dtype=torch.float32) -> dict:
    """Random DFlash backbone tensors under the published (z-lab / SpecForge) names."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2, center=0.0):
        return (center + scale * torch.randn(*shape, generator=g)).to(dtype)

    t = {"fc.weight": r(D, len(LAYERS) * D), "hidden_norm.weight": r(D, center=1.0), "norm.weight": r(D, center=1.0)}
    p = "layers.0."
    t.update({
        p + "self_attn.q_proj.weight": r(NH * HD, D), p + "self_attn.k_proj.weight": r(NKV * HD, D),
        p + "self_attn.v_proj.weight": r(NKV * HD, D), p + "self_attn.o_proj.weight": r(D, NH * HD),
        p + "self_attn.q_norm.weight": r(HD, center=1.0), p + "self_attn.k_norm.weight": r(HD, center=1.0),
        p + "mlp.gate_proj.weight": r(I, D), p + "mlp.up_proj.weight": r(I, D), p + "mlp.down_proj.weight": r(D, I),
        p + "input_layernorm.weight": r(D, center=1.0), p + "post_attention_layernorm.weight": r(D, center=1.0),
    })
    return t


def domino_tensors(seed: int, dtype=torch.float32, legacy: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed + 100)
    pre = "logit_head." if legacy else ""
    return {
        pre + "prefix_gru.weight_ih_l0": (0.5 * torch.randn(3 * G, D, generator=g)).to(dtype),
        pre + "prefix_gru.weight_hh_l0": (0.5 * torch.randn(3 * G, G, generator=g)).to(dtype),
        pre + "embed_proj.0.weight": (0.5 * torch.randn(E, D + G, generator=g)).to(dtype),
        pre + "embed_proj.2.weight": (1.0 * torch.randn(VOCAB, E, generator=g)).to(dtype),
    }


def dspark_tensors(seed: int, kind: str, confidence: bool, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed + 200)

    def r(*shape):
        return (0.5 * torch.randn(*shape, generator=g)).to(dtype)

    t = {"markov_head.markov_w1.weight": r(VOCAB, R), "markov_head.markov_w2.weight": r(VOCAB, R)}
    if kind == "gated":
        t.update({"markov_head.gate_proj.weight": r(R, D + R), "markov_head.gate_proj.bias": r(R)})
    if kind == "rnn":
        t.update({"markov_head.joint_proj.weight": r(3 * R, 2 * R + D), "markov_head.joint_proj.bias": r(3 * R)})
    if confidence:
        t.update({"confidence_head.proj.weight": r(1, D + R), "confidence_head.proj.bias": r(1)})
    return t


def write_source(folder: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    """Write config.json + safetensors (optionally sharded with a HF index), as the published tools do."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def make_source(tmp: Path, fmt: str, *, seed: int = 0, dtype=torch.float32, kind: str = "vanilla",
                confidence: bool = True, shift_label: bool = True, legacy: bool = False, rope_layout: str = "t4",
                shards: int = 1, name: str = "src") -> Path:
    """A synthetic published checkpoint folder of layout ``fmt``."""
    t = backbone_tensors(seed, dtype)
    if fmt == "zlab-dflash":
        cfg = qwen3_config(rope_layout=rope_layout)
    elif fmt == "specforge-domino":
        cfg = qwen3_config(rope_layout=rope_layout, projector_type="domino", pure_draft_prefix_len=1, emb_dim=E,
                           gru_hidden_dim=G, shift_label=shift_label)
        t.update(domino_tensors(seed, dtype, legacy))
    elif fmt == "specforge-dspark":
        cfg = qwen3_config(rope_layout=rope_layout, projector_type="dspark", markov_rank=R, markov_head_type=kind,
                           enable_confidence_head=confidence, confidence_head_with_markov=True)
        t.update(dspark_tensors(seed, kind, confidence, dtype))
    else:  # deepspec-dspark: the target's config with top-level DSpark fields, own frozen embedding / lm_head
        cfg = qwen3_config(rope_layout=rope_layout)
        del cfg["dflash_config"]
        cfg.update(architectures=["Qwen3DSparkModel"], target_layer_ids=list(LAYERS), mask_token_id=0,
                   num_anchors=512, markov_rank=R, markov_head_type=kind, enable_confidence_head=confidence,
                   confidence_head_with_markov=True)
        t.update(dspark_tensors(seed, kind, confidence, dtype))
        tgt = tiny_target(vocab_size=VOCAB)  # DeepSpec's frozen copies are the target's own tensors
        t.update({"embed_tokens.weight": tgt.embed_tokens.weight.detach().to(dtype).clone(),
                  "lm_head.weight": tgt.lm_head.weight.detach().to(dtype).clone()})
    return write_source(tmp / name, cfg, t, shards)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------ independent oracles (published math)
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):  # x [T, h, d], rotate-half convention of Qwen3
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def dflash_reference_hidden(t: dict, feats: torch.Tensor, block_emb: torch.Tensor, start: int) -> torch.Tensor:
    """DFlash block forward from the published equations (z-lab/dflash ``dflash/model.py``):
    context = hidden_norm(fc(feats)); per
    layer q from the block, k/v = k_norm/v of [k_proj(context) ; k_proj(block)], RoPE at absolute positions,
    non-causal attention, SwiGLU MLP; final norm. feats [C, nL*D], block_emb [B, D] -> [B, D]."""
    ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    c, b = ctx.shape[0], block_emb.shape[0]
    pos_k, pos_q = torch.arange(c + b), torch.arange(c, c + b)
    assert c == start
    x = block_emb
    p = "layers.0."
    h = _rms(x, t[p + "input_layernorm.weight"])
    q = _rms((h @ t[p + "self_attn.q_proj.weight"].T).view(b, NH, HD), t[p + "self_attn.q_norm.weight"])
    kin = torch.cat([ctx, h])
    k = _rms((kin @ t[p + "self_attn.k_proj.weight"].T).view(c + b, NKV, HD), t[p + "self_attn.k_norm.weight"])
    v = (kin @ t[p + "self_attn.v_proj.weight"].T).view(c + b, NKV, HD)
    q, k = _rope(q, pos_q), _rope(k, pos_k)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD), -1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(b, NH * HD) @ t[p + "self_attn.o_proj.weight"].T
    x = x + o
    h = _rms(x, t[p + "post_attention_layernorm.weight"])
    x = x + (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return _rms(x, t["norm.weight"])


def domino_reference(t: dict, emb: torch.Tensor, prev, hidden, base, prefix_len: int = 1):
    """Domino (arXiv 2605.29707): s_k = GRU(E[prev_0..k]) with torch.nn.GRU(bias=False) loaded from
    prefix_gru.*; logits_k = U_k + embed_proj([z_k ; s_k]) for k >= prefix_len, U_k before."""
    gru = torch.nn.GRU(D, G, num_layers=1, batch_first=True, bias=False)
    proj = torch.nn.Sequential(torch.nn.Linear(D + G, E, bias=False), torch.nn.SiLU(), torch.nn.Linear(E, VOCAB, bias=False))
    with torch.no_grad():
        gru.weight_ih_l0.copy_(t["prefix_gru.weight_ih_l0"])
        gru.weight_hh_l0.copy_(t["prefix_gru.weight_hh_l0"])
        proj[0].weight.copy_(t["embed_proj.0.weight"])
        proj[2].weight.copy_(t["embed_proj.2.weight"])
        s = gru(emb[prev])[0]  # [N, P, G]
        corr = proj(torch.cat([hidden, s], -1))
    keep = (torch.arange(prev.shape[1]) >= prefix_len).float()[None, :, None]
    return base + keep * corr


def dspark_reference(t: dict, kind: str, prev, hidden, base):
    """DSpark heads (arXiv 2607.05147) with x_{k-1} = prev[:, k] (the anchor first): vanilla W2 W1[x];
    gated W2 (sigmoid(Wg [h ; W1[x]] + bg) * W1[x]); rnn s_k = sig(a) s + (1 - sig(a)) tanh(c),
    bias W2 tanh(o) with (a, c, o) = Wj [s ; W1[x] ; h] + bj. Returns (logits [N, P, V], confidence logits
    w . [h ; W1[x]] + b [N, P])."""
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    e = w1[prev]  # [N, P, R]
    if kind == "vanilla":
        lat = e
    elif kind == "gated":
        gate = torch.sigmoid(torch.cat([hidden, e], -1) @ t["markov_head.gate_proj.weight"].T + t["markov_head.gate_proj.bias"])
        lat = gate * e
    else:
        s = torch.zeros(prev.shape[0], R)
        outs = []
        for k in range(prev.shape[1]):
            z = torch.cat([s, e[:, k], hidden[:, k]], -1) @ t["markov_head.joint_proj.weight"].T + t["markov_head.joint_proj.bias"]
            a, c, o = z[:, :R], z[:, R:2 * R], z[:, 2 * R:]
            s = torch.sigmoid(a) * s + (1 - torch.sigmoid(a)) * torch.tanh(c)
            outs.append(torch.tanh(o))
        lat = torch.stack(outs, 1)
    conf = None
    if "confidence_head.proj.weight" in t:
        conf = torch.cat([hidden, e], -1) @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
    return base + lat @ w2.T, conf


def unroll(head, prev, hidden, base):
    """dartree's g over the full vocabulary, unrolled with score/advance: [N, P, V]."""
    n, p = prev.shape
    cand = torch.arange(VOCAB).expand(n, VOCAB)
    state, outs = head.init_state(prev[:, 0]), []
    for j in range(p):
        outs.append(head.score(cand, hidden[:, j], state, base[:, j]))
        if j + 1 < p:
            state = head.advance(state, prev[:, j + 1], hidden[:, j])
    return torch.stack(outs, 1)


# -------------------------------------------------------------------------------------------- the formats
def _head_inputs(p: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (3, p), generator=g), torch.randn(3, p, D, generator=g),
            torch.randn(3, p, VOCAB, generator=g))


def test_zlab_dflash_backbone_and_positions_match_the_published_forward(tmp_path, target):
    src = make_source(tmp_path, "zlab-dflash")
    out = convert(src, tmp_path / "dt", target=target)
    dm = load_dartree(out, target=target)
    cfg = dm.config["drafter"]
    assert (cfg["proposal_offset"], dm.drafter.cfg.num_proposals, dm.config["head"]) == (1, BLOCK - 1, {"type": "identity"})
    t = load_file(str(src / "model.safetensors"))
    prompt = [5, 9, 16, 25, 36, 49, 7]
    feats = target.forward(torch.tensor([prompt])).features[0]
    anchor, start = 11, len(prompt)
    block = draft_block(target, dm.drafter, anchor, start, feats, DraftCache(1))
    ids = torch.tensor([anchor] + [0] * (BLOCK - 1))
    ref_h = dflash_reference_hidden(t, feats.float(), target.embed_tokens(ids).float(), start)
    ref_logits = ref_h[1:] @ target.lm_head.weight.float().T  # z-lab: positions 1..B-1 are the proposals
    torch.testing.assert_close(block.base_logits, ref_logits, atol=1e-5, rtol=1e-5)
    cand = torch.arange(VOCAB)[None]
    assert torch.equal(dm.head.score(cand, block.hidden[:1], None, block.base_logits[:1]), block.base_logits[:1])


@pytest.mark.parametrize("shift_label", [True, False])
@pytest.mark.parametrize("legacy", [False, True])
def test_specforge_domino_gru_head_matches_published_math(tmp_path, target, shift_label, legacy):
    src = make_source(tmp_path, "specforge-domino", shift_label=shift_label, legacy=legacy)
    dm = load_dartree(convert(src, tmp_path / "dt", target=target), target=target)
    assert dm.config["head"]["type"] == "gru" and dm.config["head"]["prefix_len"] == 1
    assert dm.drafter.cfg.proposal_offset == (0 if shift_label else 1)
    t = {k.removeprefix("logit_head."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    p = dm.drafter.cfg.num_proposals
    prev, hidden, base = _head_inputs(p)
    want = domino_reference(t, target.embed_tokens.weight.detach(), prev, hidden, base)
    got = unroll(dm.head, prev, hidden, base)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, 0], base[:, 0])  # pure_draft_prefix_len = 1: the first proposal is base only
    torch.testing.assert_close(dm.head.block_logits(prev, hidden, base), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["specforge-dspark", "deepspec-dspark"])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_dspark_heads_match_published_math(tmp_path, target, fmt, kind):
    src = make_source(tmp_path, fmt, kind=kind, confidence=True)
    dm = load_dartree(convert(src, tmp_path / "dt", target=target), target=target)
    assert dm.config["head"]["type"] == {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}[kind]
    assert dm.drafter.cfg.proposal_offset == 0 and dm.drafter.cfg.num_proposals == BLOCK  # all B positions
    t = load_file(str(src / "model.safetensors"))
    prev, hidden, base = _head_inputs(BLOCK)  # prev[:, 0] is the anchor: position 0's previous token
    want, conf = dspark_reference(t, kind, prev, hidden, base)
    torch.testing.assert_close(unroll(dm.head, prev, hidden, base), want, atol=1e-5, rtol=1e-5)
    state = dm.head.init_state(prev[:, 0])
    for j in range(BLOCK):  # the confidence head reads [h_k ; W1[x_{k-1}]]
        torch.testing.assert_close(dm.head.confidence_logits(hidden[:, j], state), conf[:, j], atol=1e-5, rtol=1e-5)
        state = dm.head.advance(state, prev[:, (j + 1) % BLOCK], hidden[:, j])


def test_transformers5_rope_layout_and_shards_convert_the_same(tmp_path):
    a = convert(make_source(tmp_path, "zlab-dflash", name="t4"), tmp_path / "a")
    b = convert(make_source(tmp_path, "zlab-dflash", rope_layout="t5", shards=2, name="t5"), tmp_path / "b")
    ca, cb = (json.loads((x / "config.json").read_text()) for x in (a, b))
    assert ca["drafter"] == cb["drafter"] and ca["drafter"]["rope_theta"] == 10000.0
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("fmt,why", [("zlab-dflash", "without head"), ("specforge-domino", "domino"),
                                     ("specforge-dspark", "dspark"), ("deepspec-dspark", "DeepSpec")])
def test_auto_detection_names_the_layout(tmp_path, fmt, why):
    src = make_source(tmp_path, fmt)
    got, reason = detect_format_why(json.loads((src / "config.json").read_text()), src)
    assert got == fmt and why in reason


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("fmt,kw", [("zlab-dflash", {}), ("specforge-domino", {}), ("specforge-domino", {"legacy": True}),
                                    ("specforge-dspark", {"kind": "vanilla"}), ("specforge-dspark", {"kind": "gated"}),
                                    ("specforge-dspark", {"kind": "rnn", "confidence": False})])
def test_source_to_dartree_to_source_is_byte_identical(tmp_path, fmt, kw):
    src = make_source(tmp_path, fmt, dtype=torch.bfloat16, **kw)
    back = export(convert(src, tmp_path / "dt"), tmp_path / "back", to=fmt)
    orig = {k.removeprefix("logit_head."): v for k, v in load_file(str(src / "model.safetensors")).items()}
    got = load_file(str(back / "model.safetensors"))
    assert orig.keys() == got.keys()
    for k in orig:
        assert got[k].dtype == orig[k].dtype == torch.bfloat16 and _bytes(got[k]) == _bytes(orig[k]), k
    c0, c1 = (json.loads((x / "config.json").read_text()) for x in (src, back))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "block_size", "vocab_size", "rope_theta", "num_target_layers"):
        assert c0[key] == c1[key], key
    assert c0["dflash_config"] == c1["dflash_config"]


def test_deepspec_converts_and_exports_as_specforge_dspark_with_identical_tensors(tmp_path):
    src = make_source(tmp_path, "deepspec-dspark", dtype=torch.bfloat16, kind="rnn")
    dt = convert(src, tmp_path / "dt")
    assert json.loads((dt / "config.json").read_text())["provenance"]["dropped"] == ["embed_tokens.weight", "lm_head.weight"]
    back = load_file(str(export(dt, tmp_path / "sf", to="specforge-dspark") / "model.safetensors"))
    orig = load_file(str(src / "model.safetensors"))
    assert set(orig) - set(back) == {"embed_tokens.weight", "lm_head.weight"} and set(back) <= set(orig)
    assert all(_bytes(back[k]) == _bytes(orig[k]) for k in back)


def _trained_here(tmp_path, target, head, proposal_offset: int) -> Path:
    """A drafter + head saved by training/train.py's checkpoint writer, then converted to dartree."""
    drafter = make_drafter(proposal_offset=proposal_offset)
    save_training_checkpoint(tmp_path / "train", drafter, head, target, {"recipe": "unit"}, {"step": 1})
    return convert(tmp_path / "train", tmp_path / "dt")


def _heads_trained_here():
    torch.manual_seed(0)
    gru = GRUHead(VOCAB, D, emb_dim=E, gru_hidden_dim=G, prefix_len=1)
    rnn = RNNHead(VOCAB, R, hidden_size=D, confidence_head=True)
    for h in (gru, rnn):
        for p in h.parameters():
            torch.nn.init.normal_(p, std=0.5)
    return {"zlab-dflash": (None, 1), "specforge-domino": (gru, 0), "specforge-dspark": (rnn, 0)}


@pytest.mark.parametrize("fmt", ["zlab-dflash", "specforge-domino", "specforge-dspark"])
def test_trained_here_export_and_reimport_is_unchanged(tmp_path, target, fmt):
    from dartree.models.heads import IdentityHead

    head, offset = _heads_trained_here()[fmt]
    dt = _trained_here(tmp_path, target, head or IdentityHead(), offset)
    exported = export(dt, tmp_path / "pub", to=fmt)
    again = convert(exported, tmp_path / "again")
    c0, c1 = (json.loads((x / "config.json").read_text()) for x in (dt, again))
    assert c0["drafter"] == c1["drafter"] and c0["head"] == c1["head"]
    assert {k: c0["target"][k] for k in ("vocab_size", "hidden_size", "num_layers")} == \
           {k: c1["target"][k] for k in ("vocab_size", "hidden_size", "num_layers")}
    t0, t1 = load_file(str(dt / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert t0.keys() == t1.keys() and all(t0[k].dtype == t1[k].dtype and _bytes(t0[k]) == _bytes(t1[k]) for k in t0)
    assert json.loads((exported / "config.json").read_text())["architectures"]


def test_conversion_carries_a_training_runs_lineage_and_a_published_checkpoint_none(tmp_path, target, capsys):
    """A training run's checkpoint (training.json with the lineage: steps, schedule steps, data cursor) converts into a
    folder whose lineage.json gives lineage_record what the run's own checkpoint gives, so train.schedule_from_init
    and data.cursor_from_init continue a shipped checkpoint; a re-conversion keeps it, a published layout carries
    none (and drops a stale one), and a broken lineage.json is named with its fix."""
    from types import SimpleNamespace

    from dartree.convert.tools.to_dartree import main as convert_main
    from dartree.models.checkpoint import LINEAGE_FILE, TRAINING_FILE, read_lineage
    from dartree.training.build import run_recipe
    from dartree.training.cursor import DataCursor, data_fingerprint, lineage_record, run_cursor
    from dartree.training.recipe import RecipeError, TrainSection
    from dartree.training.schedule import plan_schedule

    # a run 8 steps into its lineage (4 before it) on a 12-step schedule, 3 sequences a step over 10 sequences
    tokens = [torch.arange(i, i + 5) for i in range(10)]
    data = SimpleNamespace(train_ids=list(range(10)), tokens=tokens)
    cursor = DataCursor(data.train_ids, seed=0)
    cursor.take(24)
    state = {"steps": 4, "final_loss": 1.5, "losses": [2.0, 1.8, 1.6, 1.5],
             "lineage": {"step0": 4, "steps": 8, "schedule_steps": 12},
             "cursor": cursor.state(data_fingerprint(tokens, data.train_ids))}
    src = save_training_checkpoint(tmp_path / "run" / "checkpoint", make_drafter(), make_markov(), target,
                                   {"recipe": "unit", "train": {"lr": 1e-3}}, state)
    want = {"steps": 8, "cursor": state["cursor"], "schedule_steps": 12}
    assert lineage_record(str(src)) == want and want["cursor"]["epoch"] == 2 and len(want["cursor"]["done"]) == 4

    assert convert_main([str(src), "--out", str(tmp_path / "shipped")]) == 0
    out = tmp_path / "shipped"
    assert f"kept the training lineage (8 steps, a data cursor) in {out / LINEAGE_FILE}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", LINEAGE_FILE, "model.safetensors"]
    assert json.loads((out / LINEAGE_FILE).read_text()) == {"lineage": state["lineage"], "cursor": state["cursor"]}
    assert lineage_record(str(out)) == lineage_record(str(src)) == want
    # still a plain dartree checkpoint: detected and loaded as one, never taken for a training run's checkpoint
    assert detect_format_why(json.loads((out / "config.json").read_text()), out)[0] == "dartree"
    assert load_dartree(out, target=target).config["provenance"]["source_format"] == "dartree-train"
    with pytest.raises(RecipeError, match="holds no training checkpoint"):
        run_recipe(out)
    # what a run continued from the shipped folder plans: the lineage's step and schedule, the cursor's position
    logs: list[str] = []
    sch = plan_schedule(TrainSection(max_steps=4, schedule_from_init=True, schedule_steps=12), 10,
                        lineage_record(str(out)), cursor_from_init=True, init_from=str(out), log=logs.append)
    assert (sch.step0, sch.lr.offset) == (8, 8) and "lineage reached step 8" in logs[0]
    cur = run_cursor(data, 0, resumed=None, lineage=lineage_record(str(out)), seqs_per_step=3, init_from=str(out),
                     log=logs.append)
    assert (cur.epoch, cur.done) == (cursor.epoch, cursor.done) and cur.take(3) == cursor.take(3)

    # a re-conversion (dartree -> dartree, another dtype) keeps the record
    convert(out, tmp_path / "again", dtype=torch.float32)
    assert lineage_record(str(tmp_path / "again")) == want
    # a published layout records none; converted over the shipped folder it drops the old weights' lineage.json and
    # keeps the files the converter does not write
    (out / "learning_curve.json").write_text("[]")
    pub = convert(make_source(tmp_path, "zlab-dflash"), tmp_path / "pub")
    assert not (pub / LINEAGE_FILE).exists() and lineage_record(str(pub)) == {} and read_lineage(pub) == {}
    convert(make_source(tmp_path, "zlab-dflash", name="src2"), out)
    assert not (out / LINEAGE_FILE).exists() and lineage_record(str(out)) == {}
    assert (out / "learning_curve.json").exists() and not (out / TRAINING_FILE).exists()

    # a lineage.json that does not parse: one line naming the file and the fix, from training and from convert
    (tmp_path / "again" / LINEAGE_FILE).write_text('{"lineage": {"steps": 8')
    with pytest.raises(RecipeError, match=rf"again/{LINEAGE_FILE} does not parse \(.*\); give init_from a checkpoint "
                                          r"converted again from its run \(python convert/to_dartree.py"):
        lineage_record(str(tmp_path / "again"))
    with pytest.raises(CheckpointError, match=rf"again/{LINEAGE_FILE} does not parse \(.*\); convert the training "
                                              "run's checkpoint again"):
        convert(tmp_path / "again", tmp_path / "third")
    assert not (tmp_path / "third").exists()
    (tmp_path / "again" / LINEAGE_FILE).write_text(json.dumps({"lineage": {"steps": "8"}}))
    with pytest.raises(RecipeError, match=rf"{LINEAGE_FILE}: lineage.steps is a string, not an integer"):
        lineage_record(str(tmp_path / "again"))


@pytest.mark.parametrize("fmt", ["zlab-dflash", "speculators"])
def test_export_carries_the_targets_context_length(tmp_path, fmt):
    """A drafter trained for a 131,072-token target exports with max_position_embeddings 131072 (it was left out,
    so loaders took Qwen3's default, 32,768): training records the target's context length in the checkpoint's
    target section, exports write it, conversion reads it back. A checkpoint written before it was recorded still
    loads and exports, with a warning, and ``--target`` supplies the figure."""
    from dartree.models.heads import IdentityHead

    target = tiny_target()
    target.model.config.max_position_embeddings = 131072
    dt = _trained_here(tmp_path, target, IdentityHead(), 1)
    assert json.loads((dt / "config.json").read_text())["target"]["max_position_embeddings"] == 131072

    def written(folder):
        cfg = json.loads((folder / "config.json").read_text())
        return (cfg["transformer_layer_config"] if fmt == "speculators" else cfg).get("max_position_embeddings")

    out = export(dt, tmp_path / "pub", to=fmt)
    assert written(out) == 131072
    again = convert(out, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["target"]["max_position_embeddings"] == 131072
    old = json.loads((dt / "config.json").read_text())  # as saved before the context length was recorded
    del old["target"]["max_position_embeddings"]
    (dt / "config.json").write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="records no target context length"):  # the loader's default then applies
        assert written(export(dt, tmp_path / "old", to=fmt)) == (32768 if fmt == "speculators" else None)
    assert written(export(dt, tmp_path / "old_t", to=fmt, target=target)) == 131072


@pytest.mark.slow
def test_user_trains_with_train_py_exports_and_reimports_unchanged(tmp_path, monkeypatch, target):
    from dartree.training.recipe import load_recipe
    from dartree.training.build import build_models
    from dartree.training.settings import model_settings
    from dartree.training.trainer import run

    for recipe, kind in (("tiny_dspark", "gated_markov"), ("tiny_dspark", "rnn"), ("tiny_domino", "gru")):
        _, head = build_models(model_settings(load_recipe([f"recipe={recipe}", f"head.type={kind}"])), target)
        assert head.type_name == kind  # build_models takes every head type
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_domino", f"output_dir={tmp_path / 'run'}"]))
    dt = tmp_path / "run" / "checkpoint"  # a dartree checkpoint already: it exports as it is
    again = convert(export(dt, tmp_path / "pub", to="specforge-domino"), tmp_path / "again", dtype=torch.float32)
    c0, c1 = (json.loads((x / "config.json").read_text()) for x in (dt, again))
    assert c0["head"]["type"] == "gru" and (c0["drafter"], c0["head"]) == (c1["drafter"], c1["head"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # what train.py ran is recorded
    assert c0["provenance"]["steps"] == summary["steps"] > 0
    assert c0["provenance"]["holdout_chain_tau"] == pytest.approx(summary["holdout_chain_tau"])
    t0, t1 = load_file(str(dt / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert t0.keys() == t1.keys() and all(_bytes(t0[k]) == _bytes(t1[k]) for k in t0)


# ------------------------------------------------------------------------------------------------ decoding
def _load_by_hand(t: dict, drafter, head) -> None:
    """Put published tensors into dartree modules attribute by attribute (the spec, independent of the converter)."""
    p = "layers.0."
    lay = drafter.layers[0]
    pairs = {drafter.fc: "fc", drafter.hidden_norm: "hidden_norm", drafter.norm: "norm",
             lay.input_layernorm: p + "input_layernorm", lay.post_attention_layernorm: p + "post_attention_layernorm"}
    pairs.update({getattr(lay, n): p + "self_attn." + n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")})
    pairs.update({getattr(lay, n): p + "mlp." + n for n in ("gate_proj", "up_proj", "down_proj")})
    with torch.no_grad():
        for mod, name in pairs.items():
            mod.weight.copy_(t[name + ".weight"])
        if isinstance(head, GRUHead):
            head.weight_ih.copy_(t["prefix_gru.weight_ih_l0"])
            head.weight_hh.copy_(t["prefix_gru.weight_hh_l0"])
            head.fc1.weight.copy_(t["embed_proj.0.weight"])
            head.fc2.weight.copy_(t["embed_proj.2.weight"])
        elif isinstance(head, MarkovHead):
            head.w1.weight.copy_(t["markov_head.markov_w1.weight"])
            head.w2.weight.copy_(t["markov_head.markov_w2.weight"])
            for name in ("gate_proj", "joint_proj"):
                if hasattr(head, name):
                    getattr(head, name).weight.copy_(t[f"markov_head.{name}.weight"])
                    getattr(head, name).bias.copy_(t[f"markov_head.{name}.bias"])


@pytest.mark.parametrize("fmt,kind", [("zlab-dflash", None), ("specforge-domino", None),
                                      ("specforge-dspark", "gated"), ("deepspec-dspark", "rnn")])
def test_decoding_with_converted_checkpoint_is_lossless_and_drafts_like_weights_trained_here(tmp_path, target, fmt, kind):
    from dartree.models.families.dspark import GatedMarkovHead
    from dartree.models.heads import IdentityHead

    src = make_source(tmp_path, fmt, kind=kind or "vanilla", confidence=False)
    dm = load_dartree(convert(src, tmp_path / "dt", target=target), target=target)
    t = load_file(str(src / "model.safetensors"))
    drafter = make_drafter(proposal_offset=1 if fmt == "zlab-dflash" else 0)
    head = {"zlab-dflash": lambda: IdentityHead(),
            "specforge-domino": lambda: GRUHead(VOCAB, D, emb_dim=E, gru_hidden_dim=G, prefix_len=1),
            "specforge-dspark": lambda: GatedMarkovHead(VOCAB, R, hidden_size=D),
            "deepspec-dspark": lambda: RNNHead(VOCAB, R, hidden_size=D)}[fmt]()
    _load_by_hand(t, drafter, head)
    head.bind_embeddings(target.embed_tokens.weight)
    chain = get_builder("chain")
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        prompt = torch.randint(2, VOCAB, (5 + i,), generator=g).tolist()
        feats = target.forward(torch.tensor([prompt])).features[0]
        trees = []
        for dr, hd in ((dm.drafter, dm.head), (drafter, head)):
            block = draft_block(target, dr, prompt[-1], len(prompt) - 1, feats[:-1], DraftCache(1))
            trees.append(chain(block, hd, prompt[-1], BLOCK, k=VOCAB).tokens)
        assert torch.equal(trees[0], trees[1])
        ar = autoregressive_generate(target, prompt, max_new_tokens=14).tokens
        for dr, hd in ((dm.drafter, dm.head), (drafter, head)):
            out = speculative_generate(target, dr, hd, prompt, DecodeSettings(builder="pruned", max_new_tokens=14,
                                                                              budget=6))
            assert out.tokens == ar


# ----------------------------------------------------------------------------------------------- bad input
def _cli(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_detects_converts_and_exports(tmp_path):
    src = make_source(tmp_path, "specforge-domino")
    r = _cli("convert/to_dartree.py", str(src), "--out", str(tmp_path / "dt"))
    assert r.returncode == 0, r.stderr
    assert "detected format: specforge-domino" in r.stdout
    r = _cli("convert/from_dartree.py", str(tmp_path / "dt"), "--to", "specforge-domino", "--out", str(tmp_path / "pub"))
    assert r.returncode == 0, r.stderr and (tmp_path / "pub" / "model.safetensors").exists()
    r = _cli("convert/from_dartree.py", str(tmp_path / "dt"), "--to", "specforge-dspark", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "head type 'gru'" in r.stderr
    assert not (tmp_path / "x").exists()


def _edit(src: Path, fn):
    t = load_file(str(src / "model.safetensors"))
    fn(t)
    save_file(t, str(src / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("case,pattern", [
    ("truncated", r"cannot read .*model\.safetensors.*truncated"),
    ("missing", r"missing tensor 'prefix_gru\.weight_hh_l0' \(expected shape \[15, 5\]\)"),
    ("shape", r"tensor 'embed_proj\.0\.weight' has shape \[6, 36\], expected \[6, 37\]"),
    ("unexpected", r"unexpected tensor 'extra\.bias'"),
    ("unknown", r"unknown checkpoint layout"),
    ("layout", r"unknown config layout for specforge-domino: no dflash_config\.gru_hidden_dim.*expected"),
    ("shard", r"shard 'model-00002-of-00002\.safetensors' named in model\.safetensors\.index\.json is missing"),
])
def test_bad_sources_give_one_line_errors_and_write_nothing(tmp_path, case, pattern):
    src = make_source(tmp_path, "specforge-domino", shards=2 if case == "shard" else 1)
    if case == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    elif case == "missing":
        _edit(src, lambda t: t.pop("prefix_gru.weight_hh_l0"))
    elif case == "shape":
        _edit(src, lambda t: t.update({"embed_proj.0.weight": torch.zeros(E, D + G - 1)}))
    elif case == "unexpected":
        _edit(src, lambda t: t.update({"extra.bias": torch.zeros(2)}))
    elif case in ("unknown", "layout"):
        cfg = json.loads((src / "config.json").read_text())
        if case == "unknown":
            del cfg["dflash_config"]
        else:
            del cfg["dflash_config"]["gru_hidden_dim"]
        (src / "config.json").write_text(json.dumps(cfg))
    elif case == "shard":
        (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=pattern):
        convert(src, tmp_path / "out")
    r = _cli("convert/to_dartree.py", str(src), "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("other,pattern", [
    (dict(vocab_size=64), r"vocab_size: checkpoint 96 vs target 64"),
    (dict(hidden_size=48), r"hidden_size: checkpoint 32 vs target 48"),
    (dict(num_layers=2), r"num_layers: checkpoint 4 vs target 2.*target_layer_ids \[2\] outside"),
])
def test_wrong_target_pairing_is_named(tmp_path, other, pattern):
    src = make_source(tmp_path, "specforge-dspark")
    with pytest.raises(CheckpointError, match=pattern):
        convert(src, tmp_path / "out", target=tiny_target(**other))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_target_pairing_error_is_one_line(tmp_path):
    src = make_source(tmp_path, "specforge-dspark")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 5]
    (src / "config.json").write_text(json.dumps(cfg))
    r = _cli("convert/to_dartree.py", str(src), "--out", str(tmp_path / "out"), "--target", "tiny-qwen3")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "target_layer_ids [5] outside the target's 4 layers" in r.stderr and not (tmp_path / "out").exists()


def test_mask_token_outside_target_vocab_is_named(tmp_path, target):
    src = make_source(tmp_path, "zlab-dflash")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = VOCAB
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mask_token_id 96 >= target vocab rows 96"):
        convert(src, tmp_path / "out", target=target)


def test_exporter_refuses_what_the_layout_cannot_express(tmp_path, target):
    from dartree.models.heads import IdentityHead

    dt = _trained_here(tmp_path, target, IdentityHead(), 0)  # all-B proposals, z-lab uses B-1
    with pytest.raises(CheckpointError, match="zlab-dflash drafters use proposal_offset 1"):
        export(dt, tmp_path / "z", to="zlab-dflash")
    with pytest.raises(CheckpointError, match="head type 'identity' cannot be exported as specforge-domino"):
        export(dt, tmp_path / "d", to="specforge-domino")
    cfg = json.loads((dt / "config.json").read_text())
    cfg["drafter"]["qk_norm"] = False
    cfg["head"] = {"type": "markov", "vocab_size": VOCAB, "rank": R}
    with pytest.raises(CheckpointError, match="qk_norm=false"):
        from dartree.convert.specforge import dspark_config

        dspark_config(cfg)
    assert not any((tmp_path / n).exists() for n in ("z", "d"))


def test_published_names_live_with_each_family_and_an_unknown_head_type_is_named():
    """Each shipped head type's published names come from its family module and are the names the publishers use
    (SpecForge ``dspark_heads.py`` / ``domino.py``, DeepSpec, z-lab ``DFlash2DraftModel``, vLLM speculators): tensor
    names, DSpark's ``markov_head_type``, the speculators type and the ``--to`` layouts; an unknown head type is
    refused naming the registered ones, and a family cannot name a published type for a head it does not train."""
    from dartree.convert.export_config import layout_for_head
    from dartree.convert.vllm_speculators import write as speculators_write
    from dartree.models.families import family_of_head, published_names, published_type, register_family
    from dartree.models.families.dflash import DFlashFamily

    dspark = {"w1.weight": "markov_head.markov_w1.weight", "w2.weight": "markov_head.markov_w2.weight",
              "gate_proj.weight": "markov_head.gate_proj.weight", "gate_proj.bias": "markov_head.gate_proj.bias",
              "joint_proj.weight": "markov_head.joint_proj.weight", "joint_proj.bias": "markov_head.joint_proj.bias",
              "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"}
    for t, kind in (("markov", "vanilla"), ("gated_markov", "gated"), ("rnn", "rnn")):
        assert published_names(t) == dspark and published_type(t) == kind
        assert family_of_head(t).speculators_type == "dspark" and layout_for_head(t) == "choose --to specforge-dspark"
    assert published_names("gru") == {"weight_ih": "prefix_gru.weight_ih_l0", "weight_hh": "prefix_gru.weight_hh_l0",
                                      "fc1.weight": "embed_proj.0.weight", "fc2.weight": "embed_proj.2.weight"}
    assert published_names("selector") == {"w1.weight": "candidate_selector.predecessor_codebook",
                                           "w2.weight": "candidate_selector.successor_codebook",
                                           "proj.weight": "candidate_selector.hidden_projection.weight"}
    assert published_names("identity") == {}
    assert {t: family_of_head(t).speculators_type for t in ("identity", "selector", "gru")} == {
        "identity": "dflash", "selector": "dflash2", "gru": ""}
    assert [layout_for_head(t) for t in ("identity", "gru", "selector")] == [
        "choose --to zlab-dflash", "choose --to specforge-domino", "choose --to zlab-dflash2 or --to speculators"]
    with pytest.raises(KeyError, match=r"head type 'nope' belongs to no registered drafter family.*registered head "
                                       r"types: \[[^]]*'gru', 'identity', 'markov', 'rnn', 'selector'"):
        published_names("nope")
    with pytest.raises(KeyError, match=r"head type 'gru' \(family 'domino'\) has no published type name"):
        published_type("gru")
    gru = {"drafter": {"qk_norm": True}, "head": {"type": "gru"}, "target": {}}
    with pytest.raises(CheckpointError, match=r"head type 'gru' cannot be exported as speculators \(it carries "
                                              r"dflash: identity, dflash2: selector, dspark: markov / gated_markov / "
                                              r"rnn\); choose --to specforge-domino"):
        speculators_write(gru, {})

    class Stray(DFlashFamily):  # a complete family (the identity head) naming a head type it does not train
        name = "stray_published_types"
        published_types = {"markov": "vanilla"}

    with pytest.raises(ValueError, match=r"published_types names head types \['markov'\] it does not train"):
        register_family(Stray())


def test_config_json_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        convert(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- the format registry
def _cli_choices(main, argv, monkeypatch) -> dict:
    """{dest: choices} of the argparse parser that ``main`` builds (its run stops at parse_args)."""
    import argparse

    seen = {}

    def grab(parser, *args, **kwargs):
        seen.update({a.dest: a.choices for a in parser._actions if a.choices is not None})
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(SystemExit):
        main(argv)
    return seen


def test_the_registry_lists_exactly_the_layouts_the_clis_accept(monkeypatch):
    """--from is auto, dartree's own two sources and every registered layout; --to every layout with a writer (all
    but the read-only deepspec-dspark); both lists come from the one registry."""
    from dartree.convert import importer, publishers
    from dartree.convert.tools import from_dartree, to_dartree

    pairs = publishers.FORMAT_PAIRS
    assert set(pairs) == {"zlab-dflash", "zlab-dflash2", "specforge-domino", "specforge-dspark", "deepspec-dspark",
                          "speculators", "specforge-dspine", "tencent-dspine"}
    assert publishers.SOURCE_FORMATS == tuple(pairs)
    assert publishers.EXPORT_FORMATS == tuple(n for n in pairs if n not in ("deepspec-dspark", "tencent-dspine"))
    assert pairs["deepspec-dspark"].write is None and all(pairs[n].write for n in publishers.EXPORT_FORMATS)
    froms = _cli_choices(to_dartree.main, ["src"], monkeypatch)["source_format"]
    assert sorted(froms) == sorted(["auto", "dartree", "dartree-train", *pairs])
    assert sorted(importer.READERS) == sorted(["dartree", "dartree-train", *pairs])
    tos = _cli_choices(from_dartree.main, ["src", "--to", "zlab-dflash", "--out", "x"], monkeypatch)["to"]
    assert sorted(tos) == sorted(publishers.EXPORT_FORMATS)
    with pytest.raises(CheckpointError, match=r"--to 'deepspec-dspark' is not one of"):
        export("unused", "unused", to="deepspec-dspark")


def test_every_publisher_modules_pairs_are_registered_once_and_only_there():
    """Each publisher module lists its layouts in PAIRS and registers nothing itself; publishers.py registers every
    one of them (and no other FormatPair exists in convert/); a duplicate, reserved or missing name is refused."""
    import importlib

    from dartree.convert import publishers, registry, specforge, zlab
    from dartree.convert.registry import FormatPair, FormatRegistry

    pairs = publishers.FORMAT_PAIRS
    listed = [p for module in publishers.PUBLISHERS for p in module.PAIRS]
    assert sorted(p.name for p in listed) == sorted(pairs) and all(pairs[p.name] is p for p in listed)
    assert {m.__name__.rsplit(".", 1)[1] for m in publishers.PUBLISHERS} == {"zlab", "specforge", "deepspec",
                                                                              "vllm_speculators", "dspine"}
    for f in sorted((Path(__file__).resolve().parents[1] / "convert").glob("*.py")):  # no pair outside the registry
        module = importlib.import_module(f"dartree.convert.{f.stem}")
        for value in vars(module).values():
            assert not isinstance(value, FormatPair) or pairs.get(value.name) is value, (f.name, value.name)
    assert not any(isinstance(v, (dict, FormatRegistry)) and v and all(isinstance(p, FormatPair) for p in v.values())
                   for v in vars(registry).values())  # no module-level registry that an import could fill
    reg = FormatRegistry(reserved=publishers.RESERVED)
    assert reg.register(zlab.DFLASH) is zlab.DFLASH and list(reg) == ["zlab-dflash"] and reg.writable() == ("zlab-dflash",)
    with pytest.raises(ValueError, match="'zlab-dflash' is already registered"):
        reg.register(zlab.DFLASH)
    with pytest.raises(ValueError, match="'dartree' is reserved"):
        reg.register(FormatPair("dartree", detect=zlab.detect_dflash, read=zlab.read_dflash))
    with pytest.raises(ValueError, match="already registered"):
        publishers.build_registry(publishers.REGISTRATION_ORDER + (zlab.DFLASH,))
    with pytest.raises(ValueError, match=r"\['zlab-dflash'\] left out"):
        publishers.build_registry(publishers.REGISTRATION_ORDER[:-1])
    with pytest.raises(ValueError, match=r"\['speculators', 'zlab-dflash2', 'deepspec-dspark', 'specforge-dspine', "
                                         r"'tencent-dspine', 'zlab-dflash'\] listed by no publisher module"):
        publishers.build_registry(publishers.REGISTRATION_ORDER, publishers=(specforge,))


@pytest.mark.parametrize("cfg,names,fmt", [
    ({"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"]}, set(), "speculators"),
    ({"dflash_config": {"projector_type": "domino", "conv_kernel_size": 2}}, set(), "zlab-dflash2"),
    ({"target_layer_ids": [1], "markov_rank": 4}, set(), "deepspec-dspark"),
    ({"dflash_config": {"mask_token_id": 0}}, {"prefix_gru.weight_ih_l0", "markov_head.markov_w1.weight"},
     "specforge-domino"),
    ({"dflash_config": {"mask_token_id": 0}}, {"logit_head.markov_head.markov_w1.weight"}, "specforge-dspark"),
    ({"dflash_config": {"mask_token_id": 0}, "markov_rank": 4}, set(), "specforge-dspark"),
    ({"dflash_config": {"mask_token_id": 0}, "architectures": ["DSpineDraftModel"]},
     {"transfer_codes", "transfer_ready"},
     "specforge-dspine"),
    ({"config": {"dflash_config": {"mask_token_id": 0}}}, {"injection.bias", "codes"}, "tencent-dspine"),
    ({"dflash_config": {"mask_token_id": 0}}, {"fc.weight"}, "zlab-dflash"),
], ids=["speculators-first", "dflash2-before-specforge", "deepspec", "domino-before-dspark", "legacy-names", "dspark",
        "dspine", "dspine-tencent", "zlab-last"])
def test_auto_detection_tries_the_registry_in_order(cfg, names, fmt):
    """--from auto takes the first registered layout that answers: speculators, z-lab DFlash 2, DeepSpec, SpecForge
    Domino, SpecForge DSpark, SpecForge's and Tencent's DSpine, then z-lab DFlash (the catch-all of a dflash_config);
    no match lists every layout."""
    from dartree.convert import publishers

    assert list(publishers.FORMAT_PAIRS) == ["speculators", "zlab-dflash2", "deepspec-dspark", "specforge-domino",
                                             "specforge-dspark", "specforge-dspine", "tencent-dspine", "zlab-dflash"]
    assert publishers.detect(cfg, names)[0] == fmt
    with pytest.raises(CheckpointError, match="unknown checkpoint layout") as err:
        publishers.detect({"format": "other"}, set())
    assert all(f"{name} (" in str(err.value) for name in publishers.FORMAT_PAIRS)


def test_convert_modules_import_one_way():
    """registry < the shared helpers (config fields, published tensors, export config) < the publisher modules (none
    imports another) < publishers.py < the two converters (importer, exporter) < their command lines (convert/tools/
    and the thin scripts at the documented paths)."""
    from test_layers import import_graph

    rank = {"registry": 0, "config_fields": 1, "published_tensors": 1, "export_config": 1, "zlab": 2, "specforge": 2,
            "deepspec": 2, "vllm_speculators": 2, "dspine": 2, "publishers": 3, "importer": 4, "exporter": 4, "tools": 5, "tools.to_dartree": 5, "tools.from_dartree": 5,
            "to_dartree": 6, "from_dartree": 6, "__init__": 0}
    graph = import_graph()
    mods = {m: deps for m, deps in graph.items() if m.startswith("dartree.convert")}

    def key(m: str) -> str:
        return m.removeprefix("dartree.convert").lstrip(".") or "__init__"

    assert {key(m) for m in mods} == set(rank)
    bad = [f"{a} -> {b}" for a, deps in mods.items() for b in deps if b.startswith("dartree.convert.")
           and rank[key(b)] >= rank[key(a)]]
    assert bad == []


@pytest.mark.parametrize("fmt", ["zlab-dflash", "speculators"])
def test_exports_name_the_target_by_a_model_id_another_machine_resolves(tmp_path, fmt):
    """A drafter for the packaged default target records it as SmolLM2's hub id, never this machine's dequantised
    cache folder or the recorded name's note; --verifier overrides it."""
    from dartree.convert.tools.from_dartree import main as export_main
    from dartree.models.heads import IdentityHead
    from dartree.models.target import _SMOLLM2_NAME, SMOLLM2_ID, model_id, resolve_target_path

    dt = _trained_here(tmp_path, tiny_target(), IdentityHead(), 1)
    cfg = json.loads((dt / "config.json").read_text())
    cfg["target"]["name"] = _SMOLLM2_NAME  # as a drafter trained on the default target records it
    (dt / "config.json").write_text(json.dumps(cfg))

    def recorded(folder):
        pub = json.loads((folder / "config.json").read_text())
        return pub["speculators_config"]["verifier"]["name_or_path"] if fmt == "speculators" else pub["_name_or_path"]

    assert recorded(export(dt, tmp_path / "pub", to=fmt)) == SMOLLM2_ID
    assert export_main([str(dt), "--to", fmt, "--out", str(tmp_path / "own"), "--verifier", "me/my-model"]) == 0
    assert recorded(tmp_path / "own") == "me/my-model"
    assert model_id(str(resolve_target_path("smollm2"))) == SMOLLM2_ID == model_id("smollm2")  # the cache folder
    assert model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B" and model_id(None) == ""
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "org/base-model"}))
    assert model_id(str(local)) == "org/base-model"  # a local folder that records its hub id
    (local / "config.json").write_text("{}")
    assert model_id(str(local)) == str(local)  # one that records none: the folder, as the user gave it


def test_a_speculators_export_that_can_only_name_a_local_folder_as_the_verifier_warns(tmp_path, capsys):
    """vLLM loads a speculators drafter's verifier (embedding, lm_head, norm) from verifier.name_or_path, so an
    export that can only record a local folder there (one whose config.json records no hub id) or a name that is no
    hub id says so, once, naming --verifier; the library warns, the command prints one ``warning:`` line. The name is
    still written (the export stays usable on this machine); --verifier or a folder that records its hub id is
    silent."""
    import warnings

    from dartree.convert.exporter import verifier_warning
    from dartree.convert.tools.from_dartree import main as export_main
    from dartree.models.heads import IdentityHead

    dt = _trained_here(tmp_path, tiny_target(), IdentityHead(), 1)
    local = tmp_path / "my-target"
    local.mkdir()
    (local / "config.json").write_text("{}")
    cfg = json.loads((dt / "config.json").read_text())
    cfg["target"]["name"] = str(local)  # as a drafter trained on a local target folder records it
    (dt / "config.json").write_text(json.dumps(cfg))

    def recorded(folder):
        return json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]

    with pytest.warns(UserWarning) as caught:
        out = export(dt, tmp_path / "a", to="speculators")
    said = [str(w.message) for w in caught if "verifier" in str(w.message)]
    assert said == [f"the export records the verifier as '{local}', a local path "
                    "(speculators_config.verifier.name_or_path), which another machine cannot load the verifier from; "
                    "pass --verifier ORG/MODEL, the target's hub id"]
    assert recorded(out) == str(local)
    assert export_main([str(dt), "--to", "speculators", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {said[0]}"]
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        assert recorded(export(dt, tmp_path / "c", to="speculators", verifier="me/my-model")) == "me/my-model"
        (local / "config.json").write_text(json.dumps({"_name_or_path": "org/base-model"}))
        assert recorded(export(dt, tmp_path / "d", to="speculators")) == "org/base-model"
    assert [str(w.message) for w in quiet if "verifier" in str(w.message)] == []
    assert verifier_warning("Qwen/Qwen3-0.6B") is None
    assert "as 'tiny-qwen3-seed0', not a hub id (org/model)" in verifier_warning("tiny-qwen3-seed0")
    assert verifier_warning("").startswith("the export records no verifier (")


def test_speculators_export_writes_rope_theta_where_transformers_4_and_5_read_it(tmp_path):
    """speculators' config classes keep rope_theta only under transformer_layer_config.rope_parameters (the
    transformers 5 layout); a reader pinned to transformers 4 (Qwen3Config(rope_theta=...)) reads the top level and
    would take its default, so the export writes both, equal to the drafter's; either layout alone converts back to
    the same drafter."""
    from dartree.models.heads import IdentityHead

    dt = _trained_here(tmp_path, tiny_target(), IdentityHead(), 1)
    cfg = json.loads((dt / "config.json").read_text())
    cfg["drafter"]["rope_theta"] = 5000.0  # not transformers' default, so a default cannot pass for it
    (dt / "config.json").write_text(json.dumps(cfg))
    out = export(dt, tmp_path / "pub", to="speculators", verifier="org/model")
    pub = json.loads((out / "config.json").read_text())
    tl = pub["transformer_layer_config"]
    assert tl["rope_theta"] == 5000.0
    assert tl["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    for drop in ("rope_parameters", "rope_theta"):  # a transformers 4 reader, a transformers 5 reader
        only = {**pub, "transformer_layer_config": {k: v for k, v in tl.items() if k != drop}}
        src = tmp_path / f"only_{drop}"
        src.mkdir()
        (src / "config.json").write_text(json.dumps(only))
        (src / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
        back = json.loads((convert(src, tmp_path / f"back_{drop}") / "config.json").read_text())
        assert back["drafter"]["rope_theta"] == 5000.0

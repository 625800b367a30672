"""DSpine (models/families/dspine.py, convert/dspine.py): the family, its converters, decoding over it, and parity
with SpecForge's own DSpine code.

The parity fixture ``tests/fixtures/dspine_reference.safetensors`` (53 KB, numbers only) was written by
``tests/fixtures/make_dspine_reference.py``, which imports SpecForge's DSpine from a folder given on its command
line and runs it on a tiny configuration (its docstring says what it fixes and why). The folder held the SpecForge
snapshot of sgl-project/SpecForge at a6b6b0230009d15ec2a97a57384e6f53f0f96946 (``specforge/modeling/draft/dflash.py``,
``dflash_kernels.py``, ``registry.py``, ``specforge/algorithms/common/dflash_family_model.py``,
``specforge/core/chunking.py``) plus the DSpine files ``specforge/modeling/draft/dspine.py`` (blob of commit
9aafadfceaeb728209d4b4c6bda221f2c1fed70f) and ``specforge/algorithms/dspine/model.py`` (commit
f7bed051d09b605f37f494dfd3640b0487b2536e), every package ``__init__.py`` empty::

    git --git-dir=SPECFORGE.git archive a6b6b0230009d15ec2a97a57384e6f53f0f96946 specforge/modeling/draft/dflash.py \\
        specforge/modeling/draft/dflash_kernels.py specforge/modeling/draft/registry.py \\
        specforge/algorithms/common/dflash_family_model.py specforge/core/chunking.py | tar -x -C /tmp/sf_ref
    # + the two DSpine files at the commits above; touch every specforge/**/__init__.py
    python tests/fixtures/make_dspine_reference.py /tmp/sf_ref --out tests/fixtures/dspine_reference.safetensors

(transformers 5.23, torch 2.13 CPU, fp32).
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import LAYERS, VOCAB
from dartree.convert.importer import convert
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.sampling import rejection_accept, sample_chain_tokens
from dartree.decode.settings import DecodeSettings
from dartree.decode.trees import DraftBlock, block_candidates
from dartree.models.checkpoint import CheckpointError, load_dartree
from dartree.models.drafter import BlockAttention, DFlashDrafter, DraftCache, DrafterConfig
from dartree.models.families.dspine import DSpineHead, dspine_loss, schedule
from dartree.training.losses import label_mask
from dartree.training.recipe import RecipeError, load_recipe

FIXTURE = Path(__file__).parent / "fixtures" / "dspine_reference.safetensors"
STOP = 1


def _drafter(layers=2, seed=0, causal=True, hidden=32, heads=4, block=8):
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                                       num_heads=heads, num_kv_heads=2, head_dim=hidden // heads,
                                       target_layer_ids=list(LAYERS), mask_token_id=0, block_size=block,
                                       proposal_offset=1, causal_block=causal)).eval()


def _head(lm, layers=2, seed=0, active=True, **kw):
    """A DSpine head with codes from ``lm`` [V, D]; ``active``: writes and predecessor gate away from zero."""
    torch.manual_seed(seed)
    head = DSpineHead(lm.shape[0], lm.shape[1], layers, **{"transfer_rank": 8, "message_size": 8, "top_k": 4, **kw})
    head.init_codes(lm)
    if active:
        with torch.no_grad():
            for w in [*head.injection.writes, head.injection.predecessor_gate]:
                w.weight.normal_(std=0.5)
    return head.eval()


def _pair(target, **kw):
    drafter = _drafter(**kw)
    head = _head(target.lm_head.weight.detach(), layers=drafter.cfg.num_layers)
    head.bind_models(drafter, target.lm_head.weight)
    return drafter, head


# ------------------------------------------------------------------------------------------------ the family
def test_codes_are_the_whitened_pca_of_the_normalised_head_rows():
    torch.manual_seed(3)
    lm = torch.randn(40, 12)
    head = DSpineHead(40, 12, 2, transfer_rank=5, message_size=4, top_k=3)
    head.init_codes(lm)
    x = torch.nn.functional.normalize(lm, dim=-1)
    x = x - x.mean(0)
    _, s, vt = torch.linalg.svd(x, full_matrices=False)  # eigenvalues of X^T X are s^2
    z = torch.nn.functional.normalize(x @ vt[:5].T / s[:5], dim=-1)
    codes = head.transfer_codes
    torch.testing.assert_close(codes @ codes.T, z @ z.T, atol=1e-5, rtol=0)  # equal up to each direction's sign
    torch.testing.assert_close(codes.norm(dim=-1), torch.ones(40))
    for r in head.injection.readouts:  # the readouts start on the same orthonormal directions, ascending
        torch.testing.assert_close(r.weight @ r.weight.T, torch.eye(5), atol=1e-5, rtol=0)
        torch.testing.assert_close((r.weight @ vt[:5].flip(0).T).abs(), torch.eye(5), atol=1e-4, rtol=0)  # ascending
    assert bool(head.transfer_ready) and float(head.injection.predecessor_gate.weight.detach().abs().max()) == 0.0


def test_bad_heads_and_pairings_are_refused_in_one_line(target):
    with pytest.raises(ValueError, match=r"^dspine head: transfer_rank=40 exceeds min\(hidden_size 32, vocab_size - 1 "
                                         r"= 95\); choose head.transfer_rank <= 32$"):
        DSpineHead(VOCAB, 32, 2, transfer_rank=40)
    with pytest.raises(ValueError, match="replacement_hold_ratio=0.5 must be below replacement_end_ratio"):
        DSpineHead(VOCAB, 32, 2, transfer_rank=8, replacement_hold_ratio=0.5)
    with pytest.raises(ValueError, match="top_k=200 exceeds the vocabulary"):
        DSpineHead(VOCAB, 32, 2, transfer_rank=8, top_k=200)
    head = DSpineHead(VOCAB, 32, 2, transfer_rank=8, message_size=8)
    with pytest.raises(ValueError, match=r"token codes need the target's lm_head \[vocab_size 96, hidden_size 32\], "
                                         r"got \[50, 32\]"):
        head.init_codes(torch.randn(50, 32))
    with pytest.raises(ValueError, match="lm_head is \\[50, 32\\], not \\[vocab_size 96"):
        head.bind_models(_drafter(), torch.randn(50, 32))
    with pytest.raises(ValueError, match=r"drafter.causal_block False \(needs True\); drafter.num_layers 3 \(needs 2\)"):
        head.bind_models(_drafter(layers=3, causal=False))
    drafter = _drafter()
    head.bind_models(drafter, target.lm_head.weight)  # fits, but the codes were never set
    with pytest.raises(RuntimeError, match="^dspine token codes are not initialised"):
        speculative_generate(target, drafter, head, [5, 6, 7], DecodeSettings(builder="chain", max_new_tokens=4,
                                                                              stop_ids=[STOP]))


def test_an_untrained_injection_computes_the_causal_backbone_and_the_block_is_causal(target):
    drafter = _drafter()
    fresh = _head(target.lm_head.weight.detach(), active=False)  # writes and predecessor gate at zero
    x, qp, feats = torch.randn(1, 16, 32), (torch.tensor([3, 9])[:, None] + torch.arange(8)).reshape(1, -1), \
        torch.randn(1, 14, 2 * 32)
    mask = BlockAttention.from_anchors(torch.tensor([3, 9]), 14, 8)
    ids = torch.randint(2, VOCAB, (1, 2, 8))
    with torch.no_grad():
        plain = drafter(x, qp, feats, torch.arange(14)[None], mask=mask)
        fresh.bind_models(drafter)
        same = drafter(x, qp, feats, torch.arange(14)[None], mask=mask, hook=fresh.layer_hook(ids))
        assert torch.equal(same, plain)
        head = _head(target.lm_head.weight.detach())
        head.bind_models(drafter)
        out = drafter(x, qp, feats, torch.arange(14)[None], mask=mask, hook=head.layer_hook(ids))
        assert float((out - plain).abs().max()) > 1e-3  # an active injection acts
        torch.testing.assert_close(out.view(2, 8, 32)[:, 0], plain.view(2, 8, 32)[:, 0])  # the anchor is never written
        x2, ids2 = x.clone(), ids.clone()
        x2[:, 5:8] += 3.0  # later positions of block 0 ...
        ids2[..., 5:] = (ids2[..., 5:] + 1) % VOCAB  # ... and its true tokens (unused without replacement)
        out2 = drafter(x2, qp, feats, torch.arange(14)[None], mask=mask, hook=head.layer_hook(ids2))
        assert torch.equal(out2.view(2, 8, 32)[0, :5], out.view(2, 8, 32)[0, :5])  # causal: positions < 5 unchanged
        assert float((out2.view(2, 8, 32)[0, 5:] - out.view(2, 8, 32)[0, 5:]).abs().max()) > 1e-3
        # decoding (one block, no mask, the context through the cache) computes what training computes
        one = drafter(x[:, :8], qp[:, :8], feats[:, :3], torch.arange(3)[None], cache=DraftCache(2),
                      hook=head.layer_hook(ids[:, :1]))
        torch.testing.assert_close(one[0], out[0, :8], atol=1e-5, rtol=0)


def test_replacement_gives_the_first_layers_the_true_predecessor(target):
    drafter, head = _pair(target, layers=3)
    head.replacement_layers = 1
    h = torch.randn(1, 2, 8, 32)
    ids = torch.randint(2, VOCAB, (1, 2, 8))
    rep = torch.tensor([[True, False]])
    for layer in range(3):
        plain, swapped = head.inject(h, layer, ids), head.inject(h, layer, ids, rep)
        assert torch.equal(swapped[0, 1], plain[0, 1]) and torch.equal(swapped[..., 0, :], h[..., 0, :])
        assert torch.equal(swapped, plain) if layer else not torch.equal(swapped[0, 0, 2:], plain[0, 0, 2:])
    assert schedule(0, 600, 0.5, 146, 0.5, 1 / 6, 1 / 3) == (0.0, 0.5)
    assert schedule(146, 600, 0.5, 146, 0.5, 1 / 6, 1 / 3)[0] == 0.5
    assert schedule(150, 600, 0.5, 146, 0.5, 1 / 6, 1 / 3)[1] == pytest.approx(0.25)
    assert schedule(200, 600, 0.5, 146, 0.5, 1 / 6, 1 / 3)[1] == 0.0 and schedule(50, None, 0.5, 146, 0.5, 0.1, 0.2)[1] == 0


DSPINE = ["recipe=tiny_dflash", "loss.type=dspine", "head.type=dspine", "drafter.causal_block=true",
          "drafter.num_layers=2", "head.transfer_rank=8", "head.message_size=8", "head.top_k=4", "train.max_steps=3",
          "train.engine=torch"]


def test_the_recipe_holds_specforge_names_and_refuses_what_dspine_cannot_train():
    cfg = load_recipe(DSPINE)
    assert (cfg.head.alignment_warmup_steps, cfg.head.replacement_layers, cfg.head.candidate_mass_threshold) == (
        146, 3, 1e-4)
    assert load_recipe(["recipe=tiny_dspark"]).head.transfer_rank == 512  # scaled for the default target (D 576)
    with pytest.raises(RecipeError, match="set drafter.causal_block=true"):
        load_recipe([d for d in DSPINE if "causal_block" not in d])
    with pytest.raises(RecipeError, match="drafter.proposal_offset=0: DSpine proposes from block position 1"):
        load_recipe([*DSPINE, "drafter.proposal_offset=0"])
    with pytest.raises(RecipeError, match=r"^head.replacement_probability=1.5 is out of range: must be a finite "
                                          r"number in \[0, 1\]"):
        load_recipe([*DSPINE, "head.replacement_probability=1.5"])
    with pytest.raises(RecipeError, match="DSpine's CE / L1 split is head.ce_weight"):
        load_recipe([*DSPINE, "loss.ce_weight=0.5"])


# ------------------------------------------------------------------------------------------------ parity
def _reference():
    ref = load_file(str(FIXTURE))
    with safe_open(str(FIXTURE), "pt") as fh:
        meta = fh.metadata()
    return ref, json.loads(meta["config"]), json.loads(meta["cases"]), int(meta["length"])


def _specforge_folder(folder: Path, ref: dict, config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k[len("state."):]: v for k, v in ref.items() if k.startswith("state.")}, str(folder / "model.safetensors"))
    return folder


def test_forward_transition_scores_and_loss_equal_specforge(tmp_path):
    ref, config, cases, length = _reference()
    dm = load_dartree(convert(_specforge_folder(tmp_path / "sf", ref, config), tmp_path / "dt"))
    drafter, head, lm = dm.drafter, dm.head, ref["lm_head"]
    head.bind_models(drafter, lm)
    anchors, ids, L = ref["input.anchors"][0], ref["input.input_ids"][0], 4
    blocks = ref["forward.block_token_ids"]  # [1, 2, 4] the blocks' true tokens
    noise = torch.full((1, 8), 31)
    noise[0, ::L] = ids[anchors]
    x, qp = ref["embed"][noise], (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    feats, mask = ref["input.hidden_states"], BlockAttention.from_anchors(anchors, length, L)
    hook = head.layer_hook(blocks, features=True)
    with torch.no_grad():
        out = drafter(x, qp, feats, torch.arange(length)[None], mask=mask, hook=hook)
        got = {"forward.hidden_states": out.view(1, 2, L, -1), "forward.pre_injection": hook.head_hidden.view(1, 2, L, -1),
               "forward.layer_features": torch.stack(hook.features),
               "scores": head.transition_scores(ref["forward.pre_injection"][..., 1:, :], ref["scores.candidates"],
                                                ref["scores.anchors"])}
    lp = anchors[:, None] + 1 + torch.arange(L - 1)
    valid = label_mask(lp, length, ref["input.loss_mask"][0].bool(), cumulative=True)
    t_hidden = ref["input.target_last_hidden_states"][0][lp - 1]
    names = {"ce_sum": "backbone_ce", "l1_sum": "backbone_l1", "refinement": "refinement_loss",
             "alignment": "alignment_loss", "den": "den"}
    for case, (step, total, prob) in cases.items():
        o = dspine_loss(drafter, head, lm, x, qp, feats, mask, blocks[0], t_hidden, valid, gamma=7.0,
                        progress=(step, total), replace=torch.ones(2, dtype=torch.bool) if prob else None)
        got[f"loss.{case}"] = o["loss"].detach()
        got.update({f"loss.{case}.{names[k]}": torch.as_tensor(o[k]).detach() for k in names})
    diffs = {k: float((v.float() - ref[k].float()).abs().max()) for k, v in got.items()}
    assert max(diffs.values()) < 1e-5, diffs
    assert float(ref["loss.replaced"]) != pytest.approx(float(ref["loss.late"]))  # the two cases differ ...
    unreplaced = dspine_loss(drafter, head, lm, x, qp, feats, mask, blocks[0], t_hidden, valid,
                             progress=tuple(cases["replaced"][:2]))["loss"]
    assert abs(float(unreplaced.detach()) - float(ref["loss.replaced"])) > 1e-3  # ... and replacement is part of it


# ------------------------------------------------------------------------------------------------ converters
def _tencent_folder(folder: Path, ref: dict, config: dict) -> Path:
    folder.mkdir(parents=True)
    state = {k[len("state."):]: v for k, v in ref.items() if k.startswith("state.")}
    codes = state.pop("transfer_codes")
    state.pop("transfer_ready")
    (folder / "config.json").write_text(json.dumps({"config": {**config, "block_size": 8}}))  # the reference: 16
    save_file(state, str(folder / "model.safetensors"))
    save_file({"codes": codes}, str(folder / "transfer.safetensors"))
    return folder


def test_both_layouts_convert_and_export_back_tensor_identical(tmp_path):
    from dartree.convert.tools.from_dartree import main as export_main
    from dartree.convert.tools.to_dartree import main as convert_main

    ref, config, _, _ = _reference()
    sf = _specforge_folder(tmp_path / "sf", ref, config)
    tc = _tencent_folder(tmp_path / "tc", ref, config)
    for src, fmt in ((sf, "specforge-dspine"), (tc, "tencent-dspine")):
        assert convert_main([str(src), "--out", str(tmp_path / f"{fmt}.dt")]) == 0
        dt = json.loads((tmp_path / f"{fmt}.dt" / "config.json").read_text())
        assert dt["provenance"]["source_format"] == fmt and dt["head"]["type"] == "dspine"
        assert dt["drafter"]["causal_block"] is True and dt["drafter"]["proposal_offset"] == 1
        assert dt["drafter"]["block_size"] == (4 if fmt == "specforge-dspine" else 16)
        assert (dt["head"]["transfer_rank"], dt["head"]["message_size"], dt["head"]["num_layers"]) == (8, 6, 3)
        assert export_main([str(tmp_path / f"{fmt}.dt"), "--to", "specforge-dspine", "--out",
                            str(tmp_path / f"{fmt}.back")]) == 0
        back = load_file(str(tmp_path / f"{fmt}.back" / "model.safetensors"))
        want = {k[len("state."):]: v for k, v in ref.items() if k.startswith("state.")}
        assert sorted(back) == sorted(want)
        assert all(back[k].dtype == want[k].dtype and torch.equal(back[k], want[k]) for k in want)
        out = json.loads((tmp_path / f"{fmt}.back" / "config.json").read_text())
        assert out["architectures"] == ["DSpineDraftModel"] and out["is_causal"] is True
        assert out["dspine_config"] == {**config["dspine_config"], "ce_weight": 0.1, "alignment_weight": 0.5,
                                        "alignment_warmup_steps": 146, "replacement_layers": 3,
                                        "replacement_probability": 0.5, "replacement_hold_ratio": 1 / 6,
                                        "replacement_end_ratio": 1 / 3, "candidate_mass_threshold": 1e-4,
                                        **({"top_k": 16} if fmt == "tencent-dspine" else {})}
        assert out["dflash_config"] == config["dflash_config"]
    # the export reads back as it was written
    again = convert(tmp_path / "specforge-dspine.back", tmp_path / "again.dt")
    a, b = load_file(str(again / "model.safetensors")), load_file(str(tmp_path / "specforge-dspine.dt" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b) and sorted(a) == sorted(b)


def test_the_published_qwen3_8b_config_reads_with_specforge_shapes():
    from dartree.convert.dspine import LAYOUT, _backbone, _head, read_specforge
    from dartree.models.checkpoint import dartree_config, expected_tensors

    config = {"architectures": ["DSpineDraftModel"], "block_size": 16, "head_dim": 128, "hidden_size": 4096,
              "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
              "num_target_layers": 36, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936,
              "is_causal": True, "use_sliding_window": False, "rope_scaling": None,
              "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
              "dspine_config": {"transfer_rank": 1024, "message_size": 512, "top_k": 16}}
    with pytest.raises(CheckpointError, match="missing tensor 'fc.weight'"):
        read_specforge(config, {}, "q8")
    drafter = _backbone(config, "q8", LAYOUT, None)
    head = _head(config, config["dspine_config"], drafter, 151936, "q8")
    shapes = expected_tensors(dartree_config(drafter, head, {"vocab_size": 151936}), "q8")
    assert shapes["head.injection.readouts.4.weight"] == (1024, 4096)
    assert shapes["head.injection.writes.0.weight"] == (4096, 512)
    assert shapes["head.injection.predecessor_gate.weight"] == (512, 1024)
    assert shapes["head.transfer_codes"] == (151936, 1024) and shapes["head.transfer_ready"] == ()
    assert shapes["backbone.fc.weight"] == (4096, 5 * 4096) and len(shapes) == 11 * 5 + 3 + 2 * 5 + 4 + 2


def test_partial_or_unknown_dspine_folders_are_refused_in_one_line(tmp_path):
    ref, config, _, _ = _reference()
    tc = _tencent_folder(tmp_path / "tc", ref, config)
    (tc / "transfer.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"without its token codes: SpecForge's layout stores them as the tensor "
                                              r"transfer_codes, Tencent's in transfer.safetensors under 'codes'"):
        convert(tc, tmp_path / "o1")
    sf = _specforge_folder(tmp_path / "sf", ref, {**config, "dspine_config": {**config["dspine_config"], "rank": 3}})
    with pytest.raises(CheckpointError, match=r"dspine_config field\(s\) \['rank'\] are unknown"):
        convert(sf, tmp_path / "o2")
    shutil.rmtree(sf)
    state = {k[len("state."):]: v for k, v in ref.items() if k.startswith("state.")}
    for name, value, why in (("transfer_ready", torch.tensor(False), "transfer_ready is false"),
                             ("injection.writes.2.weight", None, "missing tensor 'injection.writes.2.weight'")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file({k: v for k, v in {**state, name: value}.items() if v is not None}, str(folder / "model.safetensors"))
        with pytest.raises(CheckpointError, match=why):
            convert(folder, tmp_path / f"{name}.out")
    dt = convert(_specforge_folder(tmp_path / "ok", ref, config), tmp_path / "ok.dt")
    from dartree.convert.exporter import export

    with pytest.raises(CheckpointError, match="cannot be exported as zlab-dflash .*choose --to specforge-dspine"):
        export(dt, tmp_path / "z", to="zlab-dflash")


def test_rank_from_the_weights_and_misfiled_codes_named_in_one_line(tmp_path):
    ref, config, _, _ = _reference()
    bare = {k: v for k, v in config["dspine_config"].items() if k not in ("transfer_rank", "message_size")}
    dt = convert(_specforge_folder(tmp_path / "bare", ref, {**config, "dspine_config": bare}), tmp_path / "bare.dt")
    head = json.loads((dt / "config.json").read_text())["head"]
    assert (head["transfer_rank"], head["message_size"]) == (8, 6)  # the weights', not SpecForge's 1024 / 512
    codes = ref["state.transfer_codes"]
    cases = (({"transfer_codes": codes}, "with transfer_codes but no transfer_ready: Tencent's reference keeps its "
                                         "codes in transfer.safetensors under the key 'codes'"),
             ({"codes": codes.round().to(torch.int32)}, "transfer_codes are int32, but DSpine's token codes are real"))
    for i, (codes_file, why) in enumerate(cases):
        tc = _tencent_folder(tmp_path / f"tc{i}", ref, config)
        save_file(codes_file, str(tc / "transfer.safetensors"))
        with pytest.raises(CheckpointError, match=why):
            convert(tc, tmp_path / f"tc{i}.out")
    with pytest.raises(CheckpointError, match="is_causal is False, but a DSpine drafter attends causally"):
        convert(_specforge_folder(tmp_path / "bi", ref, {**config, "is_causal": False}), tmp_path / "bi.dt")


# ------------------------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("builder,budget,params", [
    ("chain", None, {}),
    ("pruned", 12, {"k": 16, "width": 4}),
    ("fixed", 16, {"k": 6}),
    ("ddtree", 12, {}),
    ("pctree", 12, {"k": 6, "children": 3}),
    ("heap-sequential", 10, {"k": 6}),
])
def test_every_builder_over_dspine_equals_target_greedy(target, prompts, builder, budget, params):
    drafter, head = _pair(target)
    for p in prompts[:4]:
        want = autoregressive_generate(target, p, max_new_tokens=24, stop_ids=[STOP]).tokens
        got = speculative_generate(target, drafter, head, p, DecodeSettings(builder=builder, max_new_tokens=24,
                                                                            stop_ids=[STOP], budget=budget,
                                                                            builder_params=params))
        assert got.tokens == want and sum(got.stats.accept_lengths) + 1 == len(want)


def test_the_chain_follows_the_transition_scores(target):
    from dartree.decode.builders.chain import build_chain
    from dartree.decode.draft import draft_block

    drafter, head = _pair(target)
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    feats = target.forward(torch.tensor([[5, 9, 13, 2, 40]])).features[0]
    drafted = draft_block(target, drafter, 40, 4, feats[:4], DraftCache(2))
    hook = drafter.layer_hook(torch.tensor([[[40] + [0] * 7]]))
    with torch.no_grad():  # the block's hidden is the last layer's pre-injection state the hook records
        drafter(target.embed(torch.tensor([[40] + [0] * 7])), torch.arange(4, 12)[None], feats[None, :4],
                torch.arange(4)[None], hook=hook)
    torch.testing.assert_close(drafted.hidden, hook.head_hidden[0, 1:])
    g = torch.Generator().manual_seed(1)
    block = DraftBlock(hidden=torch.randn(7, 32, generator=g) * 3, base_logits=torch.randn(7, VOCAB, generator=g) * 3)
    tree = build_chain(block, head, 40, 7, k=6)
    ids, _ = block_candidates(block, 6, backend="torch")
    with torch.no_grad():
        scores = head.transition_scores(block.hidden, ids, torch.tensor(40))  # [P, K, K]
    row = 0
    for d in range(7):  # the argmax in the row of the chosen predecessor, as SpecForge's select_cached
        col = int(scores[d, row].argmax())
        assert int(tree.tokens[d]) == int(ids[d, col])
        row = col
    assert not torch.equal(tree.tokens, ids[:, 0])  # the scores, not the base logits, chose this chain


def test_sampled_dspine_chains_give_target_samples(target):
    # T > 0: q from the transition scores, standard speculative sampling against a Markov toy target: the first
    # committed token follows the target's own distribution (chi-square, p > 1e-3), and the draft's q is DSpine's
    drafter, head = _pair(target)
    g = torch.Generator().manual_seed(2)
    v, temp, n, root = 6, 0.8, 20000, 3
    z = torch.randn(VOCAB, VOCAB, generator=g) * 0.8
    z[:, v:] = -1e4  # the toy target lives on tokens 0..5
    block = DraftBlock(hidden=torch.randn(3, 32, generator=g), base_logits=torch.randn(3, VOCAB, generator=g))
    block.base_logits[:, v:] = -1e4
    cand, base = block_candidates(block, 3, backend="torch")
    with torch.no_grad():
        toks, q = sample_chain_tokens(head, cand, base, block.hidden, torch.full((n,), root), temp, g)
        want = torch.softmax(head.score(cand[0][None], block.hidden[0][None], head.init_state(torch.tensor([root])),
                                        base[0][None]) / temp, -1)[0]
    torch.testing.assert_close(q[0, 0], want)
    path = torch.cat([torch.full((n, 1), root), toks], dim=1)
    acc, bonus = rejection_accept(torch.softmax(z[path] / temp, -1), cand, q, toks, g)
    first = torch.where(acc > 0, toks[:, 0], bonus)
    counts = torch.bincount(first, minlength=VOCAB)[:v].float()
    p = torch.softmax(z[root] / temp, -1)[:v]
    assert 0.05 < float((acc > 0).float().mean()) < 0.95
    assert float(((counts - p * n) ** 2 / (p * n)).sum()) < 20.515  # chi-square, 5 degrees of freedom, p = 1e-3
    runs = [speculative_generate(target, drafter, head, [5, 9, 13], DecodeSettings(builder="chain", max_new_tokens=16,
                                                                                   temperature=1.0,
                                                                                   acceptance="rejection"),
                                 generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) > 0


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow  # trains end to end
def test_dspine_trains_saves_converts_and_decodes_losslessly(tmp_path, monkeypatch, prompts):
    from dartree.models.target import load_target
    from dartree.training.trainer import run

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    summary = run(load_recipe([*DSPINE, f"output_dir={tmp_path / 'run'}"]))
    assert len(summary["losses"]) == 3 and all(math.isfinite(x) and x > 0 for x in summary["losses"])
    dt = convert(tmp_path / "run" / "checkpoint", tmp_path / "dt")
    target = load_target("tiny-qwen3")
    dm = load_dartree(dt, target=target)
    assert bool(dm.head.transfer_ready) and dm.config["drafter"]["causal_block"] is True
    assert float(dm.head.injection.writes[0].weight.detach().abs().sum()) > 0  # trained away from zero
    target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    for builder in ("pruned", "chain"):
        for p in prompts[:2]:
            want = autoregressive_generate(target, p, max_new_tokens=16, stop_ids=[1]).tokens
            got = speculative_generate(target, dm.drafter, dm.head, p, DecodeSettings(builder=builder, budget=8,
                                                                                      max_new_tokens=16, stop_ids=[1]))
            assert got.tokens == want

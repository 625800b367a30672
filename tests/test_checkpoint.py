"""Checkpoints: training save -> convert -> strict load gives identical logits; bad input is named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_drafter, make_markov, write_legacy_training_checkpoint
from dartree.convert.importer import convert
from dartree.decode.generate import draft_block
from dartree.models.checkpoint import CheckpointError, load_dartree
from dartree.models.drafter import DraftCache
from dartree.models.target import tiny_target
from dartree.training.build import TRAINING_FILE, save_training_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def train_ckpt(tmp_path, target):
    """A checkpoint of the older training layout (``dartree-train``), the converter's own source format."""
    drafter, head = make_drafter(), make_markov()
    write_legacy_training_checkpoint(tmp_path / "ckpt", drafter, head, target, "unit", {"step": 3, "final_loss": 1.5})
    return tmp_path / "ckpt", drafter, head


def test_training_writes_a_dartree_checkpoint_that_loads_as_it_is(tmp_path, target):
    # training/train.py's checkpoint is the dartree format (fp32) with the run's recipe and summary beside it: it
    # loads without conversion and drafts the same logits; converting it ships bf16 by default
    drafter, head = make_drafter(), make_markov()
    recipe = {"recipe": "unit", "train": {"lr": 0.001}}
    save_training_checkpoint(tmp_path / "ckpt", drafter, head, target, recipe,
                             {"steps": 3, "final_loss": 1.5, "losses": [2.0, 1.7, 1.5]})
    dm = load_dartree(tmp_path / "ckpt", target=target)
    prov = dm.config["provenance"]
    assert prov == {"source_format": "dartree-train", "recipe": "unit", "steps": 3, "final_loss": 1.5}
    assert torch.equal(_block(target, drafter).base_logits, _block(target, dm.drafter).base_logits)
    st = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert {t.dtype for t in st.values()} == {torch.float32} and "backbone.fc.weight" in st
    training = json.loads((tmp_path / "ckpt" / TRAINING_FILE).read_text())
    assert training == {"recipe": {"recipe": "unit", "train": {"lr": 0.001}},
                        "state": {"steps": 3, "final_loss": 1.5, "losses": [2.0, 1.7, 1.5]}}
    out = convert(tmp_path / "ckpt", tmp_path / "dt")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert load_dartree(out).config["provenance"]["steps"] == 3


def _block(target, drafter, head_unused=None):
    prompt = [4, 9, 16, 25, 36, 49]
    feats = target.forward(torch.tensor([prompt])).features[0]
    return draft_block(target, drafter, 3, len(prompt), feats, DraftCache(len(drafter.layers)))


def test_save_convert_load_gives_identical_logits(tmp_path, target, train_ckpt):
    src, drafter, head = train_ckpt
    out = convert(src, tmp_path / "dt", dtype=torch.float32)
    dm = load_dartree(out, target=target)
    assert dm.config["head"]["type"] == "markov" and dm.config["provenance"]["steps"] == 3
    a, b = _block(target, drafter), _block(target, dm.drafter)
    assert torch.equal(a.base_logits, b.base_logits)
    cand = torch.arange(10)[None]
    r0, r1 = head.init_state(torch.tensor([5])), dm.head.init_state(torch.tensor([5]))
    assert torch.equal(head.score(cand, None, r0, torch.zeros(1, 10)), dm.head.score(cand, None, r1, torch.zeros(1, 10)))
    # the default bf16 conversion stores bf16-rounded tensors
    out16 = convert(src, tmp_path / "dt16")
    st = load_file(str(out16 / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in st.values())
    assert torch.equal(st["backbone.fc.weight"].float(), drafter.fc.weight.detach().bfloat16().float())


def _rewrite(src: Path, edit):
    t = load_file(str(src / "model.safetensors"))
    edit(t)
    save_file(t, str(src / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, train_ckpt):
    src = train_ckpt[0]
    _rewrite(src, lambda t: t.pop("drafter.layers.0.q_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'drafter\.layers\.0\.q_proj\.weight'"):
        convert(src, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()
    _rewrite(src, lambda t: t.update({"drafter.layers.0.q_proj.weight": torch.zeros(32, 32), "junk.x": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'junk\.x'"):
        convert(src, tmp_path / "o2")
    _rewrite(src, lambda t: (t.pop("junk.x"), t.update({"head.w1.weight": torch.zeros(96, 3)})))
    with pytest.raises(CheckpointError, match=r"'head\.w1\.weight' has shape \[96, 3\], expected \[96, 8\]"):
        convert(src, tmp_path / "o3")
    assert not any(p.name.startswith(".o3") for p in tmp_path.iterdir())


def test_truncated_file_unknown_format_and_target_mismatch(tmp_path, target, train_ckpt):
    src = train_ckpt[0]
    good = convert(src, tmp_path / "good")
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_dartree(good)
    cfg = json.loads((src / "config.json").read_text())
    cfg["format"] = "mystery"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown checkpoint layout"):
        convert(src, tmp_path / "o")
    cfg["format"] = "dartree-train"
    (src / "config.json").write_text(json.dumps(cfg))
    ok = convert(src, tmp_path / "ok")
    other = tiny_target(vocab_size=64, layer_ids=[1, 2])
    with pytest.raises(CheckpointError, match="vocab_size: checkpoint 96 vs target 64"):
        load_dartree(ok, target=other)


@pytest.mark.slow
def test_convert_cli_one_line_error_and_success(tmp_path, train_ckpt):
    src = train_ckpt[0]
    r = subprocess.run([sys.executable, "convert/to_dartree.py", str(src), "--out", str(tmp_path / "cli")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "detected format: dartree-train" in r.stdout and (tmp_path / "cli" / "config.json").exists()
    r = subprocess.run([sys.executable, "convert/to_dartree.py", str(tmp_path / "nothing")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "convert/to_dartree.py", str(tmp_path / "empty")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "config.json" in r.stderr


def test_convert_refuses_to_overwrite_a_foreign_folder(tmp_path, train_ckpt):
    src = train_ckpt[0]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        convert(src, precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    out = convert(src, tmp_path / "dt")
    convert(src, out)  # re-converting over an earlier dartree checkpoint is fine
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by others under the default umask


def test_load_with_target_binds_the_gru_heads_embeddings(tmp_path, target):
    from dartree.models.families.domino import GRUHead

    torch.manual_seed(0)
    head = GRUHead(96, 32, emb_dim=4, gru_hidden_dim=3)
    torch.nn.init.normal_(head.fc2.weight)
    save_training_checkpoint(tmp_path / "ckpt", make_drafter(), head, target, {"recipe": "unit"}, {"step": 1})
    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="bind_embeddings"):
        load_dartree(out).head.init_state(torch.tensor([5]))
    head.bind_embeddings(target.embed_tokens.weight)
    got = load_dartree(out, target=target).head.init_state(torch.tensor([5]))
    assert torch.equal(got, head.init_state(torch.tensor([5])))


@pytest.mark.parametrize("key, value, pattern", [
    ("format_version", "1", r"format_version '1' \(str\) is not 1 \(int\)"),
    ("format_version", True, r"format_version True \(bool\) is not 1 \(int\)"),  # == 1 in Python, never a version
    ("format_version", 1.0, r"format_version 1\.0 \(float\) is not 1 \(int\)"),
    ("format_version", 2, r"format_version 2 is not 1 \(write"),  # same type: no type names
    ("format", 7, r"has format 7 \(int\), expected 'dartree' \(str\)"),
])
def test_checkpoint_version_and_format_messages_show_types_where_they_differ(tmp_path, train_ckpt, key, value,
                                                                            pattern):
    ok = convert(train_ckpt[0], tmp_path / "ok")
    cfg = json.loads((ok / "config.json").read_text())
    cfg[key] = value
    (ok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=pattern):
        load_dartree(ok)


def test_target_pairing_and_field_messages_show_types_where_they_differ(tmp_path, target, train_ckpt):
    from dartree.models.validate import check_pairing

    ok = convert(train_ckpt[0], tmp_path / "ok")
    cfg = json.loads((ok / "config.json").read_text())
    cfg["target"]["vocab_size"] = "96"  # equal digits, another type: was "checkpoint 96 vs target 96"
    (ok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"vocab_size: checkpoint '96' \(str\) vs target 96 \(int\)"):
        load_dartree(ok, target=target)
    cfg["target"]["vocab_size"], cfg["drafter"]["block_size"] = 96, "8"
    (ok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"drafter\.block_size='8' \(str\) has the wrong type"):
        load_dartree(ok, target=target)
    cfg["drafter"]["block_size"], cfg["drafter"]["qk_norm"] = 8, "false"
    (ok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"drafter\.qk_norm='false' \(str\) has the wrong type"):
        load_dartree(ok, target=target)
    cfg["drafter"]["qk_norm"], cfg["drafter"]["target_layer_ids"] = False, [1, "2"]
    (ok / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"target_layer_ids=\[1, '2'\] holds '2' \(str\)"):
        load_dartree(ok, target=target)
    drafter = make_drafter()
    drafter.cfg.hidden_size = 32.0  # a float that equals the target's width is still the wrong type
    with pytest.raises(ValueError, match=r"drafter hidden_size 32\.0 \(float\) != target hidden_size 32 \(int\)"):
        check_pairing(target, drafter)


def test_choice_fields_show_types_where_they_differ():
    from dartree.base.fields import Choice

    rule = Choice((0, 1, 2))
    assert rule.problem("k", 1) is None and rule.problem("k", "1") == "k='1' (str) is not allowed: use one of [0, 1, 2] (int)"
    assert rule.problem("k", 5) == "k=5 is not allowed: use one of [0, 1, 2]"


def test_a_training_run_folder_is_refused_with_its_checkpoint_path(tmp_path):
    # `--checkpoint runs/NAME` instead of runs/NAME/checkpoint: the error names the checkpoint inside, not a conversion
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "run" / "checkpoint" / name).write_text("{}")
    with pytest.raises(CheckpointError, match=r"training run's folder.*run/checkpoint \(give that path\)"):
        load_dartree(tmp_path / "run")
    with pytest.raises(CheckpointError, match="convert a published checkpoint"):
        load_dartree(tmp_path / "run" / "missing")

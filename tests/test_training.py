"""Training: the tiny recipe through the real entry point, reproducibility, recipe errors, block masking."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_drafter
from dartree.decode.generate import draft_block
from dartree.models.drafter import DraftCache
from dartree.training.losses import block_attention_mask, dspark_loss
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.train import run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out1, out2 = tmp_path_factory.mktemp("run1"), tmp_path_factory.mktemp("run2")
    env = {"DARTREE_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, "training/train.py", "recipe=tiny_dspark", f"output_dir={out1}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s1 = json.loads((out1 / "summary.json").read_text())
    mp = pytest.MonkeyPatch()
    mp.setenv("DARTREE_CACHE", str(cache))
    try:
        s2 = run(load_recipe(["recipe=tiny_dspark", f"output_dir={out2}"]))
    finally:
        mp.undo()
    return s1, s2, out1, r.stdout + r.stderr


def test_tiny_recipe_losses_finite_and_reproducible(tiny_runs):
    s1, s2, out1, log = tiny_runs
    assert s1["steps"] == 3 and len(s1["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(s1["losses"])))
    assert all(l > 0 for l in s1["losses"])
    torch.testing.assert_close(torch.tensor(s1["losses"]), torch.tensor(s2["losses"]), rtol=1e-4, atol=0)
    assert (out1 / "checkpoint" / "config.json").exists() and (out1 / "checkpoint" / "model.safetensors").exists()
    assert "peak memory" in log and "wall time" in log


def test_recipe_typo_lists_valid_keys():
    with pytest.raises(RecipeError, match="epochs"):
        load_recipe(["recipe=tiny_dspark", "train.epoch=2"])
    with pytest.raises(RecipeError, match="tiny_dspark"):
        load_recipe(["recipe=nope"])
    with pytest.raises(RecipeError, match="recipe=NAME"):
        load_recipe([])
    with pytest.raises(RecipeError, match="head.type 'nope' is unknown"):
        load_recipe(["recipe=tiny_dspark", "head.type=nope"])
    with pytest.raises(RecipeError, match="train.lr"):
        load_recipe(["recipe=tiny_dspark", "train.lr=abc"])
    cfg = load_recipe(["recipe=dspark_b16", "train.lr=1e-3"])
    assert cfg.train.lr == 1e-3 and cfg.drafter.block_size == 16 and cfg.head.type == "markov"


def test_recipe_files_open_with_their_command():
    for path in (REPO / "recipes").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# python training/train.py recipe=" + path.stem), path


def test_block_mask_context_strictly_before_anchor_and_blocks_isolated():
    m = block_attention_mask(torch.tensor([2, 4]), ctx_len=6, block_size=3)[0, 0] == 0
    assert m.shape == (6, 12)
    assert m[:3, :6].tolist() == [[1, 1, 0, 0, 0, 0]] * 3
    assert m[3:, :6].tolist() == [[1, 1, 1, 1, 0, 0]] * 3
    assert m[:3, 6:].tolist() == [[1, 1, 1, 0, 0, 0]] * 3
    assert m[3:, 6:].tolist() == [[0, 0, 0, 1, 1, 1]] * 3


def test_training_block_equals_inference_block_and_sees_no_future(target):
    """The teacher-forced block (training mask) equals draft_block at inference, and changing the context at or
    after the anchor or another block's tokens does not change it (TESTING.md F: no peeking)."""
    drafter = make_drafter(block_size=8)
    seq = torch.randint(2, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    feats = target.forward(seq).features
    anchors = torch.tensor([11, 20])
    L = 8
    block = torch.zeros((2, L), dtype=torch.long)
    block[:, 0] = seq[0, anchors]
    x = target.embed_tokens(block.reshape(1, -1))
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    mask = block_attention_mask(anchors, 30, L)
    with torch.no_grad():
        h = drafter(x, q_pos, feats, torch.arange(30)[None], mask=mask).view(2, L, -1)
        for n, a in enumerate(anchors.tolist()):
            dc = DraftCache(1)
            inf = draft_block(target, drafter, int(seq[0, a]), a, feats[0, :a], dc)
            torch.testing.assert_close(h[n], inf.hidden, atol=1e-5, rtol=1e-5)
        f2 = feats.clone()
        f2[:, 11:] = torch.randn_like(f2[:, 11:])
        x2 = x.clone().view(2, L, -1)
        x2[1] = torch.randn_like(x2[1])
        h2 = drafter(x2.view(1, 2 * L, -1), q_pos, f2, torch.arange(30)[None], mask=mask).view(2, L, -1)
    torch.testing.assert_close(h2[0], h[0])
    assert not torch.allclose(h2[1], h[1])


def test_dspark_loss_weights_and_zero_at_match():
    v = 10
    labels = torch.tensor([[3, 4, 5]])
    valid = torch.tensor([[True, True, False]])
    logits = torch.full((1, 3, v), -30.0)
    logits[0, torch.arange(3), labels[0]] = 30.0
    out = dspark_loss(logits, labels, valid, logits.clone(), gamma=7.0, ce_weight=0.1, l1_weight=0.9)
    assert float(out.loss) < 1e-6 and out.acc_per_pos.tolist() == [1.0, 1.0, 0.0]
    wrong = torch.roll(logits, 1, dims=-1)
    out2 = dspark_loss(wrong, labels, valid, logits, gamma=7.0, ce_weight=0.1, l1_weight=0.9)
    assert float(out2.l1) == pytest.approx(2.0, abs=1e-4)  # disjoint point masses: L1 distance 2
    assert float(out2.ce) == pytest.approx(60.0, rel=1e-4)


def test_dspark_loss_decay_weights_positions():
    # CE 0 at position 0 and ~ln(V) at position 1: the weighted mean is w1*ln(V) / (w0 + w1), w_k = exp(-k/gamma)
    v, gamma = 8, 2.0
    labels = torch.tensor([[3, 4]])
    logits = torch.zeros((1, 2, v))
    logits[0, 0, 3] = 50.0
    out = dspark_loss(logits, labels, torch.ones(1, 2, dtype=torch.bool), None, gamma=gamma, ce_weight=1.0, l1_weight=0.0)
    w1 = torch.exp(torch.tensor(-1 / gamma))
    assert float(out.loss) == pytest.approx(float(w1 * torch.log(torch.tensor(8.0)) / (1 + w1)), rel=1e-4)

"""Training on CUDA (``train.device=cuda``): the trainer's device path end to end. Every test is skipped where torch
sees no CUDA device; on a machine with a GPU, ``python -m pytest tests/test_training_cuda.py`` runs them. The CPU
side of the same code is tested in tests/test_training.py (a step on the ``meta`` device builds every tensor there
and never reads one back; fixed-seed CPU runs reproduce their stored losses)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_training import STORED_RUNS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")

REPO = Path(__file__).resolve().parents[1]


def _env(cache: Path) -> dict:
    return {**os.environ, "DARTREE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


@pytest.mark.parametrize("recipe", ["tiny_dspark", "tiny_domino"])
def test_a_tiny_recipe_trains_on_cuda_with_a_finite_falling_loss(recipe, tmp_path, monkeypatch):
    """One process, no launcher, the plain-torch engine: the target, drafter and head on the GPU (the gru head's
    bound embedding is the target's CUDA matrix), bf16 autocast from ``train.bf16=auto`` on the GPU, 40 steps whose
    loss is finite and falls."""
    from dartree.training.engine import process_group_scope
    from dartree.training.recipe import load_recipe
    from dartree.training.settings import run_settings
    from dartree.training.trainer import Trainer

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    cfg = load_recipe([f"recipe={recipe}", "train.device=cuda", "train.engine=torch", "train.bf16=auto",
                       "train.max_steps=40", f"output_dir={tmp_path / 'run'}"])
    assert cfg.train.bf16 is torch.cuda.is_bf16_supported()
    with process_group_scope():
        trainer = Trainer(run_settings(cfg))
        assert trainer.device.type == "cuda" and trainer.target.device.type == "cuda"
        params = [*trainer.drafter.parameters(), *trainer.head.parameters(), *trainer.drafter.buffers()]
        assert params and all(p.device.type == "cuda" for p in params)
        if recipe == "tiny_domino":
            emb = trainer.head.__dict__["_embed"]
            assert emb.device.type == "cuda" and emb.data_ptr() == trainer.target.embed_tokens.weight.data_ptr()
        trainer.fit()
        s = trainer.finish()
    losses = s["losses"]
    assert len(losses) == 40 and all(math.isfinite(x) and x > 0 for x in losses)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first - 0.05, (first, last)
    assert s["predictions"] > 0 and (tmp_path / "run" / "checkpoint" / "model.safetensors").exists()


def test_deepspeed_on_one_gpu_without_a_launcher_gives_the_cpu_losses_in_fp32(tmp_path):
    """``python training/train.py ... train.device=cuda`` (DeepSpeed, the ``cpu:gloo,cuda:nccl`` group of one process,
    fp32): the logged losses of the fixed-seed tiny run equal the stored CPU ones (rtol 1e-3: another summation
    order over 4 optimiser steps)."""
    args, losses, _ = STORED_RUNS["dspark"]
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "training/train.py", *args, "train.device=cuda", "train.max_steps=4",
                        f"output_dir={out}"], cwd=REPO, env=_env(tmp_path / "cache"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["processes"] == 1 and "device: cuda" in r.stdout
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(losses), rtol=1e-3, atol=0)


def test_online_features_stay_on_the_gpu_and_a_step_never_waits_for_it(tmp_path, monkeypatch):
    """Campaign data (features computed online by the target): features, final states and log-sum-exp stay on
    the GPU; a step with cached features (forward, fused loss with a draft vocabulary, backward) runs under
    ``torch.cuda.set_sync_debug_mode("error")``, so any read back to the host raises; and its loss and gradients
    equal the CPU step's in fp32."""
    from dartree.training.build import build_models, load_recipe_target
    from dartree.training.settings import model_settings, parse_recipe_dtype, step_settings
    from dartree.training.campaign_data import CampaignData
    from dartree.training.recipe import load_recipe
    from dartree.training.step import sequence_loss

    cfg = load_recipe(["recipe=tiny_dspark", "drafter.draft_vocab_size=40", "train.device=cuda"])
    torch.manual_seed(0)
    target = load_recipe_target(cfg.target.path, parse_recipe_dtype(cfg.target.dtype, "target.dtype"))
    drafter, head = build_models(model_settings(cfg), target)
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": torch.randint(2, target.vocab_size, (6,), generator=g).tolist(),
             "response_ids": torch.randint(2, target.vocab_size, (n,), generator=g).tolist(), "loss_mask": [1] * n}
            for n in (20, 26)]

    def step(data):
        out = sequence_loss(drafter, head, target, data, 0, step_settings(cfg), torch.Generator().manual_seed(3))
        out.loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in drafter.named_parameters() if p.grad is not None}
        drafter.zero_grad(set_to_none=True), head.zero_grad(set_to_none=True)
        return out, grads

    cpu_out, cpu_grads = step(CampaignData(target, rows[:1], rows[1:]))
    dev = torch.device("cuda", 0)
    target.model.to(dev), drafter.to(dev), head.to(dev)
    data = CampaignData(target, rows[:1], rows[1:])
    data.need_lse = True
    _, feats, final, _ = data.sequence(0)
    assert feats.device == final.device == data.lse_of(0).device == dev
    step(data)  # the first visit computes the features (the target's own forward) and the output rows
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sequence_loss(drafter, head, target, data, 0, step_settings(cfg), torch.Generator().manual_seed(3))
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.loss.device == dev and out.acc_per_pos.device == dev
    drafter.zero_grad(set_to_none=True), head.zero_grad(set_to_none=True)
    cuda_out, cuda_grads = step(data)
    torch.testing.assert_close(cuda_out.loss.cpu(), cpu_out.loss, rtol=1e-4, atol=1e-6)
    assert cuda_grads.keys() == cpu_grads.keys() and cuda_grads
    for k in cpu_grads:
        torch.testing.assert_close(cuda_grads[k], cpu_grads[k], rtol=1e-3, atol=1e-5)

"""Shared fixtures: tiny random Qwen3 targets and drafters built in code (no files, no downloads)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# One torch thread per test process: the models here are tiny, and two OpenMP threads per process spin against
# each other (and against the 2-process training tests) on a 2-core machine: a tiny speculative_generate took
# 21 s with 2 threads under load and 0.6 s with 1 (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from dartree.models.drafter import DFlashDrafter, DrafterConfig
from dartree.models.families import build_head
from dartree.models.families.dspark import MarkovHead
from dartree.models.heads import IdentityHead
from dartree.models.target import tiny_target

VOCAB = 96
LAYERS = [1, 2]


@pytest.fixture(scope="session")
def target():
    """Tiny random Qwen3 target (fp32, sdpa) capturing layers 1 and 2; stop id 1, MASK id 0."""
    return tiny_target(vocab_size=VOCAB, layer_ids=LAYERS)


def make_drafter(block_size: int = 8, seed: int = 0, proposal_offset: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        target_layer_ids=list(LAYERS), mask_token_id=0, block_size=block_size, proposal_offset=proposal_offset,
    )
    return DFlashDrafter(cfg).eval()


def make_markov(seed: int = 0, scale: float = 0.5) -> MarkovHead:
    torch.manual_seed(seed)
    head = MarkovHead(VOCAB, 8)
    torch.nn.init.normal_(head.w2.weight, std=scale)
    return head.eval()


@pytest.fixture
def drafter():
    return make_drafter()


def make_head(name: str, target=None, seed: int = 0, scale: float = 0.5):
    """A head of every registered type on the tiny shapes, with non-zero output rows so the correction acts;
    the gru head is bound to ``target``'s embeddings."""
    if name == "identity":
        return IdentityHead()
    if name == "markov":
        return make_markov(seed, scale)
    torch.manual_seed(seed)
    params = {"vocab_size": VOCAB, "hidden_size": 32}
    if name == "gru":
        params.update(emb_dim=8, gru_hidden_dim=16, prefix_len=1)
    elif name == "selector":
        params.update(rank=8, top_k=6)
    else:
        params["rank"] = 8
    head = build_head(name, **params)
    out = head.fc2 if name == "gru" else head.w2
    torch.nn.init.normal_(out.weight, std=scale)
    if name == "selector":  # all three factors of the selector's bilinear term, so its correction acts
        for w in (head.w1.weight, head.proj.weight):
            torch.nn.init.normal_(w, std=scale * 2)
    if name == "gru":
        head.bind_embeddings(target.embed_tokens.weight)
    return head.eval()


@pytest.fixture(params=["identity", "markov", "gated_markov", "rnn", "gru", "selector"])
def head(request, target):
    """Every head type behind g(C, H, r)."""
    return make_head(request.param, target)


@pytest.fixture
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB, (4 + i,), generator=g).tolist() for i in range(12)]


def write_legacy_training_checkpoint(folder, drafter, head, target, recipe: str, state: dict):
    """A checkpoint in the older training layout (format ``dartree-train``: ``drafter.*`` / ``head.*`` fp32 tensors,
    recipe and state inside config.json), which load_init and convert/to_dartree.py still read."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True)
    tensors = {f"drafter.{k}": v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in drafter.state_dict().items()}
    tensors.update({f"head.{k}": v.detach().float().contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"format": "dartree-train", "drafter": drafter.cfg.to_dict(), "head": {"type": head.type_name,
              **head.hparams()}, "target": target.identity(), "recipe": {"recipe": recipe}, "state": state}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder

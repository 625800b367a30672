"""A bounded on-disk store of a target's features per sequence, for repeated epochs over campaign data.

Campaign training recomputes the target's features online, one target forward per sequence visit
(:mod:`dartree.training.campaign_data`): right for a campaign that sees each sequence about once, wasteful once
epochs repeat. With ``data.feature_store_gb`` > 0 a visit whose sequence was computed before (in this run or an
earlier one on this machine) reads the features from the user cache instead: ``<cache>/feature-store/<target
key>/<sequence key>.pt``, never under the repository. The target key hashes what decides the features (the
target's name, dtype, captured layer ids, shapes and a checksum of its embedding and output weights); the sequence
key hashes its token ids. Each file holds ``feats`` [T, nL*D] bf16, ``final`` [T, D] bf16 (exactly the tensors an
online forward gives, so training reads the same numbers) and, once a loss needed it, ``lse`` [T] fp32. About
6.9 KB per token at 5 x 576 features: 13 GB for the 1.85M tokens of 27 campaign shards. The store stays under its
bound by removing the least recently used files (reads refresh a file's time).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

FORMAT = 1  # bump when what a file holds changes: older folders are then never read


def target_key(target) -> str:
    """A 16-hex-digit key of what decides ``target``'s captured features: name, dtype, layer ids
    (``target.layer_ids``, set before), vocabulary and hidden sizes, and float64 checksums of its embedding and
    ``lm_head`` weights (another checkpoint under the same name gets another key)."""
    emb, head = target.embed_tokens.weight, target.lm_head.weight
    ident = {"name": target.name, "dtype": str(target.dtype), "layers": list(target.layer_ids),
             "vocab": int(head.shape[0]), "hidden": int(head.shape[1]),
             "emb": float(emb.detach().double().sum()), "head": float(head.detach().double().sum()),
             "format": FORMAT}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def sequence_key(tokens: torch.Tensor) -> str:
    """sha256 (hex, 32 digits) of a sequence's token ids ([T] int64)."""
    return hashlib.sha256(tokens.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:32]


class FeatureStore:
    """Target features per sequence on disk, bounded in size.

    Args:
        root: the store's folder (``<cache>/feature-store``); the target's files go to ``root/<target_key>``.
        target: the :class:`~dartree.models.target.Target` whose features are stored (its layer ids set).
        max_bytes: the bound on the target folder's size; the least recently used files go first.
    Raises:
        ValueError: ``max_bytes`` <= 0.
    """

    def __init__(self, root: Path, target, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"the feature store needs a positive size bound, got {max_bytes} bytes")
        self.folder = Path(root) / target_key(target)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.bytes = sum(e.stat().st_size for e in os.scandir(self.folder) if e.name.endswith(".pt"))
        self.hits = self.misses = 0
        self.read_s = 0.0  # seconds spent reading files (the cost a hit pays instead of a forward)

    def path(self, tokens: torch.Tensor) -> Path:
        """The file of the sequence ``tokens``."""
        return self.folder / f"{sequence_key(tokens)}.pt"

    def get(self, tokens: torch.Tensor, device, need_lse: bool):
        """(feats, final, lse) of ``tokens`` on ``device`` from the store, or None when absent, unreadable, or
        without the lse ``need_lse`` asks for. A hit refreshes the file's time (least recently used goes first)."""
        import time

        path = self.path(tokens)
        t0 = time.time()
        try:
            d = torch.load(path, map_location=device, weights_only=True)
        except (FileNotFoundError, RuntimeError, EOFError, OSError, ValueError):
            self.misses += 1
            return None
        if d.get("feats") is None or d.get("final") is None or (need_lse and d.get("lse") is None) \
                or d["feats"].shape[0] != tokens.numel():
            self.misses += 1
            return None
        try:
            os.utime(path)
        except OSError:  # removed meanwhile by another process's eviction: the tensors are read already
            pass
        self.hits += 1
        self.read_s += time.time() - t0
        return d["feats"], d["final"], d.get("lse")

    def put(self, tokens: torch.Tensor, feats: torch.Tensor, final: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Store one sequence's tensors (on the CPU, written atomically), then evict down to the bound."""
        path = self.path(tokens)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        old = path.stat().st_size if path.exists() else 0
        torch.save({"feats": feats.detach().cpu(), "final": final.detach().cpu(),
                    "lse": None if lse is None else lse.detach().cpu()}, tmp)
        os.replace(tmp, path)
        self.bytes += path.stat().st_size - old
        if self.bytes > self.max_bytes:
            self.evict()

    def evict(self) -> None:
        """Remove the least recently used files until the folder is under 90% of the bound."""
        files = []
        for e in os.scandir(self.folder):
            if e.name.endswith(".pt"):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, e.path))
        files.sort()
        total = sum(f[1] for f in files)
        for _, size, p in files:
            if total <= 0.9 * self.max_bytes:
                break
            try:
                os.remove(p)
                total -= size
            except FileNotFoundError:
                pass
        self.bytes = total

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

``torch.load`` does not verify its archive's checksums, so each file is sealed (:func:`dartree.base.integrity.seal`:
the size and sha256 of the saved bytes after them) and checked before it is loaded: a file whose bytes changed,
cut short or of an older format is removed, counted in ``rejected``, named on stderr and recomputed by the online
forward, never used. The check hashes the bytes once more than ``torch.load`` reads them: for the 3.9 MB of a
565-token sequence (5 x 576 features) 3 ms (11 ms on a shared core) against 1 ms for ``torch.load`` alone and 4.3 s
for the fp32 target forward a hit saves (one Xeon core; docs/training.md, "A local feature store").
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import torch

from dartree.base.integrity import IntegrityError, seal, unseal

FORMAT = 2  # bump when what a file holds changes: older folders are then never read (2: sealed files)


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
        self.hits = self.misses = self.rejected = 0  # rejected: files that failed their check (recomputed)

    def path(self, tokens: torch.Tensor) -> Path:
        """The file of the sequence ``tokens``."""
        return self.folder / f"{sequence_key(tokens)}.pt"

    def get(self, tokens: torch.Tensor, device, need_lse: bool):
        """(feats, final, lse) of ``tokens`` on ``device`` from the store, or None when absent, unreadable, failing
        its check (the file is then removed, so the online forward recomputes and stores it again) or without the
        lse ``need_lse`` asks for. A hit refreshes the file's time (least recently used goes first)."""
        path = self.path(tokens)
        try:
            d = torch.load(io.BytesIO(unseal(path.read_bytes())), map_location=device, weights_only=True)
        except FileNotFoundError:
            self.misses += 1
            return None
        except (IntegrityError, RuntimeError, EOFError, OSError, ValueError) as exc:
            self._reject(path, exc)
            return None
        if not isinstance(d, dict) or d.get("feats") is None or d.get("final") is None \
                or d["feats"].shape[0] != tokens.numel():
            self._reject(path, IntegrityError("it does not hold this sequence's feats and final"))
            return None
        if need_lse and d.get("lse") is None:
            self.misses += 1
            return None
        try:
            os.utime(path)
        except OSError:  # removed meanwhile by another process's eviction: the tensors are read already
            pass
        self.hits += 1
        return d["feats"], d["final"], d.get("lse")

    def _reject(self, path: Path, exc: Exception) -> None:
        """Count, name (stderr, one line) and remove a file that failed its check; a miss (recomputed)."""
        self.misses += 1
        self.rejected += 1
        print(f"feature store: {path} failed its check ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
              "); removed, its features are computed again", file=sys.stderr, flush=True)
        try:
            size = path.stat().st_size
            path.unlink()
            self.bytes -= size
        except FileNotFoundError:
            pass

    def put(self, tokens: torch.Tensor, feats: torch.Tensor, final: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Store one sequence's tensors (on the CPU, sealed with their size and sha256, written atomically), then
        evict down to the bound."""
        path = self.path(tokens)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        old = path.stat().st_size if path.exists() else 0
        buf = io.BytesIO()
        torch.save({"feats": feats.detach().cpu(), "final": final.detach().cpu(),
                    "lse": None if lse is None else lse.detach().cpu()}, buf)
        tmp.write_bytes(seal(buf.getvalue()))
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

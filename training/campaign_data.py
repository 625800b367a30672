"""Campaign shards as training data, with the target's features recomputed online (or, with a bounded on-disk
:class:`~dartree.training.feature_store.FeatureStore`, read back on later visits).

:class:`CampaignData` answers the interface training reads from :class:`~dartree.training.data.BlockData`
(``tokens``, ``prompt_len``, ``loss_mask``, ``train_ids``, ``holdout_ids``, ``sequence(i)``, ``lse_of(i)``,
``mask_of(i)``, ``num_tokens``), but instead of reading a feature file that grows with the data (5.8 KB per token
for 5 x 576 bf16 features: 13 GB at 4x the shipped data), ``sequence(i)`` runs one target forward over the
sequence and captures the layer outputs and the final normed hidden state there. The cost is one target prefill
per training sequence visit, shared by the ``train.num_anchors`` blocks drawn from it; the last few sequences stay
in a small cache, and the held-out sequences' features stay (every held-out evaluation revisits all of them).
Features stay on the target's device (the training device), where the step reads them. ``data.feature_store_gb`` > 0
keeps every computed sequence's features in the user cache too (:mod:`dartree.training.feature_store`), so a
repeated epoch, a later run, or the held-out set of the next run reads them instead of running the target.

Dimension letters as in :mod:`dartree.models.target`: T tokens of one sequence, D hidden size, nL captured layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from dartree.models.target import Target
from dartree.training.campaign_store import CampaignError, check_files, read_manifest, read_shard


def campaign_rows(folder: Path, max_shards: int | None = None) -> tuple[list[dict], list[dict]]:
    """Training rows of the first ``max_shards`` committed shards (all by default) and the held-out rows.

    Raises:
        CampaignError: no held-out set or no training shard yet (fix: run ``python training/tools/campaign.py
            stage=data`` first), or a shard file that cannot be read or does not match its manifest entry.
    """
    folder = Path(folder)
    m = read_manifest(folder)
    if not m.get("holdout") or not m.get("shards"):
        raise CampaignError(f"{folder} has no held-out set or no training shard yet; run "
                            "`python training/tools/campaign.py stage=data` first")
    check_files(folder, m, max_shards)
    recs = m["shards"] if max_shards is None else m["shards"][:max_shards]
    out = [read_shard(folder / rec["file"]) for rec in [m["holdout"]] + recs]
    hold = out[0]
    train = [r for rows in out[1:] for r in rows]
    return train, hold


class CampaignData:
    """Campaign sequences (training shards first, the held-out set last) with online target features.

    Args:
        target: the target whose layer ids (``target.set_layer_ids``) the drafter reads.
        train_rows, holdout_rows: rows of :func:`campaign_rows` (prompt_ids, response_ids, loss_mask).
        cache_size: training sequences whose features are kept in memory (least recently used out); the
            held-out sequences' features are kept once computed (about 7 KB per token for 5 x 576 features).
        store: an on-disk :class:`~dartree.training.feature_store.FeatureStore` read before a forward and written
            after one, or None (every visit not in memory runs the target).
    Attributes:
        online: True (the trainer computes the draft vocabulary's log-sum-exp per sequence, not from a file).
    Raises:
        ValueError: a row's ``loss_mask`` does not have one entry per response token.
    """

    online = True

    def __init__(self, target: Target, train_rows: Sequence[dict], holdout_rows: Sequence[dict], cache_size: int = 64,
                 store=None):
        self.target = target
        self.store = store
        rows = list(train_rows) + list(holdout_rows)
        self.prompt_len = [len(r["prompt_ids"]) for r in rows]
        self.tokens = [torch.tensor(list(r["prompt_ids"]) + list(r["response_ids"]), dtype=torch.long) for r in rows]
        self.loss_mask = []
        for k, (r, t, pl) in enumerate(zip(rows, self.tokens, self.prompt_len)):
            if len(r["loss_mask"]) != len(t) - pl:
                raise ValueError(f"campaign row {k}: {len(r['loss_mask'])} loss_mask entries for {len(t) - pl} "
                                 "response tokens")
            m = torch.zeros(len(t), dtype=torch.bool)
            m[pl:] = torch.tensor([bool(x) for x in r["loss_mask"]], dtype=torch.bool)
            self.loss_mask.append(m)
        n, h = len(rows), len(holdout_rows)
        usable = [bool((m[:-1] & m[1:]).any()) for m in self.loss_mask]
        self.train_ids = [i for i in range(n - h) if usable[i]]
        self.holdout_ids = [i for i in range(n - h, n) if usable[i]]
        self.cache_size = cache_size
        self._cache: dict[int, tuple] = {}
        self._lru: list[int] = []  # cached training sequences, least recently used first
        self._holdout = set(self.holdout_ids)
        self.features_path = None
        self.lse = None
        self.need_lse = False  # set by the trainer when a draft vocabulary trains with target distributions
        self.forward_s = 0.0  # seconds spent in target forwards (the online-feature cost; on CUDA the launches only)
        self.forward_tokens = 0

    def __len__(self) -> int:
        return len(self.train_ids)

    def num_tokens(self, ids: Sequence[int] | None = None) -> int:
        """Total tokens of the given sequences (default: training split)."""
        ids = self.train_ids if ids is None else ids
        return sum(len(self.tokens[i]) for i in ids)

    def mask_of(self, i: int) -> torch.Tensor:
        """Loss mask [T] bool of sequence i (True on the target's own tokens)."""
        return self.loss_mask[i]

    @torch.no_grad()
    def _features(self, i: int) -> tuple:
        hit = self._cache.get(i)
        if hit is not None:
            if i in self._lru:
                self._lru.remove(i)
                self._lru.append(i)
            return hit
        import time

        need_lse = getattr(self, "need_lse", False)
        if self.store is not None:
            got = self.store.get(self.tokens[i], self.target.device, need_lse)
            if got is not None:
                return self._keep(i, got)
        t0 = time.time()
        tgt = self.target
        captured = {}
        hook = tgt.model.model.norm.register_forward_hook(lambda m, a, o: captured.__setitem__("final", o))
        try:
            out = tgt.forward(self.tokens[i][None].to(tgt.device, non_blocking=True), logits_slice=slice(0, 0))
        finally:
            hook.remove()
        # on the target's device (the training device): the step reads them there, no round trip through the host
        feats = out.features[0].to(torch.bfloat16)  # [T, nL*D], as the feature file stores them
        final = captured["final"][0].to(torch.bfloat16)  # [T, D]
        lse = None
        if need_lse:
            w = tgt.lm_head.weight
            lse = torch.logsumexp(torch.nn.functional.linear(final.to(w.device, w.dtype), w).float(), dim=-1)
        self.forward_s += time.time() - t0
        self.forward_tokens += int(self.tokens[i].numel())
        hit = (feats, final, lse)
        if self.store is not None:
            self.store.put(self.tokens[i], feats, final, lse)
        return self._keep(i, hit)

    def _keep(self, i: int, hit: tuple) -> tuple:
        """Keep sequence i's (feats, final, lse) in memory (training sequences least recently used out) and return
        them."""
        self._cache[i] = hit
        if i not in self._holdout:  # held-out sequences stay: every curve point revisits all of them
            self._lru.append(i)
            while len(self._lru) > self.cache_size:
                self._cache.pop(self._lru.pop(0), None)
        return hit

    def sequence(self, i: int):
        """(tokens [T] int64 on the CPU, feats [T, nL*D] bf16, final [T, D] bf16, prompt_len) of sequence i: the
        target's captured layer outputs and final normed hidden state, computed by one forward (bf16, as stored
        features), on the target's device."""
        feats, final, _ = self._features(i)
        return self.tokens[i], feats, final, self.prompt_len[i]

    def lse_of(self, i: int) -> torch.Tensor:
        """Target log-sum-exp over the full vocabulary, [T] fp32 on the target's device, of sequence i (from the bf16
        final states, as :func:`~dartree.training.features.target_lse` computes it from the feature file)."""
        self.need_lse = True
        feats, final, lse = self._features(i)
        if lse is None:
            self._cache.pop(i, None)
            if i in self._lru:
                self._lru.remove(i)
            lse = self._features(i)[2]
        return lse

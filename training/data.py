"""Training data as the step reads it: :class:`BlockData` (sequences with cached target features), anchor sampling
(:func:`sample_anchors`) and the draft vocabulary (:func:`select_draft_vocab`).

One pipeline makes every data set, a module per stage, each cached under ``cache_root()/data/<hash>`` and reused
when its inputs are unchanged (:func:`dartree.training.answers.regenerate_responses` runs stages 1-2):

1. conversations (:mod:`dartree.training.dialogues`): the human turns of the whole ShareGPT conversations, up to
   ``data.max_turns`` of each, ``data.num_prompts`` of them drawn by ``data.seed``, rendered by the target's chat
   template into per-turn segments. Single-turn data (``data.max_turns=1``, the shipped recipes) is the case of one
   turn per conversation: its first prompt is the chat-templated first turn;
2. answers (:mod:`dartree.training.answers`): greedy continuations by the target itself, every assistant turn in
   order with its own earlier answers as the history, with continuous batching, shortest first, appended as rows
   finish. Each row carries ``loss_mask``: 1 on the tokens the target generated, 0 on the chat template and the user
   turns; the loss and the anchors use it (:func:`sample_anchors`, :func:`dartree.training.losses.label_mask`), as
   SpecForge trains on assistant tokens only;
3. features (:mod:`dartree.training.features`): one target forward per sequence storing the captured layer outputs
   and the final (normed) hidden state in bf16, from which training recomputes the target distribution p_t.

A fixed held-out set (``data.holdout_set=fixed``): the conversations first in SHA-256 order of their first human
turn (:func:`~dartree.training.dialogues.holdout_rank`), regenerated once into their own cache folder and never
trained on, so held-out curves compare across ``data.num_prompts`` and ``data.seed``.

Dimension letters as in :mod:`dartree.models.target`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from dartree.training.answers import load_responses


class BlockData:
    """Sequences with cached target features, and random anchor sampling for DFlash-style block training.

    The features are read from the file per sequence (memory-mapped, ``safetensors.safe_open``), not loaded
    whole: they take 5.8 KB per token at 5 x 576 bf16 (2.8 GB for 480k tokens), and the page cache is shared by
    the processes of a data-parallel run.

    Args:
        responses: path of ``responses.jsonl``.
        features: path from :func:`~dartree.training.features.compute_features` (must have been computed for the same responses).
        holdout: number of sequences kept out of training (the last ones in index order).
    Attributes:
        loss_mask: per sequence, [T] bool: True on the tokens the target generated (every response token of
            single-turn data; the rows' ``loss_mask`` for multi-turn data), False on the prompt and template.
    Raises:
        ValueError: the feature file does not match the responses (different token count), or a row's
            ``loss_mask`` does not have one entry per response token.
    """

    def __init__(self, responses: Path, features: Path, holdout: int = 0):
        ds = load_responses(responses)
        self.prompt_len = [len(p) for p in ds["prompt_ids"]]
        self.tokens = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
        masks = ds["loss_mask"] if "loss_mask" in ds.column_names else None
        self.loss_mask: list[torch.Tensor] = []
        for i, (t, pl) in enumerate(zip(self.tokens, self.prompt_len)):
            m = torch.zeros(len(t), dtype=torch.bool)
            if masks is None:
                m[pl:] = True
            else:
                if len(masks[i]) != len(t) - pl:
                    raise ValueError(f"{responses}: row {i} has {len(masks[i])} loss_mask entries for "
                                     f"{len(t) - pl} response tokens; delete the folder to rebuild")
                m[pl:] = torch.tensor(masks[i], dtype=torch.bool)
            self.loss_mask.append(m)
        self._features = safe_open(str(features), framework="pt")
        self.features_path = Path(features)
        self.offsets = self._features.get_tensor("offsets")
        self.lse: torch.Tensor | None = None  # [T_all] target log-sum-exp, set when a draft vocabulary trains
        if int(self.offsets[-1]) != sum(len(x) for x in self.tokens):
            raise ValueError(f"feature file {features} does not match {responses}; delete it to rebuild")
        n = len(self.tokens)
        # a sequence trains only if it has an anchor: a supervised position followed by a supervised label
        usable = [bool((m[:-1] & m[1:]).any()) for m in self.loss_mask]
        self.train_ids = [i for i in range(n - holdout) if usable[i]]
        self.holdout_ids = [i for i in range(n - holdout, n) if usable[i]]

    def __len__(self) -> int:
        return len(self.train_ids)

    def num_tokens(self, ids: Sequence[int] | None = None) -> int:
        """Total tokens of the given sequences (default: training split)."""
        ids = self.train_ids if ids is None else ids
        return sum(len(self.tokens[i]) for i in ids)

    def lse_of(self, i: int) -> torch.Tensor:
        """Target log-sum-exp [T] fp32 of sequence i (after ``self.lse`` was set from :func:`~dartree.training.features.target_lse`)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.lse[a:b]

    def sequence(self, i: int):
        """Return (tokens [T] int64, feats [T, nL*D] bf16, final [T, D] bf16, prompt_len) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        feats = self._features.get_slice("feats")[a:b]
        final = self._features.get_slice("final")[a:b]
        return self.tokens[i], feats, final, self.prompt_len[i]

    def mask_of(self, i: int) -> torch.Tensor:
        """Loss mask [T] bool of sequence i (:attr:`loss_mask`)."""
        return self.loss_mask[i]


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Draw sorted anchor positions uniformly without replacement from the supervised region.

    Without ``loss_mask`` an anchor p is valid when it is a response position with a label after it:
    ``prompt_len <= p <= T - 2`` (at inference the first anchor is the first generated token, whose context is
    the prompt). With ``loss_mask`` ([T] bool, True on tokens the target generated) p is valid when p and p + 1
    are supervised (SpecForge ``OnlineDFlashModel._sample_anchor_positions`` in
    ``specforge/algorithms/common/dflash_family_model.py``); for a mask that is True exactly from ``prompt_len``
    on, both rules give the same candidates and the same draw.

    Returns:
        [A] int64, A = min(num_anchors, number of valid positions) (may be 0).
    """
    if loss_mask is None:
        lo, hi = prompt_len, seq_len - 2
        cand = torch.arange(lo, hi + 1) if hi >= lo else torch.zeros(0, dtype=torch.long)
    else:
        m = loss_mask[:seq_len].to(torch.bool)
        cand = (m[:-1] & m[1:]).nonzero()[:, 0]
    if cand.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    k = min(num_anchors, cand.numel())
    pick = torch.randperm(cand.numel(), generator=generator)[:k]
    return cand[pick].sort().values


def select_draft_vocab(data: "BlockData", n: int, vocab_size: int, always: Sequence[int] = ()) -> tuple[torch.Tensor, float]:
    """The N most frequent response tokens of the training split, for a reduced draft vocabulary.

    EAGLE-3's reduced draft vocabulary (arXiv 2503.01840) applied to DFlash drafters (why: docs/performance.md,
    "Draft economics"): the drafter scores only these N tokens with the target's own lm_head rows; verification
    keeps the full vocabulary.
    Ties go to the lower token id; ids in ``always`` (the stop token) are included in any case. Response tokens
    are the supervised ones (``data.loss_mask`` where the data has it: the target's answers, not the user turns
    of multi-turn data), else every token after the prompt.

    Returns:
        (ids [N] int64 ascending, fraction of training response tokens they cover).
    Raises:
        ValueError: n < 1, n > vocab_size, or more ``always`` ids than n.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {n}")
    always = sorted({int(a) for a in always if 0 <= int(a) < vocab_size})
    if len(always) > n:
        raise ValueError(f"draft_vocab_size {n} cannot hold the {len(always)} required ids {always}")
    masks = getattr(data, "loss_mask", None)
    resp = [data.tokens[i][masks[i]] if masks is not None else data.tokens[i][data.prompt_len[i]:]
            for i in data.train_ids]
    counts = torch.bincount(torch.cat(resp), minlength=vocab_size) if resp else torch.zeros(vocab_size, dtype=torch.long)
    order = torch.sort(-counts, stable=True).indices.tolist()
    chosen = list(always)
    keep = set(chosen)
    for t in order:
        if len(chosen) == n:
            break
        if t not in keep:
            chosen.append(t)
            keep.add(t)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = int(counts.sum())
    return ids, (float(counts[ids].sum()) / total if total else 1.0)


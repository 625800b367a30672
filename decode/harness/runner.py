"""The per-prompt step both evaluation programs share (``decode/eval.py`` through
:class:`~dartree.decode.harness.session.EvalSession` and ``decode/bench.py``): decode one prompt with one method, timed
by the loop itself (``stats.decode_s``, prefill excluded), optionally in lockstep with its own AR decode, and check the
tokens against AR's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dartree.decode.budget import CostModel
from dartree.decode.generate import ARStepper, DecodeStats, autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings, check_settings
from dartree.models.drafter import DFlashDrafter
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target


@dataclass
class PromptDecode:
    """One prompt decoded by one method.

    Attributes:
        tokens: generated ids (prompt excluded; ends at the first stop id, inclusive).
        stats: the loop's :class:`~dartree.decode.generate.DecodeStats` (``decode_s`` seconds, prefill excluded).
        paired_ar: with ``paired=True``, the :class:`~dartree.decode.generate.ARStepper` that ran in lockstep (then to
            its end); None otherwise.
        mismatch: with a ``reference``, whether ``tokens`` differ from it; None without one.
        first_divergence: the first index where they differ (``min`` of the lengths when one is a prefix of the
            other); None when they agree or without a reference.
    """

    tokens: list
    stats: DecodeStats
    paired_ar: ARStepper | None = None
    mismatch: bool | None = None
    first_divergence: int | None = field(default=None)


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """Index of the first token where ``tokens`` and ``reference`` differ; the shorter length when one is a prefix
    of the other (equal lists: their length)."""
    for i, (x, y) in enumerate(zip(tokens, reference)):
        if x != y:
            return i
    return min(len(tokens), len(reference))


def against_ar(tokens: Sequence[int], reference: Sequence[int]) -> tuple[bool, int | None]:
    """(whether ``tokens`` differ from AR's ``reference``, the first divergence or None when equal)."""
    differs = list(tokens) != list(reference)
    return differs, (first_divergence(tokens, reference) if differs else None)


def decode_one(target: Target, prompt_ids: Sequence[int], settings: DecodeSettings, *,
               drafter: DFlashDrafter | None = None, head: CorrectionHead | None = None, seed: int | None = None,
               cost_model: CostModel | None = None, paired: bool = False,
               reference: Sequence[int] | None = None) -> PromptDecode:
    """Decode ``prompt_ids`` once with ``settings``, time it (the loop's own ``stats``), and compare with AR.

    Args:
        target: the target; drafter, head: the checkpoint's (needed unless ``settings.builder`` is None).
        prompt_ids: [T] chat-templated ids.
        settings: the decode's :class:`~dartree.decode.settings.DecodeSettings`; ``builder`` None: plain
            autoregressive decoding (:func:`~dartree.decode.generate.autoregressive_generate`, with its
            max_new_tokens, temperature and stop ids), else :func:`~dartree.decode.generate.speculative_generate`.
        seed: the sampler's seed (a CPU ``torch.Generator`` seeded with it; the lockstep AR decode gets its own with
            the same seed); None: no generator (greedy only).
        cost_model: the ``budget="auto"`` policy of this decode (None: the loop's one-off policy).
        paired: also run an :class:`~dartree.decode.generate.ARStepper` in lockstep with a speculative decode
            (``speculative_generate(lockstep=)``), then to its end (``PromptDecode.paired_ar``).
        reference: AR's tokens for this prompt, to fill ``mismatch`` / ``first_divergence``; None: no check.
    Returns:
        :class:`PromptDecode`.
    Raises:
        ValueError / TypeError / KeyError: as :func:`~dartree.decode.generate.speculative_generate` (or
        :func:`~dartree.decode.generate.autoregressive_generate` for AR).
    """
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    pair = None
    s = check_settings(settings)
    if s.builder is None:
        out = autoregressive_generate(target, prompt_ids, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                      stop_ids=s.stop_ids, generator=gen)
    else:
        if paired:
            pair = ARStepper(target, prompt_ids, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                             stop_ids=s.stop_ids,
                             generator=None if seed is None else torch.Generator().manual_seed(seed))
        out = speculative_generate(target, drafter, head, prompt_ids, s, generator=gen, cost_model=cost_model,
                                   lockstep=pair.run_to if pair is not None else None)
        if pair is not None:
            pair.run_to(s.max_new_tokens)
    result = PromptDecode(out.tokens, out.stats, pair)
    if reference is not None:
        result.mismatch, result.first_divergence = against_ar(out.tokens, reference)
    return result

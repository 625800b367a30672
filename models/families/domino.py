"""Domino (arXiv 2605.29707; SpecForge ``DominoDraftModel`` / ``OnlineDominoModel``): the GRU correction head
``gru``, trained by ``(1 - lambda) CE(corrected) + lambda CE(base)`` with a base-anchored linear curriculum for
lambda. Recipe ``loss.type=domino``."""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import GRUHead


def lambda_schedule(step: int, total_steps: int, start: float = 1.0, ratio: float = 1.0) -> float:
    """Domino's base-anchored curriculum (arXiv 2605.29707), as SpecForge 0.2.0's ``linear_lambda_base``:
    lambda = clamp(start * (1 - min(step / max(1, int(total * ratio)), 1)), 0, 1), ``step`` counting optimiser
    steps from 0. The int() rounds the decay horizon down (total 7, ratio 0.5: 0 at step 3); for an integer
    ``ratio * total`` (ratio 1.0) it is step / (ratio * total) exactly.

    Raises:
        ValueError: ratio <= 0 or total_steps < 1.
    """
    if ratio <= 0 or total_steps < 1:
        raise ValueError(f"lambda schedule needs ratio > 0 and total_steps >= 1, got {ratio}, {total_steps}")
    progress = min(step / max(1, int(total_steps * ratio)), 1.0)
    return float(min(1.0, max(0.0, start * (1.0 - progress))))


class DominoFamily(Family):
    """Domino's GRU head (:class:`~dartree.models.heads.GRUHead`) and its curriculum CE."""

    name = "domino"
    heads = (GRUHead,)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``emb_dim`` E (default ``head.rank``), ``gru_hidden_dim`` (default 4 E), ``prefix_len`` (default 1,
        Domino's pure_draft_prefix_len); ``hidden_size`` D and ``vocab_size`` V from the target."""
        emb = int(head.get("emb_dim", None) or head["rank"])
        return {"vocab_size": vocab_size, "hidden_size": hidden_size, "emb_dim": emb,
                "gru_hidden_dim": int(head.get("gru_hidden_dim", None) or 4 * emb),
                "prefix_len": int(head.get("prefix_len", 1))}

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """lambda from :func:`lambda_schedule` (``loss.lambda_base_start``, ``loss.lambda_decay_ratio``)."""
        schedule = partial(lambda_schedule, start=loss["lambda_base_start"], ratio=loss["lambda_decay_ratio"])
        return Objective(gamma=loss["gamma"], base_weight=0.0, curriculum=schedule, logged=("lam",))

    def recipe_problems(self, cfg) -> list[str]:
        """``head.prefix_len`` that leaves no proposal to correct."""
        d, h = cfg.drafter, cfg.head
        proposals = d.block_size - d.proposal_offset
        if h.prefix_len >= proposals:
            return [f"head.prefix_len={h.prefix_len} leaves no proposal to correct (block {d.block_size}, "
                    f"{proposals} proposals): must be < {proposals}"]
        return []


register_family(DominoFamily())

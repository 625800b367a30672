"""DFlash 2 (z-lab/dflash ``dflash/model.py``; vLLM speculators ``dflash2``): the candidate selector ``selector``,
trained by the CE of the selector-corrected logits beside the CE of the unary (base) logits, equally weighted.
Recipe ``loss.type=dflash2``."""

from __future__ import annotations

from typing import Any, Mapping

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import SelectorHead

# weight of the base (unary) CE beside the selector-corrected CE, (1 - w) CE(U + A W^T) + w CE(U); 0.5 weights them
# equally, as speculators' DFlash 2 trainer does (selector_loss_alpha 1.0 beside the unary loss)
DFLASH2_BASE_WEIGHT = 0.5


class DFlash2Family(Family):
    """DFlash 2's selector (:class:`~dartree.models.heads.SelectorHead`) and its unary + selector CE."""

    name = "dflash2"
    heads = (SelectorHead,)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``rank`` (``head.rank``), ``top_k`` (``head.top_k``, default 16), ``hidden_size`` D, ``vocab_size`` V."""
        return {"vocab_size": vocab_size, "rank": head["rank"], "hidden_size": hidden_size,
                "top_k": int(head.get("top_k", 16))}

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """CE(U) and CE(corrected) at :data:`DFLASH2_BASE_WEIGHT` each."""
        return Objective(gamma=loss["gamma"], base_weight=DFLASH2_BASE_WEIGHT)


register_family(DFlash2Family())

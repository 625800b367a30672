"""Plain DFlash (Chen et al. 2025, arXiv 2602.06036; z-lab/dflash): no correction head, trained by the decay-weighted
CE of the base logits U = lm_head(H). Head ``identity``; recipe ``loss.type=dflash``."""

from __future__ import annotations

from typing import Any, Mapping

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import IdentityHead


class DFlashFamily(Family):
    """Plain DFlash: :class:`~dartree.models.heads.IdentityHead`, loss CE(U) (DFlash, Sec. 3; SpecForge
    ``OnlineDFlashModel``)."""

    name = "dflash"
    heads = (IdentityHead,)
    # no head tensors (published = {}): z-lab/dflash DFlashDraftModel, SpecForge's DFlash, speculators dflash
    speculators_type, speculators_architecture = "dflash", "DFlashSpeculator"
    export_to = ("zlab-dflash",)

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``{"vocab_size": V}`` (the identity head has no parameters)."""
        return {"vocab_size": vocab_size}

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """CE of the base logits, decay ``loss.gamma``."""
        return Objective(gamma=loss["gamma"], corrected=False)


register_family(DFlashFamily())

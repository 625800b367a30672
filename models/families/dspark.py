"""DSpark (arXiv 2607.05147): Markov correction heads ``markov``, ``gated_markov`` and ``rnn``, optionally with
DSpark's confidence head, trained by ``ce_weight CE + l1_weight L1(p_d, p_t) + conf_weight BCE`` (Sec. 3.3; DeepSpec
``config/dspark``), plus the total variation and KL(p_t || p_d) terms (``loss.tv_weight``, ``loss.kl_weight``).
Recipe ``loss.type=dspark``."""

from __future__ import annotations

from typing import Any, Mapping

from dartree.models.families.base import Family, Objective, register_family
from dartree.models.heads import GatedMarkovHead, MarkovHead, RNNHead


class DSparkFamily(Family):
    """DSpark's Markov heads (:class:`~dartree.models.heads.MarkovHead`, ``GatedMarkovHead``, ``RNNHead``) and
    their distribution-matching loss."""

    name = "dspark"
    heads = (MarkovHead, GatedMarkovHead, RNNHead)
    confidence = True
    distribution = True

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """``vocab_size``, ``rank`` (``head.rank``); ``hidden_size`` for the gated and RNN heads and with a confidence
        head; ``confidence_head`` / ``confidence_with_markov`` (default true) when ``head.confidence_head``."""
        conf = bool(head.get("confidence_head", False))
        params = {"vocab_size": vocab_size, "rank": head["rank"]}
        if head["type"] != "markov" or conf:
            params["hidden_size"] = hidden_size
        if conf:
            params.update(confidence_head=True, confidence_with_markov=bool(head.get("confidence_with_markov", True)))
        return params

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """The DSpark weights of the recipe (``loss.tv_weight`` / ``loss.kl_weight`` read 0 in recipes written
        before them); the confidence BCE where ``head.confidence_head``."""
        kl = float(loss.get("kl_weight", 0.0) or 0.0)
        return Objective(gamma=loss["gamma"], ce_weight=loss["ce_weight"], l1_weight=loss["l1_weight"],
                         tv_weight=float(loss.get("tv_weight", 0.0) or 0.0), kl_weight=kl,
                         conf_weight=loss["conf_weight"], confidence=bool(head.get("confidence_head", False)),
                         logged=("l1", "kl") if kl else ("l1",))

    def recipe_problems(self, cfg) -> list[str]:
        """A loss that weights nothing: every one of ``loss.ce_weight``, ``l1_weight``, ``tv_weight``, ``kl_weight``
        is 0."""
        lo = cfg.loss
        if lo.ce_weight == 0 and lo.l1_weight == 0 and not lo.get("tv_weight", 0) and not lo.get("kl_weight", 0):
            return ["loss.ce_weight=0 and loss.l1_weight=0 (and loss.tv_weight, loss.kl_weight 0): the DSpark loss "
                    "would not train the drafter or its Markov head; give one of them a positive weight"]
        return []


register_family(DSparkFamily())

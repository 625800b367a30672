"""One typed object for how a speculative decode runs: :class:`DecodeSettings`.

The decoders (:func:`~dartree.decode.generate.speculative_generate`, :func:`~dartree.decode.batched.batched_generate`),
the policy seeding (:func:`~dartree.decode.generate.seed_policy`), the API (:mod:`dartree.speculator`), the
evaluation and benchmark programs and the offline-GPU job build one per decode setting and pass it down, so that
the same ten settings are declared once instead of in every signature. It plays the part of Hugging Face's
``GenerationConfig`` (``max_new_tokens``, ``temperature``, the end ids and ``prompt_lookup_num_tokens`` live there
too); what a call alone owns (its sampler's generator, the shared ``"auto"`` cost model, a lockstep AR decode)
stays a keyword of the call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from dartree.base.fields import describe


@dataclass(frozen=True)
class DecodeSettings:
    """How one speculative decode builds, sizes and verifies its trees, and when it stops. Frozen: derive a variant
    with :meth:`with_` (``dataclasses.replace``). Values are checked where a decoder receives them
    (:func:`~dartree.decode.generate.check_speculative`, before any forward), each error naming the field.

    Attributes:
        builder: a registered tree-builder name (``chain``, ``ddtree``, ``pctree``, ``fixed``, ``pruned``, ...) or
            an alias of :data:`~dartree.decode.builders.BUILDER_ALIASES`; None: plain autoregressive decoding (the
            evaluation's AR rows, :func:`~dartree.decode.harness.runner.decode_one`; the speculative decoders
            refuse it).
        budget: tree nodes per round B (int >= 0), None (P, the drafter's proposals per block) or ``"auto"`` (the
            cost model keeps, per round, the node count that maximises expected tokens per second; 0: a plain AR
            step; :mod:`dartree.decode.budget`).
        builder_params: the builders' keyword parameters as the registry declares them (``k``, ``width``,
            ``beta``, ``children``, ``backend``; :class:`~dartree.decode.builders.BuilderParam`), or None.
        acceptance: ``"match"`` (deterministic drafts, exact target-sample matching; every builder) or
            ``"rejection"`` (builder ``chain``, T > 0: speculative sampling, Leviathan et al. 2023, Algorithm 1).
        lookup: > 0 grafts a prompt-lookup chain of up to this many tokens onto every round's tree
            (:mod:`dartree.decode.lookup`); 0: off.
        lookup_ngram: the longest n-gram the lookup matches (it tries n = lookup_ngram .. 1).
        max_new_tokens: exact cap on generated tokens (int >= 0; :func:`~dartree.decode.batched.batched_generate`
            also takes one int per prompt).
        temperature: T >= 0: the target's token at each node is its argmax (T = 0) or a sample (T > 0).
        stop_ids: generation ends right after the first of these tokens, even mid-block (a sequence, a set, one int
            or None).
        record_trees: also keep every round's verify tree and accepted path in ``stats.trees`` (for drawing).
    """

    builder: str | None = "pruned"
    budget: int | str | None = None
    builder_params: Mapping[str, Any] | None = None
    acceptance: str = "match"
    lookup: int = 0
    lookup_ngram: int = 3
    max_new_tokens: int | Sequence[int] = 256
    temperature: float = 0.0
    stop_ids: Sequence[int] | int | None = ()
    record_trees: bool = False

    def with_(self, **changes) -> "DecodeSettings":
        """A copy with ``changes`` applied (``dataclasses.replace``).

        Raises:
            TypeError: a name that is not a field (names the fields).
        """
        unknown = sorted(set(changes) - set(self.__dataclass_fields__))
        if unknown:
            raise TypeError(f"DecodeSettings has no field {', '.join(unknown)}; its fields: "
                            f"{', '.join(self.__dataclass_fields__)}")
        return replace(self, **changes)

    @property
    def params(self) -> dict:
        """``builder_params`` as a fresh dict ({} for None), for the builders' keyword arguments."""
        return dict(self.builder_params or {})


def check_settings(settings: Any, what: str = "settings") -> DecodeSettings:
    """``settings`` itself when it is a :class:`DecodeSettings`.

    Raises:
        TypeError: anything else (a dict or the old keyword arguments: the message shows the fix).
    """
    if not isinstance(settings, DecodeSettings):
        raise TypeError(f"{what} is {describe(settings)}; give a dartree.decode.settings.DecodeSettings, e.g. "
                        "DecodeSettings(builder='pruned', budget='auto', max_new_tokens=128)")
    return settings

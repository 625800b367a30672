"""Every published drafter layout dartree reads and writes, registered explicitly and in one place.

Each publisher module defines its layouts as :class:`~dartree.convert.registry.FormatPair` objects and lists them
in ``PAIRS``; importing a module registers nothing. Here every module of :data:`PUBLISHERS` has its pairs
registered in :data:`FORMAT_PAIRS`, in the order ``--from auto`` tries them (:func:`detect`):

1. vLLM speculators (:mod:`dartree.convert.vllm_speculators`): ``speculators_model_type`` decides, and a type
   dartree does not read is refused by name before any other layout is tried;
2. z-lab (:mod:`dartree.convert.zlab`): ``zlab-dflash2`` first, since a DFlash 2 config is a DFlash config plus marks
   of its own, and ``zlab-dflash`` only after the layouts below, whose marks also sit in a ``dflash_config``;
3. DeepSpec (:mod:`dartree.convert.deepspec`): ``deepspec-dspark`` (no ``dflash_config``);
4. SpecForge (:mod:`dartree.convert.specforge`): ``specforge-domino``, then ``specforge-dspark``;
5. DSpine (:mod:`dartree.convert.dspine`): ``specforge-dspine``, then ``tencent-dspine`` (its codes in a file of
   their own), before ``zlab-dflash``, whose catch-all ``dflash_config`` a DSpine config also has.

The converters take their ``--from`` / ``--to`` lists (:data:`SOURCE_FORMATS`, :data:`EXPORT_FORMATS`) and every
reader and writer from :data:`FORMAT_PAIRS`; ``dartree`` and the older ``dartree-train`` are the converters' own
sources (``convert/to_dartree.py``), reserved here.
"""

from __future__ import annotations

from dartree.convert import deepspec, dspine, specforge, vllm_speculators, zlab
from dartree.convert.registry import FormatPair, FormatRegistry
from dartree.models.checkpoint import FORMAT, CheckpointError

PUBLISHERS = (vllm_speculators, zlab, deepspec, specforge, dspine)  # every publisher module
# the registration order is the detection order (see the module docstring)
REGISTRATION_ORDER: tuple[FormatPair, ...] = (
    vllm_speculators.SPECULATORS,
    zlab.DFLASH2,
    deepspec.DSPARK,
    specforge.DOMINO,
    specforge.DSPARK,
    dspine.SPECFORGE,
    dspine.TENCENT,
    zlab.DFLASH,
)
RESERVED = ("auto", FORMAT, "dartree-train")  # --from auto and the converters' own sources


def build_registry(pairs=REGISTRATION_ORDER, publishers=PUBLISHERS) -> FormatRegistry:
    """A :class:`~dartree.convert.registry.FormatRegistry` holding ``pairs`` in order.

    Raises:
        ValueError: a name registered twice or reserved (:data:`RESERVED`), a pair of a module of ``publishers``
            left out, or a pair that no module of ``publishers`` lists.
    """
    registry = FormatRegistry(reserved=RESERVED)
    for pair in pairs:
        registry.register(pair)
    listed = [pair for module in publishers for pair in module.PAIRS]
    missing = [pair.name for pair in listed if registry.get(pair.name) is not pair]
    unlisted = [name for name in registry if name not in {pair.name for pair in listed}]
    if missing or unlisted:
        raise ValueError(f"every publisher module's pairs, and only those, are registered: {missing} left out, "
                         f"{unlisted} listed by no publisher module")
    return registry


FORMAT_PAIRS = build_registry()
SOURCE_FORMATS = FORMAT_PAIRS.readable()  # every published layout a checkpoint converts from (--from)
EXPORT_FORMATS = FORMAT_PAIRS.writable()  # every published layout a dartree checkpoint exports to (--to)


def detect(config: dict, tensor_names: set[str]) -> tuple[str, str]:
    """Name the published layout of a checkpoint from its config fields and tensor names; returns (format, reason).

    Tries every pair of :data:`FORMAT_PAIRS` in registration order and takes the first that answers; the tensor
    names are given to the pairs with older SpecForge ``logit_head.`` prefixes removed.

    Raises:
        CheckpointError: a pair refuses the checkpoint by name (a speculators type dartree does not read), or no
            layout matches (the message lists what each layout needs).
    """
    names = {n[len("logit_head."):] if n.startswith("logit_head.") else n for n in tensor_names}
    for pair in FORMAT_PAIRS.values():
        why = pair.detect(config, names)
        if why:
            return pair.name, why
    needs = ", ".join(f"{pair.name} ({pair.marks})" for pair in FORMAT_PAIRS.values())
    raise CheckpointError(
        f"unknown checkpoint layout (format={config.get('format')!r}, no dflash_config, no top-level "
        f"target_layer_ids); expected one of: dartree / dartree-train (config 'format'), {needs}"
    )

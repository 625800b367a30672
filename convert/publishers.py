"""Every published drafter layout dartree reads and writes, in one place.

The built-in layouts (z-lab DFlash, SpecForge Domino / DSpark, DeepSpec DSpark) are parsed and written by
:mod:`dartree.convert.formats`; the reader/writer pairs (vLLM speculators, z-lab DFlash 2) live one module each and
register themselves in :mod:`dartree.convert.registry` when imported below. The converters import the lists from here.
"""

from __future__ import annotations

from dartree.convert import formats, registry
from dartree.convert import vllm_speculators, zlab_dflash2  # noqa: F401  (each registers its reader/writer pair)
from dartree.models.checkpoint import FORMAT

FORMAT_PAIRS = registry.FORMAT_PAIRS
_taken = set(FORMAT_PAIRS) & (set(formats.SOURCE_FORMATS) | {FORMAT, "dartree-train"})
if _taken:
    raise ValueError(f"format name(s) {sorted(_taken)} registered twice: a pair module reuses a built-in layout's name")
# every layout a checkpoint can be read from / written to (--from / --to of the converters)
SOURCE_FORMATS = formats.SOURCE_FORMATS + tuple(FORMAT_PAIRS)
EXPORT_FORMATS = formats.EXPORT_FORMATS + tuple(FORMAT_PAIRS)

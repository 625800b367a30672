"""The floating-point dtypes the tools take by name (``--dtype``, recipe ``target.dtype``), in one table."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` in :data:`DTYPES`.

    Args:
        name: ``float32``, ``bfloat16`` or ``float16``.
        what: the option or key the name came from, for the message (e.g. ``target.dtype``).
    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name not in DTYPES:
        raise ValueError(f"{what}: unknown dtype {name!r}; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name]

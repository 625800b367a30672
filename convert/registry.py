"""The registry of published layouts that come as a reader/writer pair (one module per layout registers its pair
when imported; :mod:`dartree.convert.publishers` imports every one of them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FormatPair:
    """One published layout as a reader/writer pair (the format registry, :data:`FORMAT_PAIRS`).

    Attributes:
        name: the ``--from`` / ``--to`` name.
        detect: (config.json dict, tensor names) -> a reason string when the checkpoint is in this layout, else None.
        read: (config.json dict, tensors by published name, where, target or None) -> (dartree config, tensors by
            dartree name); raises CheckpointError naming any field or tensor it cannot honour.
        write: (dartree config, tensors by dartree name, target or None) -> (config.json dict, tensors by published
            name); raises CheckpointError naming what the layout cannot express.
    """

    name: str
    detect: object
    read: object
    write: object

    def reader(self, read_tensors):
        """A ``to_dartree`` reader ``(src, config, target=None) -> (dartree config, tensors)`` over this pair."""

        def reader(src, config: dict, target=None):
            return self.read(config, read_tensors(src), src, target)

        reader.__doc__ = f"Reader for the {self.name} layout (format registry)."
        return reader


FORMAT_PAIRS: dict[str, FormatPair] = {}


def register_format(pair: FormatPair) -> FormatPair:
    """Add a reader/writer pair to :data:`FORMAT_PAIRS` under ``pair.name``; returns it.

    Raises:
        ValueError: the name is already registered.
    """
    if pair.name in FORMAT_PAIRS:
        raise ValueError(f"format {pair.name!r} is already registered")
    FORMAT_PAIRS[pair.name] = pair
    return pair

"""The format registry: every published drafter layout dartree reads (and, where it can, writes) as one
:class:`FormatPair`, held by a :class:`FormatRegistry`.

This module only defines the mechanism. Each publisher module (:mod:`dartree.convert.zlab`,
:mod:`dartree.convert.specforge`, :mod:`dartree.convert.deepspec`, :mod:`dartree.convert.vllm_speculators`) defines
its layouts as ``FormatPair`` objects and lists them in its ``PAIRS``; nothing registers itself on import.
:mod:`dartree.convert.publishers` registers them all, explicitly and in one place, and the converters
(``to_dartree.py``, ``from_dartree.py``) look every layout up there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FormatPair:
    """One published layout as a reader and an optional writer (an entry of a :class:`FormatRegistry`).

    Attributes:
        name: the ``--from`` / ``--to`` name (``zlab-dflash``, ``speculators``, ...).
        detect: (config.json dict, tensor names) -> a reason string when the checkpoint is in this layout, else
            None; may raise CheckpointError for a checkpoint of this publisher that dartree cannot read (named).
            ``--from auto`` tries the pairs in registration order and takes the first that answers.
        read: (config.json dict, tensors by published name, where, target=None) -> (dartree config, tensors by
            dartree name); ``where`` is the checkpoint folder (messages, provenance) and ``target`` an optional
            :class:`~dartree.models.target.Target`. Raises CheckpointError naming any field or tensor it cannot
            honour.
        write: (dartree config, tensors by dartree name, target=None, where="the checkpoint") -> (config.json dict,
            tensors by published name), raising CheckpointError naming what the layout cannot express; None for a
            layout dartree reads only (``deepspec-dspark``).
        marks: what ``--from auto`` looks for in this layout, listed when no layout matches.
    """

    name: str
    detect: Callable
    read: Callable
    write: Callable | None = None
    marks: str = ""

    def reader(self, read_tensors: Callable):
        """A ``to_dartree`` reader ``(src, config, target=None) -> (dartree config, tensors)`` over this pair.

        Args:
            read_tensors: src folder -> {published name: tensor} (every safetensors shard of the folder).
        """

        def reader(src, config: dict, target=None):
            return self.read(config, read_tensors(src), src, target)

        reader.__doc__ = f"Reader for the {self.name} layout (format registry)."
        return reader


class FormatRegistry(Mapping):
    """The published layouts by name, in registration order (a read-only mapping name -> :class:`FormatPair`;
    :meth:`register` is the only way in).

    Args:
        reserved: names no pair may take (the converters' own sources, such as ``dartree``, and ``auto``).
    """

    def __init__(self, reserved: tuple[str, ...] = ()):
        self._pairs: dict[str, FormatPair] = {}
        self._reserved = tuple(reserved)

    def register(self, pair: FormatPair) -> FormatPair:
        """Add ``pair`` under ``pair.name``; returns it.

        Raises:
            ValueError: the name is already registered or reserved, or ``pair`` is not a :class:`FormatPair`.
        """
        if not isinstance(pair, FormatPair):
            raise ValueError(f"{pair!r} is not a FormatPair")
        if pair.name in self._pairs:
            raise ValueError(f"format {pair.name!r} is already registered")
        if pair.name in self._reserved:
            raise ValueError(f"format name {pair.name!r} is reserved (one of {list(self._reserved)})")
        self._pairs[pair.name] = pair
        return pair

    def __getitem__(self, name: str) -> FormatPair:
        return self._pairs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def readable(self) -> tuple[str, ...]:
        """Names of every registered layout (each has a reader), in registration order."""
        return tuple(self._pairs)

    def writable(self) -> tuple[str, ...]:
        """Names of the layouts with a writer, in registration order."""
        return tuple(name for name, pair in self._pairs.items() if pair.write is not None)

"""Field checks of inputs where they enter (layer 0, ``dartree.base``: imports nothing of dartree): ranges, flags,
choices and id lists of nested config mappings, and whether a path can become an output folder.

Every entry point (the train / convert / export / eval CLIs and the Python API) checks its inputs before any work,
so a bad value is refused with one line that names the argument or key, the value given, the allowed range and the
fix, never with a traceback from deep inside or with a silently wrong meaning.

A *field table* maps a (dotted) key to a :class:`Range`, :class:`Flag`, :class:`Choice` or :class:`IdList`;
:func:`field_problems` checks a nested mapping against it. The tables live with what they describe: the dartree
checkpoint config's in :mod:`dartree.models.validate`, each head class's ``fields`` in its family module, the
recipe table in ``dartree.training.checks``.
"""

from __future__ import annotations

import math
import numbers
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

_MISSING = object()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def describe(x: Any) -> str:
    """Type (and shape, dtype) of ``x`` for messages, e.g. ``a torch.Tensor of shape [2, 5] and dtype
    torch.int64`` (any object with ``shape`` and ``dtype``: tensors, numpy arrays)."""
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return f"a {type(x).__module__}.{type(x).__name__} of shape {list(shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def is_int(value: Any) -> bool:
    """True for Python / numpy integers (never ``bool``; a 0-d integer tensor is not accepted here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for finite-or-not real numbers, ints included (never ``bool``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """The type name messages compare: every integer type (Python, numpy) is ``int``; ``bool`` stays ``bool``."""
    return "int" if is_int(value) else type(value).__name__


def same_value(got: Any, want: Any) -> bool:
    """True when ``got`` equals ``want`` and is of the same kind: integers of any integer type are one kind, but
    ``"1"`` is not ``1``, nor is ``True`` or ``1.0`` (as ``==`` alone would say)."""
    return _kind(got) == _kind(want) and got == want


def typed(value: Any, other: Any) -> str:
    """``repr(value)`` for a message that sets ``value`` against ``other``, with its type appended when the two
    differ in kind, e.g. ``typed("1", 1)`` -> ``'1' (str)``, ``typed(1, "1")`` -> ``1 (int)``, ``typed(2, 1)`` -> ``2``."""
    return repr(value) if _kind(value) == _kind(other) else f"{value!r} ({_kind(value)})"


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric field.

    Attributes:
        lo, hi: inclusive bounds (None: unbounded); ``lo_open`` / ``hi_open`` make them exclusive.
        integer: the value must be an integer (``bool`` never counts as a number); else a finite real.
        optional: None is allowed (the field's default applies).
        note: what the field means or how to fix it, appended to the message in parentheses.
    """

    lo: float | None = None
    hi: float | None = None
    integer: bool = True
    optional: bool = False
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def describe(self) -> str:
        """The allowed range in words, e.g. ``an integer >= 1`` or ``a finite number in (0, 1]``."""
        kind = "an integer" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            text = (f"{kind} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            text = kind
        return text + (" or null (the default)" if self.optional else "")

    def problem(self, key: str, value: Any) -> str | None:
        """None when ``value`` is allowed, else one line naming ``key``, the value and the allowed range."""
        if value is None:
            return None if self.optional else self._say(key, value, "is missing")
        if not (is_int(value) if self.integer else is_real(value)):
            return self._say(key, value, f"({_kind(value)}) has the wrong type")
        v = float(value)
        bad = not math.isfinite(v)
        if self.lo is not None:
            bad |= v <= self.lo if self.lo_open else v < self.lo
        if self.hi is not None:
            bad |= v >= self.hi if self.hi_open else v > self.hi
        return self._say(key, value, "is out of range") if bad else None

    def _say(self, key: str, value: Any, what: str) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{key}={value!r} {what}: must be {self.describe()}{note}"


@dataclass(frozen=True)
class Flag:
    """A boolean field: only ``true`` / ``false`` (a string such as ``"false"`` would read as true); with
    ``auto=True`` also the string ``auto`` (resolved by the code that reads the field)."""

    note: str = ""
    auto: bool = False

    def problem(self, key: str, value: Any) -> str | None:
        """None for a bool (or ``"auto"`` where allowed), else one line naming ``key`` and the value."""
        if isinstance(value, bool) or (self.auto and value == "auto"):
            return None
        allowed = "true, false or auto" if self.auto else "true or false"
        return f"{key}={value!r} ({_kind(value)}) has the wrong type: must be {allowed}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Choice:
    """A field with a fixed set of allowed values (strings or numbers)."""

    values: tuple
    note: str = ""

    def problem(self, key: str, value: Any) -> str | None:
        """None when ``value`` is one of :attr:`values`, else one line listing them."""
        if any(same_value(value, v) for v in self.values):
            return None
        note = f" ({self.note})" if self.note else ""
        kinds = sorted({_kind(v) for v in self.values})
        shown = repr(value) if _kind(value) in kinds else f"{value!r} ({_kind(value)})"
        of = "" if _kind(value) in kinds else f" ({', '.join(kinds)})"
        return f"{key}={shown} is not allowed: use one of {list(self.values)}{of}{note}"


@dataclass(frozen=True)
class IdList:
    """A list of integer ids, each >= ``lo`` (e.g. target layer ids); ``allow_empty`` accepts [] (a default)."""

    lo: int = 0
    allow_empty: bool = False
    note: str = ""

    def problem(self, key: str, value: Any) -> str | None:
        """None for a list of integers >= lo (non-empty unless allowed), else one line naming the bad entry."""
        note = f" ({self.note})" if self.note else ""
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            return f"{key}={value!r} ({_kind(value)}) has the wrong type: must be a list of integers >= {self.lo}{note}"
        items = list(value)
        if not items and not self.allow_empty:
            return f"{key}=[] is empty: give at least one integer >= {self.lo}{note}"
        for i in items:
            if not is_int(i) or int(i) < self.lo:
                return (f"{key}={items!r} holds {typed(i, self.lo)}: every entry must be an integer >= "
                        f"{self.lo}{note}")
        return None


def lookup(values: Mapping, dotted: str, default: Any = _MISSING) -> Any:
    """``values["a"]["b"]`` for ``"a.b"``; ``default`` (or the module's missing marker) when absent."""
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def field_problems(values: Mapping, table: Mapping[str, Any], prefix: str = "", *, required: bool = False) -> list[str]:
    """Check the fields of ``values`` named in ``table``; returns one line per bad field, table order.

    Args:
        values: a (nested) mapping such as a config dict or ``OmegaConf.to_container(cfg)``.
        table: dotted key -> :class:`Range` / :class:`Flag` / :class:`Choice` / :class:`IdList`.
        prefix: prepended to every key in the messages (e.g. ``"drafter."``).
        required: report a key of ``table`` that ``values`` lacks (else absent keys are skipped: defaults apply).
    """
    out = []
    for key, rule in table.items():
        value = lookup(values, key)
        if value is _MISSING:
            if required and not getattr(rule, "optional", False):
                out.append(f"{prefix}{key} is missing")
            continue
        msg = rule.problem(prefix + key, value)
        if msg:
            out.append(msg)
    return out


def check_fields(values: Mapping, table: Mapping[str, Any], prefix: str = "", *, required: bool = False) -> None:
    """:func:`field_problems`, raising the first problem.

    Raises:
        ValueError: one line naming the key, the value and the allowed range.
    """
    problems = field_problems(values, table, prefix, required=required)
    if problems:
        raise ValueError(problems[0])


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot become an output folder, found by trying (permission bits say little to root): None
    when it can. The trial writes a temporary file in ``path`` when it exists, else a temporary folder in its nearest
    existing parent, and removes it again: nothing is left behind, and folders that other processes create or remove
    meanwhile (runs side by side under one parent) are never touched.

    Returns:
        None, or a phrase such as ``"is an existing file, not a folder"`` for the caller's one-line message.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return "is an existing file, not a folder"
    for attempt in range(3):  # a parent another process removes meanwhile: look again
        try:
            q = p
            while not q.exists():
                q = q.parent
            if not q.is_dir():
                return f"cannot be created: {q} is a file"
            if q == p:
                with tempfile.TemporaryFile(dir=p):
                    pass
            else:  # a folder of this trial's own in the nearest existing one: shared parents are never touched
                os.rmdir(tempfile.mkdtemp(dir=q))
            return None
        except FileNotFoundError as exc:
            if attempt == 2:
                return f"cannot be created or written ({exc.strerror or exc})"
        except OSError as exc:
            return f"cannot be created or written ({exc.strerror or exc})"
    return None

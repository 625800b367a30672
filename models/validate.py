"""Checks of inputs where they enter: field ranges of configs, and the pairing of a drafter and head with a target.

Every entry point (the train / convert / export / eval CLIs and the Python API) checks its inputs here before
any work, so a bad value is refused with one line that names the argument or key, the value given, the allowed
range and the fix, never with a traceback from deep inside or with a silently wrong meaning.

A *field table* maps a (dotted) key to a :class:`Range`, :class:`Flag`, :class:`Choice` or :class:`IdList`;
:func:`field_problems` checks a nested mapping against it. The tables for dartree checkpoint configs are
:data:`DRAFTER_FIELDS` (the :class:`~dartree.models.drafter.DrafterConfig` fields) and each head class's ``fields``
(its hyper-parameters, :mod:`dartree.models.heads`); the recipe table lives in ``dartree.training.checks``.

Shapes in :func:`check_pairing`: V vocabulary rows of the target's lm_head, D hidden size, n target layers.
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


# The DrafterConfig fields (dartree checkpoint config ``drafter``; checkpoints/README.md, "Format").
DRAFTER_FIELDS = {
    "hidden_size": Range(1, note="D, the target's hidden size"),
    "intermediate_size": Range(1),
    "num_layers": Range(1),
    "num_heads": Range(1),
    "num_kv_heads": Range(1),
    "head_dim": Range(1),
    "target_layer_ids": IdList(0, note="decoder layers of the target; DeepSpec's -1 is not supported"),
    "mask_token_id": Range(0, note="a token id of the target's vocabulary"),
    "block_size": Range(2, note="L, the anchor plus at least one proposal"),
    "proposal_offset": Range(0, 1, note="0: DSpark/Domino, 1: z-lab DFlash"),
    "qk_norm": Flag(),
    "rms_norm_eps": Range(0, integer=False, lo_open=True),
    "rope_theta": Range(0, integer=False, lo_open=True),
    "draft_vocab_size": Range(0, note="0: the full vocabulary"),
    "conv_kernel_size": Range(0, note="0: DFlash layers; k >= 1: DFlash 2 convolutions of k taps"),
    "conv_group_size": Range(1, note="channels per dynamic tap; must divide hidden_size"),
}

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


def check_pairing(target, drafter=None, head=None) -> None:
    """Check live modules against a target before decoding: the values that depend on the target.

    Args:
        target: a :class:`~dartree.models.target.Target` (V = lm_head rows, D, n layers).
        drafter: a :class:`~dartree.models.drafter.DFlashDrafter` or None.
        head: a :class:`~dartree.models.heads.CorrectionHead` or None.
    Raises:
        ValueError: hidden size, layer ids, mask token id, draft vocabulary, head vocabulary / widths, the
            token embeddings of a head that reads them (``reads_embeddings``: the gru head), or the device do not
            fit the target (both values named, with the fix).
    """
    v, d, n = target.vocab_size, target.hidden_size, target.num_layers
    rows = int(target.embed_tokens.weight.shape[0])
    dev = target.device
    fix = "; use the drafter trained for this target (load_dartree(..., target=target) checks it)"
    if drafter is not None:
        c = drafter.cfg
        if not same_value(c.hidden_size, d):
            raise ValueError(f"drafter hidden_size {typed(c.hidden_size, d)} != target hidden_size {typed(d, c.hidden_size)}"
                             f"{fix}")
        bad = [i for i in c.target_layer_ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} are outside the target's {n} layers (0..{n - 1}){fix}")
        if not 0 <= c.mask_token_id < rows:
            raise ValueError(f"drafter mask_token_id {c.mask_token_id} is not a token id of the target "
                             f"(embedding rows 0..{rows - 1}){fix}")
        if c.draft_vocab_size:
            ids = drafter.draft_vocab
            if c.draft_vocab_size > v or int(ids.min()) < 0 or int(ids.max()) >= v:
                raise ValueError(f"drafter draft vocabulary ({c.draft_vocab_size} ids, max {int(ids.max())}) does not "
                                 f"fit the target's {v} tokens{fix}")
        p = next(drafter.parameters(), None)
        if p is not None and p.device != dev:
            raise ValueError(f"drafter is on {p.device} but the target is on {dev}; move it: drafter.to({str(dev)!r})")
    if head is not None:
        hv = getattr(head, "vocab_size", None)
        if hv is not None and not same_value(hv, v):
            raise ValueError(f"head vocab_size {typed(hv, v)} != target vocabulary {typed(v, hv)}{fix}")
        hd = getattr(head, "hidden_size", None)
        dd = drafter.cfg.hidden_size if drafter is not None else None
        if drafter is not None and hd is not None and not same_value(hd, dd):
            raise ValueError(f"head hidden_size {typed(hd, dd)} != drafter hidden_size {typed(dd, hd)}{fix}")
        if getattr(head, "reads_embeddings", False):  # bound by bind_embeddings, kept as _embed (Domino's GRU)
            emb, want = head.__dict__.get("_embed"), target.embed_tokens.weight
            bind = "call head.bind_embeddings(target.embed_tokens.weight)"
            name = head.type_name
            if emb is None:
                raise ValueError(f"{name} head has no token embeddings: {bind} (load_dartree(..., target=target) does it)")
            if tuple(emb.shape) != tuple(want.shape):
                raise ValueError(f"{name} head is bound to embeddings of shape {list(emb.shape)}, not the target's "
                                 f"{list(want.shape)}; {bind}")
        p = next(head.parameters(), None)
        if p is not None and p.device != dev:
            raise ValueError(f"head is on {p.device} but the target is on {dev}; move it: head.to({str(dev)!r})")

"""Reading the JSON records dartree programs write (training states, manifests, learning curves, reports, results):
every reader goes through :func:`read_json`, which parses the file and checks the shape its reader relies on, so a
truncated, corrupt or hand-broken record is one line naming the file, the place in it and the fix, never a
``KeyError`` or ``TypeError`` traceback from deep inside the program. Layer 0 (``dartree.base``): imports nothing
of dartree.

A shape is a small JSON description of what a reader indexes:

- ``object``: anything;
- a type (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``); ``float`` accepts integers, ``int`` and
  ``float`` refuse ``true``/``false``;
- a tuple of alternatives (types, ``None`` for ``null``, object or list shapes): ``(str, None)``, ``({...}, None)``;
- ``{"key": shape, "key?": shape, "*": shape}``: an object whose ``key`` must be there, whose ``key?`` may be
  absent, and whose every other key holds ``*`` (other keys are free without ``*``);
- ``[shape]``: a list whose every item has ``shape``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

NUMBER = (int, float)  # a JSON number
_KIND = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
         bool: "true or false", type(None): "null"}
_REQUIRED = object()  # read_json's ``absent`` default: a missing file is an error


class RecordError(ValueError):
    """A record is missing, does not parse or lacks what its reader needs; the message is one line naming the file,
    the place in it and the fix."""


def _kind_of(value) -> str:
    if isinstance(value, bool):
        return json.dumps(value)
    return _KIND.get(type(value), type(value).__name__)


def _expected(shape) -> str:
    if isinstance(shape, dict):
        return "an object"
    if isinstance(shape, list):
        return "a list"
    alts = shape if isinstance(shape, tuple) else (shape,)
    if float in alts:  # a number covers the integers
        alts = tuple(a for a in alts if a is not int)
    return " or ".join(_expected(a) if isinstance(a, (dict, list)) else _KIND[type(None) if a is None else a]
                       for a in alts)


def _is(value, shape) -> bool:
    """Whether ``value`` has the plain type(s) ``shape`` (not a dict or list shape)."""
    for alt in shape if isinstance(shape, tuple) else (shape,):
        if alt is object or (alt is None and value is None):
            return True
        if alt is None or isinstance(value, bool) and alt in (int, float):
            continue
        if isinstance(value, alt) or (alt is float and isinstance(value, int)):
            return True
    return False


def _at(where: str, key) -> str:
    """The path of ``key`` (a list index or an object key) inside ``where`` (``shards[3].sha256``)."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    part = str(key) if str(key).isidentifier() else f"[{json.dumps(key)}]"
    return part if not where else where + (part if part.startswith("[") else "." + part)


def shape_problem(value: Any, shape: Any, where: str = "") -> str | None:
    """The first place where ``value`` (parsed JSON) differs from ``shape`` (module docstring), as one phrase
    (``shards[3].sha256 is null, not a string``), or None when it has the shape.

    Args:
        value: the parsed JSON. shape: the expected shape. where: the path of ``value`` inside its file ("": top).
    """
    here = where or "the top level"
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return f"{here} is {_kind_of(value)}, not an object"
        for key, sub in shape.items():
            if key == "*":
                continue
            name, optional = (key[:-1], True) if key.endswith("?") else (key, False)
            if name not in value:
                if optional:
                    continue
                return f"{_at(where, name)} is missing" if where else f"the key {name!r} is missing"
            problem = shape_problem(value[name], sub, _at(where, name))
            if problem:
                return problem
        if "*" in shape:
            named = {k[:-1] if k.endswith("?") else k for k in shape}
            for key, item in value.items():
                problem = None if key in named else shape_problem(item, shape["*"], _at(where, key))
                if problem:
                    return problem
        return None
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{here} is {_kind_of(value)}, not a list"
        for i, item in enumerate(value):
            problem = shape_problem(item, shape[0], _at(where, i))
            if problem:
                return problem
        return None
    if isinstance(shape, tuple) and any(isinstance(a, (dict, list)) for a in shape):  # alternatives with structure
        problems = [shape_problem(value, a, where) if isinstance(a, (dict, list)) else
                    (None if _is(value, a) else "") for a in shape]
        if None in problems:
            return None
        kin = [p for a, p in zip(shape, problems) if isinstance(a, dict) and isinstance(value, dict)
               or isinstance(a, list) and isinstance(value, list)]
        return kin[0] if kin else f"{here} is {_kind_of(value)}, not {_expected(shape)}"
    if not _is(value, shape):
        return f"{here} is {_kind_of(value)}, not {_expected(shape)}"
    return None


def check_shape(value: Any, shape: Any, name: str, fix: str, error: type[Exception] = RecordError) -> Any:
    """``value`` when it has ``shape``.

    Args:
        value: parsed JSON. shape: see the module docstring. name: what to call the record in the message (its
            path). fix: what to do about a bad record (``restore it with git``). error: the exception class raised.
    Returns:
        ``value``.
    Raises:
        ``error``: ``NAME: WHERE is X, not Y; FIX`` (one line).
    """
    problem = shape_problem(value, shape)
    if problem:
        raise error(f"{name}: {problem}; {fix}")
    return value


def parse_json(text: str | bytes, shape: Any, name: str, fix: str, error: type[Exception] = RecordError) -> Any:
    """``text`` parsed as JSON and checked against ``shape`` (:func:`check_shape`).

    Raises:
        ``error``: ``NAME does not parse (MESSAGE at line L, column C); FIX``, or a shape problem (one line).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{name} does not parse ({exc.msg} at line {exc.lineno}, column {exc.colno}); {fix}") from None
    except UnicodeDecodeError:
        raise error(f"{name} is not UTF-8 text; {fix}") from None
    return check_shape(value, shape, name, fix, error)


def read_json(path: Path, shape: Any = object, *, fix: str = "restore it with git", absent: Any = _REQUIRED,
              error: type[Exception] = RecordError) -> Any:
    """A JSON record read and checked: the one way dartree programs read the files they or another program wrote.

    Args:
        path: the file. shape: what its reader relies on (module docstring).
        fix: the remedy the message ends with (``restore it with `git checkout FILE```, ``run stage=apply
            again``). absent: a copy of it is returned when the file does not exist (default: that is an error too).
        error: the exception class raised (the program's own, e.g. ``CampaignError``, so its refusal path stays).
    Returns:
        the parsed value (dicts, lists, scalars).
    Raises:
        ``error``: one line naming ``path`` and the problem: missing (without ``absent``), unreadable, not JSON
            (where it breaks), or the first place that lacks the shape (``PATH: shards[3].sha256 is null, not a
            string``), ending with ``fix``.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if absent is not _REQUIRED:
            return copy.deepcopy(absent)
        raise error(f"{path} is missing; {fix}") from None
    except OSError as exc:
        raise error(f"{path} cannot be read ({exc.strerror or type(exc).__name__}); {fix}") from None
    return parse_json(data, shape, str(path), fix, error)

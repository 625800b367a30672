"""Drafter families defined outside dartree: imported by module name (a recipe's ``families`` list) or found through
the ``dartree.families`` entry-point group of installed packages (docs/families.md).

A family module registers its family when it is imported (``register_family(MyFamily())`` at its end). Two ways
make the programs import it:

- **A package's entry point**, for every program (training, conversion, evaluation, the API): the package declares,
  in its ``pyproject.toml``::

      [project.entry-points."dartree.families"]
      my_family = "my_package.my_family"

  and :func:`load_entry_point_families` imports ``my_package.my_family`` at the first lookup of a head type
  (:func:`dartree.models.families.build_head`, :func:`~dartree.models.families.head_fields`: loading a checkpoint) or of a
  recipe (:func:`dartree.training.recipe.load_recipe`). Entry points are the Python packaging mechanism (PyPA entry-points
  specification; :func:`importlib.metadata.entry_points`), as pytest's ``pytest11`` plugins are.
- **A module on the path**, for one training run: ``python training/train.py families=[my_family] ...``
  (:func:`import_families`).
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "dartree.families"  # the entry-point group a package declares its family modules in
_LOADED: set[str] = set()  # entry-point values imported already (module or module:attribute)
_SCANNED: set[str] = set()  # groups whose entry points were read in this process


def load_entry_point_families(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Import every family module that installed packages declare in the entry-point group ``group`` (each import
    registers its family). The installed packages' metadata is read once per group and process (a scan takes a few
    milliseconds, and every head lookup calls this), so a package installed while the process runs is seen by the
    next process.

    Args:
        group: the entry-point group (:data:`ENTRY_POINT_GROUP`).
    Returns:
        The entry-point values imported by this call (``module`` or ``module:attribute``).
    Warns:
        UserWarning: an entry point whose import fails (its package, value and the error named); the other
            families stay usable and a checkpoint or recipe that needs the broken one is refused where its head
            type is looked up.
    """
    if group in _SCANNED:
        return []
    _SCANNED.add(group)
    loaded = []
    for ep in entry_points(group=group):
        if ep.value in _LOADED:
            continue
        _LOADED.add(ep.value)
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not take dartree down: report it and go on
            dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
            warnings.warn(f"{group} entry point {ep.name!r} = {ep.value!r} of {dist} failed to import "
                          f"({type(exc).__name__}: {exc}); its drafter family is not available", stacklevel=2)
            continue
        loaded.append(ep.value)
    return loaded


def import_families(modules, where: str = "families") -> list[str]:
    """Import the family modules named in ``modules`` (dotted module names on ``sys.path``; importing one registers
    its family). A module imported before is not imported again.

    Args:
        modules: an iterable of module names, e.g. ``["my_family"]``.
        where: the setting's name, for messages (``families``).
    Returns:
        The module names, in order.
    Raises:
        ValueError: a name that is not a non-empty string; a module that is not found (put its folder on
            ``PYTHONPATH`` or install its package); a module found whose import fails: a module it imports is
            missing (install it), or any other error it raises, a family registered twice included (the error
            named). One line each.
    """
    names = []
    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: {name!r} is not a module name; give dotted Python module names, e.g. "
                             f"{where}=[my_package.my_family]")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not (name == exc.name or name.startswith(exc.name + ".")):
                raise ValueError(f"{where}: module {name!r} imports {exc.name!r}, which is not installed; install "
                                 "it") from None
            raise ValueError(f"{where}: cannot import {name!r} ({type(exc).__name__}: {exc}); put its folder on "
                             "PYTHONPATH or install its package") from None
        except Exception as exc:  # a syntax error, a failed registration, anything the module raises: one line
            raise ValueError(f"{where}: importing {name!r} failed ({type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'})") from None
        names.append(name)
    return names

"""dartree importable from the repository tree without installing it, for the GPU burst (docs/burst.md):
``python training/tools/burst_layout.py DEST`` lays the package out under ``DEST`` as links into the tree, from
pyproject.toml's own package map (``[tool.setuptools] packages`` and ``[tool.setuptools.package-dir]``), so every
package the installed dartree has is there, a package added to pyproject later included; ``--check`` then imports
each package with ``DEST`` first on ``PYTHONPATH`` and refuses (exit 2) if one is missing or comes from elsewhere.

Standard library only (``tomllib``, Python 3.11+): ``training/tools/burst.sh run`` calls it on a machine where nothing
of dartree is installed yet.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class LayoutError(ValueError):
    """pyproject.toml's package map cannot be laid out, or a package does not import from the layout; the message
    names the package and the fix."""


def package_dirs(pyproject: Path = REPO / "pyproject.toml") -> dict[str, Path]:
    """Every package of ``[tool.setuptools] packages`` -> its folder (absolute, resolved), by setuptools' rule: the
    folder of the nearest package-dir entry above it (itself included; ``""`` is the project root), then the rest of
    its name.

    Raises:
        LayoutError: ``packages`` is not a list of names (e.g. a ``find:`` directive), or a package's folder has no
            ``__init__.py`` (both named).
    """
    setup = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    packages, mapping = setup.get("packages"), setup.get("package-dir", {})
    if not isinstance(packages, list) or not all(isinstance(p, str) for p in packages):
        raise LayoutError(f"{pyproject}: [tool.setuptools] packages must list the package names (got {packages!r}); "
                          "list them, as the burst lays out exactly those")
    root = pyproject.parent
    out: dict[str, Path] = {}
    for pkg in packages:
        parts = pkg.split(".")
        cut = next(i for i in range(len(parts), -1, -1) if i == 0 or ".".join(parts[:i]) in mapping)
        folder = root.joinpath(mapping.get(".".join(parts[:cut]), ""), *parts[cut:]).resolve()
        if not (folder / "__init__.py").is_file():
            raise LayoutError(f"{pyproject}: package {pkg} maps to {folder}, which has no __init__.py; fix its "
                              "[tool.setuptools.package-dir] entry")
        out[pkg] = folder
    return out


def _in_place(pkg: str, dirs: dict[str, Path]) -> bool:
    """Whether every package below ``pkg`` sits in ``pkg``'s folder at the path its name says (then one link to the
    folder brings them all)."""
    base = dirs[pkg]
    return all(dirs[sub] == base.joinpath(*sub[len(pkg) + 1:].split("."))
               for sub in dirs if sub.startswith(pkg + "."))


def lay_out(dest: Path, pyproject: Path = REPO / "pyproject.toml") -> dict[str, Path]:
    """Lay the packages of ``pyproject`` out under ``dest`` (created; must not exist): a package whose subpackages
    all sit in its folder is one link to that folder; any other is a real folder holding a link to each entry of its
    own folder (``__pycache__`` left out), its subpackages added beside them. Returns :func:`package_dirs`.

    Raises:
        LayoutError: ``dest`` exists, the package map is unusable (:func:`package_dirs`), or a package's folder
            holds an entry named like a subpackage mapped elsewhere.
    """
    dirs = package_dirs(pyproject)
    if dest.exists() or dest.is_symlink():
        raise LayoutError(f"{dest} exists; remove it first (the layout is made afresh)")
    dest.mkdir(parents=True)
    for pkg in sorted(dirs, key=lambda p: p.count(".")):
        here = dest.joinpath(*pkg.split("."))
        if here.exists() or here.is_symlink():  # brought by its parent's link, or an entry of the parent's folder
            if here.resolve() != dirs[pkg].resolve():
                raise LayoutError(f"package {pkg} maps to {dirs[pkg]}, but its parent's folder has an entry "
                                  f"{here.name!r} of its own; rename one of them")
            continue
        if _in_place(pkg, dirs):
            here.symlink_to(dirs[pkg], target_is_directory=True)
            continue
        here.mkdir()
        for entry in sorted(dirs[pkg].iterdir()):
            if entry.name != "__pycache__":
                (here / entry.name).symlink_to(entry)
    return dirs


def check(dest: Path, pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """Import every package of ``pyproject`` in this interpreter and check that each comes from the layout under
    ``dest`` (run with ``dest`` first on ``PYTHONPATH``). Returns package -> its ``__init__.py`` path.

    Raises:
        LayoutError: a package does not import (the error named) or imports from outside ``dest`` (both paths
            named: an installed dartree is supplying it).
    """
    top = Path(dest).absolute()
    out = {}
    for pkg in package_dirs(pyproject):
        try:
            mod = importlib.import_module(pkg)
        except Exception as exc:
            raise LayoutError(f"{pkg} does not import from {top} ({type(exc).__name__}: {exc}); is it in "
                              "pyproject.toml's [tool.setuptools] packages?") from None
        where = Path(mod.__file__ or "").absolute()
        if top not in where.parents:
            raise LayoutError(f"{pkg} imports from {where}, not from the layout under {top}: another dartree "
                              "supplies it; put the layout first on PYTHONPATH")
        out[pkg] = str(where)
    return out


def main(argv: list[str] | None = None) -> int:
    """``burst_layout.py DEST [--check]``: lay out (or, with ``--check``, check) dartree under DEST; prints one
    line; returns 0, or 2 with ``error: ...`` on stderr."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) not in (1, 2) or (len(args) == 2 and args[1] != "--check") or args[0].startswith("-"):
        print("error: usage: python training/tools/burst_layout.py DEST [--check]", file=sys.stderr)
        return 2
    dest = Path(args[0])
    try:
        if len(args) == 2:
            found = check(dest)
            print(f"burst: dartree imports from {dest.absolute() / 'dartree'} ({len(found)} packages)")
        else:
            dirs = lay_out(dest)
            print(f"burst: dartree laid out under {dest} ({len(dirs)} packages, from pyproject.toml)")
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

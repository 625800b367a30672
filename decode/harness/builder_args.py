"""Command-line flags of the tree builders' parameters, derived from the builder registry
(:data:`dartree.decode.builders.BUILDERS`): a builder that declares a :class:`~dartree.decode.builders.BuilderParam`
with a ``flag`` gets that flag in ``dartree-eval`` with no edit here (``--width``, ``--candidates``, ``--beta``,
``--children``)."""

from __future__ import annotations

import argparse

from dartree.decode.builders import BUILDERS, declared_params


def _flagged():
    return [p for p in declared_params().values() if p.flag]


def add_builder_param_args(ap: argparse.ArgumentParser) -> None:
    """One flag per flagged registry parameter, with its declared type (int / float), default and help, and the
    builders that take it where not every builder does (``--width``: "(pruned)")."""
    for p in _flagged():
        users = [name for name, spec in BUILDERS.items() if p in getattr(spec, "params", ())]
        where = "" if len(users) == len(BUILDERS) else f" ({', '.join(users)})"
        ap.add_argument(p.flag, type=int if p.kind == "int" else float, default=p.default, help=p.help + where)


def builder_params_of(args: argparse.Namespace) -> dict:
    """The ``builder_params`` dict of parsed arguments: every flagged parameter by its name
    (``{"k": args.candidates, "width": args.width, "beta": args.beta, "children": args.children}``)."""
    return {p.name: getattr(args, p.dest) for p in _flagged()}


def builder_param_problems(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """(bad, message) per flagged parameter, its value checked against the declared range
    (``--width 0 must be an integer >= 1``)."""
    out = []
    for p in _flagged():
        value = getattr(args, p.dest)
        bad = p.problem(value)
        out.append((bad is not None, f"{p.flag} {value} " + (bad[1] if bad is not None else "is fine")))
    return out

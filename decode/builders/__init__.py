"""The registry of draft-tree builders: every builder by its one name, with the parameters it declares
(:class:`BuilderParam`), whether it ranks by ``score + beta * depth`` and the most nodes its tree can have.

All builders have one signature, ``build(block, head, root_id, budget, **params) -> Tree`` (the types and the shared
selection: :mod:`dartree.decode.trees`; adding a builder: docs/trees.md). Each shipped builder sits in a module named
after it: ``chain`` (:mod:`.chain`), DARTree's ``pruned`` and ``fixed`` (:mod:`.dartree`), ``pctree``
(:mod:`.pctree`), ``heap-sequential`` (:mod:`.heap`) and ``ddtree`` (:mod:`.ddtree`); :mod:`.supertree` holds DARTree's
depth-wise expansion that several of them run. Those modules import :mod:`dartree.decode.trees`, never this package,
which imports them and registers them below, in a fixed order (:data:`BUILDERS` is ordered).
:func:`register_builder` stays public for third-party builders.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

from dartree.base.fields import is_int, is_real
from dartree.decode.builders.chain import build_chain
from dartree.decode.builders.dartree import build_dartree_fixed, build_dartree_pruned
from dartree.decode.builders.ddtree import build_ddtree
from dartree.decode.builders.heap import build_heap_sequential
from dartree.decode.builders.pctree import build_pctree
from dartree.decode.trees import Tree, _kary_nodes, head_k, use_declared_params
from dartree.models.heads import CorrectionHead


@dataclass(frozen=True)
class BuilderParam:
    """One keyword parameter of a tree builder, as the builder declares it in :func:`register_builder`.

    A parameter name means one thing in every builder that declares it (same kind, default, range and help), so one
    ``builder_params`` dict and one set of command-line flags serve every builder of a run; a builder ignores a
    declared parameter it does not take (``chain`` accepts ``width``).

    Attributes:
        name: the keyword in ``builder_params`` (``k``, ``width``, ...).
        kind: ``"int"`` (an integer), ``"real"`` (a finite real number) or ``"choice"`` (one of ``choices``).
        default: the value a builder uses when the keyword is absent (the published setting).
        help: what the value means, with its unit, for ``--help``.
        minimum, maximum: inclusive bounds of an ``int`` / ``real`` (None: unbounded).
        choices: the accepted values of a ``"choice"``.
        flag: the command-line flag of ``dartree-eval`` (``--candidates`` for ``k``); ``""``: not on the command line.
        reason: why the bounds hold, appended to the range error (``beta > 0 breaks prefix closure``).
    """

    name: str
    kind: str
    default: object
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    flag: str = ""
    reason: str = ""

    @property
    def dest(self) -> str:
        """The argparse attribute of :attr:`flag` (``--candidates`` -> ``candidates``); "" without a flag."""
        return self.flag.lstrip("-").replace("-", "_")

    def range_text(self) -> str:
        """The accepted values in words (``an integer >= 1``, ``a finite number <= 0``, ``'auto', 'torch' or ...``)."""
        if self.kind == "choice":
            return ", ".join(repr(c) for c in self.choices[:-1]) + f" or {self.choices[-1]!r}"
        words = "an integer" if self.kind == "int" else "a finite number"
        bounds = [f">= {self.minimum}"] * (self.minimum is not None) + [f"<= {self.maximum}"] * (self.maximum is not None)
        return " ".join([words, *bounds])

    def problem(self, value) -> tuple[type, str] | None:
        """(exception class, what is wrong) when ``value`` is not an accepted value, else None."""
        if self.kind == "choice":
            return None if value in self.choices else (ValueError, f"must be {self.range_text()}")
        if self.kind == "int" and not is_int(value) or self.kind == "real" and not is_real(value):
            return TypeError, f"must be {self.range_text()}"
        if self.kind == "real" and not math.isfinite(float(value)) or \
                self.minimum is not None and value < self.minimum or self.maximum is not None and value > self.maximum:
            return ValueError, f"must be {self.range_text()}" + (f" ({self.reason})" if self.reason else "")
        return None


# The parameters the registered builders declare (one object per name, shared by the builders that take it).
PARAM_K = BuilderParam("k", "int", 64, "candidate count K per depth (top-K of the base logits)", minimum=1,
                       flag="--candidates")
PARAM_WIDTH = BuilderParam("width", "int", 12, "supertree width W per depth", minimum=1, flag="--width")
PARAM_BETA = BuilderParam("beta", "real", -0.2, "depth bonus beta of the ranking score + beta * depth (<= 0)",
                          maximum=0, flag="--beta", reason="beta > 0 breaks DARTree's prefix closure")
PARAM_CHILDREN = BuilderParam("children", "int", 4, "children per kept parent k", minimum=1, flag="--children")
PARAM_BACKEND = BuilderParam("backend", "choice", "auto", "kernel backend of candidate selection and frontier scoring",
                             choices=("auto", "torch", "triton"))


@dataclass(frozen=True)
class TreeBuilder:
    """A registered tree builder: ``build(block, head, root_id, budget, **params) -> Tree``, with the parameters it
    declares and whether it ranks its nodes by ``score + beta * depth``. Calling it calls ``build``.

    Attributes:
        name: its registered name.
        build: the function (arguments and errors in its own docstring).
        params: the :class:`BuilderParam` objects it takes.
        ranks_by_beta: True when its top-B keeps the best nodes by ``score + beta * depth`` (DARTree-pruned,
            heap-sequential); the ``budget="auto"`` policy then cuts its trees by the same rank.
        size: ``(P, params) -> int``, the most nodes its tree can have for P proposals whatever the budget (params:
            its parameters, declared defaults filled in, ``k`` capped by the head's candidates); None: the budget.
    """

    name: str
    build: Callable[..., Tree]
    params: tuple = ()
    ranks_by_beta: bool = False
    size: Callable[[int, dict], int] | None = None

    def __call__(self, *args, **kwargs) -> Tree:
        return self.build(*args, **kwargs)

    def max_nodes(self, budget: int, proposals: int, builder_params: dict | None = None,
                  head: CorrectionHead | None = None) -> int:
        """The most nodes it returns with ``budget`` for a drafter of ``proposals`` (P) proposals: ``budget``
        capped by :attr:`size` (a chain: P whatever the budget). ``builder_params`` as the builder takes them
        (declared defaults where absent); ``head`` caps ``k`` at its candidates (:func:`head_k`)."""
        if self.size is None:
            return int(budget)
        values = {p.name: p.default for p in self.params} | dict(builder_params or {})
        if head is not None and "k" in values:
            values["k"] = head_k(int(values["k"]), head)
        return min(int(budget), int(self.size(int(proposals), values)))

    def beta(self, builder_params: dict | None) -> float:
        """The depth bonus its ranking uses with ``builder_params`` (the declared default when absent), 0.0 for a
        builder that does not rank by beta."""
        if not self.ranks_by_beta:
            return 0.0
        default = next(p.default for p in self.params if p.name == "beta")
        return float((builder_params or {}).get("beta", default))


BUILDERS: dict[str, TreeBuilder] = {}


# the names the papers use for DARTree's two builders, accepted wherever a builder is named
BUILDER_ALIASES: dict[str, str] = {"dartree-pruned": "pruned", "dartree-fixed": "fixed"}


def register_builder(name: str, *, params: tuple = (), ranks_by_beta: bool = False,
                     size: Callable[[int, dict], int] | None = None):
    """Decorator registering a builder function in :data:`BUILDERS` under its one name, with the parameters it
    declares (:class:`BuilderParam`), whether it ranks by beta and the most nodes its tree can have
    (:attr:`TreeBuilder.size`; the warm-up prepares verify sizes up to it); the decorated function is returned
    unchanged.

    Raises:
        ValueError: the name is taken (by a builder or an alias of :data:`BUILDER_ALIASES`), a parameter name is
            declared by another builder with another meaning (kind, default, range or help), ``ranks_by_beta``
            without a ``beta`` parameter, or the function cannot be called as every builder is
            (:func:`builder_signature_problem`: the builder, the function and the parameter named).
    """

    def wrap(fn: Callable[..., Tree]) -> Callable[..., Tree]:
        if name in BUILDERS or name in BUILDER_ALIASES:
            raise ValueError(f"tree builder {name!r} is already registered")
        known = declared_params()
        for p in params:
            if p.name in known and known[p.name] != p:
                raise ValueError(f"tree builder {name!r} declares parameter {p.name!r} unlike the registered builders "
                                 f"({p} vs {known[p.name]}); reuse their BuilderParam or pick another name")
        if ranks_by_beta and "beta" not in {p.name for p in params}:
            raise ValueError(f"tree builder {name!r} ranks by beta but declares no 'beta' parameter")
        problem = builder_signature_problem(name, fn, tuple(params))
        if problem:
            raise ValueError(problem)
        BUILDERS[name] = TreeBuilder(name, fn, tuple(params), ranks_by_beta, size)
        return fn

    return wrap


def builder_signature_problem(name: str, fn: Callable, params: tuple) -> str:
    """What stops ``fn`` being called as every builder is, ``fn(block, head, root_id, budget, **params)`` with the
    parameters all builders declare (docs/trees.md), as one line naming the builder, the function and the parameter;
    "" when nothing does (or its signature cannot be read). Refused: fewer than the four positional arguments; a
    further argument without a default; no ``**extra`` (the parameters other builders declare arrive too); one of
    its declared ``params`` it takes positionally only, or with a default other than the declared one."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    kinds = inspect.Parameter
    args = list(sig.parameters.values())
    who = f"tree builder {name!r} ({getattr(fn, '__qualname__', type(fn).__name__)})"
    positional = [a for a in args if a.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 4 and not any(a.kind is kinds.VAR_POSITIONAL for a in args):
        return (f"{who} takes {len(positional)} positional argument(s); a builder is called as build(block, head, "
                "root_id, budget, **params)")
    for a in positional[4:] + [a for a in args if a.kind is kinds.KEYWORD_ONLY]:
        if a.default is a.empty:
            return f"{who} requires argument {a.name!r}, which no call passes; give it a default (the declared one)"
    if not any(a.kind is kinds.VAR_KEYWORD for a in args):
        return (f"{who} takes no **extra: every builder is called with the parameters all builders declare "
                f"({sorted(set(declared_params()) | {p.name for p in params})}); add **extra and ignore the others")
    for p in params:
        a = sig.parameters.get(p.name)
        if a is not None and a.kind is kinds.POSITIONAL_ONLY:
            return f"{who} takes its declared parameter {p.name!r} positionally only; it is passed by keyword"
        if a is not None and a.default is not a.empty and a.default != p.default:
            return (f"{who}: its argument {p.name}={a.default!r} differs from the declared default {p.default!r}; "
                    "make them equal (a call without that parameter must mean the declared default)")
    return ""


def declared_params() -> dict[str, BuilderParam]:
    """Every parameter some registered builder declares, by name, in registration order (a builder stored in
    :data:`BUILDERS` as a bare function, as tests do, declares none)."""
    out: dict[str, BuilderParam] = {}
    for spec in BUILDERS.values():
        for p in getattr(spec, "params", ()):
            out.setdefault(p.name, p)
    return out


def check_builder_params(params) -> None:
    """Check tree-builder parameters before the first round (the builders check again when called): every key is a
    parameter some registered builder declares (:func:`declared_params`), every value in its declared range.

    Args:
        params: None or a dict such as ``{"k": 64, "width": 12, "beta": -0.2}``.
    Raises:
        TypeError: not a dict, an unknown key (lists the known ones), or a value of the wrong type.
        ValueError: a value out of range (names the range).
    """
    if params is None:
        return
    known = declared_params()
    if not isinstance(params, dict):
        raise TypeError(f"builder_params is {type(params).__name__}; give a dict such as {{'k': 64, 'width': 12}}")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise TypeError(f"builder_params has unknown key(s) {unknown}; known: {sorted(known)}")
    for key, value in params.items():
        bad = known[key].problem(value)
        if bad is not None:
            raise bad[0](f"builder_params[{key!r}]={value!r} {bad[1]}")


def ranks_by_beta(name: str) -> bool:
    """Whether the builder called ``name`` (or its alias) ranks nodes by ``score + beta * depth``.

    Raises:
        ValueError: unknown name (:func:`builder_name`).
    """
    return bool(getattr(get_builder(name), "ranks_by_beta", False))


def builder_beta(name: str, builder_params: dict | None = None) -> float:
    """The depth bonus the builder called ``name`` ranks by with ``builder_params`` (its declared default when absent;
    0.0 for a builder that does not rank by beta).

    Raises:
        ValueError: unknown name (:func:`builder_name`).
    """
    spec = get_builder(name)
    return spec.beta(builder_params) if isinstance(spec, TreeBuilder) else 0.0


def builder_name(name: str) -> str:
    """The registered name of a builder called ``name`` (itself, or what its alias in :data:`BUILDER_ALIASES`
    stands for: ``dartree-pruned`` -> ``pruned``).

    Raises:
        ValueError: unknown name; the message lists the registered names and the aliases.
    """
    name = BUILDER_ALIASES.get(name, name)
    if name not in BUILDERS:
        raise ValueError(f"unknown tree builder {name!r}; available: {sorted(BUILDERS)} (aliases: "
                       + ", ".join(f"{a} = {b}" for a, b in sorted(BUILDER_ALIASES.items())) + ")")
    return name


def get_builder(name: str) -> TreeBuilder:
    """Look a builder up by its name or an alias (:func:`builder_name`).

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    return BUILDERS[builder_name(name)]


# The shipped builders, in registration order (the order of BUILDERS, of declared_params() and of the flags).
register_builder("chain", params=(PARAM_K, PARAM_BACKEND), size=lambda p, v: p)(build_chain)
register_builder("pruned", params=(PARAM_K, PARAM_WIDTH, PARAM_BETA, PARAM_BACKEND), ranks_by_beta=True,
                 size=lambda p, v: p * int(v["width"]))(build_dartree_pruned)  # at most W nodes per depth
register_builder("fixed", params=(PARAM_K, PARAM_BACKEND),
                 size=lambda p, v: _kary_nodes(int(v["k"]), p))(build_dartree_fixed)
register_builder("pctree", params=(PARAM_K, PARAM_CHILDREN, PARAM_BACKEND),
                 size=lambda p, v: p * int(v["children"]))(build_pctree)  # ``children`` nodes kept per depth
register_builder("heap-sequential", params=(PARAM_K, PARAM_BETA, PARAM_BACKEND), ranks_by_beta=True,
                 size=lambda p, v: _kary_nodes(int(v["k"]), p))(build_heap_sequential)
register_builder("ddtree", params=(PARAM_BACKEND,))(build_ddtree)

# the builders' check of their **extra accepts what the registered builders declare
use_declared_params(declared_params)

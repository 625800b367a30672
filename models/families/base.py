"""What a drafter family is, and the registry that finds one by name (docs/families.md).

A *family* is one way of training and reading a DFlash drafter's correction head: DFlash (no correction), DSpark
(Markov heads), Domino (GRU head), DFlash 2 (candidate selector). Its module declares, in one place:

- the head classes it trains (:class:`~dartree.models.heads.CorrectionHead` subclasses; each class carries its
  checkpoint hyper-parameter table, ``fields``);
- :meth:`Family.head_kwargs`: the constructor arguments of its head from a recipe's ``head`` section (its defaults);
- :meth:`Family.objective`: its training loss as an :class:`Objective`, from the recipe's ``loss`` and ``head``
  sections;
- :meth:`Family.recipe_problems`: recipe combinations it cannot train (one line each);
- :attr:`Family.recipe_fields`: ``head`` keys of its own that recipes may set (beside the shared ones of
  :class:`dartree.training.recipe.HeadSection`), each with its default and allowed values;
- its published names: :attr:`Family.published` (the names of its head tensors in the publishers' checkpoints),
  :attr:`Family.published_types` (the publishers' names of its head types), :attr:`Family.speculators_type` /
  :attr:`Family.speculators_architecture` (the vLLM speculators model that carries it) and :attr:`Family.export_to`
  (the ``--to`` layouts that write it). The publishers' readers and writers in :mod:`dartree.convert` look them up
  by head type (:func:`published_names`, :func:`published_type`), so they hold no table per family.

The family's registered name is the recipe's ``loss.type``. Registering it registers its head classes under their
``type_name`` (the checkpoint config's ``head.type``) in :data:`dartree.models.heads.HEADS`, so checkpoints of its
heads load through :func:`dartree.models.checkpoint.load_dartree` once the family's module is imported; the lookup by
name (:func:`build_head`, :func:`head_fields`) is here, where every built-in family is imported first (this module's
package does) and the installed packages' families on the first lookup.

Registry habits follow SpecForge's draft-model registry (``specforge/modeling/auto.py``): a duplicate name is
refused, and a lookup of an unknown name lists the registered ones.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dartree.models.families.plugins import load_entry_point_families
from dartree.models.heads import HEADS, CorrectionHead, check_head_class, register_head


@dataclass(frozen=True)
class Objective:
    """A family's training loss as weights of the terms every DFlash-family loss is made of (nats, per prediction,
    decay-weighted by exp(-k / gamma) over the P proposals and normalised as ``loss.normalization`` says;
    :mod:`dartree.training.losses` computes them):

    - CE of the final logits x = U + A · W^T (``corrected``) or of the base logits U alone (not ``corrected``);
    - with ``base_weight`` w (not None): ``(1 - w) CE(x) + w CE(U)`` (Domino, arXiv 2605.29707; DFlash 2's unary +
      selector CE at w = 0.5), where ``curriculum`` (step, total steps) -> w gives w per optimiser step;
    - else ``ce_weight CE + (l1_weight + tv_weight / 2) L1 + kl_weight KL(p_t || p_d) + lk_weight LK +
      conf_weight BCE`` (DSpark, arXiv 2607.05147, Sec. 3.3), the L1 distance sum_v |p_d - p_t|, the KL to the
      target's distribution p_t, the LK loss lambda KL + (1 - lambda) TV (arXiv 2602.23881; lambda ``lk_lambda``,
      or exp(-``lk_eta`` (1 - TV)) when None), and the confidence BCE when the head carries a confidence head
      (``confidence``).

    Attributes:
        gamma: decay length of the position weights (None: weight 1).
        corrected: train the head's correction (False: plain DFlash, the CE of U).
        ce_weight, l1_weight, tv_weight, kl_weight, conf_weight: the distribution-matching weights (``base_weight``
            None only).
        confidence: the recipe trains a confidence head (``head.confidence_head``).
        base_weight: the weight w of CE(U), or None for no base term.
        curriculum: (step, total_steps) -> w in [0, 1], or None for a fixed ``base_weight``.
        logged: names of the step's loss terms shown beside ``loss`` and ``ce`` (``l1``, ``kl``, ``lam``).
        block_loss: None (the terms above), or a loss that is not made of them, computed by the family itself:
            ``block_loss(drafter, head, blocks, *, gen, progress, denom)`` -> {"loss", "ce", "l1", "hit" [A, P]} for
            one sequence's step tensors (``dartree.training.step.StepBlocks``), its anchor generator, (optimiser
            step, planned steps) or None, and the batch denominator or None.
    """

    gamma: float | None
    corrected: bool = True
    ce_weight: float = 1.0
    l1_weight: float = 0.0
    tv_weight: float = 0.0
    kl_weight: float = 0.0
    conf_weight: float = 0.0
    lk_weight: float = 0.0
    lk_lambda: float | None = None
    lk_eta: float = 3.0
    confidence: bool = False
    base_weight: float | None = None
    curriculum: Callable[[int, int], float] | None = None
    logged: tuple[str, ...] = ()
    block_loss: Callable | None = None

    @property
    def l1_coef(self) -> float:
        """The L1 distance's coefficient: ``l1_weight + tv_weight / 2`` (the total variation is L1 / 2)."""
        return self.l1_weight + 0.5 * self.tv_weight

    def distribution_weights(self) -> tuple[float, float, float]:
        """(L1 coefficient, KL weight, 1.0 / 0.0 for a trained confidence head): the terms that read the target's
        distribution p_t; all 0 for a family that compares with the labels only. The LK loss counts in both the L1
        (its TV, over the full vocabulary) and the KL."""
        return self.l1_coef + self.lk_weight, self.kl_weight + self.lk_weight, float(self.confidence)

    def lam(self, step: int | None = None, total: int | None = None) -> float | None:
        """The base-CE weight w at optimiser ``step`` of ``total`` (the curriculum's value; 0.0 without a step, as
        held-out evaluation reports it), the fixed ``base_weight``, or None for an objective without a base term."""
        if self.curriculum is None:
            return self.base_weight
        return 0.0 if step is None else float(self.curriculum(step, total))


class Family:
    """A drafter family (module docstring). Subclass it in the family's module and register one instance with
    :func:`register_family`.

    Attributes:
        name: the registered name, the recipe's ``loss.type``.
        heads: the head classes it trains (their ``type_name`` is the recipe's ``head.type``).
        confidence: its heads may carry DSpark's confidence head (``head.confidence_head=true`` is refused
            elsewhere).
        distribution: its loss has the terms that compare with the target's distribution (``loss.tv_weight`` /
            ``loss.kl_weight`` > 0 are refused elsewhere).
        recipe_fields: recipe ``head`` keys this family adds: name -> (default, rule), the rule a
            :mod:`dartree.base.fields` field rule (``Range``, ``Flag``, ``Choice``); every recipe then holds them.
        published: its head tensors' names in the publishers' checkpoints: dartree name without ``head.`` (as
            ``state_dict`` spells it, ``w1.weight``) -> published name (``markov_head.markov_w1.weight``), one table
            for every head type of the family and every publisher that carries it (SpecForge, DeepSpec, z-lab, vLLM
            speculators name a family's tensors alike); a head tensor missing here has no published counterpart, so
            converting it is refused by name. Empty: the heads have no tensors (``identity``) or no publisher.
        published_types: dartree head type -> the publishers' name for it, where their configs choose among the
            family's heads (DSpark's ``markov_head_type``: ``markov`` -> ``vanilla``); empty otherwise.
        speculators_type, speculators_architecture: the vLLM speculators ``speculators_model_type`` that carries the
            family's heads and its ``architectures`` entry (``dspark``, ``DSparkSpeculator``); empty: speculators has
            no form for them.
        export_to: the ``--to`` layouts that write the family's heads, the first the family's own (``zlab-dflash``),
            named when an export to another layout is refused; empty: no published layout carries them.
    """

    name: str = ""
    heads: tuple[type[CorrectionHead], ...] = ()
    confidence: bool = False
    distribution: bool = False
    recipe_fields: dict[str, tuple[Any, Any]] = {}
    published: dict[str, str] = {}
    published_types: dict[str, str] = {}
    speculators_type: str = ""
    speculators_architecture: str = ""
    export_to: tuple[str, ...] = ()

    def head_kwargs(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int) -> dict:
        """Constructor arguments of the recipe's head (``head.type``) for a target of ``vocab_size`` tokens and
        hidden size ``hidden_size``, the family's defaults filling what the recipe leaves null."""
        raise NotImplementedError

    def objective(self, loss: Mapping[str, Any], head: Mapping[str, Any]) -> Objective:
        """The family's training loss from the recipe's ``loss`` and ``head`` sections."""
        raise NotImplementedError

    def recipe_problems(self, recipe: Mapping[str, Any]) -> list[str]:
        """Combinations of the merged recipe this family cannot train, one line each naming the key, the value and
        the fix (none by default). ``recipe``: the recipe as plain data, section name -> {key: value}."""
        return []

    def head_types(self) -> list[str]:
        """The ``head.type`` names this family trains."""
        return [cls.type_name for cls in self.heads]

    def build_head(self, head: Mapping[str, Any], vocab_size: int, hidden_size: int,
                   num_layers: int | None = None) -> CorrectionHead:
        """A fresh head of the recipe's ``head.type`` (:meth:`head_kwargs`); a head class whose constructor takes
        ``num_layers`` (tensors per drafter layer) gets the drafter's ``num_layers`` when given.

        Raises:
            KeyError: ``head.type`` is not one of this family's heads (the message lists them).
            ValueError: a hyper-parameter out of range (named by the head).
        """
        by_name = {cls.type_name: cls for cls in self.heads}
        if head["type"] not in by_name:
            raise KeyError(f"loss.type {self.name!r} trains head.type {sorted(by_name)}, not {head['type']!r}")
        cls, kwargs = by_name[head["type"]], self.head_kwargs(head, vocab_size, hidden_size)
        if num_layers is not None and "num_layers" in inspect.signature(cls).parameters:  # tensors per drafter layer
            kwargs.setdefault("num_layers", int(num_layers))
        return cls(**kwargs)


FAMILIES: dict[str, Family] = {}

# What a family class must define, checked when it registers (the base class's versions raise NotImplementedError)
REQUIRED_FAMILY_METHODS = ("head_kwargs", "objective")


def check_family_class(family: Family) -> None:
    """Refuse a family that cannot train, before it registers: a method of :data:`REQUIRED_FAMILY_METHODS` its class
    does not define, no head classes, or a head class :func:`dartree.models.heads.check_head_class` refuses.

    Raises:
        ValueError: one line naming the family's class and the method (or the head class and its method).
    """
    cls = type(family)
    name = f"drafter family {family.name!r} ({cls.__name__})"
    missing = [m for m in REQUIRED_FAMILY_METHODS if getattr(cls, m) is getattr(Family, m)]
    if missing:
        raise ValueError(f"{name} does not define {', '.join(m + '()' for m in missing)}: every family must "
                         f"(dartree.models.families.Family says what each returns); define "
                         f"{'it' if len(missing) == 1 else 'them'}")
    if not isinstance(family.heads, (tuple, list)) or not family.heads:
        raise ValueError(f"{name} has heads={family.heads!r}; set heads to the tuple of head classes it trains")
    for head in family.heads:
        try:
            check_head_class(head)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


def register_family(family: Family) -> Family:
    """Add ``family`` to the registry under ``family.name`` and its head classes to the head registry
    (:data:`dartree.models.heads.HEADS`; a class registered there already is kept).

    Raises:
        ValueError: the family name is taken (the registered family's class named), the family or one of its head
            classes lacks a method every one defines (:func:`check_family_class`; the class and the method named),
            one of its head names belongs to another class, a recipe field is declared by another family with
            another default, or its ``published_types`` names a head type it does not train. Nothing is registered
            then.
    """
    if not family.name:
        raise ValueError(f"{type(family).__name__} has no name: set the class attribute name (the recipe's loss.type)")
    if family.name in FAMILIES:
        have = type(FAMILIES[family.name])
        raise ValueError(f"drafter family {family.name!r} is already registered (by {have.__module__}."
                         f"{have.__qualname__}); give {type(family).__name__} another name")
    check_family_class(family)
    # a family whose head names, recipe fields or published types clash is refused here, before anything is
    # registered
    declared = recipe_fields()
    for key, (default, _) in family.recipe_fields.items():
        if key in declared and declared[key][0] != default:
            raise ValueError(f"family {family.name!r}: recipe field head.{key} is already declared with default "
                             f"{declared[key][0]!r}; use that default or another name")
    strangers = sorted(set(family.published_types) - set(family.head_types()))
    if strangers:
        raise ValueError(f"family {family.name!r}: published_types names head types {strangers} it does not train "
                         f"(its heads: {family.head_types()})")
    for cls in family.heads:
        known = HEADS.get(cls.type_name)
        if known is not None and known is not cls:
            raise ValueError(f"family {family.name!r}: head type {cls.type_name!r} is already registered as "
                             f"{known.__module__}.{known.__name__}; give {cls.__name__} another type_name")
    for cls in family.heads:
        if cls.type_name not in HEADS:
            register_head(cls)
    FAMILIES[family.name] = family
    return family


def build_head(type_name: str, **params) -> CorrectionHead:
    """Construct a head by registered name (its family's constructor arguments ``params``); the families of installed
    packages (:func:`~dartree.models.families.plugins.load_entry_point_families`) are loaded first.

    Raises:
        KeyError: unknown name; the message lists the registered ones (a head of a family outside
            :mod:`dartree.models.families` registers when its family's module is imported).
    """
    load_entry_point_families()
    if type_name not in HEADS:
        raise KeyError(f"unknown head type {type_name!r}; available: {sorted(HEADS)} (a head of another drafter "
                       "family registers when that family's module is imported: install its package, whose "
                       "dartree.families entry point imports it, or, from Python, import the module first)")
    return HEADS[type_name](**params)


def head_fields(type_name) -> dict:
    """The hyper-parameter rules (:attr:`~dartree.models.heads.CorrectionHead.fields`) of the registered head type
    ``type_name``; {} for an unknown name (its lookup error comes from :func:`build_head`)."""
    load_entry_point_families()
    cls = HEADS.get(type_name) if isinstance(type_name, str) else None
    return dict(cls.fields) if cls is not None else {}


def get_family(name: str) -> Family:
    """The registered family ``name`` (a recipe's ``loss.type``).

    Raises:
        KeyError: unknown name; the message lists the registered ones.
    """
    if name not in FAMILIES:
        raise KeyError(f"unknown drafter family (loss.type) {name!r}; available: {sorted(FAMILIES)}")
    return FAMILIES[name]


def recipe_fields() -> dict[str, tuple[Any, Any]]:
    """The recipe ``head`` keys the registered families add (:attr:`Family.recipe_fields`): name -> (default, rule)."""
    out: dict[str, tuple[Any, Any]] = {}
    for fam in FAMILIES.values():
        out.update(fam.recipe_fields)
    return out


def family_of_head(type_name: str) -> Family | None:
    """The registered family that trains head type ``type_name``, or None."""
    for fam in FAMILIES.values():
        if type_name in fam.head_types():
            return fam
    return None


def _published_family(type_name: str, what: str) -> Family:
    """The registered family of head type ``type_name`` for a published-name lookup (``what``, for the message);
    on a miss the installed packages' ``dartree.families`` entry points are loaded first
    (:func:`dartree.models.families.plugins.load_entry_point_families`), as a head lookup does.

    Raises:
        KeyError: no registered family trains it; the message names it and lists the registered head types.
    """
    fam = family_of_head(type_name)
    if fam is None:
        load_entry_point_families()
        fam = family_of_head(type_name)
    if fam is None:
        known = sorted(t for f in FAMILIES.values() for t in f.head_types())
        raise KeyError(f"head type {type_name!r} belongs to no registered drafter family, so it has no {what}; "
                       f"registered head types: {known} (install the package whose dartree.families entry point "
                       "imports its family, or import the family's module first)")
    return fam


def published_names(type_name: str) -> dict[str, str]:
    """The published names of head type ``type_name``'s tensors (its family's :attr:`Family.published`): dartree
    name without ``head.`` -> published name, e.g. ``markov`` -> ``{"w1.weight": "markov_head.markov_w1.weight",
    ...}``, ``identity`` -> ``{}``. A copy.

    Raises:
        KeyError: no registered family trains ``type_name`` (the message lists the registered head types).
    """
    return dict(_published_family(type_name, "published tensor names").published)


def published_type(type_name: str) -> str:
    """The publishers' config name of head type ``type_name`` (its family's :attr:`Family.published_types`), e.g.
    ``gated_markov`` -> ``gated`` (DSpark's ``markov_head_type``).

    Raises:
        KeyError: no registered family trains ``type_name``, or its family gives it no published name (both named).
    """
    fam = _published_family(type_name, "published type name")
    if type_name not in fam.published_types:
        raise KeyError(f"head type {type_name!r} (family {fam.name!r}) has no published type name; the family "
                       f"names {sorted(fam.published_types) or 'none'}")
    return fam.published_types[type_name]

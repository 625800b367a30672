"""Drafter families, one module each, registered by name (the recipe's ``loss.type``): :mod:`.dflash`,
:mod:`.dspark`, :mod:`.domino`, :mod:`.dflash2`, :mod:`.dspine`; families of installed packages register through the
``dartree.families`` entry points when a head or a recipe is first looked up (:mod:`.plugins`). :mod:`.base` defines a family and the registry; docs/families.md
says how to add one."""

from dartree.models.families.base import (FAMILIES, Family, Objective, build_head, family_of_head, get_family,
                                          head_fields, published_names, published_type, recipe_fields, register_family)
from dartree.models.families import dflash, dflash2, domino, dspark, dspine  # noqa: F401  (each registers its family)

__all__ = ["FAMILIES", "Family", "Objective", "build_head", "family_of_head", "get_family", "head_fields",
           "published_names", "published_type", "recipe_fields", "register_family"]

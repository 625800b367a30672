"""Settings merged from files and ``key=value`` words into a struct-mode omegaconf schema, with one-line errors: a
misspelt key names the valid keys at its level, an ill-typed value names its key (recipes as data, torchtune's habit;
the recipe, the campaign, the burst and the comparison load their settings so). omegaconf is imported when called.
"""

from __future__ import annotations


def valid_keys(schema, dotted: str) -> list[str]:
    """The keys of the DictConfig ``schema`` at the level of the dotted key ``dotted`` (its parent's keys)."""
    from omegaconf import DictConfig

    node = schema
    for part in dotted.split(".")[:-1]:
        if not (isinstance(node, DictConfig) and part in node):
            break
        node = node[part]
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def merge_settings(schema, sources, error: type[Exception]):
    """``schema`` (a dataclass, made a struct-mode DictConfig, or a DictConfig) merged with each ``(source, label)``
    of ``sources`` in turn: a DictConfig (``OmegaConf.from_dotlist`` of the words, a loaded YAML file) and the name
    messages give it.

    Raises:
        error: ``unknown key 'K' in LABEL; valid keys there: [...]`` or ``bad value for 'K' in LABEL: reason``.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if not isinstance(schema, DictConfig):
        schema = OmegaConf.structured(schema)
        OmegaConf.set_struct(schema, True)
    for source, label in sources:
        try:
            schema = OmegaConf.merge(schema, source)
        except (ConfigKeyError, ConfigAttributeError) as exc:
            key = str(getattr(exc, "full_key", None) or exc)
            raise error(f"unknown key {key!r} in {label}; valid keys there: {valid_keys(schema, key)}") from None
        except ValidationError as exc:
            msg = (getattr(exc, "msg", None) or str(exc) or "wrong type").strip().splitlines()[0]
            key = getattr(exc, "full_key", None)
            where = f"{key!r}" if key else "a section (give key=value for a field inside it)"
            raise error(f"bad value for {where} in {label}: {msg}") from None
    return schema

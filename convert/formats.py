"""Shared pieces of the published drafter layouts, used by every publisher module (:mod:`dartree.convert.zlab`,
:mod:`dartree.convert.specforge`, :mod:`dartree.convert.deepspec`, :mod:`dartree.convert.vllm_speculators`).

Every published drafter is the DFlash backbone of z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel``): a Qwen3
config (transformers ``Qwen3Config``) and Qwen3 layers ``layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm`` plus ``fc``,
``hidden_norm`` and ``norm``; no embedding or lm_head. Here: the names of those tensors (:func:`backbone_name`),
the renaming of a drafter's tensors by its head type's published names (:func:`published_name`; the names live
with the head's family, :attr:`dartree.models.families.Family.published`, the same for every publisher), the
checked reading of config fields (:func:`field`, :func:`backbone`, :func:`dspark_head`), the strict tensor checks
(:func:`check_tensors`, :func:`check_copy_of_target`) and the base config.json of an export (:func:`export_config`).

Both transformers config layouts are read: ``rope_theta`` at the top level (transformers 4) or under
``rope_parameters`` (transformers 5). Exports write the transformers-4 layout, as the published configs do.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable

from dartree.models.checkpoint import CheckpointError, dartree_config, expected_tensors
from dartree.models.families import family_of_head, get_family, published_names
from dartree.models.target import model_id
from dartree.base.fields import Flag, Range

QWEN3 = ("hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
         "head_dim, rms_norm_eps, vocab_size, rope_theta (or rope_parameters.rope_theta)")
_LEGACY_PREFIXES = ("prefix_gru.", "embed_proj.", "markov_head.", "confidence_head.")
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_MLP = {"gate_proj", "up_proj", "down_proj"}


@dataclass(frozen=True)
class ConfigLayout:
    """How one publisher lays out a DFlash-family config.json, for the shared readers below.

    Attributes:
        name: the layout's ``--from`` name, for messages (``unknown config layout for NAME``).
        expected: the fields the layout needs, listed when one is missing.
        nested: drafter fields are read from ``dflash_config`` first, then the top level (z-lab, SpecForge);
            False: the top level only (DeepSpec).
    """

    name: str
    expected: str
    nested: bool = True


def backbone_name(name: str) -> str:
    """The published name of a dartree backbone tensor (``backbone.*``), the same in every layout.

    ``backbone.layers.{i}.q_proj.weight`` -> ``layers.{i}.self_attn.q_proj.weight``, ``...gate_proj...`` ->
    ``layers.{i}.mlp.gate_proj...``; other names (``fc``, ``hidden_norm``, ``norm``, DFlash 2's
    ``layers.{i}.{attention,mlp}_conv.*``) lose the ``backbone.`` prefix.
    """
    m = _LAYER.match(name)
    if m:
        i, rest = m.groups()
        mod = rest.split(".", 1)[0]
        if mod in _ATTN:
            return f"layers.{i}.self_attn.{rest}"
        if mod in _MLP:
            return f"layers.{i}.mlp.{rest}"
        return f"layers.{i}.{rest}"
    return name[len("backbone."):]


def published_name(name: str, heads: dict[str, str], fmt: str) -> str:
    """Map a dartree tensor name (``backbone.*`` / ``head.*``) to its name in the published layout ``fmt``.

    Args:
        name: the dartree name. heads: the head's published names, dartree name without ``head.`` -> published name
            (:func:`dartree.models.families.published_names` of its head type; empty for a head without tensors).
        fmt: the layout's name, for the message.
    Raises:
        CheckpointError: a head tensor that ``heads`` has no name for (the head type does not fit the layout).
    """
    if name.startswith("backbone."):
        return backbone_name(name)
    local = name[len("head."):]
    if local not in heads:
        raise CheckpointError(f"tensor {name!r} has no counterpart in the {fmt} layout")
    return heads[local]


def strip_legacy(tensors: dict, where) -> dict:
    """Rename older SpecForge ``logit_head.{prefix_gru,embed_proj,markov_head,confidence_head}.*`` tensors to
    the direct layout (SpecForge ``normalize_draft_head_checkpoint_keys``).

    Raises:
        CheckpointError: both the legacy and the direct name of one tensor are present.
    """
    out = {}
    for k, v in tensors.items():
        new = k
        if k.startswith("logit_head.") and k[len("logit_head."):].startswith(_LEGACY_PREFIXES):
            new = k[len("logit_head."):]
        if new in out:
            raise CheckpointError(f"{where}: tensor {new!r} appears twice (also as {k!r}); keep one of them")
        out[new] = v
    return out


# rules of :func:`field`: sizes / counts (>= 1), ids / ranks (>= 0), positive reals, reals >= 0
INT1, INT0 = Range(1), Range(0)
POSITIVE, REAL0 = Range(0, integer=False, lo_open=True), Range(0, integer=False)


def field(value, key: str, where, rule=INT1):
    """The value of published config field ``key``, checked and typed: every number or flag a published reader
    takes from a config.json goes through here (never a bare ``int(cfg[...])``, which fails with a traceback
    on ``"abc"`` and reads the string ``"false"`` as true).

    Args:
        value: the field's value as read from JSON. key: its name for the message (``hidden_size``).
        where: the file, for the message. rule: a :class:`~dartree.base.fields.Range` (default: an integer
            >= 1) or :class:`~dartree.base.fields.Flag`.
    Returns:
        ``int`` (integer ranges), ``float`` (real ranges) or ``bool`` (flags).
    Raises:
        CheckpointError: one line naming the file, the field, the value and the allowed range.
    """
    problem = rule.problem(key, value)
    if problem:
        raise CheckpointError(f"{where}: {problem}; correct {key} in that file or re-export the drafter")
    if isinstance(rule, Flag):
        return bool(value)
    return int(value) if rule.integer else float(value)


def flag(value, key: str, where) -> bool:
    """A published flag: true / false, or null (false, as ``bool(None)`` always read it).

    Raises:
        CheckpointError: any other value (:func:`field`).
    """
    return False if value is None else field(value, key, where, Flag())


def dflash_config(config: dict) -> dict:
    """The config's ``dflash_config`` object (z-lab / SpecForge), or ``{}`` when it is absent or not an object."""
    dc = config.get("dflash_config")
    return dc if isinstance(dc, dict) else {}


def config_value(config: dict, key: str, *, where, layout: ConfigLayout, default=...):
    """Field ``key`` from ``dflash_config`` (when ``layout.nested``) or the top level.

    Raises:
        CheckpointError: absent and no ``default``; the message lists ``layout.expected``.
    """
    dc = config.get("dflash_config") or {}
    if layout.nested and key in dc:
        return dc[key]
    if key in config:
        return config[key]
    if default is not ...:
        return default
    place = f"dflash_config.{key} or {key}" if layout.nested else key
    raise CheckpointError(f"{where}: unknown config layout for {layout.name}: no {place}; expected {layout.expected}")


def _rope_theta(config: dict, where, layout: ConfigLayout) -> float:
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        if rp.get("rope_type", "default") != "default":
            raise CheckpointError(f"{where}: rope_parameters.rope_type {rp['rope_type']!r} is not supported "
                                  "(dartree drafters use plain RoPE); only 'default' converts")
        return field(rp["rope_theta"], "rope_parameters.rope_theta", where, POSITIVE)
    if "rope_theta" in config:
        rs = config.get("rope_scaling")
        if rs and (rs.get("rope_type") or rs.get("type")) not in (None, "default"):
            raise CheckpointError(f"{where}: rope_scaling {rs!r} is not supported (dartree drafters use plain "
                                  "RoPE); only null or type 'default' converts")
        return field(config["rope_theta"], "rope_theta", where, POSITIVE)
    raise CheckpointError(f"{where}: unknown config layout for {layout.name}: no rope_theta at the top level "
                          f"(transformers 4) nor rope_parameters.rope_theta (transformers 5); expected {layout.expected}")


def effective_layer_types(config: dict, where="config.json") -> list[str]:
    """Per-layer attention types exactly as transformers' Qwen3Config (and so z-lab / SpecForge) resolve them.

    ``layer_types`` when given; else every layer is ``full_attention`` unless ``use_sliding_window`` is true and
    ``sliding_window`` (default 4096) is set, in which case layers ``i >= max_window_layers`` (default 28) are
    ``sliding_attention`` (transformers ``Qwen3Config.__post_init__``). Returns one entry per
    ``num_hidden_layers``. ``where`` names the file in the error on a non-integer count (:func:`field`).
    """
    if config.get("layer_types"):
        return list(config["layer_types"])
    n = field(config.get("num_hidden_layers") or 0, "num_hidden_layers", where, INT0)
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    first = 28 if config.get("max_window_layers") is None else field(config["max_window_layers"], "max_window_layers", where, INT0)
    return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]


def _check_supported(config: dict, where) -> None:
    """Refuse published options dartree's backbone does not implement (each named with its value)."""
    dc = config.get("dflash_config") or {}
    if config.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true is not supported (dartree layers have no q/k/v/o bias)")
    bad_types = sorted(set(effective_layer_types(config, where)) - {"full_attention"})
    if bad_types:
        how = ("layer_types" if config.get("layer_types") else
               f"use_sliding_window=true with max_window_layers={config.get('max_window_layers', 28)} (transformers "
               "derives sliding_attention layers from them)")
        raise CheckpointError(f"{where}: {how} gives {bad_types} layers (sliding_window="
                              f"{config.get('sliding_window', 4096)}), which are not supported; dartree drafters "
                              "attend over the whole context and the whole block (full_attention only)")
    if dc.get("use_swa") or dc.get("swa_window_size"):
        raise CheckpointError(f"{where}: dflash_config.use_swa={dc.get('use_swa')} / swa_window_size="
                              f"{dc.get('swa_window_size')} (ModelOpt sliding-window attention) is not supported; "
                              "dartree drafters attend over the whole context (full_attention only)")
    for key, ok in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        val = dc.get(key, config.get(key, ok))
        if val is not None and field(val, key, where, REAL0) != ok:
            raise CheckpointError(f"{where}: {key}={val} is not supported; dartree converts only {ok}")
    if dc.get("final_logit_softcapping", config.get("final_logit_softcapping")):
        raise CheckpointError(f"{where}: final_logit_softcapping is not supported by dartree")
    if dc.get("is_causal", config.get("is_causal")):
        raise CheckpointError(f"{where}: is_causal=true is not supported (DFlash blocks attend bidirectionally)")


def resolve_mask_token_id(tokenizer, vocab_size: int) -> int | None:
    """The MASK id SpecForge picks when a draft config names none (SpecForge
    ``training/model_utils.resolve_mask_token_id``, without an explicit or config id): the tokenizer's mask token,
    else the first embedding row past the tokenizer (``len(tokenizer)`` when it is < ``vocab_size``), else its pad,
    eos, then unk token; the first candidate inside ``[0, vocab_size)`` wins. Returns None when none fits.
    """
    if tokenizer is None:
        return None
    cands = [getattr(tokenizer, "mask_token_id", None)]
    try:
        size = len(tokenizer)
    except TypeError:
        size = vocab_size
    if size < vocab_size:
        cands.append(size)
    cands += [getattr(tokenizer, a, None) for a in ("pad_token_id", "eos_token_id", "unk_token_id")]
    for c in cands:
        if c is not None and 0 <= int(c) < vocab_size:
            return int(c)
    return None


def _mask_token_id(config: dict, where, layout: ConfigLayout, target) -> int:
    """``mask_token_id`` from the config; when absent, resolved from ``target``'s tokenizer as SpecForge does.

    Raises:
        CheckpointError: absent and no target tokenizer to resolve it from (the message names both fixes).
    """
    if "mask_token_id" in (config.get("dflash_config") or {}) or "mask_token_id" in config:
        val = config_value(config, "mask_token_id", where=where, layout=layout)
        if val is not None:
            return field(val, "mask_token_id", where, INT0)
    vocab = field(config.get("vocab_size") or 0, "vocab_size", where, INT0)
    resolved = resolve_mask_token_id(getattr(target, "tokenizer", None), vocab)
    if resolved is None:
        place = "dflash_config.mask_token_id" if layout.nested else "mask_token_id"
        raise CheckpointError(
            f"{where}: the config names no {place}; SpecForge then resolves it from the target's tokenizer (its "
            "mask token, the first unused embedding row, pad, eos, unk): pass --target with the target's folder "
            f"(it has a tokenizer) to resolve it the same way, or write {place} into config.json")
    return resolved


def backbone(config: dict, where, layout: ConfigLayout, *, proposal_offset: int, target=None) -> dict:
    """dartree ``drafter`` fields from a published Qwen3-style DFlash config (z-lab ``DFlashDraftModel``).

    Args:
        config: the config.json dict. where: the file, for messages. layout: the publisher's
            :class:`ConfigLayout`. proposal_offset: the layout's first proposed block position (0 or 1).
        target: optional :class:`~dartree.models.target.Target`; its tokenizer resolves a missing MASK id the way
            SpecForge does (:func:`resolve_mask_token_id`).
    Returns:
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, rms_norm_eps, qk_norm,
        target_layer_ids, mask_token_id, block_size, proposal_offset, rope_theta.
    Raises:
        CheckpointError: a missing field (the message lists ``layout.expected``), a value out of range, or an
            option dartree does not implement (sliding windows, attention bias, softcapping, RoPE scaling, ...),
            each named with its value.
    """
    _check_supported(config, where)
    try:
        d = field(config["hidden_size"], "hidden_size", where)
        heads = field(config["num_attention_heads"], "num_attention_heads", where)
        out = {
            "hidden_size": d,
            "intermediate_size": field(config["intermediate_size"], "intermediate_size", where),
            "num_layers": field(config["num_hidden_layers"], "num_hidden_layers", where),
            "num_heads": heads,
            "num_kv_heads": field(config.get("num_key_value_heads") or heads, "num_key_value_heads", where),
            "head_dim": field(config.get("head_dim") or d // heads, "head_dim", where),
            "rms_norm_eps": field(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, POSITIVE),
            "qk_norm": True,  # Qwen3 layers always carry q_norm / k_norm
        }
        field(config["vocab_size"], "vocab_size", where)
    except KeyError as exc:
        raise CheckpointError(f"{where}: unknown config layout for {layout.name}: no {exc.args[0]}; "
                              f"expected {layout.expected}") from None
    ids = config_value(config, "target_layer_ids", where=where, layout=layout)
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise CheckpointError(f"{where}: target_layer_ids {ids!r} must be a list of layer indices >= 0 "
                              "(DeepSpec's -1, the embedding output, is not supported by dartree)")
    out.update(
        target_layer_ids=list(ids),
        mask_token_id=_mask_token_id(config, where, layout, target),
        block_size=field(config_value(config, "block_size", where=where, layout=layout), "block_size", where,
                         Range(2)),
        proposal_offset=proposal_offset,
        rope_theta=_rope_theta(config, where, layout),
    )
    return out


def dspark_head(rank: int, kind, confidence: bool, with_markov: bool, *, vocab: int, hidden: int, where) -> dict:
    """The dartree head config of a DSpark head (SpecForge ``dspark_heads.py`` ``build_markov_head``; DeepSpec and
    speculators ``dspark`` carry the same head), from fields each publisher reads with its own defaults.

    Args:
        rank: ``markov_rank`` R (0: no Markov head). kind: ``markov_head_type`` (vanilla | gated | rnn, any case).
        confidence: ``enable_confidence_head``. with_markov: ``confidence_head_with_markov``.
        vocab: V. hidden: D. where: the file, for messages.
    Returns:
        ``{"type": "identity"}`` for rank 0, else ``{"type": markov | gated_markov | rnn, "vocab_size": V,
        "rank": R}`` plus ``hidden_size`` (gated / rnn or with a confidence head) and ``confidence_head`` /
        ``confidence_with_markov``.
    Raises:
        CheckpointError: a negative rank, a confidence head without a Markov head (SpecForge refuses one that
            reads it; dartree has none), or an unknown ``markov_head_type``.
    """
    if rank < 0:
        raise CheckpointError(f"{where}: markov_rank must be >= 0, got {rank}")
    if confidence and with_markov and rank == 0:
        raise CheckpointError(f"{where}: confidence_head_with_markov=true needs markov_rank > 0 (SpecForge refuses it too)")
    if rank <= 0:
        if confidence:
            raise CheckpointError(f"{where}: a confidence head without a Markov head (markov_rank 0) is not "
                                  "supported by dartree")
        return {"type": "identity"}
    kind = str(kind).lower()
    types = {pub: ours for ours, pub in get_family("dspark").published_types.items()}  # vanilla -> markov, ...
    if kind not in types:
        raise CheckpointError(f"{where}: markov_head_type {kind!r} is unknown; expected one of {sorted(types)}")
    head = {"type": types[kind], "vocab_size": vocab, "rank": rank}
    if kind != "vanilla" or confidence:
        head["hidden_size"] = hidden
    if confidence:
        head.update(confidence_head=True, confidence_with_markov=with_markov)
    return head


@dataclass
class Parsed:
    """A published config read into dartree terms: drafter fields, head config, target identity, and the
    names of published tensors that dartree drops (with their expected shapes)."""

    drafter: dict
    head: dict
    target: dict
    dropped: dict


def target_identity(config: dict, fmt: str, where, vocab: int, hidden: int) -> dict:
    """The dartree ``target`` entry of a converted drafter: the published ``_name_or_path`` (else a placeholder
    naming ``fmt``), vocab V, hidden size D, ``num_target_layers`` (None when absent) and, when the publisher wrote
    one, ``max_position_embeddings`` (so an export writes it back).

    Raises:
        CheckpointError: ``max_position_embeddings`` is not an integer >= 1 (:func:`field`).
    """
    target = {"name": config.get("_name_or_path") or f"(unknown; {fmt} source)", "vocab_size": vocab,
              "hidden_size": hidden, "num_layers": config.get("num_target_layers")}
    if config.get("max_position_embeddings") is not None:
        target["max_position_embeddings"] = field(config["max_position_embeddings"], "max_position_embeddings", where)
    return target


def read_parsed(parsed: Parsed, fmt: str, given: dict, where, target=None) -> tuple[dict, dict]:
    """Finish reading a DFlash-family checkpoint whose config is parsed: check and rename its tensors (the head's
    by the published names of its type, :func:`dartree.models.families.published_names`).

    Args:
        parsed: the config in dartree terms (the publisher's parse function). fmt: the layout's name (provenance
            ``source_format``, messages). given: published name -> tensor (older SpecForge ``logit_head.*`` names
            accepted, :func:`strip_legacy`). where: the checkpoint folder. target: optional
            :class:`~dartree.models.target.Target`, against which the copies in ``parsed.dropped`` are checked
            (:func:`check_copy_of_target`).
    Returns:
        (dartree config, tensors by dartree name); the tensors are ``given``'s own objects, unchanged.
    Raises:
        CheckpointError: a missing, unexpected or mis-shaped tensor (its published name and both shapes), a
            tensor under both its legacy and its direct name, or a dropped copy that differs from ``target``'s.
    """
    out = dartree_config(parsed.drafter, parsed.head, parsed.target, {"source_format": fmt, "source": str(where)})
    expected = expected_tensors(out, f"{where}/config.json")
    given = strip_legacy(given, where)
    for name, shape in parsed.dropped.items():  # DeepSpec's frozen copies of the target's embedding / lm_head
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(given[name].shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(given[name].shape)}, expected {list(shape)}")
        check_copy_of_target(name, given.pop(name), target, where)
    heads = published_names(parsed.head["type"])
    check_tensors(given, expected, where, rename=lambda n: published_name(n, heads, fmt))
    tensors = {k: given[published_name(k, heads, fmt)] for k in expected}
    if parsed.dropped:
        out["provenance"]["dropped"] = sorted(parsed.dropped)
    return out, tensors


def with_target_context(config: dict, target=None) -> dict:
    """``config`` (a dartree checkpoint config) with ``target.max_position_embeddings`` set to ``target``'s context
    length when a target with one is given (the target's own figure wins over a recorded one); else unchanged."""
    ctx = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if ctx is None:
        return config
    return {**config, "target": {**(config.get("target") or {}), "max_position_embeddings": int(ctx)}}


def context_length(config: dict) -> int | None:
    """The target's context length in tokens that an export writes as ``max_position_embeddings``: the one the
    checkpoint records (``target.max_position_embeddings``, written since training and conversion record it), or
    None, with a warning, for an older checkpoint that records none (the loader's default then applies, 32,768
    for Qwen3 layers; export with ``--target`` to write the target's)."""
    ctx = (config.get("target") or {}).get("max_position_embeddings")
    if ctx is None:
        warnings.warn("the checkpoint records no target context length (target.max_position_embeddings), so the "
                      "export leaves max_position_embeddings out and loaders take their default (32768 for Qwen3 "
                      "layers); pass --target with the target's folder to write its own", UserWarning, stacklevel=3)
        return None
    return int(ctx)


def layout_for_head(htype) -> str:
    """What to do instead when a layout cannot carry head type ``htype``, the end of a refusal: ``choose --to`` the
    layouts of its family (:attr:`dartree.models.families.Family.export_to`, e.g. ``choose --to zlab-dflash2 or
    --to speculators``), or, for a head no published layout carries, how one is added."""
    fam = family_of_head(htype)
    if fam is None or not fam.export_to:
        return ("no published layout carries it (a reader/writer pair in dartree.convert adds one, "
                "docs/conversion.md)")
    return "choose --to " + " or --to ".join(fam.export_to)


def export_ready(config: dict, fmt: str, target=None, where="the checkpoint") -> dict:
    """``config`` (a dartree checkpoint config) made ready for an export to a full-vocabulary DFlash-family layout
    (z-lab DFlash, SpecForge Domino / DSpark): the target's layer count filled in from ``target`` when the checkpoint
    records none (a converted speculators drafter).

    Raises:
        CheckpointError: the drafter drafts over a reduced vocabulary (``where`` names the checkpoint).
    """
    if config["drafter"].get("draft_vocab_size"):
        raise CheckpointError(f"{where} drafts over a reduced vocabulary of {config['drafter']['draft_vocab_size']} "
                              f"tokens, which the {fmt} layout cannot express; retrain with drafter.draft_vocab_size=0 "
                              "to export")
    tgt = config.get("target", {})
    if tgt.get("num_layers") is None and target is not None:  # e.g. converted from speculators, which records none
        config = dict(config, target=dict(tgt, num_layers=int(target.num_layers)))
    return config


def export_config(config: dict, fmt: str, *, family: str, proposal_offset: int | None) -> dict:
    """The base published config.json of a dartree drafter exported to the DFlash-family layout ``fmt``: z-lab's
    ``DFlashDraftModel`` config (transformers-4 layout: Qwen3 fields, ``block_size``, ``dflash_config.{mask_token_id,
    target_layer_ids}``, ``num_target_layers``, ``max_position_embeddings`` and ``_name_or_path`` when recorded);
    the publisher module adds its head's fields.

    Args:
        config: the dartree checkpoint config. fmt: the layout's name, for messages. family: the registered drafter
            family whose head types the layout carries (``dspark``). proposal_offset: the one proposal offset the
            layout uses, or None (any).
    Raises:
        CheckpointError: a head type not of ``family``, DFlash 2 convolutions, q/k norm off, attention causal in
            the block (all reported together, with the layout that would fit), another proposal offset, or no
            recorded vocabulary size.
    """
    d, head, tgt = config["drafter"], dict(config["head"]), config.get("target", {})
    htype, heads = head.get("type"), get_family(family).head_types()
    problems = []
    if htype not in heads:
        problems.append(f"head type {htype!r} cannot be exported as {fmt} (it carries {list(heads)}); "
                        f"{layout_for_head(htype)}")
    if d.get("conv_kernel_size"):  # DFlash 2 layers: only the zlab-dflash2 / speculators (dflash2) pairs carry them
        where = "" if htype == "selector" else " (with head type 'selector')"
        problems.append(f"the drafter has DFlash 2 grouped convolutions (conv_kernel_size {d['conv_kernel_size']}), "
                        f"which {fmt} layers do not have; only the DFlash 2 layouts carry them{where}")
    if not d.get("qk_norm", False):  # every published layout has Qwen3 layers: report it with the head problem
        problems.append("the drafter has qk_norm=false but the published layouts are Qwen3 layers with "
                        "q_norm/k_norm; only drafters trained with drafter.qk_norm=true export")
    if d.get("causal_block"):  # the layouts here attend bidirectionally inside the block
        problems.append(f"the drafter attends causally inside the block (drafter.causal_block), which {fmt} drafters "
                        f"do not; {layout_for_head(htype)}")
    if problems:
        raise CheckpointError("; ".join(problems))
    if proposal_offset is not None and d["proposal_offset"] != proposal_offset:
        raise CheckpointError(f"{fmt} drafters use proposal_offset {proposal_offset}, this one uses "
                              f"{d['proposal_offset']}; exporting would shift every proposal by one position")
    vocab = tgt.get("vocab_size") or head.get("vocab_size")
    if vocab is None:
        raise CheckpointError("the checkpoint records no target vocab_size (config target.vocab_size); cannot "
                              "write the published vocab_size")
    n = d["num_layers"]
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": d["block_size"],
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "layer_types": ["full_attention"] * n,
        "max_window_layers": n,
        "num_attention_heads": d["num_heads"],
        "num_hidden_layers": n,
        "num_key_value_heads": d["num_kv_heads"],
        "rms_norm_eps": d["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": d["rope_theta"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": vocab,
        "dflash_config": {"mask_token_id": d["mask_token_id"], "target_layer_ids": list(d["target_layer_ids"])},
    }
    if tgt.get("num_layers") is not None:
        out["num_target_layers"] = tgt["num_layers"]
    ctx = context_length(config)
    if ctx is not None:
        out["max_position_embeddings"] = ctx
    if tgt.get("name"):
        out["_name_or_path"] = model_id(tgt["name"])  # resolvable elsewhere, never a local cache path
    return out


def publish_tensors(tensors: dict, head_type: str, fmt: str) -> dict:
    """Tensors by dartree name -> by published name (:func:`published_name` with the published names of
    ``head_type``, :func:`dartree.models.families.published_names`), contiguous, values and dtypes kept.

    Raises:
        CheckpointError: a head tensor the layout has no name for.
    """
    heads = published_names(head_type)
    return {published_name(k, heads, fmt): v.contiguous() for k, v in tensors.items()}


def check_copy_of_target(name: str, tensor, target, where, rows=None) -> None:
    """Check a published drafter's own frozen copy of a target tensor against the target, when one is given.

    DeepSpec drafters keep ``embed_tokens.weight`` / ``lm_head.weight`` [V, D]; speculators checkpoints with a
    reduced vocabulary keep ``lm_head.weight`` [N, D] (the target's rows ``rows`` [N]). dartree drafts with the
    target's own tensors, so a copy that differs would silently change the drafts.

    Args:
        name: the published tensor name (``embed_tokens.weight``, ``lm_head.weight``, ``verifier_lm_head.weight``).
        tensor: the stored copy. target: a :class:`~dartree.models.target.Target` or None (nothing to check).
        rows: [N] int64 target row ids the copy holds (None: all rows).
    Raises:
        CheckpointError: shapes differ, or values differ after casting the target's tensor to the copy's dtype
            (the message gives the number of differing rows and the largest absolute difference).
    """
    if target is None:
        return
    ref = (target.embed_tokens.weight if name.startswith("embed_tokens") else target.lm_head.weight).detach()
    if rows is not None:
        ref = ref[rows.to(ref.device)]
    if tuple(ref.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{where}: the drafter's own {name} has shape {list(tensor.shape)} but the target "
                              f"{target.name!r} gives {list(ref.shape)}")
    diff = (tensor.float().cpu() - ref.to(tensor.dtype).float().cpu()).abs()
    if bool((diff > 0).any()):
        bad = int((diff.amax(-1) > 0).sum()) if diff.dim() > 1 else int((diff > 0).sum())
        raise CheckpointError(
            f"{where}: the drafter's own {name} differs from target {target.name!r}'s ({bad} of {diff.shape[0]} rows "
            f"differ, max |difference| {float(diff.max()):.4g}); dartree drafts with the target's tensor, so this "
            "drafter was trained for another target: convert it with the target it was trained for")


def check_tensors(given: dict, expected: dict, where, rename: Callable[[str], str] = lambda n: n) -> None:
    """Compare source tensors with the expected set, naming tensors in the source's own terms.

    Args:
        given: source name -> tensor. expected: dartree name -> shape. rename: dartree name -> source name.
    Raises:
        CheckpointError: missing, mis-shaped or unexpected tensor (the first one, by name, with shapes).
    """
    want = {rename(k): shape for k, shape in expected.items()}
    for name, shape in want.items():
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {list(shape)})")
        if tuple(given[name].shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(given[name].shape)}, expected {list(shape)}"
            )
    extra = sorted(set(given) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")


# ---------------------------------------------- DFlash 2 (z-lab DFlash2DraftModel, speculators dflash2)
def dflash2_marks(config: dict, names: set[str]) -> str | None:
    """What marks a DFlash 2 checkpoint (z-lab ``DFlash2DraftModel``): the architecture, a ``conv_*`` /
    ``selector_*`` config field, ``layers.*.{attention,mlp}_conv.*`` or ``candidate_selector.*`` tensors; None
    when nothing does."""
    dc = dflash_config(config)
    seen = []
    if "DFlash2DraftModel" in (config.get("architectures") or []):
        seen.append("architectures ['DFlash2DraftModel']")
    keys = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k in dc or k in config]
    if keys:
        seen.append("config " + ", ".join(keys))
    conv = sorted(n for n in names if ".attention_conv." in n or ".mlp_conv." in n)
    sel = sorted(n for n in names if n.startswith("candidate_selector."))
    if conv:
        seen.append(f"{len(conv)} layers.*.{{attention,mlp}}_conv.* tensors")
    if sel:
        seen.append(f"{len(sel)} candidate_selector.* tensors")
    return "; ".join(seen) or None


def selector_spelling(tensors: dict, where) -> dict:
    """Rename the selector codebooks' ``candidate_selector.{predecessor,successor}_codebook.weight`` (z-lab's own
    ``save_pretrained`` spelling) to the published name without ``.weight`` (what z-lab's ``from_pretrained`` maps
    and speculators stores); other tensors pass through.

    Args:
        tensors: published name -> tensor. where: the checkpoint, for the message.
    Returns:
        a new dict, published name -> tensor (same tensor objects).
    Raises:
        CheckpointError: both spellings of one codebook are present (the message names both; keep one).
    """
    out = dict(tensors)
    names = published_names("selector")
    for name in (names["w1.weight"], names["w2.weight"]):  # the codebooks
        if name + ".weight" in out:
            if name in out:
                raise CheckpointError(f"{where}: tensor {name!r} appears twice (also as {name + '.weight'!r}); keep one "
                                      "of them")
            out[name] = out.pop(name + ".weight")
    return out


def conv_fields(kernel, group, *, hidden: int, block: int, where, keys=("conv_kernel_size", "conv_group_size")) -> dict:
    """dartree ``drafter`` fields for DFlash 2's convolutions (z-lab ``GroupedDynamicCausalConv``), checked.

    Args:
        kernel, group: the published ``conv_kernel_size`` and ``conv_group_size`` as read from JSON.
        hidden: D. block: the block size B. where: the config file, for the message. keys: the two field names as
            the file spells them (for the message).
    Returns:
        ``{"conv_kernel_size": k, "conv_group_size": g}`` (ints).
    Raises:
        CheckpointError: a non-integer or out-of-range value, g not dividing D (the publishers' grouping reshape
            fails), or k > B (speculators refuses it; z-lab's convolution fails on a block shorter than its
            kernel), each named with its value.
    """
    k = field(kernel, keys[0], where)
    g = field(group, keys[1], where)
    if hidden % g:
        raise CheckpointError(f"{where}: {keys[1]}={g} does not divide hidden_size {hidden}; the DFlash 2 "
                              "convolution groups D / g channels per dynamic tap, so the file is inconsistent")
    if k > block:
        raise CheckpointError(f"{where}: {keys[0]}={k} exceeds block_size {block}; DFlash 2 taps stay inside the block "
                              "(speculators refuses it too): correct the file or re-export the drafter")
    return {"conv_kernel_size": k, "conv_group_size": g}


def selector_head(rank, top_k, *, vocab: int, hidden: int, where, keys=("selector_rank", "selector_top_k")) -> dict:
    """The dartree ``selector`` head config for DFlash 2's candidate selector (z-lab ``CandidateSelector``), checked.

    Args:
        rank, top_k: the published ``selector_rank`` and ``selector_top_k`` as read from JSON. vocab: V (the
            codebooks have one row per target token). hidden: D. where, keys: for the message.
    Returns:
        ``{"type": "selector", "vocab_size": V, "rank": R, "hidden_size": D, "top_k": K}``.
    Raises:
        CheckpointError: a non-integer or out-of-range value, or K > V (both publishers refuse it), named.
    """
    r = field(rank, keys[0], where)
    k = field(top_k, keys[1], where)
    if k > vocab:
        raise CheckpointError(f"{where}: {keys[1]}={k} exceeds the vocabulary ({vocab} tokens); the selector reranks "
                              "the top-k of the base logits, so k must be at most the vocabulary size")
    return {"type": "selector", "vocab_size": vocab, "rank": r, "hidden_size": hidden, "top_k": k}


def take_tensors(given: dict, want: dict, rename, where) -> dict:
    """Strictly pick the tensors a dartree config calls for out of a published checkpoint.

    Args:
        given: published name -> tensor (every one must be used). want: dartree name -> shape
            (:func:`~dartree.models.checkpoint.expected_tensors`). rename: dartree name -> published name.
        where: the checkpoint, for the message.
    Returns:
        dartree name -> tensor (passed through unchanged, dtype kept).
    Raises:
        CheckpointError: a missing or mis-shaped tensor (its published name and both shapes), or an unexpected one.
    """
    check_tensors(given, want, where, rename)
    return {name: given[rename(name)] for name in want}


def check_dflash2_exportable(config: dict, fmt: str) -> None:
    """Refuse a dartree drafter that a DFlash 2 layout (``fmt``: ``zlab-dflash2`` or speculators ``dflash2``)
    cannot express.

    Raises:
        CheckpointError: the head is not ``selector``, the drafter has no convolutions (``conv_kernel_size`` 0),
            q/k norm is off, or it drafts over a reduced vocabulary; every problem named, with what would fit.
    """
    d, head = config["drafter"], config["head"]
    problems = []
    if head.get("type") != "selector" and d.get("conv_kernel_size"):
        problems.append(f"head type {head.get('type')!r} with DFlash 2 convolutions (conv_kernel_size "
                        f"{d['conv_kernel_size']}) has no published layout: DFlash 2 ({fmt}) carries the candidate "
                        "selector (head type 'selector') and the other layouts have no convolutions")
    elif head.get("type") != "selector":
        problems.append(f"head type {head.get('type')!r} cannot be exported as {fmt} (DFlash 2 carries the candidate "
                        f"selector, head type 'selector'); {layout_for_head(head.get('type'))}")
    if not d.get("conv_kernel_size"):
        problems.append(f"the drafter has no DFlash 2 convolutions (drafter.conv_kernel_size 0) but every {fmt} layer "
                        "has them; train with drafter.conv_kernel_size >= 1 to export DFlash 2")
    if not d.get("qk_norm", False):
        problems.append(f"the drafter has qk_norm=false but {fmt} layers are Qwen3 layers with q_norm/k_norm; only "
                        "drafters trained with drafter.qk_norm=true export")
    if d.get("draft_vocab_size"):
        problems.append(f"the drafter drafts over a reduced vocabulary of {d['draft_vocab_size']} tokens, but DFlash 2 "
                        "scores the full vocabulary (speculators: 'DFlash2 currently requires the full verifier "
                        "vocabulary'); retrain with drafter.draft_vocab_size=0 to export")
    if problems:
        raise CheckpointError("; ".join(problems))

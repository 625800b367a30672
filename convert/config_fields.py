"""Reading a published drafter's config.json, shared by every publisher module (:mod:`dartree.convert.zlab`,
:mod:`dartree.convert.specforge`, :mod:`dartree.convert.deepspec`, :mod:`dartree.convert.vllm_speculators`,
:mod:`dartree.convert.dspine`).

Every published drafter is the DFlash backbone of z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel``): a Qwen3
config (transformers ``Qwen3Config``) and Qwen3 layers. Here: the checked reading of config fields (:func:`field`,
:func:`config_value`), the backbone's fields (:func:`backbone`, refusing every option dartree does not implement),
the heads' fields (:func:`dspark_head`, DFlash 2's :func:`conv_fields` and :func:`selector_head`) and the target's
identity (:func:`target_identity`). The tensors are :mod:`dartree.convert.published_tensors`', the export's config
:mod:`dartree.convert.export_config`'s.

Both transformers config layouts are read: ``rope_theta`` at the top level (transformers 4) or under
``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass

from dartree.base.fields import Flag, Range
from dartree.models.checkpoint import CheckpointError
from dartree.models.families import get_family


QWEN3 = ("hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
         "head_dim, rms_norm_eps, vocab_size, rope_theta (or rope_parameters.rope_theta)")


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

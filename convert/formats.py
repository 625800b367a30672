"""Published drafter layouts: tensor names and config fields, both ways (read into dartree, write back).

Layouts (facts from the public code named with each layout):

- ``zlab-dflash`` (z-lab/dflash ``dflash/model.py``): a Qwen3 config plus ``dflash_config.{mask_token_id,
  target_layer_ids}`` and ``block_size`` (top level or in ``dflash_config``); tensors ``fc``, ``hidden_norm``,
  ``norm`` and Qwen3 layers ``layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm``, ``layers.{i}.mlp.{gate,up,
  down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``; no embedding or lm_head. Block positions
  1..B-1 are the proposals (dartree ``proposal_offset`` 1), head ``identity``.
- ``specforge-domino`` (SpecForge ``specforge/modeling/draft/domino.py``): the same backbone plus
  ``prefix_gru.weight_{ih,hh}_l0`` and ``embed_proj.{0,2}.weight`` (older checkpoints: under ``logit_head.``);
  ``dflash_config.{emb_dim, gru_hidden_dim, pure_draft_prefix_len, shift_label}``. ``shift_label`` true means all
  B positions are proposals (offset 0), else B-1 (offset 1); head ``gru`` with ``prefix_len`` =
  ``pure_draft_prefix_len`` counted in proposals, as SpecForge's ``suffix_start`` does in both modes.
- ``specforge-dspark`` (SpecForge ``dspark.py`` / ``dspark_heads.py``): the backbone plus
  ``markov_head.markov_w1.weight``, ``markov_head.markov_w2.weight``, ``markov_head.gate_proj.*`` (gated),
  ``markov_head.joint_proj.*`` (rnn), ``confidence_head.proj.*``; fields ``markov_rank``, ``markov_head_type``
  (vanilla | gated | rnn), ``enable_confidence_head``, ``confidence_head_with_markov`` in ``dflash_config`` (or
  at the top level, the older ``DSparkConfig`` layout). All B positions are proposals (offset 0): DSpark trains
  on labels anchor+1..anchor+B (SpecForge ``OnlineDSparkModel`` and DeepSpec; dartree follows training, not the
  B-1 slice of SpecForge's DSpark ``spec_generate``).
- ``deepspec-dspark`` (DeepSpec ``deepspec/modeling/dspark/qwen3/{config,modeling}.py``): the target's config
  with top-level ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``num_anchors`` and the DSpark fields;
  tensors as SpecForge DSpark plus frozen copies ``embed_tokens.weight`` and ``lm_head.weight`` [V, D], which
  dartree drops (the target provides them).
- ``zlab-dflash2`` (z-lab/dflash ``dflash/model.py`` ``DFlash2DraftModel``; reader/writer pair in
  :mod:`dartree.convert.zlab_dflash2`): the z-lab DFlash layout plus ``layers.{i}.{attention,mlp}_conv.{base_kernel,
  kernel_projection.weight}`` (dartree ``backbone.layers.{i}.*_conv.*``, same names) and the candidate selector
  ``candidate_selector.{predecessor,successor}_codebook`` [V, R] (z-lab's own ``save_pretrained`` adds ``.weight``)
  and ``candidate_selector.hidden_projection.weight`` [R, D] (dartree head ``selector``: ``head.{w1,w2,proj}.weight``);
  ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank, selector_top_k}``; proposal offset 1.

Both transformers config layouts are read: ``rope_theta`` at the top level (transformers 4) or under
``rope_parameters`` (transformers 5). Exports write the transformers-4 layout, as the published configs do.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable

from dartree.models.checkpoint import FORMAT, CheckpointError
from dartree.convert.registry import FORMAT_PAIRS
from dartree.models.validate import Flag, Range

SOURCE_FORMATS = ("zlab-dflash", "specforge-domino", "specforge-dspark", "deepspec-dspark")
EXPORT_FORMATS = ("zlab-dflash", "specforge-domino", "specforge-dspark")

_MARKOV_TYPES = {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}
_DSPARK_HEADS = {v: k for k, v in _MARKOV_TYPES.items()}
_LEGACY_PREFIXES = ("prefix_gru.", "embed_proj.", "markov_head.", "confidence_head.")
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
_HEAD_NAMES = {
    "gru": {"weight_ih": "prefix_gru.weight_ih_l0", "weight_hh": "prefix_gru.weight_hh_l0",
            "fc1.weight": "embed_proj.0.weight", "fc2.weight": "embed_proj.2.weight"},
    "dspark": {"w1.weight": "markov_head.markov_w1.weight", "w2.weight": "markov_head.markov_w2.weight",
               "gate_proj.weight": "markov_head.gate_proj.weight", "gate_proj.bias": "markov_head.gate_proj.bias",
               "joint_proj.weight": "markov_head.joint_proj.weight", "joint_proj.bias": "markov_head.joint_proj.bias",
               "confidence.weight": "confidence_head.proj.weight", "confidence.bias": "confidence_head.proj.bias"},
    # DFlash 2 (z-lab DFlash2DraftModel, speculators dflash2); the published spelling has no ``.weight`` on the codebooks
    "selector": {"w1.weight": "candidate_selector.predecessor_codebook",
                 "w2.weight": "candidate_selector.successor_codebook",
                 "proj.weight": "candidate_selector.hidden_projection.weight"},
}


def published_name(name: str, fmt: str) -> str:
    """Map a dartree tensor name (``backbone.*`` / ``head.*``) to its name in the published layout ``fmt``.

    ``backbone.layers.{i}.q_proj.weight`` -> ``layers.{i}.self_attn.q_proj.weight``, ``...gate_proj...`` ->
    ``layers.{i}.mlp.gate_proj...``, other backbone names (DFlash 2's ``layers.{i}.{attention,mlp}_conv.*``
    included) lose the ``backbone.`` prefix; head names per the module docstring (``zlab-dflash2``: the selector's).
    Raises:
        CheckpointError: a head tensor that ``fmt`` has no name for (the head type does not fit the layout).
    """
    if name.startswith("backbone."):
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
    local = name[len("head."):]
    table = _HEAD_NAMES[{"specforge-domino": "gru", "zlab-dflash2": "selector"}.get(fmt, "dspark")]
    if fmt == "zlab-dflash" or local not in table:
        raise CheckpointError(f"tensor {name!r} has no counterpart in the {fmt} layout")
    return table[local]


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


_INT1, _INT0 = Range(1), Range(0)  # rules of :func:`field` for sizes / counts and for ids / ranks
_POSITIVE, _REAL0 = Range(0, integer=False, lo_open=True), Range(0, integer=False)


def field(value, key: str, where, rule=_INT1):
    """The value of published config field ``key``, checked and typed: every number or flag a published reader
    takes from a config.json goes through here (never a bare ``int(cfg[...])``, which fails with a traceback
    on ``"abc"`` and reads the string ``"false"`` as true).

    Args:
        value: the field's value as read from JSON. key: its name for the message (``hidden_size``).
        where: the file, for the message. rule: a :class:`~dartree.models.validate.Range` (default: an integer
            >= 1) or :class:`~dartree.models.validate.Flag`.
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


def _flag(value, key: str, where) -> bool:
    """A published flag: true / false, or null (false, as ``bool(None)`` always read it)."""
    return False if value is None else field(value, key, where, Flag())


def _get(config: dict, key: str, *, where, fmt: str, nested: bool = True, default=..., expected: str = ""):
    """Field ``key`` from ``dflash_config`` (when ``nested``) or the top level; error listing the layout if absent."""
    dc = config.get("dflash_config") or {}
    if nested and key in dc:
        return dc[key]
    if key in config:
        return config[key]
    if default is not ...:
        return default
    place = f"dflash_config.{key} or {key}" if nested else key
    raise CheckpointError(
        f"{where}: unknown config layout for {fmt}: no {place}; expected {expected or _EXPECTED[fmt]}"
    )


_QWEN3 = ("hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
          "head_dim, rms_norm_eps, vocab_size, rope_theta (or rope_parameters.rope_theta)")
_EXPECTED = {
    "zlab-dflash": f"a Qwen3 config ({_QWEN3}) with block_size and dflash_config.{{mask_token_id, target_layer_ids}}",
    "specforge-domino": f"a Qwen3 config ({_QWEN3}) with block_size and dflash_config.{{mask_token_id, "
                        "target_layer_ids, emb_dim, gru_hidden_dim, pure_draft_prefix_len, shift_label}",
    "specforge-dspark": f"a Qwen3 config ({_QWEN3}) with block_size and dflash_config.{{mask_token_id, "
                        "target_layer_ids, markov_rank, markov_head_type, enable_confidence_head, "
                        "confidence_head_with_markov}",
    "deepspec-dspark": f"a Qwen3 config ({_QWEN3}) with top-level block_size, mask_token_id, target_layer_ids, "
                       "markov_rank, markov_head_type, enable_confidence_head",
    "zlab-dflash2": f"a Qwen3 config ({_QWEN3}) with block_size and dflash_config.{{mask_token_id, target_layer_ids, "
                    "conv_kernel_size, conv_group_size, selector_rank, selector_top_k}",
}


def _rope_theta(config: dict, where, fmt: str) -> float:
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        if rp.get("rope_type", "default") != "default":
            raise CheckpointError(f"{where}: rope_parameters.rope_type {rp['rope_type']!r} is not supported "
                                  "(dartree drafters use plain RoPE); only 'default' converts")
        return field(rp["rope_theta"], "rope_parameters.rope_theta", where, _POSITIVE)
    if "rope_theta" in config:
        rs = config.get("rope_scaling")
        if rs and (rs.get("rope_type") or rs.get("type")) not in (None, "default"):
            raise CheckpointError(f"{where}: rope_scaling {rs!r} is not supported (dartree drafters use plain "
                                  "RoPE); only null or type 'default' converts")
        return field(config["rope_theta"], "rope_theta", where, _POSITIVE)
    raise CheckpointError(f"{where}: unknown config layout for {fmt}: no rope_theta at the top level "
                          f"(transformers 4) nor rope_parameters.rope_theta (transformers 5); expected {_EXPECTED[fmt]}")


def effective_layer_types(config: dict, where="config.json") -> list[str]:
    """Per-layer attention types exactly as transformers' Qwen3Config (and so z-lab / SpecForge) resolve them.

    ``layer_types`` when given; else every layer is ``full_attention`` unless ``use_sliding_window`` is true and
    ``sliding_window`` (default 4096) is set, in which case layers ``i >= max_window_layers`` (default 28) are
    ``sliding_attention`` (transformers ``Qwen3Config.__post_init__``). Returns one entry per
    ``num_hidden_layers``. ``where`` names the file in the error on a non-integer count (:func:`field`).
    """
    if config.get("layer_types"):
        return list(config["layer_types"])
    n = field(config.get("num_hidden_layers") or 0, "num_hidden_layers", where, _INT0)
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    first = 28 if config.get("max_window_layers") is None else field(config["max_window_layers"], "max_window_layers", where, _INT0)
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
        if val is not None and field(val, key, where, _REAL0) != ok:
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


def _mask_token_id(config: dict, where, fmt: str, nested: bool, target) -> int:
    """``mask_token_id`` from the config; when absent, resolved from ``target``'s tokenizer as SpecForge does.

    Raises:
        CheckpointError: absent and no target tokenizer to resolve it from (the message names both fixes).
    """
    if "mask_token_id" in (config.get("dflash_config") or {}) or "mask_token_id" in config:
        val = _get(config, "mask_token_id", where=where, fmt=fmt, nested=nested)
        if val is not None:
            return field(val, "mask_token_id", where, _INT0)
    vocab = field(config.get("vocab_size") or 0, "vocab_size", where, _INT0)
    resolved = resolve_mask_token_id(getattr(target, "tokenizer", None), vocab)
    if resolved is None:
        place = "dflash_config.mask_token_id" if nested else "mask_token_id"
        raise CheckpointError(
            f"{where}: the config names no {place}; SpecForge then resolves it from the target's tokenizer (its "
            "mask token, the first unused embedding row, pad, eos, unk): pass --target with the target's folder "
            f"(it has a tokenizer) to resolve it the same way, or write {place} into config.json")
    return resolved


def _backbone(config: dict, where, fmt: str, *, proposal_offset: int, target=None) -> dict:
    """DrafterConfig fields from a published Qwen3-style config (``target``: optional, resolves a missing MASK id)."""
    _check_supported(config, where)
    nested = fmt != "deepspec-dspark"
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
            "rms_norm_eps": field(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, _POSITIVE),
            "qk_norm": True,  # Qwen3 layers always carry q_norm / k_norm
        }
        field(config["vocab_size"], "vocab_size", where)
    except KeyError as exc:
        raise CheckpointError(f"{where}: unknown config layout for {fmt}: no {exc.args[0]}; "
                              f"expected {_EXPECTED[fmt]}") from None
    ids = _get(config, "target_layer_ids", where=where, fmt=fmt, nested=nested)
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise CheckpointError(f"{where}: target_layer_ids {ids!r} must be a list of layer indices >= 0 "
                              "(DeepSpec's -1, the embedding output, is not supported by dartree)")
    out.update(
        target_layer_ids=list(ids),
        mask_token_id=_mask_token_id(config, where, fmt, nested, target),
        block_size=field(_get(config, "block_size", where=where, fmt=fmt, nested=nested), "block_size", where,
                         Range(2)),
        proposal_offset=proposal_offset,
        rope_theta=_rope_theta(config, where, fmt),
    )
    return out


def _dspark_head(config: dict, where, fmt: str, vocab: int, hidden: int) -> dict:
    nested = fmt == "specforge-dspark"
    if fmt == "specforge-dspark":
        # SpecForge DSparkDraftModel._init_draft_head / build_markov_head: a missing markov_rank is 0 (no Markov
        # head); the confidence head exists when enable_confidence_head, which defaults to
        # confidence_head_alpha > 0; confidence_head_with_markov defaults to false.
        alpha = field(_get(config, "confidence_head_alpha", where=where, fmt=fmt, default=0.0) or 0.0,
                      "confidence_head_alpha", where, _REAL0)
        rank = field(_get(config, "markov_rank", where=where, fmt=fmt, default=0) or 0, "markov_rank", where, _INT0)
        conf = _flag(_get(config, "enable_confidence_head", where=where, fmt=fmt, default=alpha > 0.0),
                     "enable_confidence_head", where)
        with_markov = _flag(_get(config, "confidence_head_with_markov", where=where, fmt=fmt, default=False),
                            "confidence_head_with_markov", where)
    else:
        rank = field(_get(config, "markov_rank", where=where, fmt=fmt, nested=nested), "markov_rank", where, _INT0)
        conf = _flag(_get(config, "enable_confidence_head", where=where, fmt=fmt, nested=nested, default=False),
                     "enable_confidence_head", where)
        with_markov = _flag(_get(config, "confidence_head_with_markov", where=where, fmt=fmt, nested=nested,
                                 default=True), "confidence_head_with_markov", where)
    if rank < 0:
        raise CheckpointError(f"{where}: markov_rank must be >= 0, got {rank}")
    if conf and with_markov and rank == 0:
        raise CheckpointError(f"{where}: confidence_head_with_markov=true needs markov_rank > 0 (SpecForge refuses it too)")
    if rank <= 0:
        if conf:
            raise CheckpointError(f"{where}: a confidence head without a Markov head (markov_rank 0) is not "
                                  "supported by dartree")
        return {"type": "identity"}
    kind = str(_get(config, "markov_head_type", where=where, fmt=fmt, nested=nested, default="vanilla")).lower()
    if kind not in _MARKOV_TYPES:
        raise CheckpointError(f"{where}: markov_head_type {kind!r} is unknown; expected one of {sorted(_MARKOV_TYPES)}")
    head = {"type": _MARKOV_TYPES[kind], "vocab_size": vocab, "rank": rank}
    if kind != "vanilla" or conf:
        head["hidden_size"] = hidden
    if conf:
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


def parse_config(config: dict, fmt: str, where, target=None) -> Parsed:
    """Read a published config (layout ``fmt``) into dartree terms.

    ``target`` (optional :class:`~dartree.models.target.Target`): its tokenizer resolves a missing MASK id the
    way SpecForge does.

    Raises:
        CheckpointError: unknown layout (the message lists the expected fields), unsupported options, or an
            unknown ``fmt``.
    """
    if fmt not in SOURCE_FORMATS:
        raise CheckpointError(f"unknown source format {fmt!r}; known: {list(SOURCE_FORMATS)}")
    if fmt == "zlab-dflash":
        drafter = _backbone(config, where, fmt, proposal_offset=1, target=target)
        head = {"type": "identity"}
    elif fmt == "specforge-domino":
        shift = _flag(_get(config, "shift_label", where=where, fmt=fmt, default=False), "shift_label", where)
        drafter = _backbone(config, where, fmt, proposal_offset=0 if shift else 1, target=target)
        head = {
            "type": "gru",
            "vocab_size": field(config["vocab_size"], "vocab_size", where),
            "hidden_size": drafter["hidden_size"],
            "emb_dim": field(_get(config, "emb_dim", where=where, fmt=fmt), "emb_dim", where),
            "gru_hidden_dim": field(_get(config, "gru_hidden_dim", where=where, fmt=fmt), "gru_hidden_dim", where),
            "prefix_len": field(_get(config, "pure_draft_prefix_len", where=where, fmt=fmt, default=0),
                                "pure_draft_prefix_len", where, _INT0),
        }
    else:
        drafter = _backbone(config, where, fmt, proposal_offset=0, target=target)
        head = _dspark_head(config, where, fmt, field(config["vocab_size"], "vocab_size", where), drafter["hidden_size"])
    vocab, d = field(config["vocab_size"], "vocab_size", where), drafter["hidden_size"]
    dropped = {"embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d)} if fmt == "deepspec-dspark" else {}
    target = {"name": config.get("_name_or_path") or f"(unknown; {fmt} source)", "vocab_size": vocab,
              "hidden_size": d, "num_layers": config.get("num_target_layers")}
    if config.get("max_position_embeddings") is not None:  # the context the publisher wrote: an export writes it back
        target["max_position_embeddings"] = field(config["max_position_embeddings"], "max_position_embeddings", where)
    return Parsed(drafter, head, target, dropped)


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


def detect(config: dict, tensor_names: set[str]) -> tuple[str, str]:
    """Name the layout of a checkpoint from its config fields and tensor names; returns (format, reason).

    Raises:
        CheckpointError: no known layout matches; the message lists what each layout needs.
    """
    fmt = config.get("format")
    if fmt in (FORMAT, "dartree-train"):
        return fmt, f"config.json format={fmt!r}"
    names = {n[len("logit_head."):] if n.startswith("logit_head.") else n for n in tensor_names}
    for pair in FORMAT_PAIRS.values():
        why = pair.detect(config, names)
        if why:
            return pair.name, why
    dc = config.get("dflash_config")
    dc = dc if isinstance(dc, dict) else {}
    projector = dc.get("projector_type")
    has_gru = any(n.startswith(("prefix_gru.", "embed_proj.")) for n in names)
    has_markov = any(n.startswith(("markov_head.", "confidence_head.")) for n in names)
    if "target_layer_ids" in config and "dflash_config" not in config and (
            "markov_rank" in config or "embed_tokens.weight" in names):
        return "deepspec-dspark", "top-level target_layer_ids and markov_rank (DeepSpec layout)"
    if dc:
        if projector == "domino" or has_gru:
            why = "dflash_config.projector_type='domino'" if projector == "domino" else "prefix_gru.* tensors"
            return "specforge-domino", why
        if projector == "dspark" or has_markov or "markov_rank" in dc or "markov_rank" in config:
            why = "dflash_config.projector_type='dspark'" if projector == "dspark" else "markov_head.* tensors / markov_rank"
            return "specforge-dspark", why
        return "zlab-dflash", "dflash_config without head tensors"
    raise CheckpointError(
        f"unknown checkpoint layout (format={fmt!r}, no dflash_config, no top-level target_layer_ids); expected one "
        "of: dartree / dartree-train (config 'format'), zlab-dflash / specforge-domino / specforge-dspark "
        "(Qwen3 config with dflash_config), deepspec-dspark (top-level target_layer_ids and markov_rank)"
    )


def export_config(config: dict, fmt: str) -> dict:
    """The published config.json for a dartree checkpoint config exported to ``fmt`` (transformers-4 layout).

    Raises:
        CheckpointError: the drafter or head cannot be expressed in ``fmt`` (named, with what would fit).
    """
    if fmt not in EXPORT_FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r}; known: {list(EXPORT_FORMATS)}")
    d, head, tgt = config["drafter"], dict(config["head"]), config.get("target", {})
    htype = head.get("type")
    want_head = {"zlab-dflash": ("identity",), "specforge-domino": ("gru",),
                 "specforge-dspark": ("markov", "gated_markov", "rnn")}[fmt]
    problems = []
    if htype not in want_head:
        problems.append(f"head type {htype!r} cannot be exported as {fmt} (it carries {list(want_head)}); "
                        f"choose --to {_fmt_for_head(htype)}")
    if d.get("conv_kernel_size"):  # DFlash 2 layers: only the zlab-dflash2 / speculators (dflash2) pairs carry them
        where = "" if htype == "selector" else " (with head type 'selector')"
        problems.append(f"the drafter has DFlash 2 grouped convolutions (conv_kernel_size {d['conv_kernel_size']}), "
                        f"which {fmt} layers do not have; only the DFlash 2 layouts carry them{where}")
    if not d.get("qk_norm", False):  # every published layout has Qwen3 layers: report it with the head problem
        problems.append(f"the drafter has qk_norm=false but the published layouts are Qwen3 layers with "
                        "q_norm/k_norm; only drafters trained with drafter.qk_norm=true export")
    if problems:
        raise CheckpointError("; ".join(problems))
    if fmt in ("zlab-dflash", "specforge-dspark") and d["proposal_offset"] != (1 if fmt == "zlab-dflash" else 0):
        need = 1 if fmt == "zlab-dflash" else 0
        raise CheckpointError(f"{fmt} drafters use proposal_offset {need}, this one uses {d['proposal_offset']}; "
                              "exporting would shift every proposal by one position")
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
        out["_name_or_path"] = tgt["name"]
    dc = out["dflash_config"]
    if fmt == "specforge-domino":
        if head.get("embed_dim", head["hidden_size"]) != d["hidden_size"]:
            raise CheckpointError(f"gru head embed_dim {head['embed_dim']} != hidden_size {d['hidden_size']}; "
                                  "SpecForge Domino's GRU input width is the hidden size")
        out["architectures"] = ["DominoDraftModel"]  # SpecForge's loader dispatches on it (DFlash would drop the GRU)
        dc.update(projector_type="domino", pure_draft_prefix_len=head["prefix_len"], emb_dim=head["emb_dim"],
                  gru_hidden_dim=head["gru_hidden_dim"], shift_label=d["proposal_offset"] == 0)
        out["emb_dim"] = head["emb_dim"]
    elif fmt == "specforge-dspark":
        out["architectures"] = ["DSparkDraftModel"]
        dc.update(projector_type="dspark", markov_rank=head["rank"], markov_head_type=_DSPARK_HEADS[htype],
                  enable_confidence_head=bool(head.get("confidence_head", False)),
                  confidence_head_with_markov=bool(head.get("confidence_with_markov", True)))
        if d["num_kv_heads"] == d["num_heads"]:  # SpecForge DSpark refuses equal head counts unless told "mha"
            dc["attention_mode"] = "mha"
    return out


def _fmt_for_head(htype) -> str:
    return {"identity": "zlab-dflash", "gru": "specforge-domino",
            "selector": "zlab-dflash2 or --to speculators"}.get(htype, "specforge-dspark")



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
    import torch

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


def _dflash2_seen(config: dict, names: set[str]) -> str | None:
    """What marks a DFlash 2 checkpoint (z-lab ``DFlash2DraftModel``), or None."""
    dc = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
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

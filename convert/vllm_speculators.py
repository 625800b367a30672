"""vLLM's ``speculators`` drafter format (the ``speculators`` package 0.9.0, ``dflash``, ``dflash2`` and ``dspark``):
one layout of the format registry, ``speculators`` (registered by :mod:`dartree.convert.publishers`).

Facts (read from speculators 0.9.0 ``config.py``, ``models/dflash/{config,core}.py``, ``models/dflash2/*``,
``models/dspark/*``, ``model.py``; PyPI package ``speculators``):

- config.json: ``speculators_model_type`` (``dflash`` | ``dflash2`` | ``dspark``; other types are refused by name),
  ``architectures`` (``DFlashSpeculator`` | ``DFlash2DraftModel`` | ``DSparkSpeculator``),
  ``transformer_layer_config`` (a Qwen3 config of the draft layers, verifier vocabulary), ``draft_vocab_size``,
  ``block_size``, ``aux_hidden_state_layer_ids`` = dartree ``target_layer_ids`` + 1 (speculators indexes Hugging
  Face ``hidden_states`` directly),
  ``mask_token_id``, ``target_hidden_size``, ``sliding_window_non_causal``, ``sample_from_anchor`` (true: all B
  block positions are proposals, dartree ``proposal_offset`` 0; false: positions 1..B-1, offset 1), and
  ``speculators_config`` {``algorithm``, ``proposal_methods`` [greedy with ``speculative_tokens`` = B or B-1],
  ``default_proposal_method``, ``verifier`` {``name_or_path``, ``architectures``}}. dspark adds
  ``markov_rank`` (default 256), ``markov_head_type`` (vanilla | gated | rnn), ``enable_confidence_head``
  (default true), ``confidence_head_with_markov`` (default true); its ``sample_from_anchor`` defaults to true,
  dflash's to false. dflash2 (DFlash 2, ``DFlash2SpeculatorConfig``) adds ``conv_kernel_size`` (default 2),
  ``conv_group_size`` (16), ``selector_rank`` (256), ``selector_top_k`` (16), defaults ``sample_from_anchor`` to
  false and ``sliding_window_non_causal`` to true (which only acts on sliding-window layers, refused below), and
  requires ``draft_vocab_size`` = the verifier vocabulary (its model class refuses anything else). vLLM requires
  ``speculative_tokens``, ``verifier.name_or_path``, ``transformer_layer_config``, ``aux_hidden_state_layer_ids``
  and ``mask_token_id``.
- tensors: z-lab's layer names (``layers.{i}.self_attn.*``, ``layers.{i}.mlp.*``, ``fc``, ``hidden_norm``,
  ``norm``), DSpark's ``markov_head.{markov_w1,markov_w2,gate_proj,joint_proj}.*`` and ``confidence_head.proj.*``.
  dflash2's ``layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}`` and
  ``candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`` (plain Parameters,
  no ``.weight`` on the codebooks; the same tensors as z-lab DFlash 2, :mod:`dartree.convert.zlab`: dartree
  convolutions ``backbone.layers.{i}.*_conv.*`` and head ``selector``; with ``sample_from_anchor`` the selector's
  first previous token is the anchor, as for the Markov head).
  ``embed_tokens`` / ``verifier_lm_head`` / ``verifier_norm`` are never saved (reloaded from the verifier); a
  full-vocabulary ``lm_head`` is not saved either. A reduced vocabulary of N < V tokens is ``lm_head.weight``
  [N, D] (the verifier's rows), ``d2t`` [N] int64 (target id = i + d2t[i]), ``t2d`` [V] bool and
  ``markov_head.markov_w2.weight`` [N, R]. dartree's ``backbone.draft_vocab`` expresses exactly this (its base
  logits use the target's lm_head rows and are -inf elsewhere); rows of dartree's full ``w2`` outside the draft
  vocabulary never reach a logit and are written as zeros on import.

Sliding-window layers (the speculators trainer's default: every layer ``sliding_attention``, window 2048, causal
inside the block unless ``sliding_window_non_causal``) are refused by name: dartree drafters attend over the whole
context and bidirectionally inside the block.
"""

from __future__ import annotations

import torch

from dartree.convert import config_fields as C
from dartree.convert import export_config as E
from dartree.convert import published_tensors as T
from dartree.convert.registry import FormatPair
from dartree.base.fields import Range
from dartree.models.checkpoint import CheckpointError, dartree_config, expected_tensors
from dartree.models.families import FAMILIES, family_of_head, published_names, published_type
from dartree.models.target import model_id

NAME = "speculators"
# Field defaults of speculators 0.9.0's config classes (DFlash[2]SpeculatorConfig / DSparkSpeculatorConfig); used only
# when the package is not importable (tests pin them against the classes).
DEFAULTS = {
    "dflash": {"sample_from_anchor": False, "sliding_window_non_causal": False},
    "dflash2": {"sample_from_anchor": False, "sliding_window_non_causal": True, "conv_kernel_size": 2,
                "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
    "dspark": {"sample_from_anchor": True, "sliding_window_non_causal": False, "markov_rank": 256,
               "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True},
}
_DROPPED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# the draft layers' config, for the shared backbone reader's messages
LAYOUT = C.ConfigLayout(NAME, f"a transformer_layer_config with the Qwen3 fields ({C.QWEN3}) and top-level "
                              "block_size, mask_token_id, aux_hidden_state_layer_ids")


def _validated(config: dict, where="config.json") -> dict:
    """The config's fields after speculators' own validation and defaults (its pydantic config classes) when the
    package is importable, else the dict with :data:`DEFAULTS` filled in.

    Raises:
        CheckpointError: speculators rejects the config (``where`` and its message quoted, on one line).
    """
    kind = config.get("speculators_model_type")
    try:
        from speculators import SpeculatorModelConfig
    except ImportError:
        return {**DEFAULTS.get(kind, {}), **config}
    try:
        cfg = SpeculatorModelConfig.from_dict(dict(config))
    except Exception as exc:  # pydantic ValidationError, ValueError: report speculators' own words
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"{where}: speculators rejects it: {said}; correct that field or re-export the "
                              "drafter") from None
    out = dict(cfg.model_dump())
    out["transformer_layer_config"] = dict(config.get("transformer_layer_config") or {})
    return out


def _types() -> dict[str, str]:
    """The speculators types dartree reads and writes, ``speculators_model_type`` -> ``architectures`` entry: those
    of the registered families (:attr:`dartree.models.families.Family.speculators_type`; ``dflash``, ``dflash2``,
    ``dspark``)."""
    return {f.speculators_type: f.speculators_architecture for f in FAMILIES.values() if f.speculators_type}


def _published(name: str, head_type: str) -> str:
    """The speculators name of dartree tensor ``name`` of a drafter with head type ``head_type`` (backbone names as
    :func:`dartree.convert.published_tensors.backbone_name`, head names as the family publishes them)."""
    if name.startswith("backbone."):
        return T.backbone_name(name)
    return published_names(head_type)[name[len("head."):]]


def detect(config: dict, names: set[str]) -> str | None:
    """The reason ``config`` is a speculators checkpoint (``speculators_model_type`` present), else None.

    Raises:
        CheckpointError: a speculators type dartree does not read (``eagle3``, ``mtp``, ...), named.
    """
    kind = config.get("speculators_model_type")
    if kind is None:
        return None
    if kind not in _types():
        raise CheckpointError(f"detected a vLLM speculators checkpoint of type {kind!r}; dartree reads speculators "
                              f"{', '.join(sorted(_types()))} only (DFlash-family block drafters)")
    return f"speculators_model_type={kind!r}"


def read(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a speculators dflash / dflash2 / dspark checkpoint -> (dartree config, tensors by dartree name).

    Args:
        config: config.json. given: published name -> tensor. where: for messages. target: optional
            :class:`~dartree.models.target.Target`; when given, a reduced ``lm_head`` must equal its rows.
    Raises:
        CheckpointError: another type, sliding-window layers, an inconsistent ``d2t`` / ``t2d``, a dflash2 drafter
            with a reduced vocabulary or inconsistent convolution / selector fields, a missing, unexpected or
            mis-shaped tensor (named), or (with ``target``) a drafter copy that differs from it.
    """
    cfg_path = f"{where}/config.json"
    if detect(config, set()) is None:
        raise CheckpointError(f"{cfg_path}: no speculators_model_type; not a speculators checkpoint")
    v = _validated(config, cfg_path)
    kind = v["speculators_model_type"]
    tl = dict(v.get("transformer_layer_config") or {})
    _check_layers(v, tl, cfg_path)
    vocab = C.field(tl.get("vocab_size"), "transformer_layer_config.vocab_size", cfg_path)
    n_draft = C.field(v.get("draft_vocab_size") or vocab, "draft_vocab_size", cfg_path)
    pseudo = {**tl, "block_size": C.field(v.get("block_size"), "block_size", cfg_path, Range(2)),
              "dflash_config": {"mask_token_id": C.field(v["mask_token_id"], "mask_token_id", cfg_path, C.INT0),
                                "target_layer_ids": [a - 1 for a in v["aux_hidden_state_layer_ids"]]}}
    drafter = C.backbone(pseudo, cfg_path, LAYOUT, proposal_offset=0 if v.get("sample_from_anchor") else 1,
                         target=target)
    context = C.target_identity(pseudo, NAME, cfg_path, vocab, drafter["hidden_size"]).get("max_position_embeddings")
    if n_draft != vocab:
        if kind == "dflash2":
            raise CheckpointError(f"{cfg_path}: draft_vocab_size {n_draft} differs from the verifier vocabulary {vocab}; "
                                  "speculators' DFlash2DraftModel refuses that ('DFlash2 currently requires the full "
                                  "verifier vocabulary'), so the file is inconsistent: set draft_vocab_size to the "
                                  "verifier's vocab_size")
        drafter["draft_vocab_size"] = n_draft
    head = _read_head(kind, v, drafter, vocab, cfg_path)
    ident = {"name": (v.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "(unknown; speculators source)",
             "vocab_size": vocab, "hidden_size": drafter["hidden_size"], "num_layers": None,
             **({} if context is None else {"max_position_embeddings": context})}
    out = dartree_config(drafter, head, ident, {"source_format": NAME, "source": str(where),
                                                "speculators_model_type": kind})
    want = expected_tensors(out, cfg_path)
    given = dict(T.selector_spelling(given, where) if kind == "dflash2" else given)
    tensors, dropped, ids = {}, [], None
    if n_draft != vocab:
        ids = _read_vocab_map(given, n_draft, vocab, drafter["hidden_size"], target, where)
        tensors["backbone.draft_vocab"] = ids
        dropped.append("lm_head.weight")
    for name in _DROPPED + (("lm_head.weight",) if n_draft == vocab else ()):
        if name in given:
            t = given.pop(name)
            if name != "verifier_norm.weight":
                T.check_copy_of_target(name.removeprefix("verifier_"), t, target, where)
            dropped.append(name)
    tensors.update(_take_tensors(given, want, head["type"], ids, where))
    if given:
        extra = sorted(given)
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all)")
    if dropped:
        out["provenance"]["dropped"] = sorted(dropped)
    return out, tensors


def _check_layers(v: dict, tl: dict, cfg_path: str) -> None:
    """:func:`read`'s checks of the draft layers and the fields vLLM requires: Qwen3 layers with full attention only,
    ``aux_hidden_state_layer_ids`` naming decoder-layer outputs (>= 1), a ``mask_token_id``.

    Raises:
        CheckpointError: the field named, with the fix.
    """
    if tl.get("model_type", "qwen3") != "qwen3":
        raise CheckpointError(f"{cfg_path}: transformer_layer_config.model_type {tl['model_type']!r} is not "
                              "supported; dartree drafters are Qwen3 layers")
    if any(t != "full_attention" for t in C.effective_layer_types(tl, cfg_path)):
        raise CheckpointError(
            f"{cfg_path}: transformer_layer_config has sliding_attention layers (window "
            f"{tl.get('sliding_window')}, sliding_window_non_causal={v.get('sliding_window_non_causal')}; the "
            "speculators trainer's default), which dartree does not support: its drafters attend over the whole "
            "context and bidirectionally inside the block; retrain with full_attention layers")
    aux = v.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or any(isinstance(a, bool) or not isinstance(a, int) or a < 1 for a in aux):
        raise CheckpointError(f"{cfg_path}: aux_hidden_state_layer_ids {aux!r} must name decoder-layer outputs "
                              "(>= 1; 0 is the embedding output, which dartree does not capture)")
    if v.get("mask_token_id") is None:
        raise CheckpointError(f"{cfg_path}: mask_token_id is null; vLLM requires it: write the MASK id the drafter "
                              "was trained with into config.json")


def _read_head(kind: str, v: dict, drafter: dict, vocab: int, cfg_path: str) -> dict:
    """The dartree head config of a speculators ``kind``: ``identity`` (dflash, or dspark with ``markov_rank`` 0),
    ``selector`` (dflash2, whose convolution fields also enter ``drafter``, updated in place) or a DSpark head.

    Raises:
        CheckpointError: inconsistent convolution / selector / Markov fields, or a confidence head without a Markov
            head.
    """
    head = {"type": "identity"}
    if kind == "dflash2":
        drafter.update(C.conv_fields(v.get("conv_kernel_size"), v.get("conv_group_size"), hidden=drafter["hidden_size"],
                                     block=drafter["block_size"], where=cfg_path))
        head = C.selector_head(v.get("selector_rank"), v.get("selector_top_k"), vocab=vocab,
                               hidden=drafter["hidden_size"], where=cfg_path)
    if kind == "dspark" and C.field(v.get("markov_rank") or 0, "markov_rank", cfg_path, C.INT0) > 0:
        conf = C.flag(v.get("enable_confidence_head"), "enable_confidence_head", cfg_path)
        with_markov = C.flag(v.get("confidence_head_with_markov"), "confidence_head_with_markov", cfg_path)
        head = C.dspark_head(C.field(v["markov_rank"], "markov_rank", cfg_path, C.INT0),
                             v.get("markov_head_type", "vanilla"), conf, with_markov, vocab=vocab,
                             hidden=drafter["hidden_size"], where=cfg_path)
    elif kind == "dspark" and v.get("enable_confidence_head"):
        raise CheckpointError(f"{cfg_path}: a confidence head without a Markov head (markov_rank 0) is not supported "
                              "by dartree")
    return head


def _read_vocab_map(given: dict, n_draft: int, vocab: int, hidden: int, target, where) -> torch.Tensor:
    """A reduced vocabulary's target ids [N] int64 from ``d2t`` [N] / ``t2d`` [V] (target id = i + d2t[i]); pops
    them and ``lm_head.weight`` [N, D] from ``given`` (the latter checked against ``target``'s rows when given).

    Raises:
        CheckpointError: a missing or mis-shaped mapping or lm_head, or a mapping that is not one set of N distinct
            target ids.
    """
    for name, shape in (("d2t", (n_draft,)), ("t2d", (vocab,))):
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r} (expected shape {list(shape)}): "
                                  f"draft_vocab_size {n_draft} < vocab {vocab} needs the vocabulary mapping")
        if tuple(given[name].shape) != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(given[name].shape)}, expected {list(shape)}")
    ids = torch.arange(n_draft) + given.pop("d2t").long()
    t2d = given.pop("t2d").bool()
    if (ids.unique().numel() != n_draft or int(ids.min()) < 0 or int(ids.max()) >= vocab
            or int(t2d.sum()) != n_draft or not bool(t2d[ids].all())):
        raise CheckpointError(f"{where}: d2t and t2d do not describe one set of {n_draft} distinct target ids "
                              f"in [0, {vocab}) (t2d marks {int(t2d.sum())}); the mapping is corrupt")
    lm = given.pop("lm_head.weight", None)
    if lm is None:
        raise CheckpointError(f"{where}: missing tensor 'lm_head.weight' (expected shape "
                              f"[{n_draft}, {hidden}]): a reduced vocabulary stores its lm_head rows")
    T.check_copy_of_target("lm_head.weight", lm, target, where, rows=ids)
    return ids


def _take_tensors(given: dict, want: dict, head_type: str, ids: torch.Tensor | None, where) -> dict:
    """Pop every tensor the dartree config ``want`` (dartree name -> shape) calls for from ``given`` under its
    published name; with a reduced vocabulary (``ids`` [N]) ``markov_w2`` [N, R] is widened to the full [V, R]
    (zero rows outside it). Returns dartree name -> tensor.

    Raises:
        CheckpointError: a missing or mis-shaped tensor (published name and expected shape).
    """
    tensors = {}
    for name, shape in want.items():
        if name == "backbone.draft_vocab":
            continue
        pub = _published(name, head_type)
        if pub not in given:
            raise CheckpointError(f"{where}: missing tensor {pub!r} (expected shape {list(shape)})")
        t = given.pop(pub)
        if name == "head.w2.weight" and ids is not None:
            if tuple(t.shape) != (ids.numel(), shape[1]):
                raise CheckpointError(f"{where}: tensor {pub!r} has shape {list(t.shape)}, expected "
                                      f"[{ids.numel()}, {shape[1]}]")
            full = torch.zeros(shape, dtype=t.dtype)
            full[ids] = t
            t = full
        elif tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {pub!r} has shape {list(t.shape)}, expected {list(shape)}")
        tensors[name] = t
    return tensors


def write(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree checkpoint -> (speculators config.json dict, tensors by speculators name).

    The speculators type is the head's family's (:attr:`dartree.models.families.Family.speculators_type`):
    ``identity`` heads become ``dflash``, ``markov`` / ``gated_markov`` / ``rnn`` become ``dspark``, ``selector``
    (with DFlash 2 convolutions) becomes ``dflash2`` (its ``sliding_window_non_causal`` default, true, is written;
    the layers are full attention, so it acts on nothing);
    ``sample_from_anchor`` = (proposal_offset == 0); ``rope_theta`` is written both at the top level of
    ``transformer_layer_config`` (where transformers 4 reads it) and under its ``rope_parameters`` (transformers 5);
    the verifier is ``target`` when given, else the recorded target
    name, written as a model id another machine resolves (:func:`dartree.models.target.model_id`: the hub id of the
    packaged default target, not this machine's cache folder), so speculators' ``from_pretrained`` and vLLM reload the
    embedding, heads and norm from it there.
    The config is built and validated through speculators' own config classes when the package is importable.
    ``where`` is unused (every message names the drafter's fields).

    Raises:
        CheckpointError: a head speculators has no form for (``gru``), q/k norm off, a reduced draft vocabulary
            without ``target`` (its lm_head rows must be written), DFlash 2 convolutions without the selector head
            or the selector head without them, or a DFlash 2 drafter with a reduced vocabulary
            (:func:`dartree.convert.export_config.check_dflash2_exportable`).
    """
    d, head, ident = config["drafter"], config["head"], config.get("target", {})
    htype = head.get("type")
    fam = family_of_head(htype)
    if fam is None or not fam.speculators_type:
        carried = ", ".join(f"{f.speculators_type}: {' / '.join(f.head_types())}" for f in FAMILIES.values()
                            if f.speculators_type)
        raise CheckpointError(f"head type {htype!r} cannot be exported as speculators (it carries {carried}); "
                              f"{E.layout_for_head(htype)}")
    if htype == "selector" or d.get("conv_kernel_size"):
        E.check_dflash2_exportable(config, "speculators dflash2")
    if not d.get("qk_norm", False):
        raise CheckpointError("the drafter has qk_norm=false but speculators drafters are Qwen3 layers with "
                              "q_norm/k_norm; only drafters trained with drafter.qk_norm=true export")
    kind = fam.speculators_type
    vocab = int(ident.get("vocab_size") or head.get("vocab_size"))
    n_draft = int(d.get("draft_vocab_size") or 0) or vocab
    out = _validated_by_speculators(_write_config(config, kind, vocab, n_draft, target))
    # speculators' classes keep rope_theta only under rope_parameters (transformers 5); readers pinned to
    # transformers 4 (Qwen3Config(rope_theta=...)) read it at the top level, so it is written in both places
    out["transformer_layer_config"]["rope_theta"] = float(d["rope_theta"])
    return out, _write_tensors(tensors, htype, n_draft, vocab, target)


def _write_config(config: dict, kind: str, vocab: int, n_draft: int, target) -> dict:
    """The speculators config.json dict of a dartree checkpoint ``config`` as speculators type ``kind`` over a
    verifier vocabulary of ``vocab`` tokens and a draft vocabulary of ``n_draft`` (:func:`write` says what maps to
    what)."""
    d, head, ident = config["drafter"], config["head"], config.get("target", {})
    sfa = d["proposal_offset"] == 0
    block = int(d["block_size"])
    tcfg = getattr(target, "config", None)
    # a model id a server resolves, never this machine's cache path (model_id)
    verifier = model_id(getattr(tcfg, "_name_or_path", "") or getattr(target, "name", "") or ident.get("name") or "")
    archs = list(getattr(tcfg, "architectures", None) or [])
    tl = {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": d["hidden_size"],
          "intermediate_size": d["intermediate_size"], "num_hidden_layers": d["num_layers"],
          "num_attention_heads": d["num_heads"], "num_key_value_heads": d["num_kv_heads"], "head_dim": d["head_dim"],
          "rms_norm_eps": d["rms_norm_eps"], "rope_theta": d["rope_theta"],
          "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]}, "attention_bias": False,
          "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
          "layer_types": ["full_attention"] * d["num_layers"]}
    ctx = E.context_length(config)
    if ctx is not None:
        tl["max_position_embeddings"] = ctx
    out = {
        "speculators_model_type": kind, "architectures": [_types()[kind]], "transformer_layer_config": tl,
        "draft_vocab_size": n_draft, "block_size": block,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in d["target_layer_ids"]],
        "mask_token_id": int(d["mask_token_id"]), "target_hidden_size": d["hidden_size"],
        "sliding_window_non_causal": kind == "dflash2", "sample_from_anchor": sfa,
        "speculators_config": {"algorithm": kind,
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": block if sfa else block - 1}],
                               "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": verifier, "architectures": archs}},
    }
    if kind == "dflash2":
        out.update(conv_kernel_size=int(d["conv_kernel_size"]), conv_group_size=int(d["conv_group_size"]),
                   selector_rank=int(head["rank"]), selector_top_k=int(head["top_k"]))
    if kind == "dspark":
        out.update(markov_rank=int(head["rank"]), markov_head_type=published_type(head["type"]),
                   enable_confidence_head=bool(head.get("confidence_head", False)),
                   confidence_head_with_markov=bool(head.get("confidence_with_markov", True)))
    return out


def _validated_by_speculators(out: dict) -> dict:
    """``out`` as speculators' own config classes write it (``SpeculatorModelConfig``, defaults left out), when the
    package is importable; else ``out`` itself.

    Raises:
        CheckpointError: speculators rejects the config (its first line of reasons).
    """
    try:
        from speculators import SpeculatorModelConfig
    except ImportError:
        SpeculatorModelConfig = None
    if SpeculatorModelConfig is not None:
        import json

        try:
            out = json.loads(SpeculatorModelConfig.from_dict(out).to_json_string(use_diff=True))
        except Exception as exc:  # pydantic ValidationError: speculators' own words
            raise CheckpointError(f"speculators rejects the exported config: {str(exc).splitlines()[0]}") from None
    return out


def _write_tensors(tensors: dict, htype: str, n_draft: int, vocab: int, target) -> dict:
    """dartree tensors -> speculators tensors: published names; with a reduced vocabulary (``n_draft`` < ``vocab``)
    ``d2t`` [N] int64, ``t2d`` [V] bool, the target's lm_head rows [N, D] and ``markov_w2`` cut to those rows.

    Raises:
        CheckpointError: a reduced vocabulary without ``target`` (its lm_head rows must be written).
    """
    mapped = {}
    ids = None
    if n_draft != vocab:
        if target is None:
            raise CheckpointError(f"the drafter drafts over a reduced vocabulary of {n_draft} tokens; speculators "
                                  "stores that vocabulary's lm_head rows, so pass --target with the target's folder")
        ids, _ = torch.sort(tensors["backbone.draft_vocab"].long())
        mapped["d2t"] = (ids - torch.arange(n_draft)).to(torch.int64)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        mapped["t2d"] = t2d
        dtype = tensors["backbone.fc.weight"].dtype
        mapped["lm_head.weight"] = target.lm_head.weight.detach()[ids.to(target.lm_head.weight.device)].to(dtype).cpu()
    for name, t in tensors.items():
        if name == "backbone.draft_vocab":
            continue
        pub = _published(name, htype)
        if name == "head.w2.weight" and ids is not None:
            t = t[ids]
        mapped[pub] = t.contiguous()
    return mapped


SPECULATORS = FormatPair(name=NAME, detect=detect, read=read, write=write, marks="speculators_model_type")
PAIRS = (SPECULATORS,)  # registered by dartree.convert.publishers

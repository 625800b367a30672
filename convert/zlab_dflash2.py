"""z-lab DFlash 2 (``dflash`` 0.1.0 ``dflash/model.py``, ``DFlash2DraftModel``): one reader/writer pair in the format
registry of :mod:`dartree.convert.formats`, plus the DFlash 2 checks the speculators ``dflash2`` pair shares.

Facts (read from z-lab/dflash ``dflash/model.py``; speculators 0.9.0 ``models/dflash2/*`` for the same model):

- config.json: a z-lab DFlash config (Qwen3 fields, ``block_size``, ``dflash_config.{mask_token_id,
  target_layer_ids}``; ``architectures`` ``["DFlash2DraftModel"]``) plus ``conv_kernel_size`` k,
  ``conv_group_size`` g, ``selector_rank`` R and ``selector_top_k`` K, each read from ``dflash_config`` first,
  then the top level (z-lab ``_draft_value``); all four are required (z-lab calls ``int()`` on them).
- every layer wraps attention and MLP in a grouped dynamic causal convolution (``GroupedDynamicCausalConv``):
  ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, k, D] and ``...kernel_projection.weight`` [2*k*D/g, D]. The
  convolution runs over the block only (the context K/V are not convolved), causally from the anchor. dartree:
  ``backbone.layers.{i}.{attention,mlp}_conv.*`` (same shapes), ``drafter.conv_kernel_size`` /
  ``drafter.conv_group_size``.
- ``CandidateSelector``: ``candidate_selector.predecessor_codebook`` [V, R], ``candidate_selector.successor_codebook``
  [V, R] (``nn.Embedding``; z-lab's ``save_pretrained`` writes them with ``.weight``, its ``from_pretrained`` maps
  the published spelling without ``.weight`` onto them, and speculators stores plain Parameters without it: both
  spellings are read, the published one is written), ``candidate_selector.hidden_projection.weight`` [R, D]. At
  each block position the top-K tokens of the base logits U are rescored as U[C] + <pred[prev] * proj(h),
  succ[C]> (``CandidateSelector.select``); the anchor is the first proposal's previous token. dartree head
  ``selector`` {vocab_size V, rank R, hidden_size D, top_k K}: ``head.w1.weight`` = predecessor codebook,
  ``head.w2.weight`` = successor codebook, ``head.proj.weight`` = hidden projection.
- block positions 1..B-1 are the proposals (``dflash_generate`` keeps ``draft_hidden[:, 1 - B:]``): dartree
  ``proposal_offset`` 1. Every option of the z-lab DFlash backbone that changes the math (sliding-window layers,
  ``is_causal``, ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``, attention bias, RoPE
  scaling) is honoured or refused by name exactly as for ``zlab-dflash`` (:func:`dartree.convert.formats._backbone`).
"""

from __future__ import annotations

from dartree.convert import formats as F
from dartree.convert.registry import FormatPair, register_format
from dartree.models.checkpoint import CheckpointError, dartree_config, expected_tensors

NAME = "zlab-dflash2"
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


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
    for name in _CODEBOOKS:
        if name + ".weight" in out:
            if name in out:
                raise CheckpointError(f"{where}: tensor {name!r} appears twice (also as {name + '.weight'!r}); keep one "
                                      "of them")
            out[name] = out.pop(name + ".weight")
    return out


def conv_fields(kernel, group, *, hidden: int, block: int, where, keys=("conv_kernel_size", "conv_group_size")) -> dict:
    """dartree ``drafter`` fields for DFlash 2's convolutions, checked.

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
    k = F.field(kernel, keys[0], where)
    g = F.field(group, keys[1], where)
    if hidden % g:
        raise CheckpointError(f"{where}: {keys[1]}={g} does not divide hidden_size {hidden}; the DFlash 2 "
                              "convolution groups D / g channels per dynamic tap, so the file is inconsistent")
    if k > block:
        raise CheckpointError(f"{where}: {keys[0]}={k} exceeds block_size {block}; DFlash 2 taps stay inside the block "
                              "(speculators refuses it too): correct the file or re-export the drafter")
    return {"conv_kernel_size": k, "conv_group_size": g}


def selector_head(rank, top_k, *, vocab: int, hidden: int, where, keys=("selector_rank", "selector_top_k")) -> dict:
    """The dartree ``selector`` head config for DFlash 2's candidate selector, checked.

    Args:
        rank, top_k: the published ``selector_rank`` and ``selector_top_k`` as read from JSON. vocab: V (the
            codebooks have one row per target token). hidden: D. where, keys: for the message.
    Returns:
        ``{"type": "selector", "vocab_size": V, "rank": R, "hidden_size": D, "top_k": K}``.
    Raises:
        CheckpointError: a non-integer or out-of-range value, or K > V (both publishers refuse it), named.
    """
    r = F.field(rank, keys[0], where)
    k = F.field(top_k, keys[1], where)
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

    F.check_tensors(given, want, where, rename)
    return {name: given[rename(name)] for name in want}


def detect(config: dict, names: set[str]) -> str | None:
    """The reason ``config`` / tensor ``names`` are a z-lab DFlash 2 checkpoint, else None.

    Marks (any one): ``architectures`` ``["DFlash2DraftModel"]``, a ``conv_*`` / ``selector_*`` config field, or
    ``layers.*.{attention,mlp}_conv.*`` / ``candidate_selector.*`` tensors. A speculators config
    (``speculators_model_type``, whose ``dflash2`` also says ``DFlash2DraftModel``) is left to that pair.
    """
    if "speculators_model_type" in config:
        return None
    seen = F._dflash2_seen(config, names)
    return f"z-lab DFlash 2: {seen}" if seen else None


def read(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a z-lab DFlash 2 checkpoint -> (dartree config, tensors by dartree name), tensors passed through.

    Args:
        config: config.json. given: published name -> tensor. where: the checkpoint folder, for messages.
        target: optional :class:`~dartree.models.target.Target`; its tokenizer resolves a missing MASK id
            (as for ``zlab-dflash``).
    Raises:
        CheckpointError: an unknown layout (the message lists the expected fields), an option dartree does not
            implement (sliding windows, softcapping, ...: named with its value), inconsistent convolution or
            selector fields, or a missing, unexpected or mis-shaped tensor (named).
    """
    cfg_path = f"{where}/config.json"
    drafter = F._backbone(config, cfg_path, NAME, proposal_offset=1, target=target)
    d, vocab = drafter["hidden_size"], F.field(config["vocab_size"], "vocab_size", cfg_path)

    def get(key):
        return F._get(config, key, where=cfg_path, fmt=NAME)

    drafter.update(conv_fields(get("conv_kernel_size"), get("conv_group_size"), hidden=d,
                               block=drafter["block_size"], where=cfg_path))
    head = selector_head(get("selector_rank"), get("selector_top_k"), vocab=vocab, hidden=d, where=cfg_path)
    ident = {"name": config.get("_name_or_path") or f"(unknown; {NAME} source)", "vocab_size": vocab,
             "hidden_size": d, "num_layers": config.get("num_target_layers")}
    out = dartree_config(drafter, head, ident, {"source_format": NAME, "source": str(where)})
    want = expected_tensors(out, cfg_path)
    tensors = take_tensors(selector_spelling(given, where), want, lambda n: F.published_name(n, NAME), where)
    return out, tensors


def check_exportable(config: dict, fmt: str) -> None:
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
                        f"selector, head type 'selector'); choose --to {F._fmt_for_head(head.get('type'))}")
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


def write(config: dict, tensors: dict, target=None) -> tuple[dict, dict]:
    """Writer: a dartree DFlash 2 checkpoint -> (z-lab config.json dict, tensors by published name).

    The config is the ``zlab-dflash`` export (:func:`dartree.convert.formats.export_config`, transformers-4
    layout) with ``architectures`` ``["DFlash2DraftModel"]`` and ``dflash_config.{conv_kernel_size,
    conv_group_size, selector_rank, selector_top_k}``; the codebooks are written without ``.weight`` (the name
    z-lab's ``from_pretrained`` maps). ``num_target_layers`` is the recorded target's layer count, else that of
    ``target`` (a :class:`~dartree.models.target.Target` or None): z-lab's ``DFlashDraftModel.__init__`` reads it
    (as the argument of its default ``target_layer_ids``), so a config without it does not load.

    Raises:
        CheckpointError: :func:`check_exportable`; a proposal offset other than 1 (z-lab drafts block positions
            1..B-1); a head vocabulary that differs from the recorded target vocabulary; the target's layer count
            neither recorded nor given (pass ``--target``).
    """
    check_exportable(config, NAME)
    d, head = config["drafter"], config["head"]
    if d["proposal_offset"] != 1:
        raise CheckpointError(f"{NAME} drafters use proposal_offset 1 (block positions 1..B-1), this one uses "
                              f"{d['proposal_offset']}; exporting would shift every proposal by one position: choose "
                              "--to speculators (its sample_from_anchor expresses offset 0)")
    vocab = config.get("target", {}).get("vocab_size") or head["vocab_size"]
    if head["vocab_size"] != vocab:
        raise CheckpointError(f"the selector head has vocab_size {head['vocab_size']} but the target {vocab}; z-lab's "
                              "codebooks have one row per target token")
    n_target = config.get("target", {}).get("num_layers") or getattr(target, "num_layers", None)
    if n_target is None:
        raise CheckpointError("the checkpoint records no target layer count (config target.num_layers; a speculators "
                              "source has none) and z-lab's DFlash2DraftModel needs num_target_layers to load: pass "
                              "--target with the target's folder")
    plain = dict(config, drafter=dict(d, conv_kernel_size=0), head={"type": "identity"},
                 target=dict(config.get("target", {}), num_layers=int(n_target)))
    out = F.export_config(plain, "zlab-dflash")
    out["architectures"] = ["DFlash2DraftModel"]
    out["dflash_config"].update(conv_kernel_size=int(d["conv_kernel_size"]), conv_group_size=int(d["conv_group_size"]),
                                selector_rank=int(head["rank"]), selector_top_k=int(head["top_k"]))
    mapped = {F.published_name(k, NAME): v.contiguous() for k, v in tensors.items()}
    return out, mapped


register_format(FormatPair(name=NAME, detect=detect, read=read, write=write))

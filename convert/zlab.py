"""z-lab's published drafters (the ``dflash`` package 0.1.0, z-lab/dflash ``dflash/model.py``): two layouts of the
format registry, ``zlab-dflash`` (``DFlashDraftModel``) and ``zlab-dflash2`` (``DFlash2DraftModel``).

Facts (read from z-lab/dflash ``dflash/model.py``; speculators 0.9.0 ``models/dflash2/*`` for the same DFlash 2
model):

- ``zlab-dflash``: a Qwen3 config plus ``dflash_config.{mask_token_id, target_layer_ids}`` and ``block_size`` (top
  level or in ``dflash_config``); tensors ``fc``, ``hidden_norm``, ``norm`` and the Qwen3 layers of
  :mod:`dartree.convert.config_fields`; no embedding or lm_head. Block positions 1..B-1 are the proposals
  (``dflash_generate`` keeps ``draft_hidden[:, 1 - B:]``): dartree ``proposal_offset`` 1, head ``identity``.
- ``zlab-dflash2``: the z-lab DFlash layout (``architectures`` ``["DFlash2DraftModel"]``) plus ``conv_kernel_size``
  k, ``conv_group_size`` g, ``selector_rank`` R and ``selector_top_k`` K, each read from ``dflash_config`` first,
  then the top level (z-lab ``_draft_value``); all four are required (z-lab calls ``int()`` on them).

  - every layer wraps attention and MLP in a grouped dynamic causal convolution (``GroupedDynamicCausalConv``):
    ``layers.{i}.{attention,mlp}_conv.base_kernel`` [2, k, D] and ``...kernel_projection.weight`` [2*k*D/g, D]. The
    convolution runs over the block only (the context K/V are not convolved), causally from the anchor. dartree:
    ``backbone.layers.{i}.{attention,mlp}_conv.*`` (same shapes), ``drafter.conv_kernel_size`` /
    ``drafter.conv_group_size``.
  - ``CandidateSelector``: ``candidate_selector.predecessor_codebook`` [V, R],
    ``candidate_selector.successor_codebook`` [V, R] (``nn.Embedding``; z-lab's ``save_pretrained`` writes them
    with ``.weight``, its ``from_pretrained`` maps the published spelling without ``.weight`` onto them, and
    speculators stores plain Parameters without it: both spellings are read, the published one is written),
    ``candidate_selector.hidden_projection.weight`` [R, D]. At each block position the top-K tokens of the base
    logits U are rescored as U[C] + <pred[prev] * proj(h), succ[C]> (``CandidateSelector.select``); the anchor is
    the first proposal's previous token. dartree head ``selector`` {vocab_size V, rank R, hidden_size D, top_k K}:
    ``head.w1.weight`` = predecessor codebook, ``head.w2.weight`` = successor codebook, ``head.proj.weight`` =
    hidden projection.
  - proposal offset 1, as for ``zlab-dflash``. Every option of the z-lab DFlash backbone that changes the math
    (sliding-window layers, ``is_causal``, ``input_embedding_scale``, ``output_multiplier``,
    ``final_logit_softcapping``, attention bias, RoPE scaling) is honoured or refused by name exactly as for
    ``zlab-dflash`` (:func:`dartree.convert.config_fields.backbone`).
"""

from __future__ import annotations

from dartree.convert import config_fields as C
from dartree.convert import export_config as E
from dartree.convert import published_tensors as T
from dartree.convert.registry import FormatPair
from dartree.models.checkpoint import CheckpointError, dartree_config, expected_tensors
from dartree.models.families import published_names

DFLASH_NAME, DFLASH2_NAME = "zlab-dflash", "zlab-dflash2"
DFLASH_LAYOUT = C.ConfigLayout(DFLASH_NAME, f"a Qwen3 config ({C.QWEN3}) with block_size and "
                                            "dflash_config.{mask_token_id, target_layer_ids}")
DFLASH2_LAYOUT = C.ConfigLayout(DFLASH2_NAME, f"a Qwen3 config ({C.QWEN3}) with block_size and dflash_config."
                                              "{mask_token_id, target_layer_ids, conv_kernel_size, conv_group_size, "
                                              "selector_rank, selector_top_k}")


# ------------------------------------------------------------------------------------------------ zlab-dflash
def parse_dflash(config: dict, where, target=None) -> T.Parsed:
    """Read a z-lab DFlash config.json into dartree terms (head ``identity``, proposal offset 1).

    Args:
        config: the config.json dict. where: the file, for messages. target: optional
            :class:`~dartree.models.target.Target`; its tokenizer resolves a missing MASK id the way SpecForge does.
    Raises:
        CheckpointError: unknown layout (the message lists the expected fields) or an unsupported option, named.
    """
    drafter = C.backbone(config, where, DFLASH_LAYOUT, proposal_offset=1, target=target)
    vocab = C.field(config["vocab_size"], "vocab_size", where)
    return T.Parsed(drafter, {"type": "identity"},
                    C.target_identity(config, DFLASH_NAME, where, vocab, drafter["hidden_size"]), {})


def detect_dflash(config: dict, names: set[str]) -> str | None:
    """The reason ``config`` is a z-lab DFlash checkpoint: a non-empty ``dflash_config``; else None.

    The DFlash family's catch-all: :mod:`dartree.convert.publishers` tries it after every layout that adds marks
    of its own to a ``dflash_config`` (DFlash 2, SpecForge Domino and DSpark).
    """
    return "dflash_config without head tensors" if C.dflash_config(config) else None


def read_dflash(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a z-lab DFlash checkpoint -> (dartree config, tensors by dartree name), tensors passed through.

    Args:
        config: config.json. given: published name -> tensor. where: the checkpoint folder, for messages.
        target: optional :class:`~dartree.models.target.Target` (resolves a missing MASK id).
    Raises:
        CheckpointError: :func:`parse_dflash`'s, or a missing, unexpected or mis-shaped tensor (named).
    """
    parsed = parse_dflash(config, f"{where}/config.json", target=target)
    return T.read_parsed(parsed, DFLASH_NAME, given, where, target)


def dflash_config(config: dict) -> dict:
    """The z-lab DFlash config.json of a dartree checkpoint config (:func:`dartree.convert.export_config.export_config`
    with head ``identity`` and proposal offset 1).

    Raises:
        CheckpointError: the drafter cannot be expressed as z-lab DFlash (named, with what would fit).
    """
    return E.export_config(config, DFLASH_NAME, family="dflash", proposal_offset=1)


def write_dflash(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree checkpoint -> (z-lab DFlash config.json dict, tensors by published name, bit for bit).

    ``num_target_layers`` is the recorded target's layer count, else that of ``target`` (a
    :class:`~dartree.models.target.Target` or None): z-lab's ``DFlashDraftModel`` needs it to load.

    Raises:
        CheckpointError: a reduced draft vocabulary, the target's layer count neither recorded nor given (pass
            ``--target``), or :func:`dflash_config`'s refusals.
    """
    config = E.export_ready(config, DFLASH_NAME, target, where)
    if config.get("target", {}).get("num_layers") is None:
        raise CheckpointError(f"{where} records no target layer count (config target.num_layers; a speculators source "
                              "has none) and z-lab's DFlashDraftModel needs num_target_layers to load: pass --target "
                              "with the target's folder")
    return dflash_config(config), T.publish_tensors(tensors, config["head"]["type"], DFLASH_NAME)


# ----------------------------------------------------------------------------------------------- zlab-dflash2
def detect_dflash2(config: dict, names: set[str]) -> str | None:
    """The reason ``config`` / tensor ``names`` are a z-lab DFlash 2 checkpoint, else None.

    Marks (any one, :func:`dartree.convert.config_fields.dflash2_marks`): ``architectures`` ``["DFlash2DraftModel"]``, a
    ``conv_*`` / ``selector_*`` config field, or ``layers.*.{attention,mlp}_conv.*`` / ``candidate_selector.*``
    tensors. A speculators config (``speculators_model_type``, whose ``dflash2`` also says ``DFlash2DraftModel``) is
    left to that layout.
    """
    if "speculators_model_type" in config:
        return None
    seen = C.dflash2_marks(config, names)
    return f"z-lab DFlash 2: {seen}" if seen else None


def read_dflash2(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
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
    drafter = C.backbone(config, cfg_path, DFLASH2_LAYOUT, proposal_offset=1, target=target)
    d, vocab = drafter["hidden_size"], C.field(config["vocab_size"], "vocab_size", cfg_path)

    def get(key):
        return C.config_value(config, key, where=cfg_path, layout=DFLASH2_LAYOUT)

    drafter.update(C.conv_fields(get("conv_kernel_size"), get("conv_group_size"), hidden=d,
                                 block=drafter["block_size"], where=cfg_path))
    head = C.selector_head(get("selector_rank"), get("selector_top_k"), vocab=vocab, hidden=d, where=cfg_path)
    ident = {"name": config.get("_name_or_path") or f"(unknown; {DFLASH2_NAME} source)", "vocab_size": vocab,
             "hidden_size": d, "num_layers": config.get("num_target_layers")}
    out = dartree_config(drafter, head, ident, {"source_format": DFLASH2_NAME, "source": str(where)})
    want = expected_tensors(out, cfg_path)
    names = published_names(head["type"])
    tensors = T.take_tensors(T.selector_spelling(given, where), want,
                             lambda n: T.published_name(n, names, DFLASH2_NAME), where)
    return out, tensors


def write_dflash2(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree DFlash 2 checkpoint -> (z-lab config.json dict, tensors by published name).

    The config is the ``zlab-dflash`` export (:func:`dflash_config`, transformers-4 layout) with ``architectures``
    ``["DFlash2DraftModel"]`` and ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k}``; the codebooks are written without ``.weight`` (the name z-lab's ``from_pretrained`` maps).
    ``num_target_layers`` is the recorded target's layer count, else that of ``target`` (a
    :class:`~dartree.models.target.Target` or None): z-lab's ``DFlashDraftModel.__init__`` reads it (as the
    argument of its default ``target_layer_ids``), so a config without it does not load. ``where`` is unused
    (every message names the drafter's fields).

    Raises:
        CheckpointError: :func:`dartree.convert.export_config.check_dflash2_exportable`; a proposal offset other than 1
            (z-lab drafts block positions 1..B-1); a head vocabulary that differs from the recorded target
            vocabulary; the target's layer count neither recorded nor given (pass ``--target``).
    """
    E.check_dflash2_exportable(config, DFLASH2_NAME)
    d, head = config["drafter"], config["head"]
    if d["proposal_offset"] != 1:
        raise CheckpointError(f"{DFLASH2_NAME} drafters use proposal_offset 1 (block positions 1..B-1), this one uses "
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
    out = dflash_config(plain)
    out["architectures"] = ["DFlash2DraftModel"]
    out["dflash_config"].update(conv_kernel_size=int(d["conv_kernel_size"]), conv_group_size=int(d["conv_group_size"]),
                                selector_rank=int(head["rank"]), selector_top_k=int(head["top_k"]))
    return out, T.publish_tensors(tensors, head["type"], DFLASH2_NAME)


DFLASH = FormatPair(name=DFLASH_NAME, detect=detect_dflash, read=read_dflash, write=write_dflash,
                    marks="a Qwen3 config with dflash_config")
DFLASH2 = FormatPair(name=DFLASH2_NAME, detect=detect_dflash2, read=read_dflash2, write=write_dflash2,
                     marks="architectures ['DFlash2DraftModel'], dflash_config.{conv_*, selector_*} or "
                           "layers.*.{attention,mlp}_conv.* / candidate_selector.* tensors")
PAIRS = (DFLASH, DFLASH2)  # registered by dartree.convert.publishers

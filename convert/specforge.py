"""SpecForge's published drafters (``specforge`` 0.2.0, sgl-project/SpecForge): two layouts of the format registry,
``specforge-domino`` and ``specforge-dspark``.

Facts (read from SpecForge ``specforge/modeling/draft/domino.py``, ``dspark.py`` and ``dspark_heads.py``):

- ``specforge-domino``: the z-lab DFlash backbone (:mod:`dartree.convert.config_fields`) plus
  ``prefix_gru.weight_{ih,hh}_l0`` and ``embed_proj.{0,2}.weight`` (older checkpoints: under ``logit_head.``,
  SpecForge ``normalize_draft_head_checkpoint_keys``); ``dflash_config.{emb_dim, gru_hidden_dim,
  pure_draft_prefix_len, shift_label}``. ``shift_label`` true means all B positions are proposals (offset 0), else
  B-1 (offset 1); head ``gru`` with ``prefix_len`` = ``pure_draft_prefix_len`` counted in proposals, as SpecForge's
  ``suffix_start`` does in both modes. Exports say ``architectures`` ``["DominoDraftModel"]`` (SpecForge's loader
  dispatches on it).
- ``specforge-dspark``: the backbone plus ``markov_head.markov_w1.weight``, ``markov_head.markov_w2.weight``,
  ``markov_head.gate_proj.*`` (gated), ``markov_head.joint_proj.*`` (rnn), ``confidence_head.proj.*``; fields
  ``markov_rank``, ``markov_head_type`` (vanilla | gated | rnn), ``enable_confidence_head``,
  ``confidence_head_with_markov`` in ``dflash_config`` (or at the top level, the older ``DSparkConfig`` layout). All
  B positions are proposals (offset 0): DSpark trains on labels anchor+1..anchor+B (SpecForge ``OnlineDSparkModel``
  and DeepSpec; dartree follows training, not the B-1 slice of SpecForge's DSpark ``spec_generate``).
"""

from __future__ import annotations

from dartree.convert import config_fields as C
from dartree.convert import export_config as E
from dartree.convert import published_tensors as T
from dartree.convert.registry import FormatPair
from dartree.models.checkpoint import CheckpointError
from dartree.models.families import published_type

DOMINO_NAME, DSPARK_NAME = "specforge-domino", "specforge-dspark"
DOMINO_LAYOUT = C.ConfigLayout(DOMINO_NAME, f"a Qwen3 config ({C.QWEN3}) with block_size and dflash_config."
                                            "{mask_token_id, target_layer_ids, emb_dim, gru_hidden_dim, "
                                            "pure_draft_prefix_len, shift_label}")
DSPARK_LAYOUT = C.ConfigLayout(DSPARK_NAME, f"a Qwen3 config ({C.QWEN3}) with block_size and dflash_config."
                                            "{mask_token_id, target_layer_ids, markov_rank, markov_head_type, "
                                            "enable_confidence_head, confidence_head_with_markov}")


def _projector(config: dict, names: set[str]) -> tuple[dict, object, bool, bool]:
    """(dflash_config, its projector_type, Domino head tensors present, DSpark head tensors present)."""
    dc = C.dflash_config(config)
    has_gru = any(n.startswith(("prefix_gru.", "embed_proj.")) for n in names)
    has_markov = any(n.startswith(("markov_head.", "confidence_head.")) for n in names)
    return dc, dc.get("projector_type"), has_gru, has_markov


# ------------------------------------------------------------------------------------------- specforge-domino
def parse_domino(config: dict, where, target=None) -> T.Parsed:
    """Read a SpecForge Domino config.json into dartree terms (head ``gru``; proposal offset 0 with
    ``shift_label``, else 1).

    Args:
        config: the config.json dict. where: the file, for messages. target: optional
            :class:`~dartree.models.target.Target`; its tokenizer resolves a missing MASK id as SpecForge does.
    Raises:
        CheckpointError: unknown layout (the message lists the expected fields), a field out of range, or an
            unsupported option, named.
    """
    get = lambda key, **kw: C.config_value(config, key, where=where, layout=DOMINO_LAYOUT, **kw)  # noqa: E731
    shift = C.flag(get("shift_label", default=False), "shift_label", where)
    drafter = C.backbone(config, where, DOMINO_LAYOUT, proposal_offset=0 if shift else 1, target=target)
    head = {
        "type": "gru",
        "vocab_size": C.field(config["vocab_size"], "vocab_size", where),
        "hidden_size": drafter["hidden_size"],
        "emb_dim": C.field(get("emb_dim"), "emb_dim", where),
        "gru_hidden_dim": C.field(get("gru_hidden_dim"), "gru_hidden_dim", where),
        "prefix_len": C.field(get("pure_draft_prefix_len", default=0), "pure_draft_prefix_len", where, C.INT0),
    }
    vocab = C.field(config["vocab_size"], "vocab_size", where)
    return T.Parsed(drafter, head, C.target_identity(config, DOMINO_NAME, where, vocab, drafter["hidden_size"]), {})


def detect_domino(config: dict, names: set[str]) -> str | None:
    """The reason a checkpoint is SpecForge Domino: a ``dflash_config`` with ``projector_type`` ``domino`` or
    ``prefix_gru.*`` / ``embed_proj.*`` tensors; else None."""
    dc, projector, has_gru, _ = _projector(config, names)
    if dc and (projector == "domino" or has_gru):
        return "dflash_config.projector_type='domino'" if projector == "domino" else "prefix_gru.* tensors"
    return None


def read_domino(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a SpecForge Domino checkpoint -> (dartree config, tensors by dartree name), tensors passed through.

    Raises:
        CheckpointError: :func:`parse_domino`'s, or a missing, unexpected or mis-shaped tensor (named).
    """
    parsed = parse_domino(config, f"{where}/config.json", target=target)
    return T.read_parsed(parsed, DOMINO_NAME, given, where, target)


def domino_config(config: dict) -> dict:
    """The SpecForge Domino config.json of a dartree checkpoint config (``gru`` head, any proposal offset, written
    as ``shift_label``).

    Raises:
        CheckpointError: another head type, q/k norm off, DFlash 2 convolutions
            (:func:`dartree.convert.export_config.export_config`), or a GRU input width other than the hidden size.
    """
    out = E.export_config(config, DOMINO_NAME, family="domino", proposal_offset=None)
    d, head = config["drafter"], dict(config["head"])
    if head.get("embed_dim", head["hidden_size"]) != d["hidden_size"]:
        raise CheckpointError(f"gru head embed_dim {head['embed_dim']} != hidden_size {d['hidden_size']}; "
                              "SpecForge Domino's GRU input width is the hidden size")
    out["architectures"] = ["DominoDraftModel"]  # SpecForge's loader dispatches on it (DFlash would drop the GRU)
    out["dflash_config"].update(projector_type="domino", pure_draft_prefix_len=head["prefix_len"],
                                emb_dim=head["emb_dim"], gru_hidden_dim=head["gru_hidden_dim"],
                                shift_label=d["proposal_offset"] == 0)
    out["emb_dim"] = head["emb_dim"]
    return out


def write_domino(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree ``gru`` checkpoint -> (SpecForge Domino config.json dict, tensors by published name, bit
    for bit).

    Raises:
        CheckpointError: a reduced draft vocabulary (``where`` names the checkpoint) or :func:`domino_config`'s
            refusals.
    """
    config = E.export_ready(config, DOMINO_NAME, target, where)
    return domino_config(config), T.publish_tensors(tensors, config["head"]["type"], DOMINO_NAME)


# ------------------------------------------------------------------------------------------- specforge-dspark
def parse_dspark(config: dict, where, target=None) -> T.Parsed:
    """Read a SpecForge DSpark config.json into dartree terms (head ``markov`` / ``gated_markov`` / ``rnn``, or
    ``identity`` without a Markov head; proposal offset 0), with SpecForge's defaults
    (``DSparkDraftModel._init_draft_head`` / ``build_markov_head``): a missing ``markov_rank`` is 0, the confidence
    head exists when ``enable_confidence_head``, which defaults to ``confidence_head_alpha`` > 0, and
    ``confidence_head_with_markov`` defaults to false.

    Raises:
        CheckpointError: unknown layout (the message lists the expected fields), a field out of range, an unknown
            ``markov_head_type``, a confidence head without a Markov head, or an unsupported option, named.
    """
    drafter = C.backbone(config, where, DSPARK_LAYOUT, proposal_offset=0, target=target)
    vocab = C.field(config["vocab_size"], "vocab_size", where)
    get = lambda key, **kw: C.config_value(config, key, where=where, layout=DSPARK_LAYOUT, **kw)  # noqa: E731
    alpha = C.field(get("confidence_head_alpha", default=0.0) or 0.0, "confidence_head_alpha", where, C.REAL0)
    rank = C.field(get("markov_rank", default=0) or 0, "markov_rank", where, C.INT0)
    conf = C.flag(get("enable_confidence_head", default=alpha > 0.0), "enable_confidence_head", where)
    with_markov = C.flag(get("confidence_head_with_markov", default=False), "confidence_head_with_markov", where)
    head = C.dspark_head(rank, get("markov_head_type", default="vanilla"), conf, with_markov, vocab=vocab,
                         hidden=drafter["hidden_size"], where=where)
    return T.Parsed(drafter, head, C.target_identity(config, DSPARK_NAME, where, vocab, drafter["hidden_size"]), {})


def detect_dspark(config: dict, names: set[str]) -> str | None:
    """The reason a checkpoint is SpecForge DSpark: a ``dflash_config`` with ``projector_type`` ``dspark``,
    ``markov_head.*`` / ``confidence_head.*`` tensors or a ``markov_rank`` field; else None.

    :mod:`dartree.convert.publishers` tries it after :func:`detect_domino` (a Domino checkpoint may carry both).
    """
    dc, projector, _, has_markov = _projector(config, names)
    if dc and (projector == "dspark" or has_markov or "markov_rank" in dc or "markov_rank" in config):
        return "dflash_config.projector_type='dspark'" if projector == "dspark" else "markov_head.* tensors / markov_rank"
    return None


def read_dspark(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a SpecForge DSpark checkpoint -> (dartree config, tensors by dartree name), tensors passed through.

    Raises:
        CheckpointError: :func:`parse_dspark`'s, or a missing, unexpected or mis-shaped tensor (named).
    """
    parsed = parse_dspark(config, f"{where}/config.json", target=target)
    return T.read_parsed(parsed, DSPARK_NAME, given, where, target)


def dspark_config(config: dict) -> dict:
    """The SpecForge DSpark config.json of a dartree checkpoint config (a DSpark head, proposal offset 0;
    ``attention_mode`` ``mha`` when the head counts are equal, which SpecForge DSpark otherwise refuses).

    Raises:
        CheckpointError: another head type, q/k norm off, DFlash 2 convolutions, or another proposal offset
            (:func:`dartree.convert.export_config.export_config`).
    """
    out = E.export_config(config, DSPARK_NAME, family="dspark", proposal_offset=0)
    d, head = config["drafter"], config["head"]
    out["architectures"] = ["DSparkDraftModel"]
    dc = out["dflash_config"]
    dc.update(projector_type="dspark", markov_rank=head["rank"], markov_head_type=published_type(head["type"]),
              enable_confidence_head=bool(head.get("confidence_head", False)),
              confidence_head_with_markov=bool(head.get("confidence_with_markov", True)))
    if d["num_kv_heads"] == d["num_heads"]:  # SpecForge DSpark refuses equal head counts unless told "mha"
        dc["attention_mode"] = "mha"
    return out


def write_dspark(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree DSpark checkpoint -> (SpecForge DSpark config.json dict, tensors by published name, bit
    for bit).

    Raises:
        CheckpointError: a reduced draft vocabulary (``where`` names the checkpoint) or :func:`dspark_config`'s
            refusals.
    """
    config = E.export_ready(config, DSPARK_NAME, target, where)
    return dspark_config(config), T.publish_tensors(tensors, config["head"]["type"], DSPARK_NAME)


DOMINO = FormatPair(name=DOMINO_NAME, detect=detect_domino, read=read_domino, write=write_domino,
                    marks="a Qwen3 config with dflash_config and projector_type 'domino' or prefix_gru.* tensors")
DSPARK = FormatPair(name=DSPARK_NAME, detect=detect_dspark, read=read_dspark, write=write_dspark,
                    marks="a Qwen3 config with dflash_config and projector_type 'dspark', markov_rank or "
                          "markov_head.* tensors")
PAIRS = (DOMINO, DSPARK)  # registered by dartree.convert.publishers

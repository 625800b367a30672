"""DeepSpec's published DSpark drafters: one read-only layout of the format registry, ``deepspec-dspark``.

Facts (read from DeepSpec ``deepspec/modeling/dspark/qwen3/{config,modeling}.py``): the target's config with
top-level ``target_layer_ids``, ``mask_token_id``, ``block_size``, ``num_anchors`` and the DSpark fields
``markov_rank`` (required), ``markov_head_type`` (default vanilla), ``enable_confidence_head`` (default false),
``confidence_head_with_markov`` (default true); no ``dflash_config``. Tensors: the z-lab DFlash backbone of
:mod:`dartree.convert.config_fields` and the DSpark head under the published names of its family
(:mod:`dartree.models.families.dspark`: ``markov_head.*``, ``confidence_head.*``), plus frozen copies
``embed_tokens.weight`` and ``lm_head.weight`` [V, D], which dartree drops (the target provides them; with a target
they must equal its own). All B block positions are proposals (dartree ``proposal_offset`` 0). dartree writes no
DeepSpec layout (``--to`` does not list it): export a DSpark drafter as ``specforge-dspark`` or ``speculators``.
"""

from __future__ import annotations

from dartree.convert import config_fields as C
from dartree.convert import published_tensors as T
from dartree.convert.registry import FormatPair

NAME = "deepspec-dspark"
LAYOUT = C.ConfigLayout(NAME, f"a Qwen3 config ({C.QWEN3}) with top-level block_size, mask_token_id, target_layer_ids, "
                              "markov_rank, markov_head_type, enable_confidence_head", nested=False)


def parse_dspark(config: dict, where, target=None) -> T.Parsed:
    """Read a DeepSpec DSpark config.json into dartree terms (a DSpark head, or ``identity`` for ``markov_rank`` 0;
    proposal offset 0; ``embed_tokens.weight`` / ``lm_head.weight`` [V, D] listed as dropped).

    Args:
        config: the config.json dict. where: the file, for messages. target: optional
            :class:`~dartree.models.target.Target`; its tokenizer resolves a missing MASK id.
    Raises:
        CheckpointError: unknown layout (the message lists the expected fields), a field out of range, an unknown
            ``markov_head_type``, a confidence head without a Markov head, or an unsupported option, named.
    """
    drafter = C.backbone(config, where, LAYOUT, proposal_offset=0, target=target)
    vocab, d = C.field(config["vocab_size"], "vocab_size", where), drafter["hidden_size"]
    get = lambda key, **kw: C.config_value(config, key, where=where, layout=LAYOUT, **kw)  # noqa: E731
    rank = C.field(get("markov_rank"), "markov_rank", where, C.INT0)
    conf = C.flag(get("enable_confidence_head", default=False), "enable_confidence_head", where)
    with_markov = C.flag(get("confidence_head_with_markov", default=True), "confidence_head_with_markov", where)
    head = C.dspark_head(rank, get("markov_head_type", default="vanilla"), conf, with_markov, vocab=vocab, hidden=d,
                         where=where)
    dropped = {"embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d)}
    return T.Parsed(drafter, head, C.target_identity(config, NAME, where, vocab, d), dropped)


def detect(config: dict, names: set[str]) -> str | None:
    """The reason a checkpoint is DeepSpec DSpark: top-level ``target_layer_ids``, no ``dflash_config``, and
    ``markov_rank`` or an ``embed_tokens.weight`` tensor; else None."""
    if "target_layer_ids" in config and "dflash_config" not in config and (
            "markov_rank" in config or "embed_tokens.weight" in names):
        return "top-level target_layer_ids and markov_rank (DeepSpec layout)"
    return None


def read(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a DeepSpec DSpark checkpoint -> (dartree config, tensors by dartree name), tensors passed through;
    the dropped copies are recorded in the provenance (``dropped``).

    Raises:
        CheckpointError: :func:`parse_dspark`'s; a missing, unexpected or mis-shaped tensor (named); with
            ``target``, an ``embed_tokens`` / ``lm_head`` copy that differs from the target's.
    """
    parsed = parse_dspark(config, f"{where}/config.json", target=target)
    return T.read_parsed(parsed, NAME, given, where, target)


DSPARK = FormatPair(name=NAME, detect=detect, read=read, write=None,
                    marks="top-level target_layer_ids and markov_rank, no dflash_config")
PAIRS = (DSPARK,)  # registered by dartree.convert.publishers

"""DSpine's published drafters: two layouts of the format registry, ``specforge-dspine`` (read and written) and
``tencent-dspine`` (read).

Facts (read from SpecForge ``specforge/modeling/draft/dspine.py``, ``configs/qwen3-8b-dspine.json`` and
``scripts/convert_dspine_checkpoint.py`` in sgl-project/SpecForge):

- ``specforge-dspine`` (``DSpineDraftModel``): the DFlash backbone of :mod:`dartree.convert.config_fields` (Qwen3
  config, ``block_size``, ``dflash_config.{mask_token_id, target_layer_ids}``; ``is_causal`` true: the block is causal) plus
  ``architectures`` ``["DSpineDraftModel"]``, ``dspine_config`` {transfer_rank, message_size, top_k, ce_weight,
  alignment_weight, alignment_warmup_steps, replacement_layers, replacement_probability, replacement_hold_ratio,
  replacement_end_ratio, candidate_mass_threshold} (a missing rank or message size is read from the tensors' shapes,
  another missing field takes SpecForge's default) and the tensors
  ``injection.readouts.{l}.weight`` [r, D], ``injection.writes.{l}.weight`` [D, m],
  ``injection.{message,receiver_gate,predecessor_gate}.weight`` [m, r], ``injection.bias`` [m] and the buffers
  ``transfer_codes`` [V, r], ``transfer_ready`` (bool, true once the codes are set). Block position 0 is the
  anchor, 1..B-1 propose: dartree ``proposal_offset`` 1, ``causal_block`` true, head ``dspine`` (tensors
  ``head.<published name>``, :mod:`dartree.models.families.dspine`).
- ``tencent-dspine`` (the reference checkpoint SpecForge's converter packages): a config.json, bare or under a
  ``config`` key, the same model tensors without the two buffers, and the token codes in a separate safetensors file
  (``transfer.safetensors``) under the key ``codes`` [V, r]. As SpecForge's converter: the rank and message size
  come from the readout and message shapes, the block size is 16 whatever the config says (the reference trained
  with it), ``target_layer_ids`` and ``mask_token_id`` must be in ``dflash_config``, the other ``dspine_config``
  fields take SpecForge's defaults, and the codes count as set.

Conversion passes every tensor through bit for bit (``transfer_ready`` is made for ``tencent-dspine``), so
``specforge-dspine`` -> dartree -> ``specforge-dspine`` is tensor-identical.
"""

from __future__ import annotations

import torch

from dartree.convert import config_fields as C
from dartree.convert import export_config as E
from dartree.convert import published_tensors as T
from dartree.convert.registry import FormatPair
from dartree.models.checkpoint import CheckpointError
from dartree.models.families.dspine import SPECFORGE_DEFAULTS

SPECFORGE_NAME, TENCENT_NAME = "specforge-dspine", "tencent-dspine"
ARCH = "DSpineDraftModel"
LAYOUT = C.ConfigLayout(SPECFORGE_NAME, f"a Qwen3 config ({C.QWEN3}) with block_size, dflash_config.{{mask_token_id, "
                                        "target_layer_ids}, dspine_config and architectures ['DSpineDraftModel']")
TENCENT_LAYOUT = C.ConfigLayout(TENCENT_NAME, f"a Qwen3 config ({C.QWEN3}), bare or under 'config', with "
                                              "dflash_config.{mask_token_id, target_layer_ids}")
_CODES_FILE = "transfer.safetensors"


def _marks(config: dict, names: set[str]) -> list[str]:
    """What marks a DSpine checkpoint: the architecture, ``dspine_config``, ``injection.*`` tensors, the codes."""
    inner = config.get("config") if isinstance(config.get("config"), dict) else config
    seen = []
    if ARCH in (inner.get("architectures") or []):
        seen.append(f"architectures [{ARCH!r}]")
    if "dspine_config" in inner:
        seen.append("dspine_config")
    if any(n.startswith("injection.") for n in names):
        seen.append("injection.* tensors")
    return seen


def detect_specforge(config: dict, names: set[str]) -> str | None:
    """The reason a checkpoint is SpecForge DSpine: DSpine marks with a ``transfer_codes`` tensor and no Tencent
    ``codes``; else None.

    Raises:
        CheckpointError: DSpine marks without token codes (neither ``transfer_codes`` nor a ``codes`` file).
    """
    seen = _marks(config, names)
    if not seen or "codes" in names:
        return None
    if "transfer_codes" in names and "transfer_ready" not in names:
        raise CheckpointError(f"a DSpine checkpoint ({', '.join(seen)}) with transfer_codes but no transfer_ready: "
                              f"Tencent's reference keeps its codes in {_CODES_FILE} under the key 'codes' (rename "
                              "the key), SpecForge's model file holds both buffers")
    if "transfer_codes" not in names:
        raise CheckpointError(f"a DSpine checkpoint ({', '.join(seen)}) without its token codes: SpecForge's layout "
                              f"stores them as the tensor transfer_codes, Tencent's in {_CODES_FILE} under 'codes'; "
                              "copy the missing file into the folder")
    return ", ".join(seen) + ", transfer_codes"


def detect_tencent(config: dict, names: set[str]) -> str | None:
    """The reason a checkpoint is Tencent's DSpine reference: ``injection.*`` tensors and a ``codes`` tensor (the
    codes file); else None."""
    if "codes" in names and any(n.startswith("injection.") for n in names):
        return f"injection.* tensors and the token codes under 'codes' ({_CODES_FILE})"
    return None


def _head(cfg: dict, dc: dict, drafter: dict, vocab: int, where) -> dict:
    """The dartree ``dspine`` head config: the layer count and width from the backbone, ``dspine_config`` fields
    over SpecForge's defaults (checked when the head is built)."""
    unknown = sorted(set(dc) - set(SPECFORGE_DEFAULTS))
    if unknown:
        raise CheckpointError(f"{where}: dspine_config field(s) {unknown} are unknown; known: "
                              f"{sorted(SPECFORGE_DEFAULTS)}")
    return {"type": "dspine", "vocab_size": vocab, "hidden_size": drafter["hidden_size"],
            "num_layers": drafter["num_layers"], **{k: dc.get(k, v) for k, v in SPECFORGE_DEFAULTS.items()}}


def _shape_fields(given: dict) -> dict:
    """``transfer_rank`` and ``message_size`` as the tensors give them (readout 0 is [r, D], the message [m, r]), for
    the fields a config leaves out: read from the weights, not SpecForge's defaults, which fit only its 8B drafter."""
    shapes = {"transfer_rank": "injection.readouts.0.weight", "message_size": "injection.message.weight"}
    return {k: int(given[n].shape[0]) for k, n in shapes.items() if n in given and given[n].dim() == 2}


def _backbone(cfg: dict, where, layout, target) -> dict:
    """The backbone fields (``is_causal`` is DSpine's causal block), ``causal_block`` set.

    Raises:
        CheckpointError: ``is_causal`` false (a DSpine block is causal; dartree would decode it otherwise than it
            was trained), or :func:`dartree.convert.config_fields.backbone`'s refusals.
    """
    if cfg.get("is_causal", True) is not True:
        raise CheckpointError(f"{where}: is_causal is {cfg['is_causal']!r}, but a DSpine drafter attends causally "
                              "inside the block (SpecForge's configs set is_causal true); a drafter trained with a "
                              "bidirectional block is a DFlash drafter: convert it without the DSpine marks")
    cfg = {k: v for k, v in cfg.items() if k != "is_causal"}
    drafter = C.backbone(cfg, where, layout, proposal_offset=1, target=target)
    return {**drafter, "causal_block": True}


def _checked_codes(tensors: dict, where) -> None:
    """Refuse token codes that are not set, not floating point or not finite (one line)."""
    ready, codes = tensors.get("transfer_ready"), tensors.get("transfer_codes")
    if ready is not None and not bool(ready.reshape(-1)[0]):
        raise CheckpointError(f"{where}: transfer_ready is false: the token codes were never set (SpecForge sets them "
                              "from the target's lm_head when training starts); convert a trained checkpoint")
    if codes is not None and not codes.is_floating_point():
        raise CheckpointError(f"{where}: transfer_codes are {str(codes.dtype).removeprefix('torch.')}, but DSpine's "
                              "token codes are real (the whitened PCA of the lm_head rows): this is not a codes file")
    if codes is not None and not bool(torch.isfinite(codes.float()).all()):
        raise CheckpointError(f"{where}: transfer_codes holds non-finite values; the checkpoint is corrupt")


def read_specforge(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: a SpecForge DSpine checkpoint -> (dartree config, tensors by dartree name), tensors passed through.

    Raises:
        CheckpointError: unknown layout or option (named), an unknown ``dspine_config`` field, a missing,
            unexpected or mis-shaped tensor (its published name and both shapes), or codes not set.
    """
    where_cfg = f"{where}/config.json"
    dc = config.get("dspine_config") or {}
    if not isinstance(dc, dict):
        raise CheckpointError(f"{where_cfg}: dspine_config must be an object of DSpine fields, got {dc!r}")
    drafter = _backbone(config, where_cfg, LAYOUT, target)
    vocab = C.field(config["vocab_size"], "vocab_size", where_cfg)
    dc = {**_shape_fields(given), **dc}
    parsed = T.Parsed(drafter, _head(config, dc, drafter, vocab, where_cfg),
                      C.target_identity(config, SPECFORGE_NAME, where_cfg, vocab, drafter["hidden_size"]), {})
    out, tensors = T.read_parsed(parsed, SPECFORGE_NAME, given, where, target)
    _checked_codes({"transfer_ready": tensors["head.transfer_ready"], "transfer_codes": tensors["head.transfer_codes"]},
                   where)
    return out, tensors


def read_tencent(config: dict, given: dict, where, target=None) -> tuple[dict, dict]:
    """Reader: Tencent's DSpine reference checkpoint (the codes in their own file) -> (dartree config, tensors by
    dartree name); ``codes`` becomes ``head.transfer_codes``, ``head.transfer_ready`` is made true.

    Raises:
        CheckpointError: as :func:`read_specforge`, or a readout / message tensor missing (the rank and message
            size are read from them), codes of the wrong shape, or buffers beside the codes file.
    """
    where_cfg = f"{where}/config.json"
    cfg = config["config"] if isinstance(config.get("config"), dict) else config
    for name in ("injection.readouts.0.weight", "injection.message.weight"):
        if name not in given:
            raise CheckpointError(f"{where}: missing tensor {name!r}; a DSpine checkpoint has the injection's readouts "
                                  "and message (is the model file complete?)")
    if "transfer_codes" in given:
        raise CheckpointError(f"{where}: both transfer_codes and a codes file ({_CODES_FILE}); keep one of them")
    dc = C.dflash_config(cfg)
    if "target_layer_ids" not in dc or "mask_token_id" not in dc:
        raise CheckpointError(f"{where_cfg}: the reference config must name dflash_config.target_layer_ids and "
                              "dflash_config.mask_token_id (the ones used for training), as SpecForge's converter "
                              "requires")
    drafter = {**_backbone(cfg, where_cfg, TENCENT_LAYOUT, target), "block_size": 16}
    vocab = C.field(cfg["vocab_size"], "vocab_size", where_cfg)
    head = _head(cfg, {**_shape_fields(given), "top_k": 16}, drafter, vocab, where_cfg)
    tensors = {k: v for k, v in given.items() if k != "codes"}
    tensors["transfer_codes"] = given["codes"]
    tensors["transfer_ready"] = torch.tensor(True)
    parsed = T.Parsed(drafter, head, C.target_identity(cfg, TENCENT_NAME, where_cfg, vocab, drafter["hidden_size"]),
                      {})
    out, mapped = T.read_parsed(parsed, TENCENT_NAME, tensors, where, target)
    _checked_codes({"transfer_codes": mapped["head.transfer_codes"]}, where)
    return out, mapped


def specforge_config(config: dict) -> dict:
    """The SpecForge DSpine config.json of a dartree ``dspine`` checkpoint config.

    Raises:
        CheckpointError: another head type, DFlash 2 convolutions, q/k norm off, another proposal offset
            (:func:`dartree.convert.export_config.export_config`), or a drafter not causal in the block.
    """
    d = config["drafter"]
    if config["head"].get("type") == "dspine" and not d.get("causal_block"):
        raise CheckpointError("a DSpine drafter attends causally inside the block, this one does not "
                              "(drafter.causal_block false); retrain with drafter.causal_block=true")
    out = E.export_config({**config, "drafter": {**d, "causal_block": False}}, SPECFORGE_NAME, family="dspine",
                          proposal_offset=1)
    head = config["head"]
    out.update(architectures=[ARCH], auto_map={"AutoModel": "dspine.DSpineDraftModel"}, is_causal=True,
               dspine_config={k: head[k] for k in SPECFORGE_DEFAULTS})
    return out


def write_specforge(config: dict, tensors: dict, target=None, where="the checkpoint") -> tuple[dict, dict]:
    """Writer: a dartree ``dspine`` checkpoint -> (SpecForge DSpine config.json dict, tensors by published name, bit
    for bit).

    Raises:
        CheckpointError: a reduced draft vocabulary, :func:`specforge_config`'s refusals, or codes not set.
    """
    config = E.export_ready(config, SPECFORGE_NAME, target, where)
    out = specforge_config(config)
    _checked_codes({"transfer_ready": tensors.get("head.transfer_ready")}, where)
    return out, T.publish_tensors(tensors, config["head"]["type"], SPECFORGE_NAME)


SPECFORGE = FormatPair(name=SPECFORGE_NAME, detect=detect_specforge, read=read_specforge, write=write_specforge,
                       marks="architectures ['DSpineDraftModel'], dspine_config or injection.* tensors, with "
                             "transfer_codes")
TENCENT = FormatPair(name=TENCENT_NAME, detect=detect_tencent, read=read_tencent,
                     marks=f"injection.* tensors and the token codes under 'codes' ({_CODES_FILE})")
PAIRS = (SPECFORGE, TENCENT)  # registered by dartree.convert.publishers

"""The base config.json of an export to a published DFlash-family layout (:func:`export_config`: z-lab's
``DFlashDraftModel`` config in the transformers-4 layout, as the published configs are; the publisher module adds its
head's fields) and the refusals of what a layout cannot carry (:func:`export_ready`, :func:`check_dflash2_exportable`,
:func:`layout_for_head` saying which layout would).
"""

from __future__ import annotations

import warnings

from dartree.models.checkpoint import CheckpointError
from dartree.models.families import family_of_head, get_family
from dartree.models.target import model_id


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

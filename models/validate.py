"""Checks of model inputs: the dartree checkpoint config's drafter fields, and the pairing of a drafter and head
with a target (layer 2, ``dartree.models``). The generic field checks they use live in :mod:`dartree.base.fields`.

Shapes in :func:`check_pairing`: V vocabulary rows of the target's lm_head, D hidden size, n target layers.
"""

from __future__ import annotations

from dartree.base.fields import Flag, IdList, Range, same_value, typed

# The DrafterConfig fields (dartree checkpoint config ``drafter``; checkpoints/README.md, "Format").
DRAFTER_FIELDS = {
    "hidden_size": Range(1, note="D, the target's hidden size"),
    "intermediate_size": Range(1),
    "num_layers": Range(1),
    "num_heads": Range(1),
    "num_kv_heads": Range(1),
    "head_dim": Range(1),
    "target_layer_ids": IdList(0, note="decoder layers of the target; DeepSpec's -1 is not supported"),
    "mask_token_id": Range(0, note="a token id of the target's vocabulary"),
    "block_size": Range(2, note="L, the anchor plus at least one proposal"),
    "proposal_offset": Range(0, 1, note="0: DSpark/Domino, 1: z-lab DFlash"),
    "qk_norm": Flag(),
    "rms_norm_eps": Range(0, integer=False, lo_open=True),
    "rope_theta": Range(0, integer=False, lo_open=True),
    "draft_vocab_size": Range(0, note="0: the full vocabulary"),
    "conv_kernel_size": Range(0, note="0: DFlash layers; k >= 1: DFlash 2 convolutions of k taps"),
    "conv_group_size": Range(1, note="channels per dynamic tap; must divide hidden_size"),
    "causal_block": Flag(),
}


def check_pairing(target, drafter=None, head=None) -> None:
    """Check live modules against a target before decoding: the values that depend on the target.

    Args:
        target: a :class:`~dartree.models.target.Target` (V = lm_head rows, D, n layers).
        drafter: a :class:`~dartree.models.drafter.DFlashDrafter` or None.
        head: a :class:`~dartree.models.heads.CorrectionHead` or None.
    Raises:
        ValueError: hidden size, layer ids, mask token id, draft vocabulary, head vocabulary / widths, the
            token embeddings of a head that reads them (``reads_embeddings``: the gru head), or the device do not
            fit the target (both values named, with the fix).
    """
    v, d, n = target.vocab_size, target.hidden_size, target.num_layers
    rows = int(target.embed_tokens.weight.shape[0])
    dev = target.device
    fix = "; use the drafter trained for this target (load_dartree(..., target=target) checks it)"
    if drafter is not None:
        c = drafter.cfg
        if not same_value(c.hidden_size, d):
            raise ValueError(f"drafter hidden_size {typed(c.hidden_size, d)} != target hidden_size {typed(d, c.hidden_size)}"
                             f"{fix}")
        bad = [i for i in c.target_layer_ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} are outside the target's {n} layers (0..{n - 1}){fix}")
        if not 0 <= c.mask_token_id < rows:
            raise ValueError(f"drafter mask_token_id {c.mask_token_id} is not a token id of the target "
                             f"(embedding rows 0..{rows - 1}){fix}")
        if c.draft_vocab_size:
            ids = drafter.draft_vocab
            if c.draft_vocab_size > v or int(ids.min()) < 0 or int(ids.max()) >= v:
                raise ValueError(f"drafter draft vocabulary ({c.draft_vocab_size} ids, max {int(ids.max())}) does not "
                                 f"fit the target's {v} tokens{fix}")
        p = next(drafter.parameters(), None)
        if p is not None and p.device != dev:
            raise ValueError(f"drafter is on {p.device} but the target is on {dev}; move it: drafter.to({str(dev)!r})")
    if head is not None:
        hv = getattr(head, "vocab_size", None)
        if hv is not None and not same_value(hv, v):
            raise ValueError(f"head vocab_size {typed(hv, v)} != target vocabulary {typed(v, hv)}{fix}")
        hd = getattr(head, "hidden_size", None)
        dd = drafter.cfg.hidden_size if drafter is not None else None
        if drafter is not None and hd is not None and not same_value(hd, dd):
            raise ValueError(f"head hidden_size {typed(hd, dd)} != drafter hidden_size {typed(dd, hd)}{fix}")
        if getattr(head, "reads_embeddings", False):  # bound by bind_embeddings, kept as _embed (Domino's GRU)
            emb, want = head.__dict__.get("_embed"), target.embed_tokens.weight
            bind = "call head.bind_embeddings(target.embed_tokens.weight)"
            name = head.type_name
            if emb is None:
                raise ValueError(f"{name} head has no token embeddings: {bind} (load_dartree(..., target=target) does it)")
            if tuple(emb.shape) != tuple(want.shape):
                raise ValueError(f"{name} head is bound to embeddings of shape {list(emb.shape)}, not the target's "
                                 f"{list(want.shape)}; {bind}")
        p = next(head.parameters(), None)
        if p is not None and p.device != dev:
            raise ValueError(f"head is on {p.device} but the target is on {dev}; move it: head.to({str(dev)!r})")

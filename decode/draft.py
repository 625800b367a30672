"""The draft stage: one drafter forward per round, from the target's context features to the block's hidden states
and base scores over the drafter's vocabulary (DFlash, Chen et al. 2025, Sec. 3: a block [anchor, MASK x (L-1)]
denoised in one forward, conditioned on features of the target's layers).
"""

from __future__ import annotations

import torch

from dartree.decode.trees import DraftBlock
from dartree.models.drafter import DFlashDrafter, DraftCache
from dartree.models.target import Target


@torch.inference_mode()
def draft_block(
    target: Target, drafter: DFlashDrafter, anchor: int, start: int, ctx_feats: torch.Tensor, dcache: DraftCache
) -> DraftBlock:
    """One drafter forward: block [anchor, MASK x (L-1)] at positions start..start+L-1.

    ``ctx_feats`` [C, nL*D] are the target features of positions ``dcache.length .. start-1`` (not yet in the
    drafter's cache); they are appended to ``dcache``, which never holds block entries.
    A drafter with a head attached between its layers runs with that head's hook
    (:meth:`~dartree.models.drafter.DFlashDrafter.layer_hook`); the block's ``hidden`` is then the states the hook
    recorded for the head (``head_hidden``), else the drafter's output.
    Returns:
        DraftBlock(hidden [P, D], base_logits [P, V'] fp32 over the drafter's vocabulary ``vocab`` (all V ids
        when it has none), ``bf16_values`` True when they were computed in bf16) for proposals predicting
        positions start+1..start+P.
    Raises:
        ValueError: the context does not end right before the anchor.
    """
    cfg = drafter.cfg
    c0 = dcache.length
    if c0 + ctx_feats.shape[0] != start:
        raise ValueError(f"drafter context covers {c0 + ctx_feats.shape[0]} positions but the anchor is at {start}")
    dev = target.device
    block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[0, 0] = anchor
    x = target.embed(block).to(drafter.fc.weight.dtype)  # raw lookup, as z-lab (no module scale)
    q_pos = torch.arange(start, start + cfg.block_size, device=dev)[None]
    ctx_pos = torch.arange(c0, start, device=dev)[None]
    hook = drafter.layer_hook(block[:, None])  # a head acting between the layers (None for most)
    h = drafter(x, q_pos, ctx_feats[None], ctx_pos, cache=dcache, hook=hook)[0, cfg.proposal_offset :]
    base, vocab = drafter.draft_logits(h, target.lm_head)  # [P, V'] fp32 over the draft vocabulary (or V)
    # the states the head scores from: the drafter's output, or what its hook recorded (head_hidden)
    head_h = h if getattr(hook, "head_hidden", None) is None else hook.head_hidden[0, cfg.proposal_offset:]
    # base is a bf16 matmul's output cast up when the target's lm_head is bf16 (draft_logits casts the hidden to it)
    return DraftBlock(hidden=head_h, base_logits=base, vocab=vocab,
                      bf16_values=target.lm_head.weight.dtype == torch.bfloat16)

"""Plain autoregressive decoding and the speculative generate loop (one flat loop with named stages).

Stages timed per round (seconds, in ``DecodeStats.stage_s``): ``draft`` (drafter forward + base logits),
``tree_build``, ``tree_compile`` (ids, positions, ancestor mask), ``verify`` (one target forward, walk,
KV compaction),
``commit`` (stop / length handling). The loop follows z-lab ``dflash_generate`` with DDTree's tree verify
(ANCHORS.md sections 1 and 3). Prefill is timed separately and excluded from decode time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dartree.decode.trees import DraftBlock, get_builder
from dartree.decode.verify import compile_tree, target_tokens, verify
from dartree.models.drafter import DFlashDrafter, DraftCache
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target

STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")


@dataclass
class DecodeStats:
    """Per-request statistics.

    Attributes:
        accept_lengths: tokens committed by each verify round (accepted drafts + bonus, after truncation
            by stop ids / max_new_tokens).
        stage_s: seconds per stage over all rounds.
        prefill_s: seconds of the prompt forward (and first token).
        decode_s: seconds after prefill until the last token.
        new_tokens: generated tokens (the first token, from prefill, included).
        tree_nodes: tree size of each round.
    """

    accept_lengths: list = field(default_factory=list)
    stage_s: dict = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0
    tree_nodes: list = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Acceptance length: committed tokens per target verify forward, bonus included (nan if no round)."""
        return sum(self.accept_lengths) / self.rounds if self.rounds else float("nan")


@dataclass
class GenerateOutput:
    """Generated token ids (prompt excluded; ends at the first stop id, inclusive) and their stats."""

    tokens: list
    stats: DecodeStats


def _commit(out: list, new: Sequence[int], max_new_tokens: int, stop_ids: set) -> tuple[int, bool]:
    """Append ``new`` tokens to ``out`` up to and including a stop id or the length limit.

    Returns:
        (number appended, finished).
    """
    n = 0
    for t in new:
        if len(out) >= max_new_tokens:
            return n, True
        out.append(int(t))
        n += 1
        if int(t) in stop_ids:
            return n, True
    return n, len(out) >= max_new_tokens


def _prefill(target: Target, prompt_ids: Sequence[int], cache, temperature, generator):
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    out = target.forward(ids, cache=cache, logits_slice=slice(-1, None))
    first = int(target_tokens(out.logits[0], temperature, generator)[0])
    return first, out.features[0]


def _check_args(prompt_ids, max_new_tokens):
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; give at least one prompt token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


@torch.no_grad()
def autoregressive_generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Plain one-token-per-forward decoding of the target (the baseline and the losslessness oracle).

    Raises:
        ValueError: empty prompt or negative max_new_tokens.
    """
    _check_args(prompt_ids, max_new_tokens)
    stops, stats, out = set(int(s) for s in stop_ids), DecodeStats(), []
    if max_new_tokens == 0:
        return GenerateOutput(out, stats)
    cache = target.new_cache()
    t0 = time.perf_counter()
    tok, _ = _prefill(target, prompt_ids, cache, temperature, generator)
    stats.prefill_s = time.perf_counter() - t0
    _, done = _commit(out, [tok], max_new_tokens, stops)
    t1 = time.perf_counter()
    pos = len(prompt_ids)
    while not done:
        ids = torch.tensor([[tok]], dtype=torch.long, device=target.device)
        o = target.forward(ids, position_ids=torch.tensor([[pos]], device=target.device), cache=cache)
        tok = int(target_tokens(o.logits[0, -1:], temperature, generator)[0])
        pos += 1
        n, done = _commit(out, [tok], max_new_tokens, stops)
        stats.accept_lengths.append(n)
    stats.decode_s = time.perf_counter() - t1
    stats.new_tokens = len(out)
    return GenerateOutput(out, stats)


@torch.no_grad()
def draft_block(
    target: Target, drafter: DFlashDrafter, anchor: int, start: int, ctx_feats: torch.Tensor, dcache: DraftCache
) -> DraftBlock:
    """One drafter forward: block [anchor, MASK x (L-1)] at positions start..start+L-1.

    ``ctx_feats`` [C, nL*D] are the target features of positions ``dcache.length .. start-1`` (not yet in the
    drafter's cache); they are appended to ``dcache``, which never holds block entries.
    Returns:
        DraftBlock(hidden [P, D], base_logits [P, V] fp32) for proposals predicting positions start+1..start+P.
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
    x = target.embed_tokens(block).to(drafter.fc.weight.dtype)
    q_pos = torch.arange(start, start + cfg.block_size, device=dev)[None]
    ctx_pos = torch.arange(c0, start, device=dev)[None]
    h = drafter(x, q_pos, ctx_feats[None], ctx_pos, cache=dcache)[0, cfg.proposal_offset :]
    base = drafter.base_logits(h, target.lm_head)  # [P, V] fp32 (-inf outside a draft vocabulary)
    return DraftBlock(hidden=h, base_logits=base)


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: DFlashDrafter,
    head: CorrectionHead,
    prompt_ids: Sequence[int],
    *,
    builder: str = "pruned",
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_ids: Sequence[int] = (),
    budget: int | None = None,
    generator: torch.Generator | None = None,
    builder_params: dict | None = None,
) -> GenerateOutput:
    """Speculative decoding with a block drafter, a correction head and a tree builder; lossless.

    Args:
        target: the target (its ``layer_ids`` must equal the drafter's ``target_layer_ids``).
        drafter, head: the block drafter and its correction head (same dtype/device as the target).
        prompt_ids: prompt token ids (already chat-templated).
        max_new_tokens: exact cap on generated tokens.
        temperature: T >= 0; the target's token at each node is its argmax (T = 0) or a sample (T > 0).
        stop_ids: generation ends right after the first of these tokens, even mid-block.
        generator: seeded torch.Generator for T > 0.
        builder: registered tree-builder name (``chain``, ``pruned`` / ``dartree-pruned``).
        budget: tree nodes per round B (default: P, the proposals per block).
        builder_params: extra keyword arguments for the builder (``k``, ``width``, ``beta``).
    Returns:
        Tokens equal to :func:`autoregressive_generate`'s at T = 0 (and distributed as the target's samples
        at T > 0), plus stats.
    Raises:
        ValueError: empty prompt, negative max_new_tokens, or target capture layers that differ from the drafter's.
        KeyError: unknown builder (lists the available ones).
    """
    _check_args(prompt_ids, max_new_tokens)
    if list(target.layer_ids) != list(drafter.cfg.target_layer_ids):
        raise ValueError(
            f"target captures layers {target.layer_ids} but the drafter needs {drafter.cfg.target_layer_ids}; "
            "call target.set_layer_ids(drafter.cfg.target_layer_ids)"
        )
    build = get_builder(builder)
    params = dict(builder_params or {})
    budget = drafter.cfg.num_proposals if budget is None else int(budget)
    stops, stats, out = set(int(s) for s in stop_ids), DecodeStats(), []
    if max_new_tokens == 0:
        return GenerateOutput(out, stats)
    cache = target.new_cache()
    t0 = time.perf_counter()
    anchor, feats = _prefill(target, prompt_ids, cache, temperature, generator)
    stats.prefill_s = time.perf_counter() - t0
    _, done = _commit(out, [anchor], max_new_tokens, stops)
    t1 = time.perf_counter()
    start = len(prompt_ids)
    dcache = DraftCache(len(drafter.layers))
    st = stats.stage_s
    while not done:
        ta = time.perf_counter()
        block = draft_block(target, drafter, anchor, start, feats, dcache)
        tb = time.perf_counter()
        tree = build(block, head, anchor, budget, **params)
        tc = time.perf_counter()
        inputs = compile_tree(tree, anchor, start, dtype=target.dtype, device=target.device)
        tc2 = time.perf_counter()
        ver = verify(target, tree, anchor, start, cache, temperature, generator, inputs=inputs)
        td = time.perf_counter()
        n, done = _commit(out, ver.tokens + [ver.bonus_id], max_new_tokens, stops)
        stats.accept_lengths.append(n)
        stats.tree_nodes.append(tree.size)
        start += ver.accepted.numel()
        anchor, feats = ver.bonus_id, ver.features
        te = time.perf_counter()
        st["draft"] += tb - ta
        st["tree_build"] += tc - tb
        st["tree_compile"] += tc2 - tc
        st["verify"] += td - tc2
        st["commit"] += te - td
    stats.decode_s = time.perf_counter() - t1
    stats.new_tokens = len(out)
    return GenerateOutput(out, stats)

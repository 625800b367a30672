"""The two batched stages of a round of :mod:`dartree.decode.batched`: one drafter forward for all rows, one target
verify forward over all rows' trees.

Each row keeps its batch-1 meaning: its drafter block is ``[anchor, MASK x (L-1)]`` at its own positions over its own
context (:func:`dartree.decode.draft.draft_block`), its tree is compiled as DDTree compiles one
(:func:`dartree.decode.verify.compile_tree`: ids = [root] + tree tokens, positions = start + depth, every node sees
the committed prefix, its ancestors and itself) and walked as :func:`dartree.decode.verify.verify` walks one. What
the batch adds is padding, and padding is masked out of every row: the rows' trees are padded to a shared width W
(the widest tree + 1, as batched engines verify one width for every request), the rows' caches to a shared width S
(:mod:`dartree.models.batch_cache`), and the additive 4-D mask hides from a row every key that is not its own (its
cache hole, the other columns of the padded tree block); a padding query sees the row's prefix and itself only, so
every softmax row has a key. A row's logits therefore depend on its own prefix and tree only (tested to be its AR
output at T = 0 whatever its neighbours; docs/design.md, "Batched decoding").

Shapes: N rows, W shared verify width, S cache width before the forward, M_i row i's tree nodes (M_i + 1 <= W),
P proposals, L block length, C_i row i's new drafter context, F captured feature width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dartree.decode.trees import DraftBlock, Tree
from dartree.decode.verify import Verification, target_tokens, walk
from dartree.kernels.tree_compile import tree_attention
from dartree.models.batch_cache import BatchKV, RowDraftCache
from dartree.models.drafter import DFlashDrafter
from dartree.models.target import Target


@torch.inference_mode()
def draft_blocks(target: Target, drafter: DFlashDrafter, anchors: Sequence[int], starts: Sequence[int],
                 feats: Sequence[torch.Tensor], dcache: RowDraftCache) -> list[DraftBlock]:
    """One drafter forward for N rows: row i drafts ``[anchors[i], MASK x (L-1)]`` at positions ``starts[i] ..``
    over its context (its cached one, then ``feats[i]``), as :func:`~dartree.decode.draft.draft_block` drafts one.

    The rows' new context is padded to the longest (C = max C_i) and appended to ``dcache`` for every row; the mask
    [N, 1, L, S_d + C + L] (S_d the cache's width before) shows row i its cached columns ``< dcache.lens[i]``, its
    C_i real new columns and the block; afterwards each row keeps its real columns (:meth:`RowDraftCache.commit`).
    When no row has a hole or padding (always at N = 1) no mask is passed, as at batch 1. A drafter whose head acts
    between its layers gets that head's hook for the N blocks and the blocks' ``hidden`` is what the hook recorded,
    as :func:`~dartree.decode.draft.draft_block` does.

    Args:
        anchors: N root token ids. starts: N anchor positions (= each row's committed positions).
        feats: N tensors [C_i, F] of target features for positions ``dcache.lens[i] .. starts[i] - 1``.
        dcache: the batch's drafter cache (N rows).
    Returns:
        N :class:`~dartree.decode.trees.DraftBlock` (hidden [P, D], base logits [P, V'] fp32), one per row.
    Raises:
        ValueError: lists of different lengths, or a row whose context does not end right before its anchor.
    """
    n, cfg, dev = len(anchors), drafter.cfg, target.device
    if not (len(starts) == len(feats) == dcache.rows == n):
        raise ValueError(f"draft_blocks: {n} anchors, {len(starts)} starts, {len(feats)} feature sets and a cache of "
                         f"{dcache.rows} rows; pass one of each per row")
    counts = [int(f.shape[0]) for f in feats]
    for i, (c0, c, s) in enumerate(zip(dcache.lens, counts, starts)):
        if c0 + c != s:
            raise ValueError(f"draft_blocks: row {i}'s drafter context covers {c0 + c} positions but its anchor is at "
                             f"{s}")
    cmax, past = max(counts), dcache.width
    ctx = feats[0].new_zeros(n, cmax, feats[0].shape[-1])
    for i, f in enumerate(feats):
        ctx[i, : counts[i]] = f
    base_pos = torch.tensor([int(l) for l in dcache.lens], dtype=torch.long)[:, None]
    ctx_pos = (base_pos + torch.arange(cmax)[None]).to(dev)
    q_pos = (torch.tensor([int(s) for s in starts], dtype=torch.long)[:, None] +
             torch.arange(cfg.block_size)[None]).to(dev)
    block = torch.full((n, cfg.block_size), cfg.mask_token_id, dtype=torch.long)
    block[:, 0] = torch.tensor([int(a) for a in anchors], dtype=torch.long)
    x = target.embed(block.to(dev)).to(drafter.fc.weight.dtype)  # raw lookup, as draft_block
    mask = None
    if any(l != past for l in dcache.lens) or any(c != cmax for c in counts):
        dt = x.dtype
        vis = torch.ones(n, past + cmax + cfg.block_size, dtype=torch.bool)
        vis[:, :past] = torch.arange(past)[None] < base_pos
        vis[:, past:past + cmax] = torch.arange(cmax)[None] < torch.tensor(counts)[:, None]
        mask = torch.zeros(vis.shape, dtype=dt).masked_fill_(~vis, torch.finfo(dt).min)
        mask = mask[:, None, None, :].expand(n, 1, cfg.block_size, vis.shape[1]).to(dev)
    # a head acting between the drafter's layers (where the drafter has such hooks) runs as in draft_block
    make_hook = getattr(drafter, "layer_hook", None)
    hook = make_hook(block.to(dev)[:, None]) if make_hook is not None else None
    extra = {} if hook is None else {"hook": hook}
    h = drafter(x, q_pos, ctx, ctx_pos, mask=mask, cache=dcache, **extra)[:, cfg.proposal_offset:]
    dcache.commit(past, counts)
    base, vocab = drafter.draft_logits(h, target.lm_head)  # [N, P, V'] fp32
    head_h = h if getattr(hook, "head_hidden", None) is None else hook.head_hidden[:, cfg.proposal_offset:]
    bf16 = target.lm_head.weight.dtype == torch.bfloat16
    return [DraftBlock(hidden=head_h[i], base_logits=base[i], vocab=vocab, bf16_values=bf16) for i in range(n)]


@dataclass
class BatchTreeInputs:
    """Target inputs of one batched verify forward.

    Attributes:
        input_ids: [N, W] int64, row i = [root_i, tree tokens, padding (its root id)].
        position_ids: [N, W] int64, lens_i + depth (padding at lens_i).
        attention_mask: [N, 1, W, S + W] additive float in the target's dtype (0 visible, finfo.min hidden); None
            for an AR step of every row (W = 1) with no hole, which sees every key.
        sizes: N tree sizes M_i (row i's real queries are its first M_i + 1).
        past: S, the cache width the mask was built for.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    sizes: list
    past: int


def compile_batch(trees: Sequence[Tree], roots: Sequence[int], lens: Sequence[int], past: int, dtype: torch.dtype,
                  device=None, backend: str = "auto") -> BatchTreeInputs:
    """Ids, positions and the padded 4-D tree mask of N rows' trees, each row as
    :func:`~dartree.decode.verify.compile_tree` compiles it for batch 1 (DDTree ``compile_ddtree_tree``,
    ``liranringel/ddtree``), over a cache of width ``past`` in which row i's committed entries are its first
    ``lens[i]`` columns.

    Mask of row i: columns ``< lens[i]`` visible to all its queries; columns ``lens[i] .. past - 1`` (its hole)
    hidden; in the tree block (columns ``past ..``), node j sees its ancestors and itself (the
    :func:`~dartree.kernels.tree_compile.tree_attention` block), a padding query itself only. When every tree is
    empty and no row has a hole the mask is None (every query sees every key: a batched AR step).

    Args:
        trees: N trees (M_i nodes; an empty tree verifies its root alone). roots: N root ids.
        lens: N committed lengths (<= ``past``). past: the cache's width S. dtype: the target's float dtype.
        device: where the tensors go. backend: the tree-compile kernel's backend.
    Returns:
        :class:`BatchTreeInputs` with W = max M_i + 1.
    Raises:
        ValueError: lists of different lengths, a length over ``past``, a tree whose parents do not precede its
            nodes or whose depths disagree with its parents.
    """
    n = len(trees)
    if not (len(roots) == len(lens) == n) or n == 0:
        raise ValueError(f"compile_batch: {n} trees, {len(roots)} roots and {len(lens)} lengths; pass one of each "
                         "per row (at least one row)")
    if max(lens) > past:
        raise ValueError(f"compile_batch: a row length {max(lens)} exceeds the cache width {past}")
    sizes = [t.size for t in trees]
    w = max(sizes) + 1
    low = torch.finfo(dtype).min
    lens_t = torch.tensor([int(l) for l in lens], dtype=torch.long)
    ids = torch.tensor([int(r) for r in roots], dtype=torch.long)[:, None].repeat(1, w)
    if w == 1 and all(int(l) == past for l in lens):  # every row its root alone, no hole: an AR step, no mask (as
        return BatchTreeInputs(ids.to(device), lens_t[:, None].to(device), None, sizes, past)  # batch 1's passes none)
    depth = torch.zeros(n, w, dtype=torch.long)
    mask = torch.full((n, 1, w, past + w), low, dtype=dtype)
    mask[:, 0, :, :past].masked_fill_((torch.arange(past)[None] < lens_t[:, None])[:, None, :], 0.0)
    mask[:, 0, :, past:].diagonal(dim1=-2, dim2=-1).fill_(0.0)  # every query sees itself (padding: only that)
    for i, tree in enumerate(trees):
        m = sizes[i]
        if not m:
            continue
        d, _, block = tree_attention(tree.parents.long(), 0, dtype, backend=backend)
        d = d.cpu()
        if not torch.equal(tree.depth.long().cpu(), d[1:]):
            raise ValueError("tree depths must equal their parent's depth + 1 (the root has depth 0)")
        ids[i, 1 : m + 1] = tree.tokens.long().cpu()
        depth[i, : m + 1] = d
        mask[i, 0, : m + 1, past : past + m + 1] = block.cpu()
    pos = lens_t[:, None] + depth
    return BatchTreeInputs(ids.to(device), pos.to(device), mask.to(device), sizes, past)


@torch.inference_mode()
def verify_batch(target: Target, trees: Sequence[Tree], roots: Sequence[int], kv: BatchKV,
                 temperature: float = 0.0, generator: torch.Generator | None = None,
                 inputs: BatchTreeInputs | None = None) -> list[Verification]:
    """Verify N rows' trees with one target forward, commit each row's accepted path to its cache row and return
    each row's :class:`~dartree.decode.verify.Verification` (as :func:`~dartree.decode.verify.verify` for one).

    Exact target-sample matching per row (DDTree ``follow_verified_tree``): the target's token at each of row i's
    real nodes (argmax at T = 0; at T > 0 a sample of softmax(z / T), drawn for the rows in order from one generator)
    decides its walk, so every committed token is the target's own given that row's committed prefix.

    Args:
        trees, roots: N trees and their root ids (each root at position ``kv.lens[i]``).
        kv: the batch's target cache; on return row i holds ``lens[i] + A_i`` committed entries.
        temperature, generator: the target's sampling (T >= 0).
        inputs: :func:`compile_batch`'s output when the caller compiled (and timed) it already.
    Returns:
        N Verifications (accepted node indices root first, accepted tokens, bonus id, features [A_i, F]).
    Raises:
        ValueError: a row count that differs from the cache's, or inputs compiled for another cache width.
    """
    n = len(trees)
    if n != kv.rows or len(roots) != n:
        raise ValueError(f"verify_batch: {n} trees and {len(roots)} roots for a cache of {kv.rows} rows")
    past = kv.width
    inp = inputs if inputs is not None else compile_batch(trees, roots, kv.lens, past, target.dtype, target.device)
    if inp.past != past:
        raise ValueError(f"verify_batch: inputs compiled for a cache width of {inp.past}, the cache holds {past}")
    out = target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                         cache=kv.cache)
    sizes = inp.sizes
    if temperature == 0:
        post_all = out.logits.argmax(dim=-1).tolist()  # [N, W]: each row's real nodes are read below
        posts = [post_all[i][: sizes[i] + 1] for i in range(n)]
    else:
        real = torch.cat([out.logits[i, : sizes[i] + 1] for i in range(n)])
        flat = target_tokens(real, temperature, generator).tolist()
        posts, at = [], 0
        for m in sizes:
            posts.append(flat[at : at + m + 1])
            at += m + 1
    paths = [walk(tree, post) for tree, post in zip(trees, posts)]
    keeps = [torch.tensor(p, dtype=torch.long) for p in paths]
    kv.commit(past, keeps)
    res = []
    for i, (tree, post, path, acc) in enumerate(zip(trees, posts, paths, keeps)):
        feats = out.features[i].index_select(0, acc.to(out.features.device))
        res.append(Verification(acc, [int(tree.tokens[j - 1]) for j in path[1:]], int(post[path[-1]]), feats))
    return res

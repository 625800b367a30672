"""Lossless tree verification: tree attention inputs, one target forward, exact target-sample matching.

DDTree (arXiv 2604.12989; ``liranringel/ddtree`` ``ddtree.py``: ``compile_ddtree_tree`` /
``follow_verified_tree`` / ``compact_dynamic_cache``):
ids = [root] + tree tokens, position ids = start + depth, an additive 4-D float mask in which every node sees
the whole committed prefix, itself and its ancestors only. The target's own token at every node (argmax at
T = 0, a sample from softmax(z / T) at T > 0) decides the walk: from the root, move to the child whose token
equals the target's token, until none matches; the last target token is the bonus. Every committed token is
therefore exactly what the target would have produced, at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dartree.decode.trees import Tree
from dartree.kernels.tree_compile import full_mask_cpu, tree_attention, tree_attention_ref
from dartree.models.target import Target, cache_length, compact_cache


@dataclass
class TreeInputs:
    """Target inputs for one verify forward over M+1 tree tokens.

    Attributes:
        input_ids: [1, M+1] int64, root first.
        position_ids: [1, M+1] int64, start + depth.
        attention_mask: [1, 1, M+1, start+M+1] additive float (0 visible, finfo.min hidden).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Visibility among root + M nodes: vis[i, j] is True iff j is i or an ancestor of i.

    Args:
        parents: [M] int64 parent indices (0 = root), each lower than its node's index (i+1).
    Returns:
        [M+1, M+1] bool.
    Raises:
        ValueError: a parent index is not lower than its child's.
    """
    return tree_attention_ref(parents.long())[2] == 0


def compile_tree(tree: Tree, root_id: int, start: int, dtype: torch.dtype, device=None,
                 backend: str = "auto") -> TreeInputs:
    """Build ids, positions and the additive ancestor mask for verifying ``tree`` rooted at position ``start``.

    DDTree ``compile_ddtree_tree`` (``liranringel/ddtree`` ``ddtree.py``): position = start + depth (siblings
    share one).
    Args:
        tree: M nodes; ``tree.depth`` must equal the parent's depth + 1 (root depth 0).
        root_id: the root token (the last committed token, not yet in the target cache).
        start: the root's position = the number of committed positions already in the target's KV cache.
        dtype: float dtype of the mask (the target's).
        backend: kernel backend of the tree compile (``dartree.kernels.tree_compile``; auto = Triton on CUDA).
    Returns:
        TreeInputs (ids and positions [1, M+1] int64, mask [1, 1, M+1, start+M+1] of ``dtype``).
    Raises:
        ValueError: parents do not precede children, or depths disagree with parents.
    """
    m = tree.size
    parents = tree.parents.long()
    if parents.device.type == "cpu" and (device is None or torch.device(device).type == "cpu") and backend != "triton":
        depth, pos, mask = full_mask_cpu(parents, start, dtype)  # one compiled pass, prefix zeros included
        if m and not torch.equal(tree.depth.long(), depth[1:]):
            raise ValueError("tree depths must equal their parent's depth + 1 (the root has depth 0)")
        ids = torch.cat([torch.tensor([root_id], dtype=torch.long), tree.tokens.long().cpu()])[None]
        return TreeInputs(ids, pos[None], mask[None, None])
    depth, pos, block_mask = tree_attention(parents.to(device) if device is not None else parents, start, dtype,
                                            backend=backend)
    if m and not torch.equal(tree.depth.long().to(depth.device), depth[1:]):
        raise ValueError("tree depths must equal their parent's depth + 1 (the root has depth 0)")
    ids = torch.cat([torch.tensor([root_id], dtype=torch.long), tree.tokens.long().cpu()])[None]
    mask = torch.cat([torch.zeros((m + 1, start), dtype=dtype, device=block_mask.device), block_mask], dim=1)
    return TreeInputs(ids.to(device), pos[None].to(device), mask[None, None].to(device))


def target_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token per row: argmax (lowest id on ties) at T = 0, else a sample of softmax(logits / T).

    Args:
        logits: [N, V] fp32.
        temperature: T >= 0.
        generator: torch.Generator for T > 0 (seeded for reproducibility).
    Returns:
        [N] int64.
    Raises:
        ValueError: negative temperature.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Verification:
    """Outcome of one verify round.

    Attributes:
        accepted: [A] int64 node indices of the accepted path, root (0) first; A - 1 tree tokens were accepted.
        tokens: the A - 1 accepted draft tokens (list of int).
        bonus_id: the target's token after the accepted path (the next round's root).
        features: [A, nL*D] target features at the accepted nodes (the drafter's next context).
    """

    accepted: torch.Tensor
    tokens: list
    bonus_id: int
    features: torch.Tensor


def walk(tree: Tree, posterior: list[int]) -> list[int]:
    """Follow target tokens from the root: returns the accepted node indices, root first.

    Args:
        posterior: target token at each of the M+1 nodes (root first).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()), start=1):
        children.setdefault(p, {}).setdefault(t, i)  # first sibling wins on duplicate tokens
    path, cur = [0], 0
    while True:
        nxt = children.get(cur, {}).get(posterior[cur])
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def verify(
    target: Target,
    tree: Tree,
    root_id: int,
    start: int,
    cache,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    inputs: TreeInputs | None = None,
) -> Verification:
    """Verify ``tree`` with one target forward, commit the accepted path to the KV cache and return it.

    Exact target-sample matching (DDTree ``follow_verified_tree``): lossless at any temperature for deterministic
    drafts, since every committed token is a target sample given the committed prefix.
    Args:
        target: the target model.
        tree: the draft tree (root = ``root_id`` at position ``start``).
        start: committed positions in ``cache`` (= the root's position).
        cache: the target KV cache; on return it holds ``start + A`` positions (root + accepted nodes).
        temperature: T >= 0 (0: argmax).
        generator: seeded torch.Generator used for the target's samples at T > 0.
        inputs: ``compile_tree`` output when the caller compiled (and timed) it already.
    Returns:
        Verification (accepted node indices, accepted tokens, bonus token, features of accepted nodes).
    Raises:
        ValueError: the cache does not hold exactly ``start`` positions, or the tree is malformed.
    """
    if cache_length(cache) != start:
        raise ValueError(f"target cache holds {cache_length(cache)} positions but the root is at {start}")
    if tree.size == 0:  # the root alone (a plain AR step): it sees the whole prefix, so no mask is needed
        ids = torch.tensor([[int(root_id)]], dtype=torch.long, device=target.device)
        out = target.forward(ids, position_ids=torch.tensor([[start]], device=target.device), cache=cache)
    else:
        inp = inputs if inputs is not None else compile_tree(tree, root_id, start, dtype=target.dtype,
                                                            device=target.device)
        out = target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                             cache=cache)
    post = target_tokens(out.logits[0], temperature, generator).tolist()
    path = walk(tree, post)
    acc = torch.tensor(path, dtype=torch.long)
    if tree.size:  # a root-only forward appended exactly the one entry that stays
        compact_cache(cache, start, acc)
    tokens = [int(tree.tokens[i - 1]) for i in path[1:]]
    return Verification(acc, tokens, int(post[path[-1]]), out.features[0].index_select(0, acc.to(out.features.device)))

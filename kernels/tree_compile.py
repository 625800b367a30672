"""Tree compile: parents -> depth, position ids and the additive ancestor mask of tree attention.

DDTree ``compile_ddtree_tree`` (``liranringel/ddtree`` ``ddtree.py``): node 0 is the root (the last committed
token at position ``start``), nodes 1..M follow in topological order (parents[i] < i + 1). Node i sees itself
and its ancestors only: vis[i, :i] = vis[parent(i), :i], vis[i, i] = True. Positions are start + depth (RoPE by
depth).

Returns the [M+1, M+1] tree block of the mask; callers prepend zeros for the committed prefix (every node sees
all of it). Mask values are 0 (visible) and ``finfo(dtype).min`` (hidden): additive float, never boolean.
"""

from __future__ import annotations

import numpy as np
import torch

from dartree.kernels._backend import resolve


def _check(parents: torch.Tensor) -> None:
    if parents.dim() != 1:
        raise ValueError(f"tree parents must be a 1-D tensor [M], got shape {tuple(parents.shape)}")
    m = parents.numel()
    if m and bool(((parents < 0) | (parents >= torch.arange(1, m + 1, device=parents.device))).any()):
        raise ValueError("tree parents must precede their children (0 <= parents[i] < i + 1); "
                         "number nodes in topological order")


def tree_attention_ref(parents: torch.Tensor, start: int = 0, dtype: torch.dtype = torch.float32):
    """Plain-torch twin (defines the meaning).

    Args:
        parents: [M] int64, parents[i] = parent of node i+1 (0 = root).
        start: absolute position of the root.
        dtype: float dtype of the mask.
    Returns:
        depth [M+1] int64 (root 0), position_ids [M+1] int64 (start + depth), mask [M+1, M+1] ``dtype``.
    Raises:
        ValueError: parents not 1-D or not preceding their children.
    """
    _check(parents)
    m = parents.numel()
    par = parents.long().tolist()
    vis = torch.eye(m + 1, dtype=torch.bool)
    depth = [0] * (m + 1)
    for i in range(1, m + 1):
        vis[i] |= vis[par[i - 1]]
        depth[i] = depth[par[i - 1]] + 1
    depth_t = torch.tensor(depth, dtype=torch.long)
    mask = torch.zeros(m + 1, m + 1, dtype=dtype).masked_fill_(~vis, torch.finfo(dtype).min)
    dev = parents.device
    return depth_t.to(dev), (depth_t + int(start)).to(dev), mask.to(dev)


def _tree_attention_cpu(parents: torch.Tensor, start: int, dtype: torch.dtype):
    """The ref's arithmetic on NumPy rows (a draft tree has at most a few hundred nodes: one row copy per node
    instead of a torch op per node); CPU tensors only, equal to :func:`tree_attention_ref` exactly."""
    par = parents.numpy()
    m = par.size
    vis = np.eye(m + 1, dtype=bool)
    depth = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, m + 1):
        p = par[i - 1]
        vis[i, :i] |= vis[p, :i]
        depth[i] = depth[p] + 1
    mask = torch.zeros(m + 1, m + 1, dtype=dtype).masked_fill_(torch.from_numpy(~vis), torch.finfo(dtype).min)
    depth_t = torch.from_numpy(depth)
    return depth_t, depth_t + int(start), mask


_HIDDEN_BITS: dict = {}
_INT_OF = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}


def _hidden_bits(dtype: torch.dtype) -> int:
    """The bit pattern of ``finfo(dtype).min`` as a signed integer of the same width (cached)."""
    bits = _HIDDEN_BITS.get(dtype)
    if bits is None:
        width = torch.finfo(dtype).bits // 8
        bits = _HIDDEN_BITS[dtype] = int(torch.tensor(torch.finfo(dtype).min, dtype=dtype).view(_INT_OF[width][1]))
    return bits


def full_mask_cpu(parents: torch.Tensor, start: int, dtype: torch.dtype):
    """The whole verify mask of a CPU tree in one compiled pass (``dartree.kernels.tree_expand.tree_mask``): depth,
    positions and the additive mask [M+1, start+M+1] (the committed prefix visible to every node, then the tree
    block of :func:`tree_attention_ref`), written as the integer bit patterns of 0 and ``finfo(dtype).min`` and
    viewed as ``dtype`` (numba has no bf16). Equal to the ref's block with zeros prepended (tested).

    Args:
        parents: [M] int64 CPU tensor (0 = root); start: the root's position (>= 0); dtype: a float dtype.
    Returns:
        depth [M+1] int64, position_ids [M+1] int64, mask [M+1, start+M+1] ``dtype``.
    Raises:
        ValueError: parents not 1-D or not preceding their children, or start < 0.
    """
    # lazy: a numba kernel module: numba loads and compiles on first use, not when this module is imported
    from dartree.kernels.tree_expand import tree_mask

    if parents.dim() != 1:
        _check(parents)
    if int(start) < 0:
        raise ValueError(f"the root's position start must be >= 0 (committed positions in the cache), got {start}")
    width = torch.finfo(dtype).bits // 8
    np_int, torch_int = _INT_OF[width]
    out = tree_mask(parents.long().numpy(), int(start), _hidden_bits(dtype), np_int)
    if out is None:
        _check(parents)  # raises the ref's error
    depth, mask = out
    depth_t = torch.from_numpy(depth)
    return depth_t, depth_t + int(start), torch.from_numpy(mask).view(dtype)


def tree_attention(parents: torch.Tensor, start: int = 0, dtype: torch.dtype = torch.float32,
                   backend: str = "auto"):
    """Tree compile on the GPU (one Triton program per node walks its ancestors), on CPU the ref's rule on NumPy
    rows (:func:`_tree_attention_cpu`).

    Same contract as :func:`tree_attention_ref`.
    Raises:
        ValueError: as the ref or an unknown backend; RuntimeError: ``backend="triton"`` where it cannot run.
    """
    _check(parents)
    if resolve(backend, parents.device) == "torch":
        if parents.device.type == "cpu":
            return _tree_attention_cpu(parents.long(), start, dtype)
        return tree_attention_ref(parents, start, dtype)
    # lazy: triton is optional (CUDA only): the Triton kernel module loads on the first GPU call
    from dartree.kernels import _tree_compile_triton

    return _tree_compile_triton.launch(parents, int(start), dtype)

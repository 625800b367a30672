"""Triton kernel behind :func:`dartree.kernels.tree_compile.tree_attention` (imported only for the Triton backend).

Program i fills row i of the mask with the hidden value, then walks from node i up to the root, opening the
columns of every node on the way; the number of steps is node i's depth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_kernel(par_ptr, depth_ptr, mask_ptr, N, start, hidden, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = mask_ptr + i * N
    for c0 in range(0, N, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        tl.store(row + offs, tl.zeros([BLOCK], dtype=tl.float32) + hidden, mask=offs < N)
    tl.store(row, 0.0)  # the root is everyone's ancestor
    cur = i
    d = 0
    while cur > 0:
        tl.store(row + cur, 0.0)
        cur = tl.load(par_ptr + cur - 1).to(tl.int32)
        d += 1
    tl.store(depth_ptr + i, d.to(tl.int64))


def launch(parents: torch.Tensor, start: int, dtype: torch.dtype):
    """parents [M] -> (depth [M+1], position_ids [M+1], mask [M+1, M+1] dtype). Checked by the caller."""
    n = parents.numel() + 1
    dev = parents.device
    par = parents.long().contiguous()
    if par.numel() == 0:
        par = torch.zeros(1, dtype=torch.long, device=dev)
    depth = torch.empty(n, dtype=torch.long, device=dev)
    mask = torch.empty(n, n, dtype=torch.float32, device=dev)
    hidden = torch.finfo(dtype).min
    _tree_kernel[(n,)](par, depth, mask, n, start, hidden, BLOCK=min(triton.next_power_of_2(n), 1024))
    return depth, depth + start, mask.to(dtype)

"""Triton kernel behind :func:`dartree.kernels.gru.gru_cell` (imported only when the Triton backend runs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dartree.kernels._backend import next_pow2


@triton.jit
def _gru_cell_kernel(gi_ptr, h_ptr, w_ptr, out_ptr, G, BLOCK_G: tl.constexpr, BLOCK_IN: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mo = offs < G
    acc_r = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_G], dtype=tl.float32)
    for i0 in range(0, G, BLOCK_IN):
        ii = i0 + tl.arange(0, BLOCK_IN)
        mi = ii < G
        hv = tl.load(h_ptr + row * G + ii, mask=mi, other=0.0).to(tl.float32)
        m2 = mo[:, None] & mi[None, :]
        wr = tl.load(w_ptr + offs[:, None] * G + ii[None, :], mask=m2, other=0.0).to(tl.float32)
        wz = tl.load(w_ptr + (offs[:, None] + G) * G + ii[None, :], mask=m2, other=0.0).to(tl.float32)
        wn = tl.load(w_ptr + (offs[:, None] + 2 * G) * G + ii[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_r += tl.sum(wr * hv[None, :], axis=1)
        acc_z += tl.sum(wz * hv[None, :], axis=1)
        acc_n += tl.sum(wn * hv[None, :], axis=1)
    base = gi_ptr + row * 3 * G
    i_r = tl.load(base + offs, mask=mo, other=0.0).to(tl.float32)
    i_z = tl.load(base + G + offs, mask=mo, other=0.0).to(tl.float32)
    i_n = tl.load(base + 2 * G + offs, mask=mo, other=0.0).to(tl.float32)
    r = tl.sigmoid(i_r + acc_r)
    z = tl.sigmoid(i_z + acc_z)
    n = 2.0 * tl.sigmoid(2.0 * (i_n + r * acc_n)) - 1.0  # tanh, portable to the interpreter
    h_old = tl.load(h_ptr + row * G + offs, mask=mo, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * G + offs, (1.0 - z) * n + z * h_old, mask=mo)


def launch(gi: torch.Tensor, h: torch.Tensor, w_hh: torch.Tensor) -> torch.Tensor:
    """Launch the fused GRU cell; inputs [N, 3G], [N, G], [3G, G] -> fp32 [N, G]. Shapes are checked by the caller."""
    n, g = h.shape
    # the interpreter does not support bf16 arithmetic: hand it fp32
    gi, h, w_hh = (t.contiguous() if t.dtype != torch.bfloat16 else t.float().contiguous() for t in (gi, h, w_hh))
    out = torch.empty(n, g, dtype=torch.float32, device=h.device)
    block_g = min(next_pow2(g), 64)
    block_in = min(next_pow2(g), 64)
    _gru_cell_kernel[(n, triton.cdiv(g, block_g))](gi, h, w_hh, out, g, BLOCK_G=block_g, BLOCK_IN=block_in)
    return out

"""Triton kernels behind :mod:`dartree.kernels.invariant_gpu` (imported only when the Triton backend runs).

Every kernel computes a row with a launch configuration fixed by the weight or head shape alone, never by the
number of rows in the call, so a row's bits do not depend on the other rows (batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dartree.kernels._backend import next_pow2

# fixed tiles: one configuration for every row count (no autotuning, no split-K)
MM_BLOCK_M = 16
MM_BLOCK_N = 64
MM_BLOCK_K = 64
ATTN_BLOCK_N = 32


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the reduction over K in BLOCK_K chunks, always in this order
        rk = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                     other=0.0)
        wb = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                     other=0.0)
        if not USE_DOT:  # the interpreter: its dot (BLAS) rounds a row by its place in the tile; this does not
            acc += tl.sum(xa[:, :, None].to(tl.float32) * wb[None, :, :].to(tl.float32), axis=1)
        elif IEEE:
            acc += tl.dot(xa, wb, input_precision="ieee")
        else:
            acc += tl.dot(xa, wb)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def launch_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype; fp32 accumulation. Shapes checked by the caller."""
    m, k = x.shape
    n = w.shape[0]
    interp = x.device.type == "cpu"
    if interp and x.dtype == torch.bfloat16:  # the interpreter has no bf16 arithmetic: widen exactly, round back
        return launch_matmul(x.float(), w.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    x = x.contiguous()
    w = w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N))
    _matmul_kernel[grid](x, w, x if bias is None else bias, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, USE_DOT=not interp,
                         BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K)
    return out


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mh = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mh, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = (x / tl.sqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)  # normalised, in the input dtype
    w = tl.load(w_ptr + offs, mask=mh, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mh)


def launch_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [R, H] with weight [H] -> [R, H] in x's dtype (one program per row)."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:  # interpreter: fp32 math, rounded as on the GPU
        r, h = x.shape
        xf = x.float()
        y = (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) / h + eps)).to(torch.bfloat16).float()
        return (w.float() * y).to(torch.bfloat16)
    x = x.contiguous()
    out = torch.empty_like(x)
    r, h = x.shape
    _rmsnorm_kernel[(r,)](x, w.contiguous(), out, h, x.stride(0), out.stride(0), float(eps),
                          BLOCK_H=next_pow2(h))
    return out


@triton.jit
def _row_attention_kernel(q_ptr, k_ptr, v_ptr, counts_ptr, idx_ptr, out_ptr, scale,
                          stride_qh, stride_qr, stride_kh, stride_kl, stride_vh, stride_vl, stride_or, stride_oh,
                          n_idx, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, PREFIX: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP
    od = tl.arange(0, BLOCK_D)
    md = od < D
    q = tl.load(q_ptr + h * stride_qh + r * stride_qr + od, mask=md, other=0.0).to(tl.float32)
    n = tl.load(counts_ptr + r)
    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j0 in range(0, n, BLOCK_N):  # keys in position order, blocks of BLOCK_N from the row's first key
        oj = j0 + tl.arange(0, BLOCK_N)
        mj = oj < n
        if PREFIX:
            pos = oj
        else:
            pos = tl.load(idx_ptr + r * n_idx + oj, mask=mj, other=0)
        kb = tl.load(k_ptr + g * stride_kh + pos[:, None] * stride_kl + od[None, :], mask=mj[:, None] & md[None, :],
                     other=0.0).to(tl.float32)
        s = tl.sum(kb * q[None, :], axis=1) * scale
        s = tl.where(mj, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        vb = tl.load(v_ptr + g * stride_vh + pos[:, None] * stride_vl + od[None, :], mask=mj[:, None] & md[None, :],
                     other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vb, axis=0)
        m_i = m_new
    tl.store(out_ptr + r * stride_or + h * stride_oh + od, acc / l_i, mask=md)


def launch_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor,
                         idx: torch.Tensor, prefix: bool, scale: float) -> torch.Tensor:
    """q [H, R, d], k / v [H_kv, L, d] (last dim contiguous), counts [R] int32 and idx [R, n_idx] int32 on q's
    device -> [R, H, d] float32. Checked by the caller."""
    h, r, d = q.shape
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:  # the interpreter has no bf16 arithmetic
        q, k, v = q.float(), k.float(), v.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    out = torch.empty(r, h, d, dtype=torch.float32, device=q.device)
    n_idx = idx.shape[1] if idx.dim() == 2 else 0
    _row_attention_kernel[(r, h)](q, k, v, counts, idx, out, float(scale), q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), n_idx,
                                  GROUP=h // k.shape[0], D=d, BLOCK_D=next_pow2(d), BLOCK_N=ATTN_BLOCK_N,
                                  PREFIX=bool(prefix))
    return out

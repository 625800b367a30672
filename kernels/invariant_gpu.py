"""Row-invariant kernels for a GPU target (Triton): linear, RMSNorm and decode attention whose bits for a row never
depend on how many rows share the call.

The CPU mode (:mod:`dartree.kernels.row_attention` plus a linear path measured row invariant) has a GPU twin here,
for the same purpose: a verify row's logits equal the AR step's bit for bit, so speculative decoding at T = 0 gives
the AR output by construction (batch invariance: He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab, 2025). Library GPU kernels are not row invariant: cuBLAS picks a GEMM kernel (tile shape, split-K)
by the row count M, and the reductions of a norm split across threads by the number of rows. Each kernel here runs
one launch configuration for every row count:

- :func:`invariant_linear`: ``x W^T + b`` tiled 16 x 64 x 64 (rows x outputs x inputs), the inputs reduced in
  64-wide chunks in ascending order with fp32 accumulation and no split-K, whatever M is (an AR step, a verify, a
  prefill); fp32 inputs use IEEE products (no TF32);
- :func:`invariant_rms_norm`: one program per row, the mean square reduced over the whole row in one block, the
  Llama formula ``w * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``;
- :func:`row_attention_gpu`: one program per (query row, head) over the keys that row sees, read in position
  order in blocks of 32 from its first key, with an online softmax in fp32; so a row's bits depend on its query,
  key count and keys only (the numba CPU kernel's contract; the block order differs, so CPU and GPU bits differ).

On a machine without a GPU these run under the Triton interpreter (``TRITON_INTERPRET=1`` before the first
launch), which is how the tests check them; bf16 there is widened exactly to fp32 (the interpreter has no bf16
arithmetic) and the result rounded back. Dimension letters: M rows, K inputs, N outputs, R query rows, H query
heads, H_kv key/value heads, L keys in the cache, d head size.
"""

from __future__ import annotations

import torch

from dartree.kernels._backend import resolve

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _launcher():
    # lazy: triton is optional (CUDA only): the Triton kernel module loads on the first GPU call
    from dartree.kernels import _invariant_triton

    return _invariant_triton


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with bits per row independent of the number of rows (module docstring).

    Args:
        x: [..., K] float32, bfloat16 or float16, on a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
        weight: [N, K], x's dtype and device. bias: [N] or None.
    Returns:
        [..., N] in x's dtype (fp32 accumulation, rounded once).
    Raises:
        ValueError: shapes, dtypes or devices that do not fit (named).
        RuntimeError: no Triton here, or a CPU tensor without the interpreter (the fix named).
    """
    if weight.dim() != 2 or x.shape[-1:] != weight.shape[1:] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"invariant_linear: x [..., K], weight [N, K], bias [N] expected, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype or x.device != weight.device:
        raise ValueError(f"invariant_linear: x and weight of one dtype in {DTYPES} on one device, got x {x.dtype} on "
                         f"{x.device}, weight {weight.dtype} on {weight.device}")
    resolve("triton", x.device)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    out = _launcher().launch_matmul(flat, weight, None if bias is None else bias.to(x.dtype))
    return out.reshape(*x.shape[:-1], weight.shape[0])


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm ``weight * (x / sqrt(mean(x^2, -1) + eps)).to(x.dtype)`` (the Llama form: Zhang and Sennrich,
    2019, eq. 4; normalised in fp32, rounded to x's dtype, then scaled), one program per row.

    Args:
        x: [..., H] float32, bfloat16 or float16 on a CUDA device (or CPU under the interpreter). weight: [H].
        eps: added to the mean square.
    Returns:
        [..., H] in x's dtype.
    Raises:
        ValueError: shapes or dtypes that do not fit. RuntimeError: no Triton here (the fix named).
    """
    if weight.shape != x.shape[-1:] or x.dtype not in DTYPES:
        raise ValueError(f"invariant_rms_norm: x [..., H] in {DTYPES} and weight [H] expected, got x "
                         f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}")
    resolve("triton", x.device)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return x.clone()
    return _launcher().launch_rmsnorm(flat, weight.to(x.dtype), float(eps)).reshape(x.shape)


def row_attention_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts, idx=None,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of R query rows, each over its own keys, with bits that depend on that row alone (GPU twin of
    :func:`dartree.kernels.row_attention.row_attention`, same arguments).

    Args:
        q: [R, H, d]; k, v: [H_kv, L, d] (H divisible by H_kv), one dtype in float32 / bfloat16 / float16, one
            device. counts: [R] key counts (1 .. L). idx: [R, >= max(counts)] key indices in position order, or
            None (row r sees keys 0 .. counts[r] - 1). scale: score scale (default d ** -0.5).
    Returns:
        [R, H, d] float32: softmax(q . k_j * scale) v_j over the keys each row sees.
    Raises:
        ValueError: shapes that do not fit, a row with no key or an index outside the cache (named).
        RuntimeError: no Triton here (the fix named).
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2] or 0 in k.shape[::2] \
            or q.shape[1] % k.shape[0]:
        raise ValueError(f"row_attention_gpu: q [R, H, d] and k = v [H_kv, L, d] with H % H_kv == 0 expected, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"row_attention_gpu: q, k, v of one dtype in {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    resolve("triton", q.device)
    counts_t = torch.as_tensor(counts).to(torch.int64).cpu()
    if counts_t.shape != (q.shape[0],) or int(counts_t.min()) < 1 or int(counts_t.max()) > k.shape[1]:
        raise ValueError(f"row_attention_gpu: counts must be {q.shape[0]} key counts in 1..{k.shape[1]}, got "
                         f"{counts_t.tolist()}")
    prefix = idx is None
    if prefix:
        idx_t = torch.zeros(q.shape[0], 0, dtype=torch.int64)
    else:
        idx_t = torch.as_tensor(idx).to(torch.int64).cpu()
        n = int(counts_t.max())
        if idx_t.dim() != 2 or idx_t.shape[0] != q.shape[0] or idx_t.shape[1] < n:
            raise ValueError(f"row_attention_gpu: idx must be [R, >= max(counts)] key indices, got "
                             f"{tuple(idx_t.shape)}")
        used = idx_t[:, :n][torch.arange(n)[None] < counts_t[:, None]]
        if int(used.min()) < 0 or int(used.max()) >= k.shape[1]:
            raise ValueError(f"row_attention_gpu: idx entries must lie in 0..{k.shape[1] - 1}")
    dev = q.device
    return attend_gpu(q.transpose(0, 1), k, v, counts_t.to(torch.int32).to(dev), idx_t.to(torch.int32).to(dev),
                      prefix, scale)


def attend_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor,
               prefix: bool, scale: float | None) -> torch.Tensor:
    """:func:`row_attention_gpu` without its checks, for callers that checked a forward's row plan once: q
    [H, R, d] (a ``transformers`` query's layout for one sequence), k / v [H_kv, L, d], counts [R] int32 and idx
    [R, >= max(counts)] int32 ([R, 0] when ``prefix``) on q's device. Returns [R, H, d] float32."""
    scale = float(q.shape[2] ** -0.5 if scale is None else scale)
    return _launcher().launch_row_attention(q, k, v, counts, idx, prefix, scale)

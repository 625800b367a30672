"""Row-invariant decode attention on the CPU (numba): every query row reduced over its own keys in one fixed order.

Speculative decoding at T = 0 is lossless by construction when a verify row's logits are the bits the AR step
computes at the same node (batch invariance: He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab, 2025). Library attention kernels split their work by the number of query rows and threads, so a row
of a 9-row verify and the one-row AR step round differently (docs/invariance.md). This kernel computes
``softmax(q k^T * scale) v`` for each (query row, head) pair as one task on one thread, over the keys that row may
see, read in position order through an index, with every reduction in an order fixed by the key count alone:

- score of key j: the dot product over the head size accumulated in 16 lanes (lane l takes elements
  t = l, l + 16, ...), the lanes summed pairwise (8, 4, 2, 1), times ``scale``;
- softmax: the maximum (order free), ``exp(s - max)`` by a fixed float32 polynomial (Cephes ``expf``: range reduction
  by ln 2 in two parts, a degree-6 polynomial, the power of two set in the exponent bits), the sum in 16 lanes
  (lane = j mod 16) summed pairwise;
- output: ``sum_j e_j v_j`` accumulated over keys in position order, elementwise over the head size, divided by the
  sum at the end.

So the bits of a row depend only on its query, its key count and its keys, never on the other rows of the call or
the thread count: a verify row equals the AR step at the same node bit for bit (tests/test_invariant.py), in
float32 and in bf16 (keys and values are widened exactly from bf16; arithmetic is float32 throughout). Compiled
with numba on first use (``cache=True``: a few seconds once per machine), parallel over (row, head) pairs.

Dimension letters: R query rows, H query heads, H_kv key/value heads (grouped-query attention: query head h reads
key/value head h // (H / H_kv), as ``transformers``' ``repeat_kv`` orders them), L keys in the cache, d head size,
n keys a row sees.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.core import types
from numba.extending import intrinsic, overload

LANES = 16
# Cephes expf (S. L. Moshier, Cephes Math Library): exp(x) = 2^k * p(r), r = x - k ln 2 with ln 2 in two parts
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)
_EXP_MIN = np.float32(-87.0)  # below this exp underflows float32's normal range: the term is 0


@intrinsic
def _bits_f32(typingctx, x):  # pragma: no cover - compiled
    """Reinterpret the low 32 bits of an integer as float32 (no conversion)."""
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        import llvmlite.ir as llir

        low = builder.trunc(args[0], llir.IntType(32)) if x.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(types.float32))

    return sig, codegen


def _widen2(a, i, j, t):  # pragma: no cover - replaced by the overload below
    """a[i, j, t] as float32: exact for float32 and for bf16 given as uint16 bits."""
    raise NotImplementedError


def _widen1(a, j):  # pragma: no cover - replaced by the overload below
    """a[j] as float32: exact for float32 and for bf16 given as uint16 bits."""
    raise NotImplementedError


@overload(_widen1, inline="always")
def _widen1_impl(a, j):  # pragma: no cover - compiled
    if a.dtype == types.uint16:
        def impl(a, j):
            return _bits_f32(np.uint32(a[j]) << np.uint32(16))
        return impl

    def impl(a, j):
        return a[j]
    return impl


@overload(_widen2, inline="always")
def _widen2_impl(a, i, j, t):  # pragma: no cover - compiled
    if a.dtype == types.uint16:
        def impl(a, i, j, t):
            return _bits_f32(np.uint32(a[i, j, t]) << np.uint32(16))
        return impl

    def impl(a, i, j, t):
        return a[i, j, t]
    return impl


@numba.njit(cache=True, inline="always")
def _exp_nonpos(x):  # pragma: no cover - compiled
    """exp(x) for x <= 0 in float32 by the fixed Cephes polynomial; 0 below -87."""
    if x < _EXP_MIN:
        return _ZERO
    k = np.float32(np.floor(x * _LOG2E + _HALF))
    r = x - k * _LN2_HI - k * _LN2_LO
    z = r * r
    p = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * z + r + _ONE
    return p * _bits_f32(np.int32(np.int32(k) + np.int32(127)) << np.int32(23))


@numba.njit(cache=True, inline="always")
def _lane_sum(a):  # pragma: no cover - compiled
    """Sum of 16 lanes in a fixed pairwise order: (0+8, 1+9, ..), then 4 apart, 2 apart, 1 apart."""
    b0 = a[0] + a[8]
    b1 = a[1] + a[9]
    b2 = a[2] + a[10]
    b3 = a[3] + a[11]
    b4 = a[4] + a[12]
    b5 = a[5] + a[13]
    b6 = a[6] + a[14]
    b7 = a[7] + a[15]
    c0 = b0 + b4
    c1 = b1 + b5
    c2 = b2 + b6
    c3 = b3 + b7
    return (c0 + c2) + (c1 + c3)


@numba.njit(cache=True, inline="always")
def _weighted_values(acc, w, v, g, idx, r, n, prefix):  # pragma: no cover - compiled
    """acc [d] = sum_j w[j] v[g, key_j] over row r's n keys in position order (key_j = j with ``prefix``, else
    idx[r, j]), four keys per pass added one after another, then the remainder one by one (float32)."""
    d = acc.shape[0]
    acc[:] = _ZERO
    n4 = n - n % 4
    for j in range(0, n4, 4):
        if prefix:
            k0, k1, k2, k3 = j, j + 1, j + 2, j + 3
        else:
            k0, k1, k2, k3 = idx[r, j], idx[r, j + 1], idx[r, j + 2], idx[r, j + 3]
        e0, e1, e2, e3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        for t in range(d):
            acc[t] = (((acc[t] + e0 * _widen2(v, g, k0, t)) + e1 * _widen2(v, g, k1, t))
                      + e2 * _widen2(v, g, k2, t)) + e3 * _widen2(v, g, k3, t)
    for j in range(n4, n):
        kj = j if prefix else idx[r, j]
        e = w[j]
        for t in range(d):
            acc[t] += e * _widen2(v, g, kj, t)


@numba.njit(cache=True, parallel=True)
def _attend(q, kt, v, idx, counts, prefix, scale, out):  # pragma: no cover - compiled; tested against float64
    heads, r_rows, d = q.shape
    n_kv = kt.shape[0]
    group = heads // n_kv
    nmax = 0
    span = 0  # scores are computed for keys 0 .. span - 1 (every key some row reads)
    for r in range(r_rows):
        nmax = max(nmax, counts[r])
        if prefix:
            span = max(span, counts[r])
        else:
            for j in range(counts[r]):
                span = max(span, idx[r, j] + 1)
    sc = np.empty((r_rows * heads, span), np.float32)
    ew = np.empty((r_rows * heads, max(nmax, 1)), np.float32)
    o = np.empty((r_rows * heads, d), np.float32)
    t4 = d - d % 4
    for item in numba.prange(r_rows * n_kv):  # one task per (row, key/value head): its query heads share loads
        r = item // n_kv
        g = item - r * n_kv
        n = counts[r]
        # scores of every key up to the row's last: a dot product over t = 0 .. d-1 in order, four terms per pass
        # added one after another (the bits of one term per pass); the row's keys are picked after
        for hh in range(group):
            sc[item * group + hh, :] = _ZERO
        for t in range(0, t4, 4):
            for hh in range(group):
                h = g * group + hh
                row = sc[item * group + hh]
                q0, q1, q2, q3 = q[h, r, t], q[h, r, t + 1], q[h, r, t + 2], q[h, r, t + 3]
                k0, k1, k2, k3 = kt[g, t], kt[g, t + 1], kt[g, t + 2], kt[g, t + 3]
                for j in range(span):
                    row[j] = (((row[j] + q0 * _widen1(k0, j)) + q1 * _widen1(k1, j)) + q2 * _widen1(k2, j)) \
                        + q3 * _widen1(k3, j)
        for t in range(t4, d):
            for hh in range(group):
                row = sc[item * group + hh]
                qt = q[g * group + hh, r, t]
                kr = kt[g, t]
                for j in range(span):
                    row[j] += qt * _widen1(kr, j)
        for hh in range(group):
            # softmax weights: the row's keys in position order, exp by the fixed polynomial, a 16-lane sum
            w = ew[item * group + hh]
            row = sc[item * group + hh]
            smax = -np.inf
            for j in range(n):
                sj = row[j if prefix else idx[r, j]] * scale
                w[j] = sj
                smax = max(smax, sj)
            lanes = np.zeros(LANES, np.float32)
            full = n // LANES
            for bb in range(full):
                for m in range(LANES):
                    e = _exp_nonpos(w[bb * LANES + m] - smax)
                    w[bb * LANES + m] = e
                    lanes[m] += e
            for j in range(full * LANES, n):
                e = _exp_nonpos(w[j] - smax)
                w[j] = e
                lanes[j - full * LANES] += e
            total = _lane_sum(lanes)
            acc = o[item * group + hh]
            _weighted_values(acc, w, v, g, idx, r, n, prefix)
            for t in range(d):
                out[r, g * group + hh, t] = acc[t] / total


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor,
                  idx: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of R query rows, each over its own keys, with bits that depend on that row alone.

    Args:
        q: [R, H, d] float32 or bfloat16. k, v: [H_kv, L, d], float32 or bfloat16 (H divisible by H_kv).
        counts: [R] integers (a tensor, array or list), keys row r sees (1 .. L).
        idx: [R, n_max] integer or None: row r sees keys ``idx[r, :counts[r]]`` of the cache, in that (position)
            order (entries past ``counts[r]`` are ignored); None when row r sees the leading keys
            ``0 .. counts[r] - 1`` (an AR step, a chain verify).
        scale: score scale (default d ** -0.5).
    Returns:
        [R, H, d] float32: row r, head h is softmax(q[r, h] . k_j * scale) v_j over the keys row r sees, computed
        as the module docstring says (float32 arithmetic, fixed reduction order per key count).
    Raises:
        ValueError: shapes that do not fit or are empty (named), a row with no key or an index out of the cache.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2] or 0 in k.shape[::2] \
            or q.shape[1] % k.shape[0]:
        raise ValueError(f"row_attention: q [R, H, d] and k = v [H_kv, L, d] with H % H_kv == 0 expected, got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"row_attention: keys and values in float32 or bfloat16, got {k.dtype} and {v.dtype}")
    counts_np = torch.as_tensor(counts).to(torch.int64).cpu().numpy()
    if counts_np.shape != (q.shape[0],) or counts_np.min(initial=1) < 1 or counts_np.max(initial=1) > k.shape[1]:
        raise ValueError(f"row_attention: counts must be {q.shape[0]} key counts in 1..{k.shape[1]}, got "
                         f"{counts.tolist()}")
    if idx is None:
        idx_np, prefix = np.zeros((q.shape[0], 0), np.int64), True
    else:
        idx_np, prefix = torch.as_tensor(idx).to(torch.int64).cpu().numpy(), False
        if idx_np.ndim != 2:
            raise ValueError(f"row_attention: idx must be [R, >= max(counts)] key indices, got {idx_np.ndim} dims")
        used = idx_np[:, : counts_np.max()][np.arange(counts_np.max())[None] < counts_np[:, None]] if (
            idx_np.shape[0] == q.shape[0] and idx_np.shape[1] >= counts_np.max()) else None
        if used is None or used.min() < 0 or used.max() >= k.shape[1]:
            raise ValueError(f"row_attention: idx must be [R, >= max(counts)] key indices in 0..{k.shape[1] - 1}")

    return attend(q.transpose(0, 1), k, v, counts_np, idx_np, prefix, scale)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as numpy: float32 as is, bf16 as its uint16 bits (numba has no bf16)."""
    t = t.detach().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: np.ndarray, idx: np.ndarray, prefix: bool,
           scale: float | None) -> torch.Tensor:
    """:func:`row_attention` without its input checks, for callers that checked once (the decode attention
    checks a forward's row plan once for all its layers). q [H, R, d] (the layout of one sequence of a
    ``transformers`` query); counts [R] int64; idx [R, >= max(counts)] int64 (any [R, 0] when ``prefix``).
    Returns [R, H, d] float32."""
    out = np.empty((q.shape[1], q.shape[0], q.shape[2]), np.float32)
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:  # torch's thread budget: the bits do not depend on it
        numba.set_num_threads(threads)
    scale = float(q.shape[2] ** -0.5 if scale is None else scale)
    _attend(_numpy(q.float()), _numpy(k.transpose(1, 2)), _numpy(v), idx, counts, prefix, np.float32(scale), out)
    return torch.from_numpy(out)

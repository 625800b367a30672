"""CPU kernels of the first-order tree builders (numba), with the NumPy code in ``dartree.decode.builders.supertree``
and ``dartree.decode.trees`` as twins.

A first-order head (identity, Markov) scores a candidate from its parent's token alone, so a round's log q~ take
K x K values per depth (``pair_log_probs``) and DARTree's depth-wise expansion (arXiv 2608.13524, Algorithm 1;
``build_dartree_supertree``) is a loop over depths that picks the global top-q of parent score + log q~ from a
[|F|, K] table. In NumPy that loop costs a dozen calls per depth; compiled it is one call per block (timings:
docs/performance.md, "Tree stage").

- :func:`expand_first_order` is ``dartree.decode.builders.supertree._expand_first_order_np`` compiled: the same frontier
  selection (value desc, ties to the lower flat index, i.e. the earlier parent, then the better-ranked candidate),
  the same early stop of DARTree-pruned (``prune``), fp32 path sums in the same order.
- :func:`top_b_keep` is the CPU selection of ``dartree.decode.trees.select_top_b_keep``: the top-B nodes by
  score + beta * depth (computed as torch computes it in fp32: fl(score + fl(fl(beta) * depth))), ties to the
  earlier node, kept in their original (topological) order, parents re-indexed.

- :func:`tree_mask` writes the whole verify mask [M+1, start+M+1] (``dartree.kernels.tree_compile.full_mask_cpu``).

All equal their twins exactly (tests/test_trees.py, tests/test_kernels.py). numba compiles them on first use (cached on
disk, ``cache=True``: compiled once per machine, loaded once per process; docs/performance.md, "Tree stage"); the
warm-up runs of ``decode/eval.py`` and ``decode/bench.py`` absorb that before any timing.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, inline="always")
def _offer(sel_v, sel_i, n, cap, v, i):  # pragma: no cover - compiled
    """Offer (v, i) to the best-first buffer sel_v/sel_i holding n <= cap entries; returns the new n. Entries stay in
    value-descending order and a new value goes after every equal one, so ties keep the earlier offer (lower index)."""
    if n < cap:
        pos = n
        n += 1
    elif v > sel_v[cap - 1]:
        pos = cap - 1
    else:
        return n
    while pos > 0 and sel_v[pos - 1] < v:
        sel_v[pos] = sel_v[pos - 1]
        sel_i[pos] = sel_i[pos - 1]
        pos -= 1
    sel_v[pos] = v
    sel_i[pos] = i
    return n


@numba.njit(cache=True, nogil=True)
def _expand(lq, ids, quotas, b_keep, beta, prune):  # pragma: no cover - compiled; its twin is the NumPy loop
    p_len, kk = ids.shape
    cap = 0
    qmax = 1
    for d in range(p_len):
        cap += quotas[d]
        qmax = max(qmax, quotas[d])
    toks = np.empty(cap, np.int64)
    pars = np.empty(cap, np.int64)
    deps = np.empty(cap, np.int64)
    scs = np.empty(cap, np.float32)
    f_score = np.zeros(qmax, np.float32)
    f_col = np.zeros(qmax, np.int64)
    sel_v = np.empty(qmax, np.float32)
    sel_i = np.empty(qmax, np.int64)
    kept = np.empty(max(b_keep, 1), np.float32)  # the best b_keep adjusted scores so far, ascending
    n_kept = 0
    n_f = 1
    f_start = 0
    n = 0
    for d in range(p_len):
        q = min(quotas[d], n_f * kk)
        if q <= 0:
            break
        m = 0
        for j in range(n_f):
            fs = f_score[j]
            col = f_col[j]
            for c in range(kk):
                v = fs + lq[d, col, c]
                if v != v:
                    return toks[:0], pars[:0], deps[:0], scs[:0], -1  # NaN: the caller refuses the round
                m = _offer(sel_v, sel_i, m, q, v, j * kk + c)  # ties keep the lower flat index
        fmax = sel_v[0]
        for t in range(q):
            flat = sel_i[t]
            col = flat % kk
            toks[n + t] = ids[d, col]
            pars[n + t] = flat // kk + f_start
            deps[n + t] = d + 1
            scs[n + t] = sel_v[t]
            f_score[t] = sel_v[t]
            f_col[t] = col
        f_start = n + 1
        n += q
        n_f = q
        if prune and d + 1 < p_len:
            shift = np.float32(beta * (d + 1))
            for t in range(q):
                a = np.float32(f_score[t] + shift)
                if n_kept < b_keep:
                    pos = n_kept
                    n_kept += 1
                elif a > kept[0]:
                    pos = 0
                    while pos + 1 < b_keep and kept[pos + 1] < a:
                        kept[pos] = kept[pos + 1]
                        pos += 1
                    kept[pos] = a
                    continue
                else:
                    continue
                while pos > 0 and kept[pos - 1] > a:
                    kept[pos] = kept[pos - 1]
                    pos -= 1
                kept[pos] = a
            if n_kept >= b_keep and float(kept[0]) >= float(fmax) + beta * (d + 2):
                break
    return toks[:n], pars[:n], deps[:n], scs[:n], n


@numba.njit(cache=True, nogil=True)
def _top_b(score, depth, parents, budget, beta):  # pragma: no cover - compiled; its twin is select_top_b_keep
    m = score.size
    b32 = np.float32(beta)
    sel_v = np.empty(budget, np.float32)
    sel_i = np.empty(budget, np.int64)
    k = 0
    for i in range(m):
        v = np.float32(score[i] + np.float32(b32 * np.float32(depth[i])))
        if v != v:
            return sel_i[:0], parents[:0], -1
        k = _offer(sel_v, sel_i, k, budget, v, i)
    keep = np.sort(sel_i[:k])
    remap = np.full(m + 1, -1, np.int64)
    remap[0] = 0
    for t in range(k):
        remap[keep[t] + 1] = t + 1
    new_par = np.empty(k, np.int64)
    ok = 1
    for t in range(k):
        new_par[t] = remap[parents[keep[t]]]
        if new_par[t] < 0:
            ok = 0
    return keep, new_par, ok


def expand_first_order(lq: np.ndarray, ids: np.ndarray, quotas: np.ndarray, prune: tuple[int, float] | None):
    """DARTree's depth-wise expansion over pair tables, compiled (twin:
    ``dartree.decode.builders.supertree._expand_first_order_np``).

    Args:
        lq: [P, K, K] float32 log q~ (``pair_log_probs``): row j of depth d is the parent whose token is
            ``ids[d-1, j]`` (every row the root's at d = 0).
        ids: [P, K] int64 candidate token ids.
        quotas: [P] int64 nodes to keep at each depth (the builder's quota, evaluated in order; <= 0 stops).
        prune: (B, beta) for DARTree-pruned's early stop (expansion ends once no deeper node can enter the top-B by
            score + beta * depth), or None.
    Returns:
        (tokens [M] int64, parents [M] int64 (root 0, node i at i + 1), depth [M] int64, score [M] float32), depth-major;
        None when a path score is NaN (the caller then refuses the round).
    """
    b_keep, beta = (int(prune[0]), float(prune[1])) if prune is not None else (0, 0.0)
    toks, pars, deps, scs, n = _expand(np.ascontiguousarray(lq, dtype=np.float32), np.ascontiguousarray(ids, dtype=np.int64),
                                       np.ascontiguousarray(quotas, dtype=np.int64), b_keep, beta, prune is not None)
    return None if n < 0 else (toks, pars, deps, scs)


def top_b_keep(score: np.ndarray, depth: np.ndarray, parents: np.ndarray, budget: int, beta: float):
    """The top-``budget`` nodes by score + beta * depth, compiled (twin: ``select_top_b_keep``'s NumPy partition).

    Args:
        score: [M] float32 path scores; depth: [M] int64; parents: [M] int64 (root 0, node i at i + 1);
        budget: 1 <= B < M; beta: <= 0.
    Returns:
        (keep [B] int64 ascending original indices, re-indexed parents [B] int64), or None when an adjusted score is
        NaN (the caller then takes the twin).
    Raises:
        RuntimeError: the kept set is not prefix-closed (excluded by DARTree Lemma 1 for beta <= 0).
    """
    keep, new_par, ok = _top_b(np.ascontiguousarray(score, dtype=np.float32), np.ascontiguousarray(depth, dtype=np.int64),
                               np.ascontiguousarray(parents, dtype=np.int64), int(budget), float(beta))
    if ok < 0:
        return None
    if ok == 0:
        raise RuntimeError("select_top_b: kept set is not prefix-closed")
    return keep, new_par


@numba.njit(cache=True, nogil=True)
def _mask(parents, start, hidden, out):  # pragma: no cover - compiled; its twin is tree_attention_ref
    m = parents.size
    depth = np.zeros(m + 1, np.int64)
    for i in range(1, m + 1):
        p = parents[i - 1]
        if p < 0 or p >= i:
            return depth, 0
        depth[i] = depth[p] + 1
    for i in range(m + 1):
        for j in range(m + 1):
            out[i, start + j] = hidden
    for i in range(m + 1):
        out[i, start + i] = 0
        a = i
        while a > 0:  # the ancestors of node i: its row sees them
            a = parents[a - 1]
            out[i, start + a] = 0
    return depth, 1


def tree_mask(parents: np.ndarray, start: int, hidden_bits: int, int_dtype):
    """Depth [M+1] int64 and the verify mask [M+1, start+M+1] as ``int_dtype`` bit patterns (0: visible, ``hidden_bits``:
    hidden) of a tree given by ``parents`` [M] int64 (0 = root, parents[i] < i + 1), compiled
    (``dartree.kernels.tree_compile.full_mask_cpu`` views it as the float dtype). None when a parent does not precede
    its child."""
    m = parents.size
    out = np.zeros((m + 1, int(start) + m + 1), dtype=int_dtype)
    depth, ok = _mask(np.ascontiguousarray(parents, dtype=np.int64), int(start), int_dtype(hidden_bits), out)
    return (depth, out) if ok else None

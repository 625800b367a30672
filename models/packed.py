"""Prepacked oneDNN linear layers for CPU decoding (the small-M matmuls of verify and draft forwards).

``F.linear`` (MKL sgemm) re-reads and re-packs every weight on each call, so on a CPU a verify forward of M
tokens costs far more than one of a single token although both read the same weights. oneDNN's linear with the
weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise``, the path ``torch.compile`` takes on CPU with weight freezing) removes the per-call packing
(figures: docs/performance.md, "Prepacked oneDNN linears"; ``decode/bench.py`` prints the whole-forward ones).
Each output row is also independent of the other rows in the call (a row computed alone equals the same row
computed in a batch, bit for bit), so a verify forward and an AR step agree more closely than with MKL's
gemv/gemm split.

Which path wins for a few rows depends on the CPU, so :func:`tune_linears` measures both per weight shape and row
count on the machine that decodes and sets one threshold per shape.

Packing swaps the class of ``nn.Linear`` modules in place to :class:`PackedLinear`: parameters, names,
``state_dict`` and weight tying are unchanged; the packed copy is a non-persistent attribute that is rebuilt
when the weight changes (its ``_version``) and bypassed whenever autograd, another device or another dtype is
involved, so training through a packed module is exactly ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dartree.base.dtypes import onednn_linear_supported

LINEAR_BACKENDS = ("auto", "onednn", "aten")


def choose_linear(requested: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[str, str]:
    """The linear backend a decode run uses, and why (printed and recorded in reports).

    Args:
        requested: ``auto`` (oneDNN where supported, else aten), ``onednn`` or ``aten`` (plain ``F.linear``).
        dtype: the model dtype.
        device: the model device.
    Returns:
        (backend, reason) with backend ``onednn`` or ``aten``.
    Raises:
        ValueError: an unknown backend, or ``onednn`` requested where it cannot run (the message says why and
            names ``--linear aten`` / ``auto`` as the fix).
    """
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend {requested!r} is not one of {', '.join(LINEAR_BACKENDS)}")
    ok, why = onednn_linear_supported(dtype, device)
    if requested == "aten":
        return "aten", "--linear aten requested (F.linear, MKL/BLAS packs the weight on every call)"
    if requested == "onednn":
        if not ok:
            raise ValueError(f"--linear onednn cannot run here: {why}; use --linear aten or auto")
        return "onednn", "--linear onednn requested (weights prepacked once into oneDNN's layout)"
    if ok:
        return "onednn", ("auto: weights prepacked once for oneDNN, so small-M verify and draft matmuls skip the "
                          "per-call weight packing of F.linear")
    return "aten", f"auto: {why}; plain F.linear"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a [out, in] weight into oneDNN's blocked layout (an opaque mkldnn tensor, same values).

    Raises:
        RuntimeError: from oneDNN when the dtype is unsupported on this CPU (check :func:`onednn_linear_supported`).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W given as :func:`pack_weight` output; x [..., in] -> [..., out] (same dtype)."""
    return _pointwise()(x, packed, bias, "none", [None], "")


# Single-row inputs (an AR step) use F.linear for weights below this many elements, where MKL's gemv already
# streams the weight once and skips oneDNN's per-call dispatch; a large lm_head stays packed, which is faster at one
# row too (figures: docs/performance.md, "Prepacked oneDNN linears").
SINGLE_ROW_PACKED_MIN = 1 << 22
_LINEAR_POINTWISE = None


def _pointwise():
    global _LINEAR_POINTWISE
    if _LINEAR_POINTWISE is None:
        _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
    return _LINEAR_POINTWISE


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward uses a prepacked oneDNN copy of its weight.

    Created only by :func:`pack_linears` (class swap; nothing about the module's parameters changes). The packed
    copy is built on first use and rebuilt when ``weight`` is modified in place (``weight._version``), moved or
    replaced. Falls back to ``F.linear`` when grad is enabled and the weight or input requires grad, when the
    input's device or dtype differs from the packed weight's, and, for a row count R = x.numel() / in_features:
    after :func:`tune_linears`, where F.linear measured faster for R rows on this machine; untuned, for
    single-row inputs with a weight below :data:`SINGLE_ROW_PACKED_MIN` elements (see there).
    """

    def _packed_weight(self) -> torch.Tensor | None:
        """The packed copy of ``weight`` (rebuilt when stale), or None when the weight is not on the CPU or its
        dtype has no oneDNN linear here (float64, or bf16 without native support)."""
        w = self.weight
        st = self.__dict__.get("_dartree_packed")
        if st is None or st[0] is not w or st[1] != w._version or st[2] != w.data_ptr():
            ok = w.is_cpu and onednn_linear_supported(w.dtype)[0]
            st = (w, w._version, w.data_ptr(), w.dtype, pack_weight(w) if ok else None)
            self.__dict__["_dartree_packed"] = st
        return st[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(1, x.shape[-1])
        aten_rows = self.__dict__.get("_dartree_aten_rows")
        if aten_rows is None:  # untuned: the fixed single-row rule
            use_aten = rows == 1 and w.numel() < SINGLE_ROW_PACKED_MIN
        else:  # tuned on this machine (tune_linears): aten where it measured faster for this many rows
            use_aten = rows < len(aten_rows) and aten_rows[rows]
        if use_aten or not x.is_cpu or x.dtype != w.dtype \
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, self.bias)
        packed = self._packed_weight()
        if packed is None:
            return F.linear(x, w, self.bias)
        min_rows = self.__dict__.get("_dartree_min_rows", 1)
        max_rows = self.__dict__.get("_dartree_max_rows")
        if 0 < rows < min_rows or (max_rows is not None and rows > max_rows):  # the row-invariant tiling
            flat = x.reshape(rows, x.shape[-1])
            step = rows if max_rows is None else max_rows
            y = torch.cat([self._tile_call(flat[i : i + step], packed, min_rows) for i in range(0, rows, step)])
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return _pointwise()(x, packed, self.bias, "none", [None], "")

    def _tile_call(self, flat: torch.Tensor, packed: torch.Tensor, min_rows: int) -> torch.Tensor:
        """One packed call on ``flat`` [R, in] (R <= the tile's max rows), padded to ``min_rows`` rows by repeating
        its last row where R is smaller; returns [R, out]."""
        rows = flat.shape[0]
        if rows < min_rows:
            flat = torch.cat([flat, flat[-1:].expand(min_rows - rows, -1)])
        return _pointwise()(flat, packed, self.bias, "none", [None], "")[:rows]


def pack_linears(module: nn.Module, backend: str = "onednn", *, row_invariant: bool = False, min_rows: int = 1,
                 max_rows: int | None = None) -> int:
    """Switch every ``nn.Linear`` inside ``module`` to :class:`PackedLinear` (``onednn``) or back (``aten``).

    In place; parameters, buffers and ``state_dict`` keys are untouched, so shared weights (a drafter using the
    target's lm_head) stay shared. Only exact ``nn.Linear`` instances are switched (subclasses keep their own
    forward). ``row_invariant=True`` (``onednn`` only) sends every row count through the packed call, single
    rows included, so a row's output never depends on how many rows share the call (F.linear's gemv for one row
    and gemm for several round differently): an AR step and a verify forward then compute each linear of a row
    identically. ``min_rows`` (with ``row_invariant``): a call of fewer rows is padded to this many by repeating
    its last row, for CPUs whose packed kernel takes another path for one row than for several (measured by
    :func:`dartree.models.invariant.linear_is_row_invariant`: 2 on an AVX-512-BF16 Zen 5, in bf16 and fp32).
    ``max_rows`` (with ``row_invariant``; None: no limit): a call of more rows is split into consecutive calls of at
    most this many rows (the last one padded to ``min_rows`` if shorter), for CPUs whose packed kernel blocks its
    reduction one way up to a row count and another way above it (measured: 32 on an AMX Xeon in bf16, where every
    call of 1-32 rows gives a row the same bits and calls of 33 or more do not).
    Returns the number of modules switched.

    Raises:
        ValueError: unknown backend, min_rows < 1, or max_rows < min_rows.
    """
    if backend not in ("onednn", "aten"):
        raise ValueError(f"pack_linears backend must be 'onednn' or 'aten', got {backend!r}")
    if min_rows < 1 or (max_rows is not None and max_rows < min_rows):
        raise ValueError(f"pack_linears needs 1 <= min_rows <= max_rows, got min_rows={min_rows}, max_rows={max_rows}")
    n = 0
    for m in module.modules():
        if backend == "onednn" and type(m) in (nn.Linear, PackedLinear):
            if type(m) is nn.Linear:
                m.__class__ = PackedLinear
                n += 1
            if row_invariant:
                m.__dict__["_dartree_aten_rows"] = []  # no row count takes F.linear
                m.__dict__["_dartree_min_rows"] = int(min_rows)
                if max_rows is None:
                    m.__dict__.pop("_dartree_max_rows", None)
                else:
                    m.__dict__["_dartree_max_rows"] = int(max_rows)
            else:
                m.__dict__.pop("_dartree_min_rows", None)
                m.__dict__.pop("_dartree_max_rows", None)
                if m.__dict__.get("_dartree_aten_rows") == []:
                    m.__dict__.pop("_dartree_aten_rows")
        elif backend == "aten" and type(m) is PackedLinear:
            m.__class__ = nn.Linear
            m.__dict__.pop("_dartree_packed", None)
            m.__dict__.pop("_dartree_aten_rows", None)
            m.__dict__.pop("_dartree_min_rows", None)
            m.__dict__.pop("_dartree_max_rows", None)
            n += 1
    return n


# Row counts tuned by tune_linears: 1 .. TUNE_MAX_ROWS covers an AR step, every verify of a budget <= 16 tree and a
# 16-position draft block; larger inputs (prefill, big trees) keep the packed path, which wins there.
TUNE_MAX_ROWS = 17
# weights timed per shape group: enough to stream from memory as a forward does (16 x 576 x 576 fp32 = 21 MB)
TUNE_MAX_MODULES = 16


def tune_linears(*modules: nn.Module, max_rows: int = TUNE_MAX_ROWS, reps: int = 3) -> dict:
    """Measure, on this machine, F.linear against the packed oneDNN call for every row count R = 1..``max_rows``
    and every weight shape of the :class:`PackedLinear` layers inside ``modules``; each layer then takes the faster
    path for R rows (R > ``max_rows``: packed).

    Why: which path wins at small R depends on the CPU, even between hosts of one VM image, so a fixed rule is
    wrong on some of them (figures: docs/performance.md, "Prepacked oneDNN linears").

    Method: the layers are grouped by (weight shape, dtype, bias); per group up to :data:`TUNE_MAX_MODULES` of its
    weights are run back to back (so they stream from memory, as in a forward) on a random [R, in] input, with
    both paths interleaved within each of ``reps`` passes after one warm-up pass, keeping each path's minimum.
    The group then uses F.linear for R = 1..R* rows and the packed call above, with R* the threshold that
    maximises the summed measured saving, so a noisy single row count cannot flip the choice on a VM whose speed
    drifts.
    Both paths compute the same linear map (values equal up to float summation order), so the choice changes
    speed only; fp32 decoding stays equal to AR (tests/test_packed.py).

    Args:
        modules: modules already switched by :func:`pack_linears`; layers on another device, of a dtype oneDNN
            cannot run here, or not packed are skipped.
        max_rows: largest row count tuned (>= 1).
        reps: timed passes per row count (>= 1).
    Returns:
        {"out x in dtype": [1, .., R*]} the row counts that take F.linear, per shape group (for reports).
    Raises:
        ValueError: max_rows < 1 or reps < 1.
    """
    import time

    if max_rows < 1 or reps < 1:
        raise ValueError(f"tune_linears needs max_rows >= 1 and reps >= 1, got {max_rows}, {reps}")
    groups: dict = {}
    for module in modules:
        for m in module.modules():
            w = m.weight if type(m) is PackedLinear else None
            if w is not None and w.is_cpu and onednn_linear_supported(w.dtype)[0]:
                key = (tuple(w.shape), w.dtype, m.bias is not None)
                if all(m is not o for o in groups.get(key, [])):
                    groups.setdefault(key, []).append(m)
    summary = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (shape, dtype, _), mods in groups.items():
            timed = mods[:TUNE_MAX_MODULES]
            packed = [m._packed_weight() for m in timed]
            saving = [0.0] * (max_rows + 1)  # seconds F.linear saved over the packed call, per row count
            for rows in range(1, max_rows + 1):
                x = torch.randn(rows, shape[1], generator=gen).to(dtype)
                best = {"aten": float("inf"), "packed": float("inf")}
                for rep in range(reps + 1):
                    t0 = time.perf_counter()
                    for m in timed:
                        F.linear(x, m.weight, m.bias)
                    t1 = time.perf_counter()
                    for m, p in zip(timed, packed):
                        _pointwise()(x, p, m.bias, "none", [None], "")
                    t2 = time.perf_counter()
                    if rep:
                        best["aten"] = min(best["aten"], t1 - t0)
                        best["packed"] = min(best["packed"], t2 - t1)
                saving[rows] = best["packed"] - best["aten"]
            # one threshold R*: F.linear for 1..R* rows, packed above. F.linear's edge shrinks as rows grow, so a
            # win after a loss is noise; R* maximises the summed saving (0: packed everywhere; ties to the smaller)
            cum, best_total, cut = 0.0, 0.0, 0
            for rows in range(1, max_rows + 1):
                cum += saving[rows]
                if cum > best_total:
                    best_total, cut = cum, rows
            aten_rows = [0 < r <= cut for r in range(max_rows + 1)]
            for m in mods:
                m.__dict__["_dartree_aten_rows"] = tuple(aten_rows)
            name = f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}"
            summary[name] = [r for r in range(1, max_rows + 1) if aten_rows[r]]
    return summary


def is_packed(module: nn.Module) -> bool:
    """True when ``module`` is a :class:`PackedLinear` (used to pack weight slices taken from it the same way)."""
    return type(module) is PackedLinear

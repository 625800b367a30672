"""Row-invariant target forwards: a verify row computes exactly the bits an AR step computes for it.

Speculative decoding is lossless at T = 0 when the target's argmax at every verified node equals the argmax an
autoregressive step would take there. Both compute the same function, but not with the same arithmetic: a verify
forward of M rows runs matrix kernels chosen for M rows and attention over M queries with a tree mask, an AR step
runs one row; where the kernels round differently, a near-tie can flip and the outputs split (in bf16 often, in
fp32 rarely). The cure is batch invariance (He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines Lab, 2025): every operation computes a row the same way whatever else is in the call.

Measured per operation with ``python decode/harness/invariance.py`` (default target; docs/invariance.md has the
map): the RMSNorms, rotary embedding and elementwise ops are row invariant already; the linear layers are not
under the default packing (``F.linear`` and the packed oneDNN call each take one kernel for one row and another for
several), and the attention is not (the library kernel splits its work by query count and threads, and M queries
read their keys through a mask). This module closes both:

- :func:`row_invariant` runs every linear through a path measured row invariant on this machine
  (:func:`choose_invariant_linear`: the packed call for every row count, tiled where the CPU's kernel blocks by row
  count: one-row calls padded to two where the one-row kernel differs, calls of more than 32 rows split into 32-row
  calls where larger calls block their reduction otherwise, :func:`~dartree.models.packed.pack_linears` with
  ``row_invariant=True``; else ``F.linear``) and routes the target's attention through :func:`invariant_attention`;
- :func:`invariant_attention` gives every query row the keys it may see in position order (the prefix and its
  ancestors: exactly the keys the AR step at that node reads) and computes it with
  :func:`dartree.kernels.row_attention.row_attention`, whose bits for a row depend on that row's query and keys
  only (one task per row and head, every reduction in a fixed order), for the AR step and the verify alike;
- :func:`enter_invariant` decides when (``auto``: on for a CPU target in bf16) and says why.

On a CUDA target the same contract is kept by Triton kernels (:mod:`dartree.kernels.invariant_gpu`): every linear
through one tiling for every row count, every RMSNorm one program per row, the attention one program per (row,
head) over the keys that row sees in position order (``row_invariant(target, backend="triton")``; the CPU tests
run it under the Triton interpreter). It is a prepared path: ``--invariant on`` enters it, ``auto`` leaves it off
until it has been measured on a device.

A prefill from an empty cache (as many queries as keys, more than one) keeps the model's own attention: speculative
and AR decoding make the same prefill call, so it needs no invariance; every other call (an AR step, a verify of any
size, a prefill that continues a cache) goes through the kernel. Dimension letters: B batch, H query heads, H_kv key/value heads,
Q queries of the call, L keys, d head size, n keys one row sees.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from dartree.base.dtypes import onednn_linear_supported
from dartree.kernels._backend import resolve, triton_available
from dartree.kernels.invariant_gpu import DTYPES, attend_gpu, invariant_linear, invariant_rms_norm
from dartree.models.packed import is_packed, pack_linears

ATTN_NAME = "dartree_row_invariant"


_PLAN: dict = {}  # the last forward's row plan: its key (shape, mask object, the mask's tree columns), plans


def _plan(visible: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """One batch row's visibility [Q, L] as the kernel's row plan: key counts [Q], key index [Q, n_max] in
    position order, and whether every row sees its leading keys (an AR step, a chain verify: the index unused)."""
    counts = visible.sum(-1)
    if bool((counts == 0).any()):
        raise ValueError("invariant_attention: a query row sees no key; check the attention mask")
    lead = torch.arange(visible.shape[-1])[None] < counts[:, None]
    if bool(torch.equal(lead, visible)):
        return counts.numpy().astype(np.int64), np.zeros((visible.shape[0], 0), np.int64), True
    pos = torch.where(visible, torch.arange(visible.shape[-1])[None], visible.shape[-1])
    idx = pos.sort(dim=-1).values[:, : int(counts.max())]
    return counts.numpy().astype(np.int64), idx.numpy().astype(np.int64), False


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs):
    """Row-invariant attention (``transformers`` ``AttentionInterface`` signature).

    Args:
        query: [B, H, Q, d]; key, value: [B, H_kv, L, d]. attention_mask: additive [B, 1, Q, L] (0 visible,
            a large negative number hidden), a boolean [B, 1, Q, L] (True visible) or None (causal: query i sees
            keys 0 .. L - Q + i).
        scaling: score scale (default d ** -0.5).
    Returns:
        ([B, Q, H, d] in the value dtype, None). Row i's output depends only on its query and the keys it sees,
        in position order, never on the other rows of the call (:func:`dartree.kernels.row_attention.row_attention`;
        tested bit for bit).
    Raises:
        ValueError: a query that sees no key.

    The kernel is :func:`dartree.kernels.row_attention.attend` (numba, CPU), or
    :func:`dartree.kernels.invariant_gpu.attend_gpu` (Triton) where :class:`row_invariant` marked ``module`` for it.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # lazy: a numba kernel module: numba loads and compiles on first use, not when this module is imported
    from dartree.kernels.row_attention import attend

    b, h, nq, d = query.shape
    prefill = nq > 1 and key.shape[2] == nq  # from an empty cache: AR and speculative decoding share this call
    if prefill or dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    nk = key.shape[2]
    # the row plan of this forward: every layer gets the same mask object (kept alive here, so no other mask can
    # have its identity); its last nq columns (the tree) are compared as well, against a mask edited in place
    tail = None if attention_mask is None else attention_mask[..., max(0, nk - nq) : nk]
    hit = _PLAN.get("key")
    if hit is not None and hit[0] == (b, nq, nk) and hit[1] is attention_mask and (
            tail is None or torch.equal(hit[2], tail)):
        plans = _PLAN["plans"]
    else:
        if attention_mask is None:
            visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
            visible = visible[None].expand(b, nq, nk)
        elif attention_mask.dtype == torch.bool:
            visible = attention_mask[:, 0, :, :nk]
        else:
            visible = attention_mask[:, 0, :, :nk] == 0
        visible = visible.cpu()
        plans = [_plan(visible[bi]) for bi in range(b)]
        _PLAN["key"] = ((b, nq, nk), attention_mask, None if tail is None else tail.clone())
        _PLAN["plans"] = plans
        _PLAN["dev"] = None
    if getattr(module, "_dartree_invariant_backend", None) == "triton":
        dev = query.device
        if _PLAN.get("dev") is None or _PLAN["dev"][0] != dev:  # the plan as int32 tensors on the query's device
            _PLAN["dev"] = (dev, [(torch.from_numpy(c).to(dev, torch.int32), torch.from_numpy(i).to(dev, torch.int32),
                                   pre) for c, i, pre in plans])
        fn = attend_gpu
        plans = _PLAN["dev"][1]
    else:
        fn = attend
    if b == 1:
        counts, idx, prefix = plans[0]
        out = fn(query[0], key[0], value[0], counts, idx, prefix, scaling)[None]
    else:
        out = torch.stack([fn(query[bi], key[bi], value[bi], counts, idx, prefix, scaling)
                           for bi, (counts, idx, prefix) in enumerate(plans)])  # [B, Q, H, d] float32
    return out.to(value.dtype), None


CALL_ROWS = (1, 2, 3, 5, 9, 17, 33, 66)  # an AR step, and verify calls of chains and trees up to budget 65


def linear_is_row_invariant(weight: torch.Tensor, backend: str, min_rows: int = 1, rows: int = 132,
                            max_rows: int | None = None) -> bool:
    """Whether a linear path computes a row with the same bits whatever the number of rows in its call.

    Args:
        weight: [out, in], the model's dtype and device. backend: ``aten`` (``F.linear``) or ``onednn`` (the
            prepacked call for every row count, :class:`~dartree.models.packed.PackedLinear`). min_rows, max_rows
            (``onednn`` only): calls of fewer rows are padded to ``min_rows``, calls of more than ``max_rows`` split
            into calls of at most that many (``pack_linears(min_rows=..., max_rows=...)``; None: no split).
        rows: test rows (seeded, heavy-tailed like a decoder's activations: about 2% of the entries 16x larger,
            so that outputs cancel and a change of summation order shows in the rounded result).
    Returns:
        True when every row, computed in calls of each size in :data:`CALL_ROWS` (the rows split into
        consecutive calls of that size), equals the same row computed in one call of all ``rows`` rows, bit for bit.
        Measured per CPU: on an AVX-512-BF16 Zen 5 the packed kernel takes another path for one row than for
        several (bf16 and fp32), so ``min_rows=1`` fails there and ``min_rows=2`` passes; on an AMX Xeon in bf16
        calls of 1-32 rows agree and calls of 33 or more block their reduction otherwise, so ``max_rows=32`` passes.
    """
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, weight.shape[1], generator=g)
    x = (x * (1 + 15 * (torch.rand(x.shape, generator=g) < 0.02))).to(weight.dtype)
    if backend == "onednn":
        mod = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        mod.weight = torch.nn.Parameter(weight, requires_grad=False)
        pack_linears(mod, "onednn", row_invariant=True, min_rows=min_rows, max_rows=max_rows)

        def f(t):
            return mod(t)
    else:
        def f(t):
            return F.linear(t, weight)
    with torch.no_grad():
        full = f(x)
        return all(torch.equal(torch.cat([f(x[i : i + m]) for i in range(0, rows, m)]), full) for m in CALL_ROWS)


class LinearTiling(NamedTuple):
    """A linear path measured row invariant (:func:`choose_invariant_linear`).

    backend: ``onednn`` (the prepacked call for every row count) or ``aten`` (``F.linear``). min_rows: calls of
    fewer rows are padded to this many. max_rows: calls of more rows are split into calls of at most this many
    (None: never). why: one line for the run's header.
    """

    backend: str
    min_rows: int
    max_rows: int | None
    why: str


# The packed tilings tried, cheapest first: (min_rows, max_rows). Padding one-row calls to two costs an AR step a
# little; splitting at 32 rows costs only calls of more than 32 rows (verifies of budget > 31, prefills), which
# re-read the weights once per 32 rows; splitting at 16 costs a 17-row verify a second pass over the weights.
PACKED_TILINGS = ((1, None), (2, None), (1, 32), (2, 32), (1, 16), (2, 16))


def _tiling_label(backend: str, min_rows: int, max_rows: int | None) -> str:
    parts = [f"one-row calls padded to {min_rows}"] if min_rows > 1 else []
    parts += [f"calls over {max_rows} rows split into {max_rows}-row calls"] if max_rows is not None else []
    return backend + (f" ({'; '.join(parts)})" if parts else "")


def choose_invariant_linear(model: torch.nn.Module) -> LinearTiling:
    """The linear path that is row invariant for every weight shape of ``model`` on this machine, and why.

    Tries, in order, the prepacked oneDNN call for every row count with each tiling of :data:`PACKED_TILINGS`
    (where oneDNN supports the dtype), then ``F.linear``; each is measured per distinct weight shape
    (:func:`linear_is_row_invariant`). On an AMX Xeon the first to pass in bf16 is the split at 32 rows; on an
    AVX-512-BF16 Zen 5 the one-row padding.

    Returns:
        :class:`LinearTiling`.
    Raises:
        ValueError: no path is row invariant for some shape here (named), so no verify row can equal the AR
            step by construction on this CPU; decode without the mode.
    """
    shapes = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            shapes.setdefault((tuple(mod.weight.shape), mod.weight.dtype), mod.weight)
    w0 = next(iter(shapes.values()))
    tried = []
    candidates = [("aten", 1, None)]
    if onednn_linear_supported(w0.dtype, w0.device)[0]:
        candidates = [("onednn", lo, hi) for lo, hi in PACKED_TILINGS] + candidates
    else:
        tried.append("onednn: not supported here")
    for backend, min_rows, max_rows in candidates:
        bad = next((s for s, w in shapes.items()
                    if not linear_is_row_invariant(w, backend, min_rows, max_rows=max_rows)), None)
        label = _tiling_label(backend, min_rows, max_rows)
        if bad is None:
            return LinearTiling(backend, min_rows, max_rows,
                                f"{label} linears row invariant for all {len(shapes)} weight shapes (measured)")
        tried.append(f"{label}: not row invariant for {bad[0]} {bad[1]}")
    raise ValueError("no row-invariant linear on this CPU (" + "; ".join(tried) + ")")


NORM_FORMULA = "Llama RMSNorm"  # the norm form the Triton kernel computes (kernels/invariant_gpu.py)


def _is_rms_norm(mod: torch.nn.Module) -> bool:
    """A Llama-family RMSNorm (Llama, Qwen2/3, Mistral, SmolLM: ``weight`` [D] and ``variance_epsilon``)."""
    return type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and hasattr(mod, "weight")


def _triton_linear_forward(mod: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, mod.weight, mod.bias)


def _triton_norm_forward(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return invariant_rms_norm(x, mod.weight, mod.variance_epsilon)


def _triton_modules(model: torch.nn.Module) -> tuple[list, list, list]:
    """(linears, RMSNorms, attention modules) of ``model`` for the Triton mode.

    Raises:
        ValueError: a normalisation layer other than a Llama-family RMSNorm (its class named): the Triton mode has
            no row-invariant kernel for it.
    """
    linears, norms, attns = [], [], []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if isinstance(mod, torch.nn.Linear):
            linears.append(mod)
        elif _is_rms_norm(mod):
            norms.append(mod)
        elif "Norm" in kind:
            raise ValueError(f"row-invariant mode (triton): {name} is a {kind}, which has no row-invariant kernel "
                             f"here (only the {NORM_FORMULA} of the Llama, Qwen and Mistral families)")
        elif kind.endswith("Attention") and hasattr(mod, "o_proj"):
            attns.append(mod)
    return linears, norms, attns


BACKEND_CHOICES = ("cpu", "triton")


class row_invariant:
    """Context manager: inside it the target's forwards are row invariant (a verify row equals the AR step).

    ``backend="cpu"`` (the default for a CPU target) runs every linear layer of ``target.model`` through the path
    measured row invariant here (:func:`choose_invariant_linear`: oneDNN packed for every row count, one-row calls
    padded to two or large calls split into 32-row calls where the CPU needs it, else ``F.linear``; ``self.linear``,
    ``self.min_rows``, ``self.max_rows`` and ``self.why`` say which) and the attention through :func:`invariant_attention` with the numba kernel. ``backend="triton"``
    (the default for a CUDA target; on CPU only under ``TRITON_INTERPRET=1``, as the tests run it) runs every
    linear through :func:`~dartree.kernels.invariant_gpu.invariant_linear`, every RMSNorm through
    :func:`~dartree.kernels.invariant_gpu.invariant_rms_norm` and the attention through
    :func:`invariant_attention` with the Triton kernel. On exit the previous attention implementation, packing and
    module forwards come back.

    Args:
        target: a :class:`~dartree.models.target.Target`. backend: ``cpu``, ``triton`` or None (by the target's
            device).
    Raises:
        ValueError: an unknown backend; on ``cpu`` no linear path is row invariant on this CPU for some weight
            shape (named); on ``triton`` a norm layer without a kernel (named) or a dtype outside float32,
            bfloat16, float16.
        RuntimeError: ``triton`` where Triton cannot run (the fix named, :func:`dartree.kernels._backend.resolve`).
    """

    def __init__(self, target, backend: str | None = None):
        if backend is None:
            backend = "triton" if target.model.device.type == "cuda" else "cpu"
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"row_invariant: backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
        self.target, self.backend = target, backend

    def __enter__(self):
        from transformers import AttentionInterface

        model = self.target.model
        self.was_packed = [m for m in model.modules() if is_packed(m)]
        self.rows_before = {id(m): m.__dict__.get("_dartree_aten_rows") for m in self.was_packed}
        self.patched: list[torch.nn.Module] = []
        self.marked: list[torch.nn.Module] = []
        if self.backend == "triton":
            if model.dtype not in DTYPES:
                raise ValueError(f"row-invariant mode (triton): no kernel for {model.dtype} (float32, bfloat16, "
                                 "float16)")
            resolve("triton", model.device)
            linears, norms, attns = _triton_modules(model)
            pack_linears(model, "aten")
            for mod in linears:
                mod.forward = _triton_linear_forward.__get__(mod)
            for mod in norms:
                mod.forward = _triton_norm_forward.__get__(mod)
            for mod in attns:
                mod._dartree_invariant_backend = "triton"
            self.patched, self.marked = linears + norms, attns
            self.linear, self.min_rows, self.max_rows = "triton", 1, None
            self.why = (f"Triton, one 16x64x64 tiling for every row count, {len(linears)} linears and {len(norms)} "
                        "RMSNorms")
        else:
            self.linear, self.min_rows, self.max_rows, self.why = choose_invariant_linear(model)
            if self.linear == "onednn":
                pack_linears(model, "onednn", row_invariant=True, min_rows=self.min_rows, max_rows=self.max_rows)
            else:
                pack_linears(model, "aten")
        AttentionInterface.register(ATTN_NAME, invariant_attention)
        self.prev = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
        return self

    def __exit__(self, *exc):
        model = self.target.model
        model.set_attn_implementation(self.prev)
        for mod in self.patched:
            del mod.forward  # the instance attribute: the class forward again
        for mod in self.marked:
            del mod._dartree_invariant_backend
        pack_linears(model, "aten")
        if self.was_packed:
            for m in self.was_packed:
                pack_linears(m, "onednn")
                if self.rows_before[id(m)] is not None:
                    m.__dict__["_dartree_aten_rows"] = self.rows_before[id(m)]
        return False


INVARIANT_CHOICES = ("auto", "on", "off")


def enter_invariant(requested: str, target, stack) -> tuple[row_invariant | None, str]:
    """Enter the row-invariant mode for ``target`` as requested, into ``stack`` (a ``contextlib.ExitStack``).

    Args:
        requested: ``on`` (the mode, or an error), ``off`` (the default kernels) or ``auto``: the mode where it
            is needed, a CPU target in bfloat16 (without it bf16 outputs split from AR at near-ties; its cost per
            forward on a Zen 5 and an AMX Xeon is in docs/invariance.md, "Cost"), if a row-invariant linear path is
            measured here; float32 keeps the default kernels (its splits have not been seen, and the mode
            slows its AR step there: one-row linear calls padded to two, the packed path for every row count;
            docs/invariance.md, "Cost"); a CUDA target keeps them too (the Triton path, :class:`row_invariant` with
            ``backend="triton"``, is entered by ``on`` only until it has been measured on a device); other dtypes
            and devices have no kernel. Off says why.
        target: a :class:`~dartree.models.target.Target`. stack: where the mode is entered (closing it restores
            the default kernels).
    Returns:
        (the entered :class:`row_invariant`, or None; a one-line note for the run's header).
    Raises:
        ValueError: an unknown ``requested``, or ``on`` where the mode has no path here (the reason).
    """
    if requested not in INVARIANT_CHOICES:
        raise ValueError(f"invariant must be one of {', '.join(INVARIANT_CHOICES)}, got {requested!r}")
    if requested == "off":
        return None, "row-invariant verify: off (--invariant off): a verify row may round unlike the AR step"
    dtype, device = target.model.dtype, target.model.device
    why_not = None
    if device.type == "cuda":
        if not triton_available():
            why_not = "no Triton here for the CUDA kernels (pip install triton)"
        elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why_not = f"no row-invariant kernel for {str(dtype).replace('torch.', '')} (float32, bfloat16, float16)"
        elif requested == "auto":
            return None, ("row-invariant verify: off (auto on CUDA: the default kernels give verify rows equal to the "
                          "AR step's for the default architecture, and the Triton mode costs time per forward: "
                          "docs/invariance.md; --invariant on enters it)")
        else:
            try:
                mode = stack.enter_context(row_invariant(target, backend="triton"))
            except (ValueError, RuntimeError) as exc:
                raise ValueError(str(exc)) from None
            return mode, ("row-invariant verify: on (CUDA, Triton kernels: linear, RMSNorm and attention each "
                          "compute a row the same way for every row count; dartree.kernels.invariant_gpu)")
    elif device.type != "cpu":
        why_not = f"no row-invariant attention kernel for {device.type} here (CPU and CUDA only)"
    elif dtype not in (torch.float32, torch.bfloat16):
        why_not = f"no row-invariant attention kernel for {str(dtype).replace('torch.', '')} (float32, bfloat16)"
    if why_not is None and requested == "auto" and dtype == torch.float32:
        return None, ("row-invariant verify: off (auto: float32 verify rows have not split from AR steps in any run "
                      "measured, and the mode slows the AR step: docs/invariance.md, \"Cost\"; --invariant on makes "
                      "float32 exact by construction)")
    if why_not is None:
        try:
            mode = stack.enter_context(row_invariant(target))
        except ValueError as exc:
            why_not = str(exc)
        else:
            return mode, (f"row-invariant verify: on (linear {mode.linear}: {mode.why}; attention: each row over its "
                          f"own keys in a fixed order, dartree.kernels.row_attention)")
    if requested == "on":
        raise ValueError(why_not)
    return None, f"row-invariant verify: off ({why_not}); a verify row may round unlike the AR step"

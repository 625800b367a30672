"""The one way a target and a drafter are put together for decoding: :func:`assemble` returns an :class:`Assembly`.

Every program that decodes builds its models here and passes the :class:`Assembly` on: the Python API
(:func:`dartree.load` wraps it in a :class:`~dartree.speculator.SpeculativeDecoder`), the evaluation session
(``decode/eval.py``, :func:`dartree.decode.harness.session.open_session`), the round-cost bench (``decode/bench.py``)
and the GPU check (``kernels/tools/gpu_check.py``). For one dtype it

1. loads the target (:func:`~dartree.models.target.load_target`, moved to ``device``),
2. loads the dartree checkpoint against it (:func:`~dartree.models.checkpoint.load_dartree`: pairing checked,
   embeddings bound) and sets the target's captured layers to the drafter's ``target_layer_ids``,
3. packs every linear layer of the target, drafter and head on one matmul path
   (:func:`~dartree.models.packed.choose_linear`, :func:`~dartree.models.packed.pack_linears`) and, with ``tune``,
   times F.linear against the packed call per weight shape (:func:`~dartree.models.packed.tune_linears`),
4. enters the row-invariant mode as asked (:func:`~dartree.models.invariant.enter_invariant`) into the assembly's
   own ``ExitStack`` (after packing and tuning: the mode re-packs the target, and gives the packing back on exit).

With ``dtype="auto"`` where two dtypes can decode exactly (:func:`dtype_plan`: bfloat16 in the row-invariant mode
and float32 on a CPU with native bf16) both are assembled, bfloat16 is dropped where the mode has no path, the rest
are timed interleaved (:func:`~dartree.decode.precision.time_modes`) and the fastest is kept
(:func:`~dartree.decode.precision.pick_dtype`); the others are released.

One set of defaults, :func:`dartree.load`'s: ``dtype="auto"``, ``linear="auto"``, ``invariant="auto"``, no tuning,
the CPU. The programs pass their own flags through, and differ from those defaults where their purpose asks:

- ``decode/eval.py``: ``tune`` on (``--no-tune`` turns it off): a run that times decoding takes the faster path per
  weight shape and row count; its few seconds would lengthen every :func:`dartree.load`.
- ``decode/bench.py``: ``--dtype float32`` by default, and ``invariant`` ``off`` (``on`` for the ``DTYPE/invariant``
  rows of ``--invariant``): it measures named modes side by side, never a measured choice; ``tune`` on as eval.
- ``kernels/tools/gpu_check.py``: ``bfloat16`` on CUDA (the dry run: float32 on the tiny target, with a random drafter
  written as a checkpoint), ``linear="aten"`` (no packed path on CUDA; the dry run keeps F.linear), ``invariant``
  ``off``: its own section enters the Triton mode to compare it with the default kernels.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dartree.decode.precision import drafter_tau, pick_dtype, time_modes
from dartree.models.chat import chat_prompt_ids
from dartree.models.checkpoint import DraftModel, load_dartree
from dartree.base.dtypes import DTYPES, dtype_candidates
from dartree.models.invariant import INVARIANT_CHOICES, enter_invariant, row_invariant
from dartree.models.packed import choose_linear, pack_linears, tune_linears
from dartree.models.target import DEFAULT_TARGET, Target, load_target

# The text ``dtype="auto"`` times its candidates on when the caller gives no ids: a chat prompt of ordinary length.
CALIBRATION_PROMPT = "Explain how a hash map works, with a short example in Python."


class TargetLoadError(ValueError):
    """The target does not load. Attributes: ``spec`` (the target as given) and ``reason`` (the loader's first
    line); the message says both."""

    def __init__(self, spec, reason: str):
        super().__init__(f"cannot load the target {str(spec)!r}: {reason}")
        self.spec, self.reason = str(spec), reason


class ModeUnavailable(ValueError):
    """``invariant="on"`` where the row-invariant mode has no path here, for every dtype candidate; the message is
    the reason (with several candidates: ``dtype: reason`` for each)."""


@dataclass
class Assembly:
    """A target and its drafter built for decoding, and how (:func:`assemble`).

    Attributes:
        target: the :class:`~dartree.models.target.Target` (its captured layers set to the drafter's).
        draft: the :class:`~dartree.models.checkpoint.DraftModel` (drafter + correction head + config), or None
            when only the target decodes (plain AR).
        dtype: both models' torch dtype; dtype_note: why (with ``dtype="auto"``: the figures it was chosen by).
        linear: the linear-layer backend the models are packed on (``onednn`` or ``aten``); linear_note: why.
        linear_tuning: {weight shape: row counts that take F.linear} from the tuning ({} without it).
        invariant: the entered :class:`~dartree.models.invariant.row_invariant` mode, or None;
            invariant_note: which and why, one line.
        modes: the ``contextlib.ExitStack`` holding the mode: closing it (:meth:`close`) gives the target back its
            default kernels. A caller that owns a stack of its own enters this one into it.
    """

    target: Target
    draft: DraftModel | None
    dtype: torch.dtype
    dtype_note: str
    linear: str = "aten"
    linear_note: str = ""
    linear_tuning: dict = field(default_factory=dict)
    invariant: row_invariant | None = None
    invariant_note: str = "row-invariant verify: off"
    modes: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def drafter(self):
        """The draft backbone (:class:`~dartree.models.drafter.DFlashDrafter`), or None without a drafter."""
        return None if self.draft is None else self.draft.drafter

    @property
    def head(self):
        """The correction head, or None without a drafter."""
        return None if self.draft is None else self.draft.head

    @property
    def dtype_name(self) -> str:
        """The dtype as the tools name it (``float32``, ``bfloat16``, ``float16``)."""
        return str(self.dtype).replace("torch.", "")

    @property
    def invariant_record(self) -> dict | None:
        """The row-invariant mode as reports keep it: {linear, min_rows, max_rows, why}, or None when it is off."""
        m = self.invariant
        return None if m is None else {"linear": m.linear, "min_rows": m.min_rows, "max_rows": m.max_rows,
                                       "why": m.why}

    def close(self) -> None:
        """Leave the row-invariant mode (if entered): the target's default kernels come back."""
        self.modes.close()


def dtype_plan(requested: str, invariant: str = "auto", *, drafter: bool = True,
               device: str | torch.device = "cpu") -> tuple[list[str], str]:
    """The dtypes :func:`assemble` will build for ``requested``, and why (for a program's header before it loads).

    :func:`dartree.base.dtypes.dtype_candidates`, narrowed to float32 where two candidates could not both be
    exact or timed: ``invariant="off"`` (bfloat16 would be inexact) or no drafter (nothing to time a round with).

    Args:
        requested: ``auto`` or a name of :data:`dartree.base.dtypes.DTYPES`.
        invariant: ``auto``, ``on`` or ``off`` (:func:`~dartree.models.invariant.enter_invariant`).
        drafter: whether a drafter will be assembled.
        device: where the models decode.
    Returns:
        ([dtype name, ...] in order of preference on a tie, reason).
    Raises:
        ValueError: an unknown dtype name or invariant choice (named).
    """
    names, note = dtype_candidates(requested, str(torch.device(device)))
    if invariant not in INVARIANT_CHOICES:
        raise ValueError(f"invariant must be one of {', '.join(INVARIANT_CHOICES)}, got {invariant!r}")
    if len(names) > 1 and (invariant == "off" or not drafter):
        names = ["float32"]
        note += ("; --invariant off leaves bfloat16 inexact, so float32" if invariant == "off" else
                 "; AR only: no drafter to time a round with, so float32, the exact mode")
    return names, note


def _rows_text(rows: list[int]) -> str:
    """Row counts as ranges: [1, 2, 3, 9] -> "1-3, 9"; [] -> "none"."""
    if not rows:
        return "none"
    parts, lo = [], rows[0]
    for a, b in zip(rows, rows[1:] + [None]):
        if b != a + 1:
            parts.append(str(lo) if lo == a else f"{lo}-{a}")
            lo = b
    return ", ".join(parts)


def _say(log: Callable[[str], None] | None, line: str) -> None:
    if log is not None:
        log(line)


def _build(drafter, target, dtype: torch.dtype, linear: str, tune: bool, device: torch.device, log,
           check_target=None, check_models=None) -> Assembly:
    """Steps 1-3 of the module docstring for one dtype (no mode entered yet); the checks run where named."""
    try:
        tgt = load_target(str(target), dtype=dtype)
    except (OSError, RuntimeError, ValueError) as exc:
        raise TargetLoadError(target, (str(exc).strip().splitlines() or [type(exc).__name__])[0]) from None
    if device.type != "cpu":
        tgt.model.to(device)
    if check_target is not None:
        check_target(tgt)
    draft = load_dartree(drafter, target=tgt, dtype=dtype, device=device) if drafter is not None else None
    if draft is not None:
        tgt.set_layer_ids(draft.drafter.cfg.target_layer_ids)
    if check_models is not None:
        check_models(tgt, draft)
    backend, why = choose_linear(linear, dtype, tgt.device)
    ours = (tgt.model, *((draft.drafter, draft.head) if draft is not None else ()))
    for module in ours:
        pack_linears(module, backend)
    _say(log, f"linear layers: {backend}; {why}")
    tuning = {}
    if backend == "onednn" and tune:  # per weight shape, the row counts at which F.linear beats the packed call here
        t0 = time.time()
        tuning = tune_linears(*ours)
        _say(log, f"linear paths tuned in {time.time() - t0:.1f}s; F.linear wins at rows: "
             + "; ".join(f"{k}: {_rows_text(v)}" for k, v in tuning.items()))
    return Assembly(tgt, draft, dtype, "", linear=backend, linear_note=why, linear_tuning=tuning)


def _default_calibration_ids(target: Target) -> list[int]:
    """:data:`CALIBRATION_PROMPT` through the target's chat template, or ids 2..33 for a target without a tokenizer."""
    if target.tokenizer is None:
        return list(range(2, 34))
    return chat_prompt_ids(target.tokenizer, CALIBRATION_PROMPT)


def assemble(drafter: str | os.PathLike | None, target: str | os.PathLike = DEFAULT_TARGET, *,
             dtype: str = "auto", linear: str = "auto", invariant: str = "auto", tune: bool = False,
             device: str | torch.device = "cpu",
             calibration_ids: Callable[[Target], list[int]] | None = None,
             check_target: Callable[[Target], None] | None = None,
             check_models: Callable[[Target, DraftModel | None], None] | None = None,
             log: Callable[[str], None] | None = None) -> Assembly:
    """Build a target and a drafter for decoding, in the dtype, matmul path and row-invariant mode asked for (the
    module docstring: the steps and who passes what).

    Args:
        drafter: a dartree checkpoint folder, or None for the target alone (plain AR).
        target: ``smollm2`` (the packaged default), ``tiny-qwen3`` or a local Hugging Face folder.
        dtype: ``auto`` or ``float32`` / ``bfloat16`` / ``float16`` (:func:`dtype_plan`).
        linear: ``auto``, ``onednn`` or ``aten`` (:func:`~dartree.models.packed.choose_linear`).
        invariant: ``auto``, ``on`` or ``off`` (:func:`~dartree.models.invariant.enter_invariant`); with two dtype
            candidates, one whose mode cannot be entered under ``on`` is not a candidate, nor is bfloat16 without it.
        tune: with the onednn path, time F.linear against the packed call per weight shape and row count and take
            the faster (a few seconds).
        device: where the models decode (``cpu`` or ``cuda``).
        calibration_ids: target -> the token ids two dtype candidates are timed on (default:
            :data:`CALIBRATION_PROMPT` through the target's chat template).
        check_target: called with the first candidate's target as soon as it loads, before the drafter: a caller's
            own checks of it (e.g. eval's sampling settings and chat template); what it raises propagates.
        check_models: called with the first candidate's target and drafter (None without one) before any packing or
            timing (e.g. eval's prompts against the context); what it raises propagates.
        log: called with each line worth printing as it happens (the matmul path, the tuning, each candidate's
            row-invariant note); None prints nothing.
    Returns:
        :class:`Assembly`, its mode entered in its ``modes``.
    Raises:
        TargetLoadError: the target does not load (its reason).
        dartree.models.checkpoint.CheckpointError: the drafter folder is not a dartree checkpoint or does not fit
            the target (named).
        ModeUnavailable: ``invariant="on"`` where no candidate has a row-invariant path here (the reason).
        ValueError: an unknown dtype, linear backend or invariant choice, or ``linear="onednn"`` where it cannot run
            (the fix named).
    """
    names, note = dtype_plan(dtype, invariant, drafter=drafter is not None, device=device)
    device = torch.device(device)
    built: dict[str, Assembly] = {}
    excluded: dict[str, str] = {}
    try:
        for i, name in enumerate(names):
            first = i == 0  # the first candidate vets the target, checkpoint and inputs; the others only change dtype
            asm = _build(drafter, target, DTYPES[name], linear, tune, device, log,
                         check_target if first else None, check_models if first else None)
            try:
                asm.invariant, asm.invariant_note = enter_invariant(invariant, asm.target, asm.modes)
            except ValueError as exc:  # invariant="on" without a path: a candidate less, unless it was the only one
                if len(names) == 1:
                    raise ModeUnavailable(str(exc)) from None
                excluded[name] = str(exc)
                continue
            _say(log, asm.invariant_note)
            if len(names) > 1 and name != "float32" and asm.invariant is None:  # bf16 without the mode is not exact
                excluded[name] = "no row-invariant path here, so its outputs may split from AR at near-ties"
                asm.close()
                continue
            built[name] = asm
        if not built:
            raise ModeUnavailable("; ".join(f"{k}: {v}" for k, v in excluded.items()))
        best, best_note = _choose(built, excluded, note, calibration_ids or _default_calibration_ids)
    except BaseException:
        for asm in built.values():
            asm.close()
        raise
    for asm in built.values():
        if asm is not best:
            asm.close()
    best.dtype_note = best_note
    return best


def _choose(built: dict[str, Assembly], excluded: dict[str, str], note: str, calibration_ids) -> tuple[Assembly, str]:
    """(the one candidate, or the fastest of several timed interleaved; the dtype note: ``note``, with what was
    excluded, or the timed figures of every candidate)."""
    first = next(iter(built.values()))
    if len(built) == 1:
        if excluded:
            note += f"; only {first.dtype_name} is exact here: " + "; ".join(f"{k} ({v})" for k, v in excluded.items())
        return first, note
    t0 = time.time()
    costs = time_modes({a.dtype: (a.target, a.drafter) for a in built.values()}, calibration_ids(first.target))
    choice = pick_dtype(costs, *drafter_tau(first.draft.config), excluded=excluded)
    best = next(a for a in built.values() if a.dtype == choice.dtype)
    return best, f"{choice.reason} (timed in {time.time() - t0:.1f}s)"

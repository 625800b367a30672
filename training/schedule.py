"""The run's schedule: how many optimiser steps it plans and where they sit in the lineage of runs that continue one
another's weights (:func:`plan_schedule`), and the learning-rate factor over them (:class:`WarmupCosine`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dartree.training.checks import RecipeError
from dartree.training.recipe import TrainSection


class WarmupCosine:
    """Learning-rate factor: linear warm-up over ``warm`` steps, then cosine to 5% at ``total`` steps; with a
    wall-clock cap of ``cap_s`` seconds the decay follows whichever of steps or time is further along, so a capped
    run still ends annealed. Call :meth:`start` when the timed training begins.

    ``offset`` (``train.schedule_from_init``): the run's step 0 is the lineage's step ``offset`` (``warm`` and
    ``total`` count lineage steps), so a run continued from an earlier run's weights does not warm up again; under
    the cap the time-driven decay runs from the lineage's progress at ``offset`` to the floor over this run's cap.
    With ``offset`` 0 it is the single-run schedule. ``constant`` (``train.lr_schedule=constant``) keeps the factor
    at 1 after the warm-up: SpecForge's DSpark recipe notes (``docs/dspark_draft_backbone_recipe.md`` in its
    repository) found a constant learning rate better than cosine.
    """

    def __init__(self, warm: int, total: int, cap_s: float, offset: int = 0, constant: bool = False):
        self.warm, self.total, self.cap_s, self.offset = warm, total, cap_s, int(offset)
        self.constant = bool(constant)
        self.t0 = time.time()

    def start(self) -> None:
        """Start the wall clock the cap is measured on."""
        self.t0 = time.time()

    def progress(self, lineage_step: int) -> float:
        """The cosine's progress in [0, 1] at ``lineage_step`` by steps alone (0 during the warm-up)."""
        return min(1.0, max(0.0, (lineage_step - self.warm) / max(1, self.total - self.warm)))

    def __call__(self, step: int) -> float:
        step = step + getattr(self, "offset", 0)  # a scheduler state saved before the offset existed has none
        if step < self.warm:
            return (step + 1) / self.warm
        if getattr(self, "constant", False):
            return 1.0
        prog = (step - self.warm) / max(1, self.total - self.warm)
        if self.cap_s:
            p0 = self.progress(getattr(self, "offset", 0))
            prog = max(prog, p0 + (1 - p0) * (time.time() - self.t0) / self.cap_s)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))


@dataclass
class Schedule:
    """A run's steps (:func:`plan_schedule`).

    Attributes:
        seqs_per_step: sequences per optimiser step (``train.seqs_per_step``).
        total: the run's planned optimiser steps. cap_s: the wall-clock cap in seconds (0: none).
        step0: the lineage step this run starts at. horizon: the schedule's length in lineage steps (Domino's lambda
            follows it too). lr: the learning-rate factor.
    """

    seqs_per_step: int
    total: int
    cap_s: float
    step0: int
    horizon: int
    lr: WarmupCosine


def plan_schedule(train: TrainSection, sequences: int, lineage: dict, *, cursor_from_init: bool, init_from: str | None,
                  log: Callable[[str], None] = print) -> Schedule:
    """The schedule of a run of ``sequences`` training sequences under the ``train`` section.

    The run plans ``train.max_steps`` steps, else ``train.epochs`` passes. Its lineage step starts at 0 and the
    schedule spans the run's steps, unless it continues init_from's run (``data.cursor_from_init`` or
    ``train.schedule_from_init``, with a checkpoint whose ``lineage`` record holds its steps): it then starts at the
    step that lineage reached (its anchors are drawn per lineage step, as one long run's would be); with
    ``train.schedule_from_init`` the schedule starts there too (offset) and spans that plus this run's steps;
    ``train.schedule_steps`` > 0 sets the span.

    Args:
        lineage: what init_from's run recorded (:func:`~dartree.training.cursor.lineage_record`; {} for none).
        cursor_from_init: ``data.cursor_from_init``. init_from: the checkpoint, for messages. log: prints a line.
    """
    sps = train.seqs_per_step
    per_epoch = math.ceil(sequences / sps)
    total = train.max_steps or max(1, math.ceil(train.epochs * per_epoch))
    sched = bool(train.schedule_from_init)
    step0 = lineage["steps"] if (sched or cursor_from_init) and "steps" in lineage else 0
    if sched and "steps" in lineage:
        log(f"train.schedule_from_init: {init_from}'s lineage reached step {step0}; this run's schedule continues "
            "from there")
    elif sched:
        log(f"train.schedule_from_init: {init_from} records no lineage (a published or older checkpoint, or one "
            "converted before the converter carried the record); the schedule starts at step 0")
    offset = step0 if sched else 0
    horizon = int(train.schedule_steps or 0) or offset + total
    lr = WarmupCosine(max(1, int(train.warmup_ratio * horizon)), horizon, train.max_minutes * 60, offset=offset,
                      constant=train.lr_schedule == "constant")
    return Schedule(sps, total, train.max_minutes * 60, step0, horizon, lr)


def check_resume_length(saved_step: int, total: int, train: TrainSection, out_dir: Path) -> None:
    """Refuse to resume a state saved at a step past this run's last step: the loop would not run, and the longer
    run's weights would be written and reported as this run's.

    Args:
        saved_step: the step the resumable state was saved at. total: this run's planned steps. train: the run's
            ``train`` section (the setting that gave ``total``).
    Raises:
        RecipeError: one line naming both steps, the setting that gave ``total`` and the fix.
    """
    if saved_step <= total:
        return
    why = (f"train.max_steps={train.max_steps}" if train.max_steps
           else f"train.epochs={train.epochs} gives {total} steps")
    raise RecipeError(f"resume=true: {out_dir / 'resume'} was saved at step {saved_step} but this run ends at step "
                      f"{total} ({why}); resuming would report the longer run as this one: set train.max_steps to "
                      f"{saved_step} or more, or use a new output_dir")

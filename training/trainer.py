"""The training loop as named stages over one state: :class:`Trainer` sets a run up from its typed settings
(:class:`~dartree.training.settings.RunSettings`, built once from the recipe by :func:`run`: target, drafter and head,
data, optimiser, schedule and engine, resumed state), :meth:`Trainer.train_step` runs one optimiser step,
:meth:`Trainer.after_step` logs, evaluates and saves, and :meth:`Trainer.finish` writes the checkpoint and summary.

Every rank runs the same code; rank 0 writes files. Anchors are drawn per (seed, step, sequence)
(:func:`~dartree.training.step.seed_mix`) and the batches come from a data cursor whose position is saved
(:class:`~dartree.training.cursor.DataCursor`), so a resumed run, or one on another number of processes or another
device, sees the same batches and anchors; with ``data.cursor_from_init`` / ``train.schedule_from_init`` a new run
continued from an earlier run's checkpoint takes that run's data position / learning-rate schedule on
(:func:`~dartree.training.schedule.plan_schedule`).

The device is ``train.device`` (:func:`~dartree.training.settings.training_device`): the target, the drafter and
head, the online features and every step tensor live there, and the step's loss terms are summed there, so a CUDA
step waits for the device once (its logged losses), not once per sequence. With one process there is no collective.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dartree.training.build import choose_draft_vocabulary, load_run_data, load_run_models, save_training_checkpoint
from dartree.training.checks import check_data_files, check_output_dir
from dartree.training.cursor import lineage_record, run_cursor
from dartree.training.engine import (check_resumable, check_resume_world, collective, full_state_dict, gathered,
                                     init_distributed, load_resume, process_group_scope, save_resume, training_engine)
from dartree.training.losses import teacher_forced_tau
from dartree.training.recipe import RecipeError
from dartree.training.run_state import TrainState, online_costs, wandb_run, write_curve, write_reports
from dartree.training.schedule import check_resume_length, plan_schedule
from dartree.training.settings import RunSettings, run_settings, training_device
from dartree.training.step import TrainModule, evaluate_holdout, seed_mix, sequence_weight


class Trainer:
    """One training run on this process (every rank builds one), from its :class:`RunSettings`
    (:func:`~dartree.training.settings.run_settings` of a recipe from :func:`~dartree.training.recipe.load_recipe`).
    Call :meth:`fit` (or :meth:`train_step` and :meth:`after_step` in a loop of your own), then :meth:`finish`.

    Raises:
        RecipeError: the recipe, the target, ``init_from``, the data or a resumable state does not fit; one line.
    """

    def __init__(self, run: RunSettings):
        self.run, tr, self.t_start = run, run.train, time.time()
        check_output_dir(run.output_dir)
        check_data_files(run.data)  # committed data intact, before the target loads
        self.device = training_device(tr.device)
        try:
            self.rank, self.world = init_distributed(self.device, tr.engine)
        except RuntimeError as exc:  # DeepSpeed missing, or bound to another device: the fix is a recipe value
            raise RecipeError(str(exc).splitlines()[0]) from None
        self.main, self.out_dir = self.rank == 0, Path(run.output_dir)
        if tr.threads:
            torch.set_num_threads(tr.threads)
        if tr.seqs_per_step % self.world:
            raise RecipeError(f"train.seqs_per_step={tr.seqs_per_step} must be a multiple of the number of "
                              f"processes ({self.world})")
        if run.resume:  # before any work: a saved state this run cannot continue is refused by name
            try:
                check_resumable(self.out_dir, run.recipe)
                check_resume_world(self.out_dir, self.world)
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        torch.manual_seed(run.seed)
        self.settings, self.objective = run.step, run.step.objective  # every step function receives these
        # what init_from's run recorded of its lineage (steps, data cursor); {} for a checkpoint without a record
        self.lineage = lineage_record(run.init_from)
        self.target, self.drafter, self.head = load_run_models(run, self.device, self.log)
        self.data, self.data_s = load_run_data(run, self.target, self.main, self.log)
        if self.drafter.cfg.draft_vocab_size:
            choose_draft_vocabulary(run, self.target, self.drafter, self.data, self.main, self.log)
        self._build_engine()
        self.state = TrainState(lineage_step0=self.step0)
        if run.resume:
            self._resume()
        self.cursor = run_cursor(self.data, run.seed, resumed=(self.state.step, self.state.cursor) if run.resume
                                 else None, lineage=self.lineage if run.cursor_from_init else None,
                                 seqs_per_step=self.sps, init_from=run.init_from, log=self.log)
        self.wb = wandb_run(run, self.out_dir, self.main)

    def log(self, msg: str) -> None:
        """Print ``msg`` on rank 0."""
        if self.main:
            print(msg, flush=True)

    def _build_engine(self) -> None:
        """The optimiser (torch's fused AdamW: one kernel per parameter, CPU and CUDA, fp32), the schedule
        (:func:`~dartree.training.schedule.plan_schedule`) and the engine of ``train.engine``."""
        run, tr = self.run, self.run.train
        if run.freeze_backbone:
            self.drafter.requires_grad_(False)
        self.module = TrainModule(self.drafter, self.head)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if not self.params:
            raise RecipeError("nothing to train: freeze_backbone=true with an identity head (use a DSpark or Domino "
                              "head)")
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in self.params)
        opt = torch.optim.AdamW(self.params, lr=tr.lr, weight_decay=tr.weight_decay, betas=(0.9, 0.95), fused=fused)
        sch = plan_schedule(tr, len(self.data), self.lineage, cursor_from_init=run.cursor_from_init,
                            init_from=run.init_from, log=self.log)
        self.sps, self.total, self.cap_s, self.step0, self.horizon = (sch.seqs_per_step, sch.total, sch.cap_s,
                                                                      sch.step0, sch.horizon)
        self.lr, self.stage = sch.lr, run.zero_stage
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr)
        self.engine = training_engine(tr.engine, self.module, opt, self.sched, grad_accum=self.sps // self.world,
                                      grad_clip=tr.grad_clip, zero_stage=self.stage)

    def _resume(self) -> None:
        client = load_resume(self.engine, self.out_dir)
        if client is None:
            self.log(f"resume=true but {self.out_dir / 'resume'} holds no state: starting from step 0")
            return
        self.state = TrainState.from_client(client)
        # the run's own start, whatever init_from's folder holds now (the scheduler state restores the same offset)
        self.step0 = self.state.lineage_step0
        self.lr.offset = self.step0 if self.run.train.schedule_from_init else 0
        if self.state.acc_ema is not None:  # the client state holds plain lists; the EMA lives on the device
            self.state.acc_ema = self.state.acc_ema.to(self.device)
        check_resume_length(self.state.step, self.total, self.run.train, self.out_dir)
        self.log(f"resumed {self.out_dir / 'resume'} at step {self.state.step}/{self.total}")

    def _anchor_gen(self, step: int, i: int) -> torch.Generator:
        """The anchor RNG of sequence i at this run's ``step`` (seeded by the lineage step: the run's own step
        unless it continues an earlier run's)."""
        return torch.Generator().manual_seed(seed_mix(self.run.seed, self.step0 + step, i))

    def _batch_denominator(self, step: int, mine: list[int]) -> float | None:
        """``loss.normalization=batch`` (SpecForge's pooled loss): the step's decay-weight sum over every process
        divided by ``seqs_per_step``; DeepSpeed then averages micro-steps and ranks into sum / sum. None otherwise."""
        if not self.run.batch_loss:
            return None
        p = self.drafter.cfg.num_proposals
        wsum = torch.tensor([sum(sequence_weight(self.data, i, self.settings, p, self._anchor_gen(step, i))
                                 for i in mine)], dtype=torch.float64)
        return max(float(collective(wsum, dist.all_reduce, self.world, self.device)), 1e-8) / self.sps

    def train_step(self) -> dict:
        """One optimiser step over this rank's share of the step's batch (the next ``seqs_per_step`` sequences of
        the data cursor); returns the step's mean loss terms (``loss``, ``ce``, ``l1``, ``bce``, ``kl``, averaged over
        all processes), the curriculum weight ``lam`` of an objective with one (Domino's; 0.0 otherwise) and ``lr``."""
        st = self.state
        # a curriculum (Domino's lambda) follows the lineage's schedule: with train.schedule_from_init the run's step
        # 0 is the lineage's step offset, and the span is the lineage's (offset 0, span = this run's steps otherwise)
        lineage_step = st.step + getattr(self.lr, "offset", 0)
        lam = (self.objective.lam(lineage_step, self.horizon) if self.objective.curriculum is not None else 0.0)
        lr = float(self.sched.get_last_lr()[0])  # the rate this step's optimiser update uses
        batch = self.cursor.take(self.sps)
        st.cursor = self.cursor.state()
        st.seen.update(batch)
        st.seen_tokens += self.data.num_tokens(batch)
        mine = batch[self.rank::self.world]
        denom = self._batch_denominator(st.step, mine)
        sums = torch.zeros(6, device=self.device)  # loss, ce, l1, bce, kl, predictions: summed on the device
        for i in mine:
            out = self.engine(self.target, self.data, i, self.settings, self._anchor_gen(st.step, i), lam, denom,
                              (lineage_step, self.horizon))
            if out is None:  # pragma: no cover - BlockData keeps only sequences with anchors
                self.engine.backward(sum(p.sum() for p in self.params) * 0.0)
                self.engine.step()
                continue
            loss, o_ce, o_l1, o_bce, o_acc, o_cnt, o_kl = out
            self.engine.backward(loss)
            self.engine.step()
            # no host sync per sequence: the pieces are rounded to fp32 and summed where they are
            sums += torch.stack([t.detach().to(torch.float32) for t in (loss, o_ce, o_l1, o_bce, o_kl, o_cnt.sum())])
            st.acc_ema = o_acc if st.acc_ema is None else 0.9 * st.acc_ema + 0.1 * o_acc
        sums = collective(sums, dist.all_reduce, self.world, self.device)
        *means, preds = torch.cat([sums[:5] / self.sps, sums[5:]]).tolist()  # the step's one wait on the device
        tot, ce, l1, bce, kl = means
        st.preds += int(preds)
        st.step += 1
        st.losses.append(round(tot, 6))
        st.lrs.append(float(f"{lr:.8g}"))
        return {"loss": tot, "ce": ce, "l1": l1, "bce": bce, "kl": kl, "lam": lam, "lr": lr}

    def _report(self, m: dict) -> None:
        st = self.state
        tf_tau = teacher_forced_tau(st.acc_ema) if st.acc_ema is not None else 1.0
        rate = (st.preds - self.preds0) / max(time.time() - self.t_steps0, 1e-9)
        post = {"loss": f"{m['loss']:.4f}", "ce": f"{m['ce']:.3f}", "tf_tau": f"{tf_tau:.2f}", "pred_s": f"{rate:.0f}"}
        for name in self.objective.logged:  # the family's own terms (l1, kl, lam)
            post[name] = f"{m[name]:.2f}" if name == "lam" else f"{m[name]:.3f}"
        self.bar.set_postfix(**post)
        self.bar.update(1)
        if self.wb is not None:
            self.wb.log({**m, "lr": self.sched.get_last_lr()[0], "tf_tau": tf_tau}, step=st.step)

    def evaluate(self) -> dict:
        """Held-out evaluation (:func:`~dartree.training.step.evaluate_holdout`) with the full weights; adds a
        learning-curve point and, on rank 0, writes curve.json and curve.png."""
        self.engine.eval()
        with gathered(self.module, self.stage):
            hold = evaluate_holdout(self.drafter, self.head, self.target, self.data, self.settings)
        self.engine.train()
        self.state.add_point(hold, self.sps)
        if hold and self.main:
            write_curve(self.out_dir, self.state.curve, self.run.name)
        return hold

    def save(self) -> None:
        """Save the resumable state (engine, optimiser, :class:`TrainState`) under ``<output_dir>/resume``."""
        save_resume(self.engine, self.out_dir, self.state.to_client(), self.run.recipe)
        self.last_save = time.time()

    def after_step(self) -> bool:
        """Log the step, then evaluate and save when due; returns True when the wall-clock cap
        (``train.max_minutes``) ends the run. Rank 0's clock decides for every rank."""
        tr, step = self.run.train, self.state.step
        flags = torch.tensor([
            float(bool(tr.max_minutes) and time.time() - self.lr.t0 > self.cap_s),
            float(bool(tr.save_every_minutes) and time.time() - self.last_save > tr.save_every_minutes * 60),
        ])
        capped, due = (bool(f) for f in collective(flags, lambda x: dist.broadcast(x, 0), self.world, self.device))
        if tr.eval_every_steps and step % tr.eval_every_steps == 0 and step < self.total:
            self.evaluate()
        if (due or (tr.save_every_steps and step % tr.save_every_steps == 0)) and step < self.total and not capped:
            self.save()
        return capped

    def fit(self) -> None:
        """Train until the planned steps (``train.max_steps`` or ``train.epochs``) or the wall-clock cap."""
        self.engine.train()
        self.lr.start()
        self.t_steps0 = self.last_save = time.time()
        self.preds0, self.stopped_early = self.state.preds, False
        self.bar = tqdm(total=self.total, initial=self.state.step, desc=f"train {self.run.name}", unit="step",
                        disable=not self.main)
        while self.state.step < self.total:
            self._report(self.train_step())
            if self.after_step():
                self.stopped_early = True
                break
        self.bar.close()
        self.train_s = time.time() - self.lr.t0

    def summary(self, hold: dict, param_checksum: float) -> dict:
        """The run's summary (summary.json): steps, losses, data, speed, memory, learning curve, held-out result."""
        st, data = self.state, self.data
        return {
            "recipe": self.run.name, "steps": st.step, "total_steps_planned": self.total,
            "stopped_by_time_cap": self.stopped_early, "final_loss": st.losses[-1] if st.losses else None,
            "losses": st.losses, "processes": self.world, "zero_stage": self.stage, "train_sequences": len(data),
            "train_tokens": data.num_tokens(), "predictions": st.preds,
            "predictions_per_s": (st.preds - self.preds0) / max(self.train_s, 1e-9),
            "train_tf_tau": teacher_forced_tau(st.acc_ema) if st.acc_ema is not None else None,
            "train_acc_per_pos": None if st.acc_ema is None else [round(float(x), 4) for x in st.acc_ema],
            "data_prep_min": self.data_s / 60, "train_min": self.train_s / 60,
            "wall_min": (time.time() - self.t_start) / 60,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            "curve": st.curve, "param_checksum": param_checksum, **hold,
            "lrs": st.lrs,
            # what a run continued from this checkpoint reads (data.cursor_from_init, train.schedule_from_init)
            "lineage": {"step0": st.lineage_step0, "steps": st.lineage_step0 + st.step,
                        "schedule_steps": self.lr.total},
            "cursor": self.cursor.state(),
            **online_costs(data),
        }

    def finish(self) -> dict:
        """Save the resumable state, evaluate the final weights, and on rank 0 write the checkpoint
        (``<output_dir>/checkpoint``, :func:`~dartree.training.build.save_training_checkpoint`), summary.json,
        acceptance.json, curve.json and curve.png; returns the summary."""
        self.save()
        self.engine.eval()
        with gathered(self.module, self.stage):
            hold = evaluate_holdout(self.drafter, self.head, self.target, self.data, self.settings)
        self.state.add_point(hold, self.sps)
        sds = full_state_dict(self.drafter, self.stage), full_state_dict(self.head, self.stage)
        checksum = float(sum(v.double().sum() for sd in sds for v in sd.values()))
        s = self.summary(hold, checksum)
        if self.main:
            save_training_checkpoint(self.out_dir / "checkpoint", self.drafter, self.head, self.target,
                                     self.run.recipe, s, state_dicts=sds)
            write_reports(self.out_dir, s, self.state.curve, self.run.name)
        if self.wb is not None:
            self.wb.finish()
        print(f"[rank {self.rank}/{self.world}] done: {s['steps']} steps, final loss {s['final_loss']}, held-out "
              f"teacher-forced tau {s.get('holdout_tf_tau', float('nan')):.3f}; {s['predictions_per_s']:.0f} "
              f"predictions/s; wall time {s['wall_min']:.1f} min (data {s['data_prep_min']:.1f}, train "
              f"{s['train_min']:.1f}); peak memory {s['peak_rss_gib']:.2f} GiB; param checksum {checksum:.6f}"
              + (f"; checkpoint {self.out_dir / 'checkpoint'}" if self.main else ""), flush=True)
        return s


def run(cfg: DictConfig) -> dict:
    """Run a recipe end to end on every rank: its typed settings built once (:func:`run_settings`), then
    :class:`Trainer`; returns the summary dict (rank 0 also writes ``<output_dir>/summary.json``,
    ``acceptance.json``, the learning curve and the checkpoint).

    Raises:
        RecipeError: the recipe, target, data or a resumable state does not fit (one line).
    """
    trainer = Trainer(run_settings(cfg))
    trainer.fit()
    return trainer.finish()


def train_recipe(cfg: DictConfig) -> dict:
    """Train from a merged recipe (:func:`~dartree.training.recipe.load_recipe`) as the train command does: print the
    recipe on rank 0, then :func:`run` inside :func:`~dartree.training.engine.process_group_scope`, which tears down
    the process group this call created (gloo/shm teardown at exit can abort) and every other process-wide setting,
    so it can run again in the same process. The train command and the campaign's training stage call it.

    Returns:
        the summary dict of :func:`run`.
    Raises:
        RecipeError: the recipe, target, data or a resumable state does not fit (one line).
    """
    if os.environ.get("RANK", "0") == "0":
        print(OmegaConf.to_yaml(cfg), flush=True)
    with process_group_scope():
        return run(cfg)

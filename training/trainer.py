"""The training loop as named stages over one state: :class:`Trainer` sets a run up (target, drafter and head, data,
optimiser and engine, resumed state), :meth:`Trainer.train_step` runs one optimiser step,
:meth:`Trainer.after_step` logs, evaluates and saves, and :meth:`Trainer.finish` writes the checkpoint and summary.

Every rank runs the same code; rank 0 writes files. Anchors are drawn per (seed, step, sequence)
(:func:`~dartree.training.step.seed_mix`) and the batches come from a data cursor whose position is saved
(:class:`~dartree.training.cursor.DataCursor`), so a resumed run, or one on another number of processes or another
device, sees the same batches and anchors; with ``data.cursor_from_init`` / ``train.schedule_from_init`` a new run
continued from an earlier run's checkpoint takes that run's data position / learning-rate schedule on.

The device is ``train.device`` (:func:`~dartree.training.build.training_device`): the target, the drafter and head,
the online features and every step tensor live there, and the step's loss terms are summed there, so a CUDA step
waits for the device once (its logged losses), not once per sequence. With one process there is no collective.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from dartree.base.files import write_file_atomically
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.training.build import (
    build_models,
    data_settings,
    init_settings,
    load_init,
    load_recipe_target,
    parse_recipe_dtype,
    prepare_data,
    save_training_checkpoint,
    step_settings,
    training_device,
)
from dartree.training.checks import check_against_target, check_data_files, check_output_dir, check_recipe
from dartree.training.cursor import DataCursor, data_fingerprint, lineage_record
from dartree.base.figures import plot_curve_file
from dartree.training.data import select_draft_vocab
from dartree.training.features import target_lse
from dartree.training.engine import (
    check_resumable,
    check_resume_world,
    ds_config,
    full_state_dict,
    gathered,
    init_distributed,
    load_resume,
    make_engine,
    process_group_scope,
    save_resume,
)
from dartree.training.losses import teacher_forced_tau
from dartree.training.recipe import RecipeError
from dartree.training.step import TrainModule, evaluate_holdout, seed_mix, sequence_weight
from dartree.training.torch_engine import TorchEngine


def write_json(path: Path, payload) -> None:
    """Write ``payload`` as indented JSON to ``path`` atomically (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, json.dumps(payload, indent=1))


@dataclass
class TrainState:
    """What a resumed run continues from (saved with the engine's state as DeepSpeed client state).

    Attributes:
        step: optimiser steps done. losses: the mean loss of each step. preds: supervised predictions trained on.
        acc_ema: [P] EMA of the per-position training accuracy, or None before the first step.
        curve: learning-curve points (held-out chain tau against training tokens and sequences).
        seen: distinct training sequences visited. seen_tokens: tokens of the sequences visited (with repeats).
        cursor: the data cursor's position (:meth:`~dartree.training.cursor.DataCursor.state`), None before the
            first step (or in a state saved before the cursor existed: replayed from ``step``).
        lineage_step0: the lineage step this run started at (0 unless it continues init_from's run:
            ``data.cursor_from_init`` or ``train.schedule_from_init``).
        lrs: the learning rate of each step.
    """

    step: int = 0
    losses: list[float] = field(default_factory=list)
    preds: int = 0
    acc_ema: torch.Tensor | None = None
    curve: list[dict] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    seen_tokens: int = 0
    cursor: dict | None = None
    lineage_step0: int = 0
    lrs: list[float] = field(default_factory=list)

    def to_client(self) -> dict:
        """The JSON-able client state DeepSpeed saves beside the engine."""
        return {"step": self.step, "losses": self.losses, "preds": self.preds,
                "acc_ema": None if self.acc_ema is None else self.acc_ema.tolist(),
                "curve": self.curve, "seen": sorted(self.seen), "seen_tokens": self.seen_tokens,
                "cursor": self.cursor, "lineage_step0": self.lineage_step0, "lrs": self.lrs}

    @classmethod
    def from_client(cls, client: dict) -> "TrainState":
        """The state :meth:`to_client` saved (fields added since read as their defaults)."""
        acc = client.get("acc_ema")
        return cls(step=int(client["step"]), losses=list(client["losses"]), preds=int(client.get("preds", 0)),
                   acc_ema=None if acc is None else torch.tensor(acc), curve=list(client.get("curve", [])),
                   seen=set(client.get("seen", [])), seen_tokens=int(client.get("seen_tokens", 0)),
                   cursor=client.get("cursor"), lineage_step0=int(client.get("lineage_step0", 0)),
                   lrs=list(client.get("lrs", [])))

    def add_point(self, hold: dict, seqs_per_step: int) -> None:
        """Append a learning-curve point for the held-out result ``hold`` at this step (once per step), with the
        mean training loss since the previous point."""
        if not hold or (self.curve and self.curve[-1]["step"] == self.step):
            return
        since = self.losses[(self.curve[-1]["step"] if self.curve else 0):self.step]
        self.curve.append({"step": self.step, "train_tokens": self.seen_tokens, "sequences": self.step * seqs_per_step,
                           "distinct_sequences": len(self.seen),
                           "holdout_chain_tau": round(hold["holdout_chain_tau"], 4),
                           "holdout_tf_tau": round(hold["holdout_tf_tau"], 4),
                           **({"train_loss": round(sum(since) / len(since), 4)} if since else {})})


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


class Trainer:
    """One training run of a recipe on this process (every rank builds one).

    Build it with the recipe (:func:`~dartree.training.recipe.load_recipe`), then call :meth:`fit` (or
    :meth:`train_step` and :meth:`after_step` in a loop of your own) and :meth:`finish`.

    Raises:
        RecipeError: the recipe, the target, ``init_from``, the data or a resumable state does not fit; one line.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.t_start = time.time()
        check_recipe(cfg)  # also here: a config built or edited in Python after load_recipe
        check_output_dir(cfg.output_dir)
        check_data_files(cfg)  # committed data intact, before the target loads
        self.device = training_device(cfg)
        self.engine_name = cfg.train.get("engine", "deepspeed")
        try:
            self.rank, self.world = init_distributed(self.device, self.engine_name)
        except RuntimeError as exc:  # DeepSpeed missing, or bound to another device: the fix is a recipe value
            raise RecipeError(str(exc).splitlines()[0]) from None
        self.main = self.rank == 0
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.seqs_per_step % self.world:
            raise RecipeError(f"train.seqs_per_step={cfg.train.seqs_per_step} must be a multiple of the number of "
                              f"processes ({self.world})")
        self.out_dir = Path(cfg.output_dir)
        if cfg.resume:  # before any work: a saved state this run cannot continue is refused by name
            try:
                check_resumable(self.out_dir, OmegaConf.to_container(cfg))
                check_resume_world(self.out_dir, self.world)
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        torch.manual_seed(cfg.seed)
        # the drafter family's objective and the step options, built once (every step function receives these)
        self.settings = step_settings(cfg)
        self.objective = self.settings.objective
        # what init_from's run recorded of its lineage (steps, data cursor); {} for a checkpoint without a record
        self.lineage = lineage_record(cfg.init_from)
        self._build_models()
        self._build_data()
        self._build_engine()
        self.state = TrainState(lineage_step0=self.step0)
        if cfg.resume:
            self._resume()
        self._build_cursor()
        self.wb = None
        if cfg.wandb.enabled and self.main:
            import wandb

            self.wb = wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, name=cfg.recipe,
                                 config=OmegaConf.to_container(cfg), dir=str(self.out_dir))

    def log(self, msg: str) -> None:
        """Print ``msg`` on rank 0."""
        if self.main:
            print(msg, flush=True)

    # ------------------------------------------------------------------------------------------------ setup

    def _build_models(self) -> None:
        cfg = self.cfg
        # on the training device before build_models / load_init bind its embedding (the gru head keeps a reference)
        self.target = load_recipe_target(cfg.target.path, parse_recipe_dtype(cfg.target.dtype, "target.dtype"),
                                         device=self.device)
        check_against_target(cfg, self.target)  # layer ids, mask id, vocabulary sizes: before the data stage
        if cfg.init_from:  # a checkpoint whose head corrects nothing gets build_models' fresh head
            self.drafter, self.head = load_init(cfg.init_from, self.target, init_settings(cfg),
                                                lambda: build_models(cfg, self.target)[1])
            self.log(f"init_from {cfg.init_from}: {self.drafter.cfg.num_layers}-layer backbone, block "
                     f"{self.drafter.cfg.block_size}, head {self.head.type_name}")
        else:
            self.drafter, self.head = build_models(cfg, self.target)
        if self.device.type != "cpu":  # built on the CPU; DeepSpeed would move the module, the torch engine does not
            self.drafter.to(self.device)
            self.head.to(self.device)
        self.target.set_layer_ids(self.drafter.cfg.target_layer_ids)

    def _on_rank0_first(self, fn):
        """``fn()`` on rank 0, then on the other ranks (which read what rank 0 cached)."""
        out = fn() if self.main else None
        dist.barrier()
        return out if self.main else fn()

    def _build_data(self) -> None:
        settings, t0 = data_settings(self.cfg), time.time()
        self.data = self._on_rank0_first(lambda: prepare_data(settings, self.target))
        self.data_s = time.time() - t0
        self.log(f"data: {len(self.data)} training sequences ({self.data.num_tokens()} tokens), "
                 f"{len(self.data.holdout_ids)} held out; prepared in {self.data_s / 60:.1f} min")
        if not len(self.data):
            raise RecipeError("no training sequence has a response token to predict; raise data.max_new_tokens")
        if self.drafter.cfg.draft_vocab_size:
            self._draft_vocabulary()

    def _draft_vocabulary(self) -> None:
        """Choose the draft vocabulary from the data (a fine-tuned drafter keeps its own) and cache the target's
        log-sum-exp beside stored features (online data computes it per sequence)."""
        data = self.data
        if not self.cfg.init_from:
            try:
                ids, cover = select_draft_vocab(data, self.drafter.cfg.draft_vocab_size, self.target.vocab_size,
                                                target_stop_ids(self.target))
            except ValueError as exc:
                raise RecipeError(f"drafter.draft_vocab_size: {exc}") from None
            self.drafter.draft_vocab.copy_(ids)
            self.log(f"draft vocabulary: {ids.numel()} of {self.target.vocab_size} tokens cover {100 * cover:.1f}% "
                     "of the training response tokens")
        if not getattr(data, "online", False):
            data.lse = self._on_rank0_first(lambda: target_lse(self.target, data.features_path))

    def _build_engine(self) -> None:
        cfg = self.cfg
        if cfg.freeze_backbone:
            self.drafter.requires_grad_(False)
        self.module = TrainModule(self.drafter, self.head)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        if not self.params:
            raise RecipeError("nothing to train: freeze_backbone=true with an identity head (use a DSpark or Domino "
                              "head)")
        # torch's fused AdamW: one kernel per parameter (CPU and CUDA, fp32)
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for p in self.params)
        opt = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95),
                                fused=fused)
        self.sps = cfg.train.seqs_per_step
        self.steps_per_epoch = math.ceil(len(self.data) / self.sps)
        self.total = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * self.steps_per_epoch))
        self.cap_s = cfg.train.max_minutes * 60
        self.step0, offset, horizon = self._schedule_span()
        self.horizon = horizon  # the schedule's length in lineage steps (Domino's lambda follows it too)
        self.lr = WarmupCosine(max(1, int(cfg.train.warmup_ratio * horizon)), horizon, self.cap_s, offset=offset,
                               constant=cfg.train.get("lr_schedule", "cosine") == "constant")
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr)
        self.stage = int(cfg.deepspeed.zero_stage)
        if self.engine_name == "torch":
            self.engine = TorchEngine(self.module, opt, self.sched, grad_accum=self.sps // self.world,
                                      grad_clip=cfg.train.grad_clip)
            return
        dsc = ds_config(self.stage, self.sps // self.world, cfg.train.grad_clip)
        dsc["zero_allow_untested_optimizer"] = True
        self.engine = make_engine(self.module, opt, self.sched, dsc)
        if self.stage == 3:  # the heads read their weights functionally (not through a submodule call)
            import deepspeed

            for p in self.head.parameters():
                deepspeed.zero.register_external_parameter(self.module, p)

    def _schedule_span(self) -> tuple[int, int, int]:
        """(the lineage step this run starts at, the schedule's offset, the schedule's length in lineage steps).

        By default (0, 0, this run's planned steps). A run that continues init_from's (``data.cursor_from_init`` or
        ``train.schedule_from_init``, with a checkpoint that records its lineage) starts at the step that lineage
        reached: its anchors are drawn per lineage step, as one long run's would be. With
        ``train.schedule_from_init`` the schedule starts there too (offset), and spans that plus this run's
        steps; ``train.schedule_steps`` > 0 sets the span."""
        tc, dc = self.cfg.train, self.cfg.data
        sched, cursor = bool(tc.get("schedule_from_init", False)), bool(dc.get("cursor_from_init", False))
        step0 = self.lineage["steps"] if (sched or cursor) and "steps" in self.lineage else 0
        if sched and "steps" in self.lineage:
            self.log(f"train.schedule_from_init: {self.cfg.init_from}'s lineage reached step {step0}; this run's "
                     "schedule continues from there")
        elif sched:
            self.log(f"train.schedule_from_init: {self.cfg.init_from} records no lineage (a converted or older "
                     "checkpoint); the schedule starts at step 0")
        offset = step0 if sched else 0
        horizon = int(tc.get("schedule_steps", 0) or 0) or offset + self.total
        return step0, offset, horizon

    def _build_cursor(self) -> None:
        """The data cursor (:class:`~dartree.training.cursor.DataCursor`): a resumed run's from its saved state (a
        state saved before the cursor existed: replayed to its step), else init_from's run's with
        ``data.cursor_from_init`` (refused when that run trained on other sequences), else at the start.

        Raises:
            RecipeError: ``data.cursor_from_init`` and init_from's cursor was made on other data.
        """
        ids, seed, st = self.data.train_ids, self.cfg.seed, self.state
        if self.cfg.resume and st.step:
            self.cursor = DataCursor.from_state(ids, seed, st.cursor)
            if st.cursor is None:  # saved before the cursor: the batches were this order's first steps
                self.cursor.take(st.step * self.sps)
            return
        rec = self.lineage.get("cursor") if self.cfg.data.get("cursor_from_init", False) else None
        if self.cfg.data.get("cursor_from_init", False) and not rec:
            self.log(f"data.cursor_from_init: {self.cfg.init_from} records no data cursor; starting at epoch 0")
        if rec:
            n = int(rec.get("n", 0))
            if n > len(ids) or rec.get("fingerprint") != data_fingerprint(self.data.tokens, ids[:n]):
                raise RecipeError(f"data.cursor_from_init=true: {self.cfg.init_from}'s run visited other training "
                                  f"sequences (its first {n} are not this run's first {min(n, len(ids))}); train on "
                                  "the data it used (shards may be appended), or set data.cursor_from_init=false")
            self.log(f"data.cursor_from_init: continuing at epoch {rec.get('epoch', 0)}, "
                     f"{len(rec.get('done', []))} sequences into it")
        self.cursor = DataCursor.from_state(ids, seed, rec)

    def _resume(self) -> None:
        client = load_resume(self.engine, self.out_dir)
        if client is None:
            self.log(f"resume=true but {self.out_dir / 'resume'} holds no state: starting from step 0")
            return
        self.state = TrainState.from_client(client)
        # the run's own start, whatever init_from's folder holds now (the scheduler state restores the same offset)
        self.step0 = self.state.lineage_step0
        self.lr.offset = self.step0 if self.cfg.train.get("schedule_from_init", False) else 0
        if self.state.acc_ema is not None:  # the client state holds plain lists; the EMA lives on the device
            self.state.acc_ema = self.state.acc_ema.to(self.device)
        check_resume_length(self.state.step, self.total, self.cfg, self.out_dir)
        self.log(f"resumed {self.out_dir / 'resume'} at step {self.state.step}/{self.total}")

    # ------------------------------------------------------------------------------------------------ steps

    def next_batch(self) -> list[int]:
        """The next step's training sequence ids (``seqs_per_step`` of them, DeepSpeed's fixed accumulation) from
        the data cursor: epoch e visits the training sequences in a permutation seeded by (seed, e), every one once
        before any repeats; a batch that an epoch ends inside continues into the next epoch's permutation."""
        batch = self.cursor.take(self.sps)
        self.state.cursor = self.cursor.state()
        return batch

    def _anchor_gen(self, step: int, i: int) -> torch.Generator:
        """The anchor RNG of sequence i at this run's ``step`` (seeded by the lineage step: the run's own step
        unless it continues an earlier run's)."""
        return torch.Generator().manual_seed(seed_mix(self.cfg.seed, self.step0 + step, i))

    def _batch_denominator(self, step: int, mine: list[int]) -> float | None:
        """``loss.normalization=batch`` (SpecForge's pooled loss): the step's decay-weight sum over every process
        divided by ``seqs_per_step``; DeepSpeed then averages micro-steps and ranks into sum / sum. None otherwise."""
        if self.cfg.loss.get("normalization", "per_sequence") != "batch":
            return None
        p = self.drafter.cfg.num_proposals
        wsum = torch.tensor([sum(sequence_weight(self.data, i, self.settings, p, self._anchor_gen(step, i))
                                 for i in mine)], dtype=torch.float64)
        wsum = self._all_reduce(wsum)
        return max(float(wsum), 1e-8) / self.sps

    def _collective(self, t: torch.Tensor, op) -> torch.Tensor:
        """``op(t)`` (an in-place collective: all_reduce, broadcast from rank 0) over the processes, on a device the
        process group's backend serves (a CUDA tensor under NCCL, else the CPU); returns the result on ``t``'s
        device. One process: ``t`` itself, no collective."""
        if self.world == 1:
            return t
        comm = self.device if self.device.type == "cuda" and "nccl" in dist.get_backend() else torch.device("cpu")
        x = t.to(comm)
        op(x)
        return x.to(t.device)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the processes (:meth:`_collective`)."""
        return self._collective(t, dist.all_reduce)

    def train_step(self) -> dict:
        """One optimiser step over this rank's share of the step's batch; returns the step's mean loss terms
        (``loss``, ``ce``, ``l1``, ``bce``, averaged over all processes) and the curriculum weight ``lam`` of an
        objective with one (Domino's; 0.0 otherwise)."""
        st = self.state
        # a curriculum (Domino's lambda) follows the lineage's schedule: with train.schedule_from_init the run's step
        # 0 is the lineage's step offset, and the span is the lineage's (offset 0, span = this run's steps otherwise)
        lineage_step = st.step + getattr(self.lr, "offset", 0)
        lam = (self.objective.lam(lineage_step, self.horizon) if self.objective.curriculum is not None else 0.0)
        lr = float(self.sched.get_last_lr()[0])  # the rate this step's optimiser update uses
        batch = self.next_batch()
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
        sums = self._all_reduce(sums)
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
            write_json(self.out_dir / "curve.json", self.state.curve)
            plot_curve_file(self.state.curve, self.out_dir / "curve.png", self.cfg.recipe)
        return hold

    def save(self) -> None:
        """Save the resumable state (engine, optimiser, :class:`TrainState`) under ``<output_dir>/resume``."""
        save_resume(self.engine, self.out_dir, self.state.to_client(), OmegaConf.to_container(self.cfg))
        self.last_save = time.time()

    def after_step(self) -> bool:
        """Log the step, then evaluate and save when due; returns True when the wall-clock cap
        (``train.max_minutes``) ends the run. Rank 0's clock decides for every rank."""
        cfg, step = self.cfg, self.state.step
        flags = torch.tensor([
            float(bool(cfg.train.max_minutes) and time.time() - self.lr.t0 > self.cap_s),
            float(bool(cfg.train.save_every_minutes) and time.time() - self.last_save > cfg.train.save_every_minutes * 60),
        ])
        flags = self._collective(flags, lambda x: dist.broadcast(x, 0))
        capped = bool(flags[0])
        if cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0 and step < self.total:
            self.evaluate()
        due = bool(flags[1]) or (cfg.train.save_every_steps and step % cfg.train.save_every_steps == 0)
        if due and step < self.total and not capped:
            self.save()
        return capped

    def fit(self) -> None:
        """Train until the planned steps (``train.max_steps`` or ``train.epochs``) or the wall-clock cap."""
        self.engine.train()
        self.lr.start()
        self.t_steps0, self.preds0, self.last_save = time.time(), self.state.preds, time.time()
        self.stopped_early = False
        self.bar = tqdm(total=self.total, initial=self.state.step, desc=f"train {self.cfg.recipe}", unit="step",
                        disable=not self.main)
        while self.state.step < self.total:
            self._report(self.train_step())
            if self.after_step():
                self.stopped_early = True
                break
        self.bar.close()
        self.train_s = time.time() - self.lr.t0

    # ------------------------------------------------------------------------------------------------ finish

    def summary(self, hold: dict, param_checksum: float) -> dict:
        """The run's summary (summary.json): steps, losses, data, speed, memory, learning curve, held-out result."""
        st, data = self.state, self.data
        return {
            "recipe": self.cfg.recipe, "steps": st.step, "total_steps_planned": self.total,
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
            "cursor": self.cursor.state(data_fingerprint(data.tokens, data.train_ids)),
            **self._online_costs(),
        }

    def _online_costs(self) -> dict:
        """Online-feature costs of campaign data (none for a feature file): seconds and tokens of target forwards,
        and the on-disk feature store's hits, misses and read seconds when ``data.feature_store_gb`` > 0."""
        data = self.data
        if not getattr(data, "online", False):
            return {}
        out = {"target_forward_s": round(data.forward_s, 2), "target_forward_tokens": data.forward_tokens}
        store = getattr(data, "store", None)
        if store is not None:
            out["feature_store"] = {"hits": store.hits, "misses": store.misses, "read_s": round(store.read_s, 2),
                                    "gb": round(store.bytes / 1e9, 3), "folder": str(store.folder)}
        return out

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
        summary = self.summary(hold, checksum)
        if self.main:
            save_training_checkpoint(self.out_dir / "checkpoint", self.drafter, self.head, self.target, self.cfg,
                                     summary, state_dicts=sds)
            acceptance = {k: summary.get(k) for k in (
                "train_acc_per_pos", "train_tf_tau", "holdout_acc_per_pos", "holdout_tf_tau", "holdout_chain_tau",
                "steps", "train_tokens", "train_sequences")}
            for name, payload in (("summary.json", summary), ("curve.json", self.state.curve),
                                  ("acceptance.json", acceptance)):
                write_json(self.out_dir / name, payload)
            if self.state.curve:
                plot_curve_file(self.state.curve, self.out_dir / "curve.png", self.cfg.recipe)
        if self.wb is not None:
            self.wb.finish()
        s = summary
        print(f"[rank {self.rank}/{self.world}] done: {s['steps']} steps, final loss {s['final_loss']}, held-out "
              f"teacher-forced tau {s.get('holdout_tf_tau', float('nan')):.3f}; {s['predictions_per_s']:.0f} "
              f"predictions/s; wall time {s['wall_min']:.1f} min (data {s['data_prep_min']:.1f}, train "
              f"{s['train_min']:.1f}); peak memory {s['peak_rss_gib']:.2f} GiB; param checksum {checksum:.6f}"
              + (f"; checkpoint {self.out_dir / 'checkpoint'}" if self.main else ""), flush=True)
        return summary


def check_resume_length(saved_step: int, total: int, cfg: DictConfig, out_dir: Path) -> None:
    """Refuse to resume a state saved at a step past this run's last step: the loop would not run, and the longer
    run's weights would be written and reported as this run's.

    Args:
        saved_step: the step the resumable state was saved at. total: this run's planned steps.
    Raises:
        RecipeError: one line naming both steps, the setting that gave ``total`` and the fix.
    """
    if saved_step <= total:
        return
    why = (f"train.max_steps={cfg.train.max_steps}" if cfg.train.max_steps
           else f"train.epochs={cfg.train.epochs} gives {total} steps")
    raise RecipeError(f"resume=true: {out_dir / 'resume'} was saved at step {saved_step} but this run ends at step "
                      f"{total} ({why}); resuming would report the longer run as this one: set train.max_steps to "
                      f"{saved_step} or more, or use a new output_dir")


def run(cfg: DictConfig) -> dict:
    """Run a recipe end to end on every rank (:class:`Trainer`); returns the summary dict (rank 0 also writes
    ``<output_dir>/summary.json``, ``acceptance.json``, the learning curve and the checkpoint).

    Raises:
        RecipeError: the recipe, target, data or a resumable state does not fit (one line).
    """
    trainer = Trainer(cfg)
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

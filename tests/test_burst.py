"""The GPU burst: the prompt plan, the upload size checks, and a CPU dry run of the very script the GPU machine runs
(payload, the set-up after each upload, data, three recipes, evaluation, result files, apply) on a tiny target."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dartree.training.campaign_store import CampaignError, read_manifest
from dartree.training.tools.campaign_plan import read_plan, write_plan
from dartree.training.tools.campaign_pool import usable_items
from dartree.training.tools.campaign_settings import load_settings

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.holdout=2", "data.shard_size=3", "data.max_new_tokens=8", "data.max_turns=2", "threads=1"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from dartree.models.target import resolve_target_path

    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2"))


def test_the_plan_cuts_the_pool_as_the_data_stage_would(tmp_path, tokenizer):
    """One walk of the pool gives the pieces repeated usable_items calls give: the held-out set first while the
    manifest has none, then shards, each starting where the last ended; the plan refuses another campaign state."""
    cfg = load_settings(SMALL + [f"dir={tmp_path}"], folder=tmp_path)
    plan = write_plan(cfg, tmp_path / "plan.json.gz", 3, tokenizer=tokenizer)
    assert [e["name"] for e in plan["entries"]] == ["holdout", "train-00000", "train-00001"]
    start = 0
    for e, n in zip(plan["entries"], (2, 3, 3)):
        items, end = usable_items(cfg, tokenizer, start, n)
        assert e["pool"] == [start, end] and [i["id"] for i in e["items"]] == [it.id for it, _ in items]
        assert [i["segments"] for i in e["items"]] == [[list(s) for s in segs] for _, segs in items]
        start = end
    manifest = read_manifest(tmp_path)
    assert read_plan(tmp_path / "plan.json.gz", cfg, manifest)["start"] == 0
    with pytest.raises(CampaignError, match=r"other data settings \(\['max_new_tokens'\]\)"):
        read_plan(tmp_path / "plan.json.gz", load_settings(SMALL + ["data.max_new_tokens=9"], folder=tmp_path),
                  manifest)
    moved = {**manifest, "holdout": {"pool": [0, 5]}}
    with pytest.raises(CampaignError, match="starts at pool position 0 .holdout. but the campaign's next is 5 "
                                            r"\(train-00000\)"):
        read_plan(tmp_path / "plan.json.gz", cfg, moved)


def test_an_upload_over_the_limit_names_what_is_largest(tmp_path):
    from dartree.training.tools.burst_payload import check_upload
    from dartree.training.tools.burst_settings import BurstError

    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "target.part1").write_bytes(b"x" * (3 << 20))
    view = [(2 << 20, "checkpoints/big/model.safetensors"), (1000, "README.md")]
    rec = check_upload("1", view, tmp_path / "up", 6.0)
    assert rec["total_bytes"] == (5 << 20) + 1000 and rec["git_view_bytes"] == (2 << 20) + 1000
    with pytest.raises(BurstError, match=r"upload 1 would be 5.0 MiB, over limit_mib=4 .*target.part1 3.0 MiB, "
                                         r"checkpoints/big/model.safetensors 2.0 MiB, README.md 0.0 MiB\. Leave "
                                         r"large tracked files such as checkpoints/ out of the copy and give "
                                         r"hidden_mib=N \(the size from which they are left out\)"):
        check_upload("1", view, tmp_path / "up", 4.0)


def test_the_result_files_are_grouped_by_the_set_limits():
    """Sets of at most set_files files and set_mib MiB, first fit in order, set 1 keeping a file and 1 MiB for
    report.json: the defaults (8 files, 60 MiB) with the three recipes' bf16 checkpoints in 15 MiB pieces, and
    a transfer of 3 files and 2 MiB."""
    from dartree.training.tools.burst_device import group_sets
    from dartree.training.tools.burst_settings import MIB

    def sizes(mib, set_files, set_mib):
        files = [{"file": f"f{k}", "bytes": int(m * MIB)} for k, m in enumerate(mib)]
        return [[round(f["bytes"] / MIB, 3) for f in group] for group in group_sets(files, set_files, set_mib)]

    pieces = [1.0, 15, 15, 15, 10, 15, 2.5]  # data.tar, dspark_b16 (30), domino_b16 (25), dflash_b16 (17.5)
    assert sizes(pieces, 8, 60.0) == [[1.0, 15, 15, 15, 10], [15, 2.5]]  # set 1: at most 59 MiB
    assert sizes([0.4] * 5, 3, 2.0) == [[0.4, 0.4], [0.4, 0.4, 0.4]]  # set 1: 2 files, 1 MiB
    assert sizes([0.4] * 7, 2, 100.0) == [[0.4], [0.4, 0.4], [0.4, 0.4], [0.4, 0.4]]
    assert sizes([3.0, 0.5], 8, 2.0) == [[3.0], [0.5]]  # a file over a set's room: a set of its own


def test_the_wheels_follow_the_trainer_and_settings_are_checked(monkeypatch):
    import dartree.training.tools.campaign_train as ct
    from dartree.training.tools.burst_payload import BASE_WHEELS, DEEPSPEED_WHEELS
    from dartree.training.tools.burst_settings import BurstError, load_settings as burst_settings
    from dartree.training.tools.burst_payload import wheel_requirements

    cfg = burst_settings([])
    monkeypatch.setattr(ct, "recipe_has", lambda key: False)
    assert wheel_requirements(cfg) == BASE_WHEELS + DEEPSPEED_WHEELS  # the trainer still needs DeepSpeed
    monkeypatch.setattr(ct, "recipe_has", lambda key: key == "train.engine")
    assert wheel_requirements(cfg) == BASE_WHEELS  # a plain-torch engine: DeepSpeed stays here
    assert wheel_requirements(burst_settings(["wheels=[]"])) == []
    with pytest.raises(BurstError, match="unknown key 'minute'"):
        burst_settings(["minute=3"])
    with pytest.raises(BurstError, match="one weight > 0 per recipe"):
        burst_settings(["shares=[1,2]"])
    with pytest.raises(BurstError, match=r"set_files=1: give >= 2 \(set 1 holds report.json\)"):
        burst_settings(["set_files=1"])
    assert (burst_settings([]).set_files, burst_settings(["set_files=3"]).set_files) == (8, 3)


def _tiny_target(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dartree.models.target import resolve_target_path

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, bos_token_id=1, pad_token_id=2,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in resolve_target_path("smollm2").iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return folder


TINY_TRAIN = ["drafter.qk_norm=true", "drafter.draft_vocab_size=0", "train.save_every_minutes=1",
              "drafter.target_layer_ids=[0,1]", "drafter.num_layers=1", "drafter.intermediate_size=64",
              "drafter.block_size=4", "head.rank=8", "train.max_steps=2", "train.num_anchors=4", "train.bf16=false",
              "target.dtype=float32"]


def _device_python(root: Path) -> Path:
    """An interpreter as the GPU machine has one: this Python and this environment's packages (torch, transformers,
    ...) but no dartree. A new virtual environment at ``root`` whose site-packages links every entry of this one's
    except dartree's own (its distribution record and the editable install's path file and finder), so only what
    burst.sh lays out can supply dartree, there and in every process it starts. Returns its ``python``."""
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    py = root / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("__editable__", "dartree")) and entry.name != "__pycache__":
            (site / entry.name).symlink_to(entry)
    return py


@pytest.mark.slow
def test_the_dry_run_is_the_burst_on_a_cpu(tmp_path):
    """The burst end to end on the CPU with a tiny random Llama (SmolLM2's tokenizer): the payload (plan, prompts,
    target compressed and split in two, size checks, the list of files to copy), receive (part 1 checked), run
    (target joined, checked and placed, dartree laid out from pyproject's package map and imported from there alone,
    by an interpreter with no dartree installed, like the GPU machine's), the data stage from the plan with the GPU
    schedule, three recipes from scratch side by side, evaluation against AR (assemble, decode_one), the result
    files split into sets of at most set_files (8), a second set fetched, and apply: the shards, manifest,
    checkpoints and runs land in the campaign."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable,
           "BURST_DIR": str(tmp_path / "burst"), "BURST_KEEP": str(tmp_path / "keep"), "BURST_MINUTES": "4",
           "DARTREE_CACHE": str(tmp_path / "cache")}  # the compressed tiny target stays out of the user cache
    tiny = _tiny_target(tmp_path / "keep" / "target" / "tiny")
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / "campaign.yaml").write_text(f"target: {tiny}\ndata:\n  holdout: 2\n  shard_size: 3\n  max_new_tokens: 8\n"
                                        "  max_turns: 2\n")
    common = [f"dir={tmp_path / 'burst'}", f"campaign={camp}"]
    r = subprocess.run([sys.executable, "training/tools/burst.py", "stage=payload", *common, f"target={tiny}", "shards=3",
                        "wheels=[]", "hidden_mib=1", "eval_per_set=1"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    pay = json.loads((tmp_path / "burst" / "payload.json").read_text())
    parts = pay["target"]["parts"]
    assert pay["plan"]["pieces"] == ["holdout", "train-00000", "train-00001"] and len(parts) == 2
    assert sum(p["bytes"] for p in parts) == pay["target"]["joined_bytes"] and all(p["bytes"] > 0 for p in parts)
    assert all(u["total_bytes"] <= u["limit_bytes"] for u in pay["uploads"])
    from dartree.training.tools.burst_payload import git_view

    whole, hidden = git_view(), git_view(1.0)  # hidden_mib=1: the view less the tracked files of 1 MiB or more
    assert any(p.startswith("checkpoints/") and n >= 1 << 20 for n, p in whole)
    assert not any(n >= 1 << 20 for n, p in hidden) and pay["uploads"][0]["git_view_bytes"] == sum(n for n, _ in hidden)
    listed = (tmp_path / "burst" / "tree.txt").read_text().splitlines()  # what to copy: the files counted
    assert listed == sorted(p for _, p in hidden) and "pyproject.toml" in listed
    device_env = {**env, "PYTHON": str(_device_python(tmp_path / "device-python"))}  # no dartree installed
    device_env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "training/tools/burst.sh", "receive"], cwd=REPO, env=device_env, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "part 1" in r.stdout, r.stderr
    out = tmp_path / "out"
    run = ["bash", "training/tools/burst.sh", "run", "device=cpu", f"campaign={camp}", f"runs_dir={tmp_path / 'x'}",
           "data_args=[gen_slots=64,gen_min_free=4,gen_prefill_tokens=65536,gen_requeue=true,shards_per_call=2,"
           "threads=1]", "train_overrides=" + json.dumps(TINY_TRAIN + [f"target.path={tiny}"]),
           "eval_tokens=8", "eval_seconds=40", "pack_seconds=20", "overhead_minutes=0.5", "piece_mib=0.5",
           "set_mib=1.2", "data_share=0.2"]
    r = subprocess.run(run, cwd=REPO, env={**device_env, "OUT": str(out)}, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    # dartree came from the laid-out tree alone: every package of pyproject's map, and no installed copy is visible
    from dartree.training.tools.burst_layout import package_dirs

    src = tmp_path / "keep" / "src"
    assert f"burst: dartree imports from {src / 'dartree'} ({len(package_dirs())} packages)" in r.stdout
    probe = ("import importlib.metadata as md, json, sys, dartree.base\n"
             "try:\n    md.distribution('dartree'); dist = True\nexcept md.PackageNotFoundError:\n    dist = False\n"
             "print(json.dumps([dartree.base.__file__, dist, [repr(f) for f in sys.meta_path]]))")
    seen = subprocess.run([device_env["PYTHON"], "-c", probe], env={**device_env, "PYTHONPATH": str(src)},
                          cwd=tmp_path, capture_output=True, text=True, check=True)  # not the tree's egg-info
    base_file, dist, finders = json.loads(seen.stdout)
    assert base_file == str(src / "dartree" / "base" / "__init__.py") and not dist
    assert not any("editable" in f.lower() for f in finders), finders
    rep = json.loads((out / "report.json").read_text())
    assert rep["deadline_met"] and rep["wall_seconds"] <= 4 * 60
    assert rep["data"]["new_shards"] == 2 and rep["data"]["holdout_added"] and rep["data"]["response_tokens"] > 0
    for w in rep["workers"]:
        assert w["train"]["rc"] == 0 and not w["train"]["timed_out"], (w, (tmp_path / "keep" / "logs").iterdir())
        assert w["returned"] and w["summary"]["steps"] == 2 and w["summary"]["predictions"] > 0
        ev = w["eval"]
        assert ev["prompts"] >= 1 and ev["chain"]["mismatches"] == 0 and ev["pruned"]["mismatches"] == 0
        assert ev["chain"]["tau"] >= 1.0 and ev["pruned"]["tau"] >= 1.0  # fp32 on the CPU: lossless
    files = rep["files"]
    assert rep["sets"] >= 2 and all(f["bytes"] <= 0.5 * (1 << 20) for f in files)
    for k in range(1, rep["sets"] + 1):
        group = [f for f in files if f["set"] == k]
        assert 0 < len(group) <= (7 if k == 1 else 8) and sum(f["bytes"] for f in group) <= 1.2 * (1 << 20)
    assert sorted(p.name for p in out.iterdir()) == sorted([f["file"] for f in files if f["set"] == 1]
                                                           + ["report.json"])
    fetched = []
    for k in range(2, rep["sets"] + 1):
        o = tmp_path / f"out{k}"
        r = subprocess.run(["bash", "training/tools/burst.sh", "fetch", str(k)], cwd=REPO,
                           env={**device_env, "OUT": str(o)},
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        fetched.append(str(o))
    # apply: join, check and merge into the campaign (here: the campaign the burst extended is a copy), then eval
    # chain tau on the CPU and ship into a folder where dflash_b16's shipped checkpoint is the very one returned
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(camp / "campaign.yaml", home / "campaign.yaml")
    ship = tmp_path / "ship"
    from dartree.convert.importer import convert

    (dflash_run,) = (tmp_path / "keep" / "runs").glob("dflash_b16-*")
    convert(dflash_run / "checkpoint", ship / "dflash_b16")  # as pack converts it: bf16
    (ship / "dflash_b16" / "learning_curve.json").write_text("[]\n")
    shipped_before = (ship / "dflash_b16" / "model.safetensors").read_bytes()
    apply = [sys.executable, "training/tools/burst.py", "stage=apply", f"dir={tmp_path / 'burst'}", f"campaign={home}",
             f"runs_dir={tmp_path / 'runs'}", f"results=[{out}" + "".join(f",{f}" for f in fetched) + "]",
             "eval_limit=1", "eval_max_new_tokens=8", f"ship_dir={ship}"]
    r = subprocess.run(apply, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_manifest(home)
    assert m["holdout"]["conversations"] == 2 and len(m["shards"]) == 2
    assert "device" not in m["shards"][0]  # a CPU run names its CPU only (a GPU run adds "device")
    assert m == json.loads((camp / "manifest.json").read_text())
    state = _read_state(home, tmp_path / "runs")
    from dartree.models.checkpoint import load_dartree

    for recipe in ("dspark_b16", "domino_b16", "dflash_b16"):
        (run,) = state[recipe]["runs"]
        assert run["from_scratch"] and run["shards"] == 2 and run["output_dir"].startswith(str(tmp_path / "runs"))
        ck = Path(run["output_dir"]) / "checkpoint"
        assert json.loads((ck / "config.json").read_text())["drafter"]["qk_norm"] is True
        load_dartree(ck)  # the bf16 checkpoint loads strictly
        ev = run["eval_chain"]  # the real decode/eval.py on the CPU, with the shipped checkpoint on the same prompts
        assert run["eval_chain_tau"] >= 1.0 and (ev["limit"], ev["max_new_tokens"], ev["prompts"]) == (1, 8, 3)
        assert ev["mismatches"] == 0 and ev["shipped"] == str(ship / recipe)
        if recipe == "dflash_b16":  # the same weights: a tie, kept
            assert ev["shipped_tau"] == run["eval_chain_tau"] and "shipped_run" not in state[recipe]
            assert (ship / recipe / "model.safetensors").read_bytes() == shipped_before
            assert (ship / recipe / "learning_curve.json").read_text() == "[]\n"
            assert f"{recipe}: eval chain tau {run['eval_chain_tau']:.4f}" in r.stdout and "kept" in r.stdout
        else:  # nothing shipped yet: shipped
            assert ev["shipped_tau"] is None and state[recipe]["shipped_run"] == run["output_dir"]
            assert (ship / recipe / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
            assert f"vs nothing shipped yet: shipped into {ship / recipe}" in r.stdout
    r = subprocess.run(apply[:-3] + ["eval_limit=0"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)  # applied again: nothing twice, the measured tau kept
    assert r.returncode == 0, r.stderr[-3000:]
    again = _read_state(home, tmp_path / "runs")
    assert all(again[k]["runs"] == state[k]["runs"] for k in ("dspark_b16", "domino_b16", "dflash_b16"))
    assert read_manifest(home) == m
    if fetched:  # a missing set is named with the command that fetches it
        r = subprocess.run([sys.executable, "training/tools/burst.py", "stage=apply", f"dir={tmp_path / 'burst'}",
                            f"campaign={home}", f"results=[{out}]"], cwd=REPO, env=env, capture_output=True,
                           text=True)
        assert r.returncode == 2 and "burst.sh fetch 2" in r.stderr


def _drafter_checkpoint(folder: Path, seed: int | None) -> Path:
    """A bf16 dartree checkpoint for the tiny target (layers 0 and 1): random weights of ``seed``, or (None) all
    zeros, whose proposals are all token 0, which the tiny target never emits: chain tau exactly 1."""
    import torch

    from dartree.models.checkpoint import save_dartree
    from dartree.models.drafter import DFlashDrafter, DrafterConfig
    from dartree.models.families.dspark import MarkovHead

    torch.manual_seed(seed or 0)
    d = DFlashDrafter(DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                                    head_dim=8, target_layer_ids=[0, 1], mask_token_id=0, block_size=8))
    h = MarkovHead(49152, 4)
    if seed is None:
        with torch.no_grad():
            for p in [*d.parameters(), *h.parameters()]:
                p.zero_()
    return save_dartree(folder, d, h, {"name": "tiny", "vocab_size": 49152, "hidden_size": 32, "num_layers": 2})


@pytest.fixture(scope="module")
def tiny_eval_target(tmp_path_factory):
    return _tiny_target(tmp_path_factory.mktemp("tiny-eval") / "target")


def test_the_device_evaluation_goes_through_the_assembly_and_decode_one(tmp_path, tiny_eval_target, monkeypatch):
    """stage=device's evaluation builds its models with assemble (float32 on a CPU) and decodes each prompt with
    decode_one, AR first, then chain and pruned: an all-zero drafter (its proposals, token 0, never emitted) has chain
    tau exactly 1, a random one never splits from AR in float32; a deadline already past evaluates no prompt."""
    import time

    import torch

    import dartree.decode.assembly as assembly
    import dartree.decode.harness.runner as runner
    from dartree.training.tools.burst_device import evaluate

    built, decoded = [], []
    real_assemble, real_decode = assembly.assemble, runner.decode_one
    monkeypatch.setattr(assembly, "assemble", lambda *a, **k: built.append((a, k)) or real_assemble(*a, **k))
    monkeypatch.setattr(runner, "decode_one", lambda target, ids, method, **k: decoded.append(
        (method.builder, method.budget, k["reference"] is not None)) or real_decode(target, ids, method, **k))
    prompts = [{"text": "Write a function that adds two numbers."}, {"text": "What is 7 times 8?"}]
    zero, rand = _drafter_checkpoint(tmp_path / "zero", None), _drafter_checkpoint(tmp_path / "rand", 1)
    got = evaluate(zero, str(tiny_eval_target), prompts, device="cpu", max_new_tokens=8, budget=6,
                   deadline=time.time() + 600)
    assert built == [((zero, str(tiny_eval_target)), {"dtype": "float32", "device": torch.device("cpu")})]
    assert decoded == [(None, None, False), ("chain", None, True), ("pruned", 6, True)] * 2
    assert (got["device"], got["dtype"], got["prompts"], got["max_new_tokens"]) == ("cpu", "float32", 2, 8)
    assert got["chain"]["tau"] == 1.0 and got["chain"]["mismatches"] == 0 and got["ar_tokens_per_s"] > 0
    assert got["pruned"]["budget"] == 6 and got["pruned"]["mismatches"] == 0 and got["pruned"]["tau"] >= 1.0
    got = evaluate(rand, str(tiny_eval_target), prompts, device="cpu", max_new_tokens=8, budget=6,
                   deadline=time.time() + 600)
    assert got["prompts"] == 2 and got["chain"]["mismatches"] == got["pruned"]["mismatches"] == 0
    assert got["chain"]["tau"] >= 1.0 and got["pruned"]["tau"] >= 1.0
    decoded.clear()
    got = evaluate(rand, str(tiny_eval_target), prompts, device="cpu", max_new_tokens=8, budget=6, deadline=0.0)
    assert got["prompts"] == 0 and decoded == [] and got["chain"]["tau"] == 0.0


def _read_state(camp: Path, runs_dir: Path | str = "") -> dict:
    """``camp/train_state.json`` as the campaign reads it: its ``runs:`` paths under ``runs_dir`` (default: the
    user cache), every other stored path made local."""
    from omegaconf import OmegaConf

    from dartree.training.tools.campaign_train import read_state

    return read_state(OmegaConf.create({"dir": str(camp), "runs_dir": str(runs_dir)}))


def _eval_campaign(tmp_path: Path, target: Path, recipes: dict) -> tuple[Path, list]:
    """A campaign folder on the tiny target whose train_state.json records one run per recipe of ``recipes``
    (recipe -> drafter seed), each run folder holding its checkpoint; returns (campaign, [(recipe, run)])."""
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / "campaign.yaml").write_text(f"target: {target}\n")
    state, runs = {}, []
    for recipe, seed in recipes.items():
        run = tmp_path / "runs" / f"{recipe}-00002"
        _drafter_checkpoint(run / "checkpoint", seed)
        state[recipe] = {"runs": [{"output_dir": str(run), "shards": 2, "predictions": 10, "from_scratch": True}]}
        runs.append((recipe, str(run)))
    (camp / "train_state.json").write_text(json.dumps(state))
    return camp, runs


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_apply_measures_eval_tau_on_the_cpu_and_ships_what_beats_the_shipped_one(tmp_path, tiny_eval_target, capsys):
    """The real decode/eval.py on the tiny target: a random drafter (tau > 1) beats a shipped all-zero one (tau
    exactly 1) and replaces it in ship_dir, the shipped folder's learning_curve.json kept; a run equal to the shipped
    checkpoint ties and is kept; both runs' records get their tau and its settings, the winner is shipped_run."""
    import torch

    from dartree.training.tools.burst_apply import evaluate_and_ship
    from dartree.training.tools.burst_settings import load_settings as burst_settings

    camp, runs = _eval_campaign(tmp_path, tiny_eval_target, {"dspark_b16": 1, "domino_b16": 2})
    ship = tmp_path / "ship"
    _drafter_checkpoint(ship / "dspark_b16", None)
    (ship / "dspark_b16" / "learning_curve.json").write_text('{"mine": 1}\n')
    shutil.copytree(Path(runs[1][1]) / "checkpoint", ship / "domino_b16")
    kept = (ship / "domino_b16" / "model.safetensors").read_bytes()
    cfg = burst_settings([f"campaign={camp}", f"dir={tmp_path / 'burst'}", f"ship_dir={ship}", "eval_limit=1",
                          "eval_max_new_tokens=8", "stage=apply"])
    res = evaluate_and_ship(cfg, runs)
    new, tie = res["dspark_b16"], res["domino_b16"]
    assert new["shipped_tau"] == 1.0 and new["tau"] > 1.0 and new["shipped"]
    assert tie["tau"] == tie["shipped_tau"] and tie["tau"] >= 1.0 and not tie["shipped"]  # the same weights: a tie
    got, run_ck = _tensors(ship / "dspark_b16"), _tensors(Path(runs[0][1]) / "checkpoint")
    assert set(got) == set(run_ck) and all(torch.equal(got[k], run_ck[k]) for k in got)
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {torch.bfloat16}  # as checkpoints/ ships
    assert (ship / "dspark_b16" / "learning_curve.json").read_text() == '{"mine": 1}\n'
    assert (ship / "domino_b16" / "model.safetensors").read_bytes() == kept
    state = _read_state(camp)
    assert state["dspark_b16"]["shipped_run"] == runs[0][1] and "shipped_run" not in state["domino_b16"]
    for recipe, r in res.items():
        (rec,) = state[recipe]["runs"]
        ev = rec["eval_chain"]
        assert rec["eval_chain_tau"] == r["tau"] and ev["shipped_tau"] == r["shipped_tau"]
        assert (ev["limit"], ev["max_new_tokens"], ev["dtype"], ev["prompts"], ev["mismatches"]) == (1, 8, "float32",
                                                                                                      3, 0)
        assert ev["command"].startswith("python decode/eval.py --tree chain --budget 16 --limit 1 --max-new-tokens 8")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("burst apply: d")]
    assert lines == [f"burst apply: dspark_b16: eval chain tau {new['tau']:.4f} (dspark_b16-00002, 3 prompts, 0 "
                     f"mismatches) vs shipped 1.0000: shipped into {ship / 'dspark_b16'}",
                     f"burst apply: domino_b16: eval chain tau {tie['tau']:.4f} (domino_b16-00002, 3 prompts, 0 "
                     f"mismatches) vs shipped {tie['tau']:.4f}: kept {ship / 'domino_b16'}"]
    # the curve has the measured point beside the held-out one
    from omegaconf import OmegaConf

    from dartree.training.tools.campaign_train import curve_points

    state["baseline"] = {"dspark_b16": {"response_tokens": 1, "predictions": 1, "holdout_chain_tau": 1.0}}
    state["dspark_b16"]["runs"][0]["holdout_chain_tau"] = 1.1
    (camp / "train_state.json").write_text(json.dumps(state))
    assert curve_points(OmegaConf.create({"dir": str(camp)}))["dspark_b16"][1]["eval_chain_tau"] == new["tau"]


def test_apply_keeps_the_shipped_checkpoint_when_the_new_one_loses_and_says_why_it_cannot_ship(tmp_path, monkeypatch,
                                                                                              capsys):
    """The comparison forced by a stand-in evaluator: a run that loses (or ties) leaves ship_dir and shipped_run
    alone; ship=false measures and records only; a ship_dir entry that is not a checkpoint, an evaluation that fails
    and bad eval settings are one-line BurstErrors; the default ship_dir is checkpoints/ only for the repository's
    own campaign."""
    import dartree.training.tools.burst_apply as burst
    from dartree.training.tools.burst_apply import evaluate_and_ship, ship_root
    from dartree.training.tools.burst_settings import BurstError, load_settings as burst_settings

    camp, runs = _eval_campaign(tmp_path, tmp_path / "no-target-needed", {"dspark_b16": 1})
    ship = tmp_path / "ship"
    _drafter_checkpoint(ship / "dspark_b16", None)
    before = (ship / "dspark_b16" / "model.safetensors").read_bytes()
    taus = {str(Path(runs[0][1]) / "checkpoint"): 1.25, str(ship / "dspark_b16"): 1.5}
    seen = []

    def fake_eval(checkpoint, target, words, out):
        seen.append((str(checkpoint), str(target), words))
        return {"tau": taus[str(checkpoint)], "prompts": 15, "mismatches": 0, "prompt_ids": ["a:1"], "report": ""}

    monkeypatch.setattr(burst, "eval_chain", fake_eval)
    common = [f"campaign={camp}", f"dir={tmp_path / 'burst'}", f"ship_dir={ship}", "stage=apply"]
    res = evaluate_and_ship(burst_settings(common), runs)["dspark_b16"]
    assert (res["tau"], res["shipped_tau"], res["shipped"]) == (1.25, 1.5, False)
    assert [s[0] for s in seen] == [str(Path(runs[0][1]) / "checkpoint"), str(ship / "dspark_b16")]
    assert seen[0][1] == str(tmp_path / "no-target-needed")  # the campaign's target, from its campaign.yaml
    assert seen[0][2] == seen[1][2] == ["--tree", "chain", "--budget", "16", "--limit", "5", "--max-new-tokens", "256",
                                        "--dtype", "float32", "--no-plots", "--ar-repeats", "1"]  # the defaults
    assert (ship / "dspark_b16" / "model.safetensors").read_bytes() == before
    state = _read_state(camp)
    assert "shipped_run" not in state["dspark_b16"] and state["dspark_b16"]["runs"][0]["eval_chain_tau"] == 1.25
    assert state["dspark_b16"]["runs"][0]["eval_chain"]["shipped_tau"] == 1.5
    assert "eval chain tau 1.2500 (dspark_b16-00002, 15 prompts, 0 mismatches) vs shipped 1.5000: kept" in \
        capsys.readouterr().out
    taus[str(ship / "dspark_b16")] = 1.25  # a tie is no win
    assert not evaluate_and_ship(burst_settings(common), runs)["dspark_b16"]["shipped"]
    taus[str(ship / "dspark_b16")] = 1.0  # a win, but ship=false: measured and recorded only
    assert not evaluate_and_ship(burst_settings(common + ["ship=false"]), runs)["dspark_b16"]["shipped"]
    assert "vs shipped 1.0000: would ship (ship=false)" in capsys.readouterr().out
    assert (ship / "dspark_b16" / "model.safetensors").read_bytes() == before
    assert _read_state(camp)["dspark_b16"]["runs"][0]["eval_chain"]["shipped_tau"] \
        == 1.0
    (ship / "dspark_b16" / "config.json").write_text('{"format": "notes"}')  # not a checkpoint: never overwritten
    with pytest.raises(BurstError, match=r"shipping .* into .*dspark_b16 failed \(refusing to overwrite .*\); .* is "
                                         "as it was"):
        evaluate_and_ship(burst_settings(common), runs)
    assert (ship / "dspark_b16" / "model.safetensors").read_bytes() == before
    monkeypatch.undo()  # the real evaluation: this campaign's target folder does not exist
    with pytest.raises(BurstError, match=r"decode/eval.py could not evaluate .*checkpoint \(exit 2, its error above\); "
                                         r"fix that and run stage=apply again .* or give eval_limit=0"):
        evaluate_and_ship(burst_settings(common), runs)
    with pytest.raises(BurstError, match=r"decode/eval.py refused the words .*'--no-such-word'.*; fix eval_args="):
        evaluate_and_ship(burst_settings(common + ["eval_args=[--no-such-word]"]), runs)
    with pytest.raises(BurstError, match=r"eval_limit=-1 must be >= 0 \(0: no evaluation\)"):
        burst_settings(["eval_limit=-1"])
    assert ship_root(burst_settings([])) == REPO / "checkpoints"
    assert ship_root(burst_settings([f"campaign={camp}"])) == camp / "shipped"
    assert ship_root(burst_settings(common)) == ship

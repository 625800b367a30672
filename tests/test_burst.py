"""The GPU burst: the prompt plan, the upload size checks, and a CPU dry run of the very script the GPU machine runs
(payload, both calls' set-up, data, three recipes, evaluation, result files, apply) on a tiny target."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dartree.training.campaign import (CampaignError, load_settings, read_manifest, read_plan, usable_items,
                                       write_plan)

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
    from dartree.training.burst import BurstError, check_upload

    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "target.part1").write_bytes(b"x" * (3 << 20))
    view = [(2 << 20, "checkpoints/big/model.safetensors"), (1000, "README.md")]
    rec = check_upload("1", view, tmp_path / "up", 6.0)
    assert rec["total_bytes"] == (5 << 20) + 1000 and rec["git_view_bytes"] == (2 << 20) + 1000
    with pytest.raises(BurstError, match=r"upload 1 would be 5.0 MiB, over limit_mib=4 .*target.part1 3.0 MiB, "
                                         r"checkpoints/big/model.safetensors 2.0 MiB.*hide-large-files hide"):
        check_upload("1", view, tmp_path / "up", 4.0)


def test_the_wheels_follow_the_trainer_and_settings_are_checked(monkeypatch):
    import dartree.training.campaign_train as ct
    from dartree.training.burst import BASE_WHEELS, DEEPSPEED_WHEELS, BurstError, load_settings as burst_settings
    from dartree.training.burst import wheel_requirements

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


@pytest.mark.slow
def test_the_dry_run_is_the_burst_on_a_cpu(tmp_path):
    """The burst end to end on the CPU with a tiny random Llama (SmolLM2's tokenizer): the payload (plan, prompts,
    target compressed and split in two, size checks), call 1 (part 1 checked), call 2 (target joined, checked and
    placed, dartree importable without installing), the data stage from the plan with the GPU schedule, three
    recipes from scratch side by side, evaluation against AR, the result files split into sets of at most 8, a
    second set fetched, and apply: the shards, manifest, checkpoints and runs land in the campaign."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable,
           "BURST_DIR": str(tmp_path / "burst"), "BURST_KEEP": str(tmp_path / "keep"), "BURST_MINUTES": "4",
           "DARTREE_CACHE": str(tmp_path / "cache")}  # the compressed tiny target stays out of the user cache
    tiny = _tiny_target(tmp_path / "keep" / "target" / "tiny")
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / "campaign.yaml").write_text(f"target: {tiny}\ndata:\n  holdout: 2\n  shard_size: 3\n  max_new_tokens: 8\n"
                                        "  max_turns: 2\n")
    common = [f"dir={tmp_path / 'burst'}", f"campaign={camp}"]
    r = subprocess.run([sys.executable, "training/burst.py", "stage=payload", *common, f"target={tiny}", "shards=3",
                        "wheels=[]", "hidden_mib=1", "eval_per_set=1"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    pay = json.loads((tmp_path / "burst" / "payload.json").read_text())
    parts = pay["target"]["parts"]
    assert pay["plan"]["pieces"] == ["holdout", "train-00000", "train-00001"] and len(parts) == 2
    assert sum(p["bytes"] for p in parts) == pay["target"]["joined_bytes"] and all(p["bytes"] > 0 for p in parts)
    assert all(u["total_bytes"] <= u["limit_bytes"] for u in pay["uploads"])
    from dartree.training.burst import git_view

    whole, hidden = git_view(), git_view(1.0)  # hidden_mib=1 counts the view as hide-large-files hide 1 leaves it
    assert any(p.startswith("checkpoints/") and n >= 1 << 20 for n, p in whole)
    assert not any(n >= 1 << 20 for n, p in hidden) and pay["uploads"][0]["git_view_bytes"] == sum(n for n, _ in hidden)
    r = subprocess.run(["bash", "training/burst.sh", "receive"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "part 1" in r.stdout, r.stderr
    out, out2 = tmp_path / "out", tmp_path / "out2"
    run = ["bash", "training/burst.sh", "run", "device=cpu", f"campaign={camp}", f"runs_dir={tmp_path / 'x'}",
           "data_args=[gen_slots=64,gen_min_free=4,gen_prefill_tokens=65536,gen_requeue=true,shards_per_call=2,"
           "threads=1]", "train_overrides=" + json.dumps(TINY_TRAIN + [f"target.path={tiny}"]),
           "eval_tokens=8", "eval_seconds=40", "pack_seconds=20", "overhead_minutes=0.5", "piece_mib=0.5",
           "set_mib=1.2", "data_share=0.2"]
    r = subprocess.run(run, cwd=REPO, env={**env, "OUT": str(out)}, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
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
        r = subprocess.run(["bash", "training/burst.sh", "fetch", str(k)], cwd=REPO, env={**env, "OUT": str(o)},
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        fetched.append(str(o))
    # apply: join, check and merge into the campaign (here: the campaign the burst extended is a copy)
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(camp / "campaign.yaml", home / "campaign.yaml")
    r = subprocess.run([sys.executable, "training/burst.py", "stage=apply", f"dir={tmp_path / 'burst'}",
                        f"campaign={home}", f"runs_dir={tmp_path / 'runs'}",
                        f"results=[{out}" + "".join(f",{f}" for f in fetched) + "]"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_manifest(home)
    assert m["holdout"]["conversations"] == 2 and len(m["shards"]) == 2
    assert "device" not in m["shards"][0]  # a CPU run names its CPU only (a GPU run adds "device")
    assert m == json.loads((camp / "manifest.json").read_text())
    state = json.loads((home / "train_state.json").read_text())
    from dartree.models.checkpoint import load_dartree

    for recipe in ("dspark_b16", "domino_b16", "dflash_b16"):
        (run,) = state[recipe]["runs"]
        assert run["from_scratch"] and run["shards"] == 2 and run["output_dir"].startswith(str(tmp_path / "runs"))
        ck = Path(run["output_dir"]) / "checkpoint"
        assert json.loads((ck / "config.json").read_text())["drafter"]["qk_norm"] is True
        load_dartree(ck)  # the bf16 checkpoint loads strictly
    if fetched:  # a missing set is named with the command that fetches it
        r = subprocess.run([sys.executable, "training/burst.py", "stage=apply", f"dir={tmp_path / 'burst'}",
                            f"campaign={home}", f"results=[{out}]"], cwd=REPO, env=env, capture_output=True,
                           text=True)
        assert r.returncode == 2 and "burst.sh fetch 2" in r.stderr

"""The training campaign: a fixed prompt pool, committed shards that resume anywhere, online target features."""

import json
import time
from pathlib import Path

import pytest
import torch

from dartree.training.campaign_store import CampaignError, read_manifest, read_shard, shard_table
from dartree.training.tools.campaign_pool import eval_texts, pool_items
from dartree.training.tools.campaign_settings import load_settings
from dartree.training.tools.campaign_shards import run_data

SMALL = ["data.holdout=2", "data.shard_size=3", "data.max_new_tokens=4", "data.max_turns=2", "threads=2"]


def _first(cfg, n):
    out = []
    for it in pool_items(cfg):
        out.append(it)
        if len(out) == n:
            return out


def test_the_pool_is_fixed_mixed_and_never_holds_an_eval_prompt(tmp_path):
    cfg = load_settings([], folder=tmp_path)
    a, b = _first(cfg, 400), _first(cfg, 400)
    assert [(x.id, x.turns) for x in a] == [(x.id, x.turns) for x in b]
    assert len({x.id for x in a}) == 400
    kinds = {k: sum(x.kind == k for x in a) for k in ("chat", "code", "math")}
    assert kinds == {"chat": 180, "code": 120, "math": 100}  # the 0.45 / 0.30 / 0.25 mix, exactly per 20
    assert any(x.id.startswith("rg:codeio") for x in a) and any(len(x.turns) > 1 for x in a)
    evals = eval_texts()
    assert len(evals) > 300  # 164 HumanEval problems and 160 MT-Bench turns
    assert not any(" ".join(t.lower().split()) in evals for x in a for t in x.turns)
    # another seed shuffles ShareGPT differently; reasoning-gym streams follow the seed too
    other = _first(load_settings(["data.seed=1"], folder=tmp_path), 50)
    assert [x.id for x in other] != [x.id for x in a[:50]]


def test_settings_errors_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(CampaignError, match="unknown key 'data.shardsize'.*shard_size"):
        load_settings(["data.shardsize=3"], folder=tmp_path)
    with pytest.raises(CampaignError, match="gsm_symbolic generates the evaluation"):
        load_settings(["data.math_generators=[dice,gsm_symbolic]"], folder=tmp_path)
    with pytest.raises(CampaignError, match="data.mix"):
        load_settings(["data.mix={chat: 0, code: 0, math: 0}"], folder=tmp_path)
    with pytest.raises(CampaignError, match="stage='eval': use one of data, train, all, verify, status, baseline, "
                                            "curve, plan"):
        load_settings(["stage=eval"], folder=tmp_path)


def test_a_shard_file_round_trips_token_ids_and_masks(tmp_path):
    from dartree.training.tools.campaign_pool import PoolItem

    items = [(PoolItem("a", "chat", ["x"]), [[5]]), (PoolItem("b", "math", ["y"]), [[6]])]
    rows = [{"index": 1, "prompt_ids": [6, 7], "response_ids": [60000, 2], "loss_mask": [1, 1], "turns": 1},
            {"index": 0, "prompt_ids": [5], "response_ids": [9, 8, 2], "loss_mask": [1, 0, 1], "turns": 2}]
    (tmp_path / "s.parquet").write_bytes(shard_table(rows, items))
    back = read_shard(tmp_path / "s.parquet")
    assert [r["id"] for r in back] == ["a", "b"] and [r["kind"] for r in back] == ["chat", "math"]
    assert back[0]["response_ids"] == [9, 8, 2] and back[0]["loss_mask"] == [True, False, True]
    assert back[1]["response_ids"] == [60000, 2] and back[1]["turns"] == 1
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(CampaignError, match="git checkout"):
        read_shard(tmp_path / "bad.parquet")


@pytest.mark.slow
def test_the_data_stage_stops_at_its_deadline_and_resumes_to_the_same_shards(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    cfg = load_settings(SMALL + [f"dir={whole}"], folder=whole)
    deadline = time.time() + 3600
    n_shards = 2
    cfg.data.goal_response_tokens = 1  # stop after the first training shard ...
    run_data(cfg, deadline, work=tmp_path / "w1")
    cfg.data.goal_response_tokens = 10**9
    m = read_manifest(whole)
    assert m["holdout"]["conversations"] == 2 and len(m["shards"]) == 1
    # ... then stop inside the second shard by the clock: nothing is written for it, and it resumes
    cfg2 = load_settings(SMALL + [f"dir={cut}"], folder=cut)
    cfg2.data.goal_response_tokens = 1
    run_data(cfg2, deadline, work=tmp_path / "w2")
    cfg2.data.goal_response_tokens = 10**9
    import dartree.training.answers as data_mod

    real = data_mod.regenerate_dialogues

    def stop_soon(*args, deadline=None, **kw):  # a deadline that passes after the first finished answer
        return real(*args, deadline=time.time() - 1, **kw)

    data_mod.regenerate_dialogues = stop_soon  # what the data stage calls for a shard (through _run_wave)
    try:
        run_data(cfg2, deadline, work=tmp_path / "w2")
    finally:
        data_mod.regenerate_dialogues = real
    assert len(read_manifest(cut)["shards"]) == 1
    assert (tmp_path / "w2" / "train-00001" / "responses.partial.jsonl").stat().st_size > 0
    # both campaigns continue to two training shards; the files are identical (fp32 regeneration is exact)
    cfg.data.goal_response_tokens = cfg2.data.goal_response_tokens = sum(
        s["response_tokens"] for s in read_manifest(whole)["shards"]) + 1
    run_data(cfg, deadline, work=tmp_path / "w1")
    run_data(cfg2, deadline, work=tmp_path / "w2")
    mw, mc = read_manifest(whole), read_manifest(cut)
    assert len(mw["shards"]) == len(mc["shards"]) == n_shards
    for a, b in zip([mw["holdout"]] + mw["shards"], [mc["holdout"]] + mc["shards"]):
        assert a["sha256"] == b["sha256"] and a["pool"] == b["pool"]
    # the held-out conversations never come back in a training shard; shards tile the pool
    hold = {r["id"] for r in read_shard(whole / mw["holdout"]["file"])}
    train = [r for s in mw["shards"] for r in read_shard(whole / s["file"])]
    assert not hold & {r["id"] for r in train} and len({r["id"] for r in train}) == len(train)
    assert mw["shards"][0]["pool"][0] == mw["holdout"]["pool"][1] and mw["shards"][1]["pool"][0] == mw["shards"][0]["pool"][1]
    assert mw["totals"]["response_tokens"] == sum(sum(r["loss_mask"]) for r in train)
    assert all(s["gen_dtype"] in ("float32", "bfloat16") and s["cpu"] and s["command"] for s in mw["shards"])
    # another data setting on the same folder is refused by name
    with pytest.raises(CampaignError, match="max_new_tokens"):
        run_data(load_settings(SMALL + ["data.max_new_tokens=5", f"dir={whole}"], folder=whole), deadline,
                 work=tmp_path / "w3")


def test_online_features_equal_the_feature_file(tmp_path):
    from dartree.models.target import load_target
    from dartree.training.campaign_data import CampaignData
    from dartree.training.data import BlockData
    from dartree.training.features import compute_features, target_lse

    target = load_target("smollm2", dtype=torch.float32, layer_ids=[1, 12, 28])
    tok = target.tokenizer
    rows = []
    for k, text in enumerate(["Hello there, how are you?", "Write a haiku about rain.", "2+2=?"]):
        p = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        p = list(p["input_ids"] if hasattr(p, "keys") else p)
        resp = [tok.eos_token_id] if k == 2 else tok(" fine, thanks", add_special_tokens=False)["input_ids"] + [2]
        rows.append({"index": k, "prompt_ids": p, "response_ids": resp, "loss_mask": [1] * len(resp), "turns": 1})
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    feats = compute_features(target, path)
    stored = BlockData(path, feats, holdout=1)
    stored.lse = target_lse(target, feats)
    online = CampaignData(target, rows[:2], rows[2:])
    online.need_lse = True
    assert online.train_ids == stored.train_ids and online.holdout_ids == stored.holdout_ids
    for i in range(3):
        t1, f1, z1, p1 = stored.sequence(i)
        t2, f2, z2, p2 = online.sequence(i)
        assert torch.equal(t1, t2) and p1 == p2 and f2.dtype == torch.bfloat16 and f1.shape == f2.shape
        torch.testing.assert_close(f2.float(), f1.float(), rtol=1.6e-2, atol=1e-2)  # bf16 storage rounding
        torch.testing.assert_close(z2.float(), z1.float(), rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(online.lse_of(i), stored.lse_of(i), rtol=1e-3, atol=1e-2)
        assert torch.equal(online.mask_of(i), stored.mask_of(i))
    assert online.forward_tokens == sum(len(t) for t in online.tokens)  # one forward per sequence (cached)


def test_a_recorded_run_resumes_only_where_its_state_is(tmp_path):
    """The committed train_state names run folders and init_from paths of the machine that ran them: on this
    machine the run resumes with its own init_from; on a fresh one it starts from the committed or shipped
    weights instead of a path that does not exist."""
    from dartree.training.tools.campaign_train import REPO, start_for

    folder = tmp_path / "c"
    cfg = load_settings(SMALL + [f"dir={folder}"], folder=folder)
    out = tmp_path / "runs" / "dspark_b16-00027"
    state = {"dspark_b16": {"runs": [{"output_dir": str(out), "init_from": "/elsewhere/campaign/checkpoints/x"}]}}
    assert start_for(cfg, "dspark_b16", state, out) == (str(REPO / "checkpoints" / "dspark_b16"), False)
    committed = folder / "checkpoints" / "dspark_b16"
    committed.mkdir(parents=True)
    (committed / "config.json").write_text("{}")
    assert start_for(cfg, "dspark_b16", state, out) == (str(committed), False)
    (out / "resume").mkdir(parents=True)  # the run's resumable state is here: it resumes
    began = tmp_path / "began"
    began.mkdir()
    (began / "config.json").write_text("{}")
    state["dspark_b16"]["runs"][0]["init_from"] = str(began)
    assert start_for(cfg, "dspark_b16", state, out) == (str(began), True)  # as it began, while that exists
    (began / "config.json").unlink()
    assert start_for(cfg, "dspark_b16", state, out) == (str(committed), True)  # gone: the weights come from resume/
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "config.json").write_text("{}")
    assert start_for(cfg, "dspark_b16", state, out) == (str(out / "checkpoint"), True)
    assert start_for(cfg, "dspark_b16", {}, out) == (str(committed), False)  # no record: a new run


def test_a_shipped_checkpoint_continues_its_lineage_only_in_the_repositorys_campaign(tmp_path):
    """The shipped checkpoints carry the repository campaign's lineage (lineage.json): its data cursor is refused on
    another campaign's shards, so a campaign in another folder starts its cursor and schedule at 0 from them."""
    from omegaconf import OmegaConf

    from dartree.training.campaign_store import DEFAULT_DIR, REPO
    from dartree.training.tools.campaign_train import continues_lineage

    shipped = str(REPO / "checkpoints" / "dspark_b16")
    assert continues_lineage(OmegaConf.create({"dir": str(DEFAULT_DIR)}), shipped)
    other = OmegaConf.create({"dir": str(tmp_path / "c")})
    assert not continues_lineage(other, shipped)
    assert continues_lineage(other, str(tmp_path / "runs" / "dspark_b16-00001" / "checkpoint"))  # its own run


def test_a_run_recorded_elsewhere_gives_the_new_run_a_folder_of_its_own(tmp_path):
    """The shipped run dspark_b16-00027 ran on another machine: continuing its weights here on the same 27 shards is
    a new run (dspark_b16-00027.2), not a second record of the shipped one's name (whose parent would be itself)."""
    from dartree.training.tools.campaign_train import run_folder

    root = tmp_path / "runs"
    shipped = root / "dspark_b16-00027"
    state = {"dspark_b16": {"shipped_run": str(shipped), "runs": [{"output_dir": str(shipped)}]}}
    assert run_folder(root, "dspark_b16", 12, state) == root / "dspark_b16-00012"  # no run recorded: the plain name
    assert run_folder(root, "dspark_b16", 27, state) == root / "dspark_b16-00027.2"
    state["dspark_b16"]["runs"].append({"output_dir": str(root / "dspark_b16-00027.2")})
    (root / "dspark_b16-00027.2" / "resume").mkdir(parents=True)  # its state is here: it resumes in its folder
    assert run_folder(root, "dspark_b16", 27, state) == root / "dspark_b16-00027.2"
    (shipped / "resume").mkdir(parents=True)
    assert run_folder(root, "dspark_b16", 27, state) == shipped  # on the machine that ran it: it resumes


def test_the_curve_counts_the_predictions_of_a_runs_own_lineage(tmp_path, monkeypatch):
    """A run that started again from the baseline does not inherit the predictions of runs it did not continue;
    one that continued the committed checkpoint inherits that run's (parent_of, curve_points)."""
    from dartree.training.tools.campaign_train import curve_points, parent_of

    folder = tmp_path / "c"
    folder.mkdir()
    cfg = load_settings(SMALL + [f"dir={folder}"], folder=folder)
    (folder / "manifest.json").write_text(json.dumps({"data": None, "holdout": None, "shards": [
        {"response_tokens": 100}, {"response_tokens": 50}, {"response_tokens": 25}]}))
    state = {"baseline": {"x": {"response_tokens": 1000, "predictions": 10_000, "holdout_chain_tau": 1.4}},
             "x": {"committed_run": "/r/x-2", "runs": [
                 {"output_dir": "/r/x-1", "parent": None, "shards": 1, "predictions": 7, "holdout_chain_tau": 1.5},
                 {"output_dir": "/r/x-2", "parent": None, "shards": 2, "predictions": 30, "holdout_chain_tau": 1.6},
                 {"output_dir": "/r/x-3", "parent": "/r/x-2", "shards": 3, "predictions": 400,
                  "holdout_chain_tau": 1.7, "eval_chain_tau": 1.45},
                 {"output_dir": "/r/x-4", "parent": "/r/x-3", "shards": 3, "predictions": 100,  # measured by apply
                  "holdout_chain_tau": 1.75, "eval_chain_tau": 1.6,
                  "eval_chain": {"prompts": 15, "max_new_tokens": 256, "limit": 5}}]}}
    (folder / "train_state.json").write_text(json.dumps(state))
    pts = curve_points(cfg)["x"]
    assert [p["predictions"] for p in pts] == [10_000, 10_007, 10_030, 10_430, 10_530]
    assert [p["response_tokens"] for p in pts] == [1000, 1100, 1150, 1175, 1175]
    assert [p.get("eval_chain_tau") for p in pts] == [None, None, None, 1.45, 1.6]
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from dartree.training.tools.campaign_train import plot_curve

    seen, real_close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (seen.append(fig), real_close(fig)))  # keep the figure to read
    assert plot_curve(cfg, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    lines = {ln.get_label(): ln for ln in seen[0].axes[1].get_lines()}
    assert list(lines["x eval (15 prompts x 128 tokens)"].get_xdata()) == [10_430]  # recorded by hand
    assert list(lines["x eval (15 prompts x 256 tokens)"].get_xdata()) == [10_530]  # apply's own settings
    assert list(lines["x held-out"].get_ydata()) == [1.4, 1.5, 1.6, 1.7, 1.75]
    assert parent_of(cfg, "x", state, "/r/x-3/checkpoint") == "/r/x-3"
    assert parent_of(cfg, "x", state, str(folder / "checkpoints" / "x")) == "/r/x-2"
    assert parent_of(cfg, "x", state, "/repo/checkpoints/x") is None  # shipped, before the campaign shipped one
    state["x"]["shipped_run"] = "/r/x-3"
    assert parent_of(cfg, "x", state, "/repo/checkpoints/x") == "/r/x-3"


def test_a_lineage_from_scratch_counts_its_own_data_and_the_state_lock_keeps_every_writer(tmp_path):
    """A burst run trained from random weights (from_scratch) and its continuation count only their own shards
    and predictions; two writers under locked_state both keep their runs."""
    from dartree.training.tools.campaign_train import curve_points, locked_state, read_state

    folder = tmp_path / "c"
    folder.mkdir()
    cfg = load_settings(SMALL + [f"dir={folder}"], folder=folder)
    (folder / "manifest.json").write_text(json.dumps({"data": None, "holdout": None, "shards": [
        {"response_tokens": 100}, {"response_tokens": 50}]}))
    with locked_state(cfg) as state:
        state["baseline"] = {"x": {"response_tokens": 1000, "predictions": 10_000, "holdout_chain_tau": 1.4}}
        state["x"] = {"runs": [{"output_dir": "/r/x-1", "parent": None, "shards": 1, "predictions": 7,
                                "holdout_chain_tau": 1.5}]}
    with locked_state(cfg) as state:  # a second process adds its run to what the first wrote
        state["x"]["runs"] += [
            {"output_dir": "/g/x-2", "parent": None, "from_scratch": True, "shards": 2, "predictions": 900,
             "holdout_chain_tau": 1.3},
            {"output_dir": "/r/x-2", "parent": "/g/x-2", "shards": 2, "predictions": 40, "holdout_chain_tau": 1.35}]
    assert len(read_state(cfg)["x"]["runs"]) == 3
    pts = curve_points(cfg)["x"]
    assert [p["response_tokens"] for p in pts] == [1000, 1100, 150, 150]
    assert [p["predictions"] for p in pts] == [10_000, 10_007, 900, 940]
    assert pts[2]["label"] == "2 shards (from scratch)" and pts[3]["label"] == "2 shards (from scratch)"


def test_gpu_settings_are_checked_by_name(tmp_path):
    with pytest.raises(CampaignError, match="shards_per_call, gen_min_free and gen_prefill_tokens"):
        load_settings(["shards_per_call=0"], folder=tmp_path)
    with pytest.raises(CampaignError, match="device='tpu'"):
        load_settings(["device=tpu"], folder=tmp_path)
    with pytest.raises(CampaignError, match="stage=plan needs shards=K"):
        load_settings(["stage=plan"], folder=tmp_path)
    with pytest.raises(CampaignError, match=r"train.shares=\[1\]"):
        load_settings(["train.recipes=[a,b]", "train.shares=[1]"], folder=tmp_path)
    with pytest.raises(CampaignError, match="train.init='warm'"):
        load_settings(["train.init=warm"], folder=tmp_path)
    import torch

    from dartree.training.campaign_store import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(CampaignError, match="use device=cpu or device=auto"):
            resolve_device("cuda")


@pytest.mark.slow
def test_the_plan_reproduces_the_committed_pool_ranges():
    """Walking the pool once cuts it as the committed shards were cut (held-out set and shards 0..N-1)."""
    from dartree.training.campaign_store import REPO
    from dartree.training.tools.campaign_plan import next_names, write_plan

    cfg = load_settings([])
    committed = read_manifest(REPO / "campaign")
    empty = {"data": None, "holdout": None, "shards": []}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cfg.dir = tmp  # an empty campaign: the plan starts at pool position 0 with the held-out set
        plan = write_plan(cfg, Path(tmp) / "p.json.gz", 1 + len(committed["shards"]))
    assert [e["name"] for e in plan["entries"]] == [n for n, _ in next_names(cfg, empty, len(plan["entries"]))]
    assert [e["pool"] for e in plan["entries"]] == [committed["holdout"]["pool"]] + [s["pool"] for s in
                                                                                    committed["shards"]]
    assert [len(e["items"]) for e in plan["entries"]] == [committed["holdout"]["conversations"]] + [
        s["conversations"] for s in committed["shards"]]


@pytest.mark.slow
def test_the_training_stage_trains_on_the_shards_resumes_and_records_its_runs(tmp_path, monkeypatch):
    import os

    from dartree.training.tools.campaign_train import init_for, read_state, run_train

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext")))
    folder = tmp_path / "c"
    cfg = load_settings(SMALL + [f"dir={folder}", f"runs_dir={tmp_path / 'runs'}", "data.max_new_tokens=8",
                                 "train.min_shards=2",
                                 "train.overrides=[train.max_steps=2,train.num_anchors=4]"], folder=folder)
    cfg.data.goal_response_tokens = 1
    run_data(cfg, time.time() + 3600, work=tmp_path / "w")
    assert run_train(cfg, time.time() + 3600, runs_root=tmp_path / "runs") == {}  # 1 shard < min_shards: no run
    cfg.train.min_shards = 1
    state = run_train(cfg, time.time() + 3600, runs_root=tmp_path / "runs")
    (run,) = state["dspark_b16"]["runs"]
    assert run["shards"] == 1 and run["steps"] == 2 and run["predictions"] > 0
    assert run["init_from"].endswith("checkpoints/dspark_b16") and 1.0 <= run["holdout_chain_tau"] <= 16
    assert read_state(cfg) == state and (folder / "train_state.json").exists()
    # the next run of the recipe starts from this run's checkpoint
    assert init_for(cfg, "dspark_b16", state) == str(tmp_path / "runs" / "dspark_b16-00001" / "checkpoint")
    # a second call on the same shards resumes the run (a longer max_steps continues from step 2)
    cfg.train.overrides = ["train.max_steps=3", "train.num_anchors=4"]
    (run,) = run_train(cfg, time.time() + 3600, runs_root=tmp_path / "runs")["dspark_b16"]["runs"]
    assert run["steps"] == 3 and run["init_from"].endswith("checkpoints/dspark_b16")
    # the shipped checkpoint scored on the same held-out set is the curve's first point; the run is the next
    from dartree.training.tools.campaign_train import curve_points, holdout_baseline, plot_curve

    base = holdout_baseline(cfg, "dspark_b16")
    assert base["holdout_sequences"] == 2 and 1.0 <= base["holdout_chain_tau"] <= 16
    assert read_state(cfg)["baseline"]["dspark_b16"] == base and read_state(cfg)["dspark_b16"]["runs"] == [run]
    with pytest.raises(CampaignError, match="already records the baseline of dspark_b16"):
        holdout_baseline(cfg, "dspark_b16")  # recorded once: never overwritten by a later checkpoint
    assert read_state(cfg)["baseline"]["dspark_b16"] == base
    (pts,) = curve_points(cfg).values()
    assert [p["label"] for p in pts] == ["baseline", "1 shards"]
    assert pts[1]["response_tokens"] == base["response_tokens"] + read_manifest(folder)["totals"]["response_tokens"]
    assert pts[1]["predictions"] == base["predictions"] + run["predictions"]
    png = plot_curve(cfg, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a shard lands: the next run continues the first run's lineage (train.lineage, on by default): its data cursor
    # and its schedule go on from the 3 steps the first run took, on the grown data
    cfg.data.goal_response_tokens = read_manifest(folder)["totals"]["response_tokens"] + 1
    run_data(cfg, time.time() + 3600, work=tmp_path / "w")
    cfg.train.overrides = ["train.max_steps=2", "train.num_anchors=4"]
    first, second = run_train(cfg, time.time() + 3600, runs_root=tmp_path / "runs")["dspark_b16"]["runs"]
    assert second["shards"] == 2 and second["init_from"] == str(tmp_path / "runs" / "dspark_b16-00001" / "checkpoint")
    done = json.loads((Path(second["output_dir"]) / "checkpoint" / "training.json").read_text())["state"]
    assert done["lineage"]["step0"] == 3 and done["lineage"]["steps"] == 5
    first_cursor = json.loads((Path(first["output_dir"]) / "checkpoint" / "training.json").read_text())["state"]["cursor"]
    assert done["cursor"]["n"] > first_cursor["n"]  # the grown data, continued, not restarted


def _committed_campaign(folder: Path, cfg) -> None:
    """A campaign folder as committed after a run (manifest, a held-out set and two shards, a recorded baseline),
    written without a target."""
    import hashlib

    from dartree.training.tools.campaign_settings import data_key
    from dartree.training.campaign_store import write_manifest

    (folder / "data").mkdir(parents=True)
    recs = []
    for k, name in enumerate(("holdout", "train-00000", "train-00001")):
        rows = [{"index": 0, "turns": 1, "prompt_ids": [1, 2 + k], "response_ids": [3, 4], "loss_mask": [1, 1]}]
        blob = shard_table(rows, [(type("Item", (), {"id": f"{name}-0", "kind": "chat"})(), None)])
        (folder / "data" / f"{name}.parquet").write_bytes(blob)
        recs.append({"file": f"data/{name}.parquet", "sha256": hashlib.sha256(blob).hexdigest(), "pool": [k, k + 1],
                     "conversations": 1, "response_tokens": 2, "tokens": 4, "seconds": 1.0, "cpu": "test",
                     "gen_dtype": "float32", "threads": 1})
    write_manifest(folder, {"data": data_key(cfg), "holdout": recs[0], "shards": recs[1:]})
    (folder / "train_state.json").write_text(json.dumps({"baseline": {"dspark_b16": {
        "response_tokens": 1000, "predictions": 10_000, "holdout_chain_tau": 1.4}}}))


def test_every_stage_checks_settings_and_files_first_and_draws_beside_its_folder(tmp_path, monkeypatch, capsys):
    """Issue 44, items 2 and 3: every stage (and train.py on campaign data) refuses other data settings and a missing
    or changed shard in one line before loading anything, and the curve goes where the arguments say."""
    import dartree.models.target as target_mod
    import dartree.training.build as build_mod
    from dartree.training.tools.campaign import main
    from dartree.training.campaign_store import REPO
    from dartree.training.tools.train import main as train_main

    def no_load(*a, **k):
        raise AssertionError("loaded a target before the checks")

    monkeypatch.setattr(target_mod, "load_target", no_load)
    monkeypatch.setattr(build_mod, "load_recipe_target", no_load)
    folder = tmp_path / "c"
    _committed_campaign(folder, load_settings(SMALL + [f"dir={folder}"], folder=folder))
    base = SMALL + [f"dir={folder}", f"runs_dir={tmp_path / 'runs'}"]
    # other data settings: refused by name at every stage that uses the data (status only reports)
    for stage in ("verify", "train", "baseline", "curve", "data", "all", "plan"):
        capsys.readouterr()
        extra = [f"out={tmp_path / 'p.json.gz'}", "shards=1"] if stage == "plan" else []
        assert main(base + [f"stage={stage}", "data.max_new_tokens=5"] + extra) == 2, stage
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "other data settings (['max_new_tokens'])" in err[0], (stage, err)
    assert main(base + ["stage=status", "data.max_new_tokens=5"]) == 0
    # the curve of another folder is drawn in that folder (or at out=), never over the committed one
    committed = REPO / "checkpoints" / "campaign_curve.png"
    before = committed.read_bytes()
    assert main(base + ["stage=curve"]) == 0
    assert (folder / "campaign_curve.png").read_bytes()[:4] == b"\x89PNG" and committed.read_bytes() == before
    assert main(base + ["stage=curve", f"out={tmp_path / 'x.png'}"]) == 0 and (tmp_path / "x.png").exists()
    capsys.readouterr()
    assert main(base + ["stage=curve", f"out={tmp_path / 'x.jpg'}"]) == 2
    assert "give out=FILE.png" in capsys.readouterr().err
    # a shard changed since the manifest, then a missing one: every stage stops on it in one line, first
    shard = folder / "data" / "train-00001.parquet"
    blob = shard.read_bytes()
    for broken, words in ((blob[:-1] + bytes([blob[-1] ^ 1]), "does not match its manifest entry (sha256)"),
                          (None, "is missing but")):
        shard.write_bytes(broken) if broken is not None else shard.unlink()
        for stage in ("verify", "train", "baseline", "curve", "data", "all", "status"):
            capsys.readouterr()
            assert main(base + [f"stage={stage}"]) == 2, stage
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and str(shard) in err[0] and words in err[0], (stage, err)
        # training on the campaign's data straight through train.py stops on it too, before the target loads
        assert train_main(["recipe=dspark_b16", "data.source=campaign", f"data.campaign_dir={folder}",
                           f"output_dir={tmp_path / 'run'}"]) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run").exists()

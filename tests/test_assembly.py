"""One assembly (issue 41): ``dartree.load``, the eval session, the bench and the GPU check build their target and
drafter through :func:`dartree.decode.assembly.assemble`, with their flags passed through, and decode with the
:class:`~dartree.decode.assembly.Assembly` it returns; the assembly's dtype choice, exclusions and refusals."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

import dartree.decode.assembly as assembly
from test_eval_cli import tiny_folder  # noqa: F401  (fixture: the tiny target and drafter folders)

REPO = Path(__file__).resolve().parents[1]


class Stop(Exception):
    """Raised by a spy to stop a program where it would start loading (nothing on this machine can run it)."""


class Builds(list):
    """The recorded builds; ``stop_on``: device types whose builds raise :class:`Stop` instead of loading."""

    stop_on: set


@pytest.fixture
def builds(monkeypatch):
    """Every model build the assembly makes (one per dtype candidate) and the row-invariant setting it asks for,
    recorded; the builds go through (but on a device type in ``stop_on``)."""
    calls = Builds()
    calls.stop_on = stop_on = set()
    real_build, real_enter = assembly._build, assembly.enter_invariant

    def build(drafter, target, dtype, linear, tune, device, *rest):
        calls.append({"drafter": None if drafter is None else str(drafter), "target": str(target), "dtype": dtype,
                      "linear": linear, "tune": tune, "device": device.type})
        if device.type in stop_on:
            raise Stop
        calls[-1]["built"] = real_build(drafter, target, dtype, linear, tune, device, *rest)
        return calls[-1]["built"]

    def enter(requested, target, stack):
        next(c for c in calls if c.get("built") is not None and c["built"].target is target)["invariant"] = requested
        return real_enter(requested, target, stack)

    monkeypatch.setattr(assembly, "_build", build)
    monkeypatch.setattr(assembly, "enter_invariant", enter)
    return calls


def _both_candidates(monkeypatch) -> None:
    """``dtype="auto"`` as on a CPU with native bf16: bfloat16 and float32 both candidates."""
    real = assembly.dtype_candidates
    monkeypatch.setattr(assembly, "dtype_candidates", lambda requested, device="cpu": (
        (["bfloat16", "float32"], "auto: stub") if requested == "auto" else real(requested, device)))


def _settings(call: dict) -> tuple:
    return call["dtype"], call["linear"], call["tune"], call["device"], call.get("invariant")


def test_load_decodes_with_the_assembled_models(tiny_folder, builds):  # noqa: F811
    import dartree

    dec = dartree.load(tiny_folder / "ckpt", tiny_folder / "target", dtype="bfloat16", linear="aten", invariant="off",
                       warm_up=False)
    (call,) = builds
    assert _settings(call) == (torch.bfloat16, "aten", False, "cpu", "off")  # load() never tunes
    assert call["drafter"] == str(tiny_folder / "ckpt") and call["target"] == str(tiny_folder / "target")
    models = call["built"]
    assert dec.assembly is models and dec.target is models.target and dec.draft is models.draft
    assert (dec.dtype, dec.linear, dec.invariant) == (torch.bfloat16, "aten", None)
    assert dec.dtype_note.startswith("--dtype bfloat16 requested") and dec.linear == models.linear
    out = dec.generate("Say hi.", max_new_tokens=4, tree="chain", budget=2)  # it decodes with those models
    assert 1 <= len(out.tokens) <= 4 and out.stats.rounds >= 1


def test_the_eval_session_decodes_with_the_assembled_models(tiny_folder, builds):  # noqa: F811
    from dartree.decode.harness.eval import parse_args
    from dartree.decode.harness.session import EvalConfig, open_session

    config = EvalConfig.from_args(parse_args([
        "--target", str(tiny_folder / "target"), "--checkpoint", str(tiny_folder / "ckpt"), "--tree", "chain",
        "--budget", "2", "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "4", "--dtype", "float32",
        "--linear", "onednn", "--no-tune", "--invariant", "on"]))
    printed = io.StringIO()
    with contextlib.ExitStack() as modes:
        s = open_session(config, Console(file=printed, width=200), modes)
        (call,) = builds
        assert _settings(call) == (torch.float32, "onednn", False, "cpu", "on")
        models = call["built"]
        assert s.models is models and s.target is models.target and s.dm is models.draft
        assert models.invariant is not None and s.exact_rows
        env = s.environment(0)
        assert (env["dtype"], env["linear"], env["linear_reason"], env["linear_aten_rows"]) == (
            "float32", "onednn", models.linear_note, {})
        assert env["row_invariant"] == models.invariant_record and env["dtype_reason"] == models.dtype_note
        assert "linear layers: onednn; --linear onednn requested" in printed.getvalue()
    # the eval's modes held the assembly's: closing them gave the target its default kernels back
    assert models.target.model.config._attn_implementation != "dartree_row_invariant"


@pytest.mark.slow
def test_the_bench_measures_the_assembled_models(tiny_folder, builds, tmp_path):  # noqa: F811
    from dartree.decode.harness.bench import main

    out = tmp_path / "bench.json"
    assert main(["--target", str(tiny_folder / "target"), "--checkpoint", str(tiny_folder / "ckpt"), "--tree", "chain",
                 "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "4", "--reps", "1", "--context", "16",
                 "--linear", "aten", "--no-tune", "--invariant", "--out", str(out)]) == 0
    # the bench's own default dtype (float32), its --linear and --no-tune, the mode off then on (--invariant)
    assert [_settings(c) for c in builds] == [(torch.float32, "aten", False, "cpu", "off"),
                                              (torch.float32, "aten", False, "cpu", "on")]
    dtypes = json.loads(out.read_text())["dtypes"]
    assert sorted(dtypes) == ["float32", "float32/invariant"]
    assert dtypes["float32"]["linear_reason"] == builds[0]["built"].linear_note
    assert dtypes["float32"]["row_invariant"] is None
    assert dtypes["float32/invariant"]["row_invariant"] == {k: builds[1]["built"].invariant_record[k]
                                                            for k in ("linear", "why")}


def test_the_gpu_check_runs_on_the_assembled_models(builds):
    from dartree.kernels.tools.gpu_check import load_models

    models, prompts = load_models("smollm2", torch.device("cpu"), dry=True)  # the dry run: tiny target, random drafter
    (call,) = builds
    assert call["target"] == "tiny-qwen3" and _settings(call) == (torch.float32, "aten", False, "cpu", "off")
    assert models is call["built"] and models.target.layer_ids == models.drafter.cfg.target_layer_ids == [1, 2]
    assert [len(p) for p in prompts] == [6, 7]
    builds.stop_on.add("cuda")  # the CUDA run's wiring, stopped where it would load (no device here)
    with pytest.raises(Stop):
        load_models("smollm2", torch.device("cuda"), dry=False)
    assert builds[-1]["drafter"] == str(REPO / "checkpoints" / "dspark_b16") and builds[-1]["target"] == "smollm2"
    assert _settings(builds[-1])[:4] == (torch.bfloat16, "aten", False, "cuda")


def test_auto_times_two_exact_candidates_keeps_one_and_releases_the_other(tiny_folder, builds,  # noqa: F811
                                                                           monkeypatch):
    _both_candidates(monkeypatch)
    lines: list[str] = []
    models = assembly.assemble(tiny_folder / "ckpt", tiny_folder / "target", log=lines.append)
    assert [(c["dtype"], c.get("invariant")) for c in builds] == [(torch.bfloat16, "auto"), (torch.float32, "auto")]
    kept = [c["built"] for c in builds if c["built"] is models]
    others = [c["built"] for c in builds if c["built"] is not models]
    assert len(kept) == 1
    if models.dtype_note.startswith("auto: measured at start-up"):  # both exact here: both timed, figures named
        assert len(others) == 1 and "(timed in " in models.dtype_note
        assert all(o.target.model.config._attn_implementation != "dartree_row_invariant" for o in others)
    else:  # no row-invariant bf16 path on this CPU: bf16 was not a candidate
        assert models.dtype == torch.float32 and "only float32 is exact here: bfloat16 (" in models.dtype_note
    assert (models.invariant is not None) == (models.dtype == torch.bfloat16)
    assert sum(line.startswith("linear layers: ") for line in lines) == 2
    models.close()


def test_invariant_on_without_a_path_drops_the_candidate_or_is_refused(tiny_folder, monkeypatch):  # noqa: F811
    _both_candidates(monkeypatch)
    real = assembly.enter_invariant

    def no_bf16_path(requested, target, stack):
        if target.dtype == torch.bfloat16:
            raise ValueError("no bf16 path here")
        return real(requested, target, stack)

    monkeypatch.setattr(assembly, "enter_invariant", no_bf16_path)
    models = assembly.assemble(tiny_folder / "ckpt", tiny_folder / "target", invariant="on")
    assert models.dtype == torch.float32 and models.invariant is not None
    assert models.dtype_note == "auto: stub; only float32 is exact here: bfloat16 (no bf16 path here)"
    models.close()
    with pytest.raises(assembly.ModeUnavailable, match=r"^no bf16 path here$"):
        assembly.assemble(tiny_folder / "ckpt", tiny_folder / "target", dtype="bfloat16", invariant="on")


def test_a_target_that_does_not_load_and_the_target_alone(tiny_folder, tmp_path):  # noqa: F811
    with pytest.raises(assembly.TargetLoadError, match="cannot load the target") as info:
        assembly.assemble(tiny_folder / "ckpt", tmp_path / "no-such-target", dtype="float32")
    assert info.value.spec == str(tmp_path / "no-such-target") and info.value.reason
    names, why = assembly.dtype_plan("auto", "auto", drafter=False)
    assert names == ["float32"]
    ar = assembly.assemble(None, tiny_folder / "target", dtype="auto", linear="aten")  # plain AR: no drafter, fp32
    assert ar.draft is None and ar.drafter is None and ar.head is None and ar.dtype == torch.float32
    assert ar.dtype_note == why and ar.invariant is None
    with pytest.raises(ValueError, match="invariant must be one of auto, on, off, got 'always'"):
        assembly.dtype_plan("float32", "always")

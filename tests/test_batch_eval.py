"""The throughput curve (decode/batch_ar.py, decode/harness/batch_sweep.py, batch_report.py, ``eval.py --batch``):
the batched AR baseline equal to each prompt's own AR decode, transformers' batched generate as a peer, the sweep's
requests, rows, report and figure, and the CLI end to end on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import VOCAB
from dartree.decode.batch_ar import batched_autoregressive
from dartree.decode.generate import autoregressive_generate
from dartree.decode.harness.batch_report import fig_throughput, sweep_markdown, sweep_warnings, throughput_caption
from dartree.decode.harness.batch_sweep import sweep_requests
from dartree.decode.harness.peers import hf_generate_batch
from dartree.decode.harness.report_rows import BatchRow
from test_eval_cli import tiny_folder  # noqa: F401 (the module's fixture: a tiny Llama with the default tokenizer)

REPO = Path(__file__).resolve().parents[1]
STOP = 1
LENGTHS = (2, 57, 5, 23, 3, 40, 9, 14)


def _prompts(lengths=LENGTHS, seed=11):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _ar(target, p, n, stops=(STOP,)):
    return autoregressive_generate(target, p, max_new_tokens=n, stop_ids=stops).tokens


def test_batched_ar_rows_equal_their_own_ar_decode_at_every_batch_size(target):
    """Rows of very different lengths, per-row caps (0 and 1 end at the prefill), a queue longer than the batch."""
    prompts, caps = _prompts(), [20, 0, 33, 1, 7, 20, 12, 25]
    want = [_ar(target, p, c) for p, c in zip(prompts, caps)]
    for b in (1, 2, 4, 8):
        out = batched_autoregressive(target, prompts, max_new_tokens=caps, stop_ids=[STOP], batch_size=b)
        assert [o.tokens for o in out] == want, b
        assert set(out.widths) == {1} and max(out.rows) == min(b, 6)  # two prompts never enter a round
        assert out.rows[-1] == 1 and out.forwards == len(out.rows)
        for o, w in zip(out, want):  # one token per forward, the first from the prefill
            assert o.stats.accept_lengths == [1] * max(len(w) - 1, 0) and o.stats.new_tokens == len(w)
        if b == 1:  # one row at a time: as many forwards as tokens after the prefills
            assert out.forwards == sum(max(len(w) - 1, 0) for w in want)
    stop = want[0][3]  # a stop id met mid-row ends that row only
    out = batched_autoregressive(target, prompts, max_new_tokens=20, stop_ids=[stop], batch_size=3)
    assert [o.tokens for o in out] == [_ar(target, p, 20, (stop,)) for p in prompts]
    assert out[0].tokens[-1] == stop and len(out[0].tokens) == 4


def test_batched_ar_passes_no_mask_until_rows_differ_in_length(target, monkeypatch):
    prompts = _prompts((6, 6, 11))
    masks, real = [], target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: masks.append(k.get("attention_mask")) or real(*a, **k))
    out = batched_autoregressive(target, prompts, max_new_tokens=[3, 6, 4], batch_size=2)
    assert [o.tokens for o in out] == [_ar(target, p, c, ()) for p, c in zip(prompts, [3, 6, 4])]
    steps = [m for m in masks if m is None or m.shape[-2] == 1]  # the batched steps (prefills have T > 1 queries)
    assert steps[0] is None and steps[1] is None  # two rows of equal length: no hole, no mask (as batch 1)
    assert any(m is not None for m in steps)  # the refill of a longer prompt: holes, masked


def test_batched_ar_t_above_0_is_fixed_by_its_seed(target):
    prompts = _prompts()[:4]
    runs = [batched_autoregressive(target, prompts, max_new_tokens=15, temperature=1.0, batch_size=2,
                                   generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert [o.tokens for o in runs[0]] == [o.tokens for o in runs[1]]
    assert [o.tokens for o in runs[0]] != [o.tokens for o in runs[2]]
    assert all(len(o.tokens) > 0 for o in runs[0])


def test_batched_ar_bad_arguments_are_named(target):
    with pytest.raises(ValueError, match=r"^prompts\[1\] is empty"):
        batched_autoregressive(target, [[3, 4], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^batch_size=0 must be an int >= 1"):
        batched_autoregressive(target, [[3, 4]], max_new_tokens=4, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens holds 1 caps for 2 prompts"):
        batched_autoregressive(target, [[3, 4], [5]], max_new_tokens=[4])
    with pytest.raises(TypeError, match="give a list of prompts"):
        batched_autoregressive(target, "hello", max_new_tokens=4)


def test_hf_generate_batch_left_pads_and_each_row_is_its_ar_decode(target):
    prompts = _prompts((5, 31, 12))
    rows, decode_s, prefill_s = hf_generate_batch(target, prompts, max_new_tokens=10, stop_ids=[STOP])
    assert [r.tokens for r in rows] == [_ar(target, p, 10) for p in prompts]
    assert decode_s > 0 and prefill_s > 0 and all(r.tau == 1.0 for r in rows if len(r.tokens) > 1)
    with pytest.raises(ValueError, match="at least one stop id"):
        hf_generate_batch(target, prompts, max_new_tokens=4, stop_ids=[])


def test_sweep_requests_cycle_the_prompts_into_a_queue_for_the_largest_batch():
    assert sweep_requests(6, [1, 2, 4, 8], 1) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert sweep_requests(6, [1, 2, 4, 8]) == [0, 1, 2, 3, 4, 5] * 2 + [0, 1, 2, 3]  # a queue as long as the batch
    assert sweep_requests(10, [1, 4]) == list(range(10))
    with pytest.raises(ValueError, match="--queue >= 1"):
        sweep_requests(6, [1, 4], 0)
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        sweep_requests(3, [0, 2])


def _report(mismatch: int = 0) -> dict:
    env = {"target": "t", "dtype": "float32", "linear": "onednn", "device": "cpu", "threads": 2, "checkpoint": "c",
           "temperature": 0.0, "budget": "auto"}

    def row(m, b, tps, sp, taus, peer=False, mm=0):
        return {"method": m, "batch": b, "requests": 4, "new_tokens": 128, "decode_s": 128 / tps, "prefill_s": 0.1,
                "forwards": 20, "tokens_per_s": tps, "speedup": sp, "tau_per_row": taus,
                "tau_mean": sum(taus) / len(taus), "rows_per_forward": float(b), "mismatches": mm, "exact": not peer,
                "peer": peer, "budgets": {0: 3, 4: 5} if m == "pruned@auto" else {}, "first_mismatch": None}

    rows = [row("ar", 1, 20.0, 1.0, [1.0]) | {"decode_s_repeats": [1.0, 1.2], "repeat_spread": 0.2 / 1.1},
            row("hf-generate", 1, 10.0, 0.5, [1.0], True),
            row("pruned@auto", 1, 30.0, 1.5, [1.6, 1.8]), row("ar", 4, 60.0, 1.0, [1.0]),
            row("hf-generate", 4, 40.0, 2 / 3, [1.0], True), row("pruned@auto", 4, 63.0, 1.05, [1.2, 1.5], mm=mismatch)]
    return {"environment": env, "batch_sweep": {
        "batches": [1, 4], "requests": 4, "distinct_prompts": 2, "cpu": "X", "max_new_tokens": 32,
        "methods": ["ar", "hf-generate", "pruned@auto"], "rows": rows,
        "one_prompt": {"ar": {"tokens_per_s": 21.0, "mismatches": None},
                       "pruned@auto": {"tokens_per_s": 31.0, "speedup": 31 / 21, "mismatches": 0}},
        "batch1_vs_one_prompt": {"pruned@auto": 1.5 / (31 / 21)}, "policies": {"pruned@auto": {}},
        "row_costs": {4: {"verify_ratio": {1: 1.2, 9: 2.5}, "draft_ratio": 1.4, "seconds": None}}}}


def test_the_sweep_report_tables_warnings_and_figure():
    rep = _report()
    md = sweep_markdown(rep)
    assert "| 4 | pruned@auto | 63.0 | 1.050x | 1.350 (1.20-1.50) | 4.00 | yes |" in md
    assert "| 1 | hf-generate (peer) | 10.0 | 0.500x |" in md
    assert f"| pruned@auto | 31.0 | {31 / 21:.3f}x | 1.500x | {1.5 / (31 / 21):.3f} | yes |" in md
    assert "- pruned@auto at batch 4: 0: 3, 4: 5" in md and "| 4 | 1.20 | 2.50 | 1.40 |" in md
    assert "4 requests from 2 prompts" in md and "CPU X" in md and "N=1: 18.2% over 2 runs" in md
    assert sweep_warnings(rep) == []
    assert sweep_warnings(_report(mismatch=2)) == [
        "WARNING: pruned@auto at batch 4: 2 requests differ from their AR output (first: None); decoding is not "
        "lossless here"]
    fig = fig_throughput(rep)
    tp, sp = fig.axes
    lines = {(ax is sp, ln.get_gid()): (list(ln.get_xdata()), list(ln.get_ydata())) for ax in (tp, sp)
             for ln in ax.get_lines()}
    assert lines[(False, "ar")] == ([1, 4], [20.0, 60.0])
    assert lines[(False, "pruned@auto")] == ([1, 4], [30.0, 63.0])
    assert lines[(True, "pruned@auto")] == ([1, 4], [1.5, 1.05])
    assert lines[(True, "ar")][1] == [1.0, 1.0]  # batched AR, the 1x line
    assert [ln.get_linestyle() for ln in tp.get_lines() if ln.get_gid() == "hf-generate"] == ["--"]
    assert "pruned@auto: N=1 30.0 tok/s 1.50x, N=4 63.0 tok/s 1.05x" in throughput_caption(rep)


@pytest.mark.slow
def test_eval_cli_batch_sweep_end_to_end(tiny_folder, tmp_path):  # noqa: F811
    out = tmp_path / "rep"
    cmd = [sys.executable, "decode/eval.py", "--target", str(tiny_folder / "target"), "--checkpoint",
           str(tiny_folder / "ckpt"), "--tree", "pruned", "pruned@B4", "--datasets", "gsm8k", "mtbench", "--limit",
           "1", "--max-new-tokens", "10", "--batch", "1", "2", "4", "--queue", "1", "--peers", "hf-generate", "--out",
           str(out)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    rep = json.loads((out / "report.json").read_text())
    sw = rep["batch_sweep"]
    assert sw["batches"] == [1, 2, 4] and sw["requests"] == 4 and sw["distinct_prompts"] == 2
    assert sw["methods"] == ["ar", "hf-generate", "pruned@auto", "pruned@B4"]
    assert [(x["batch"], x["method"]) for x in sw["rows"]] == [(b, m) for b in (1, 2, 4) for m in sw["methods"]]
    assert [BatchRow.from_json(x).to_json() for x in sw["rows"]] == sw["rows"]  # the typed rows read back exactly
    for x in sw["rows"]:
        assert x["mismatches"] == 0 and x["tokens_per_s"] > 0 and len(x["tau_per_row"]) == 4
        assert x["rows_per_forward"] <= x["batch"]
        if x["method"] == "ar":  # two passes per batch size (--ar-repeats 2): its time the mean of the two
            assert x["speedup"] == 1.0 and x["tau_mean"] == 1.0 and len(x["decode_s_repeats"]) == 2
            assert x["decode_s"] == pytest.approx(sum(x["decode_s_repeats"]) / 2)
        else:  # every row runs once per pass; its speedup is the median (of two: the mean) of its paired ratios
            assert len(x["decode_s_repeats"]) == 2 and len(x["speedup_passes"]) == 2
            assert x["speedup"] == pytest.approx(sum(x["speedup_passes"]) / 2)
    assert set(sw["one_prompt"]) == {"ar", "pruned@auto", "pruned@B4"}
    assert set(sw["batch1_vs_one_prompt"]) == {"pruned@auto", "pruned@B4"}
    assert set(sw["row_costs"]) == {"2", "4"} and set(sw["policies"]) == {"pruned@auto"}
    assert (out / "throughput.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "| 4 | pruned@B4 |" in md and "![Throughput against batch](throughput.png)" in md


def test_eval_cli_batch_refuses_what_a_sweep_cannot_take(tmp_path):
    for extra, msg in ((["--batch", "0", "2"], "--batch sizes must be >= 1"),
                       (["--batch", "2", "--queue", "0"], "--queue must be >= 1"),
                       (["--batch", "2", "--paired"], "drop --paired"),
                       (["--batch", "2", "--peers", "ar-bf16"], "drop --peers ar-bf16")):
        r = subprocess.run([sys.executable, "decode/eval.py", *extra, "--out", str(tmp_path / "r")], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

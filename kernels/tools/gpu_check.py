"""GPU acceptance check: kernels vs their torch twins, tree-build timing, a bf16 eval; one JSON report.

Usage (``make gpu-check``)::

    python kernels/tools/gpu_check.py [--out reports/gpu_check.json] [--time-limit 480] [--dry] [--target smollm2|FOLDER]

On CUDA (about 8 minutes at most, ``--time-limit`` seconds; later sections are marked ``skipped`` past it):

1. ``kernels``: every Triton kernel in ``dartree.kernels`` against its plain-torch ``*_ref`` twin over the shape
   table of tests/test_kernels.py (ids, picks and masks exactly equal; floats within per-dtype tolerances).
2. ``tree_build``: milliseconds per build of ``pruned`` (W = B) vs ``heap-sequential`` at B = 64, 128, 256 on a
   real draft block of the default drafter, median of repeated builds with ``torch.cuda.synchronize()`` around
   each; also whether both give the same node set (DARTree Lemma 1; reported, not a failure: float ties may flip).
3. ``eval``: the default target in bf16 with the default drafter, every registered builder at B = 16 and 64,
   greedy, a few fixed prompts: tau, ms per output token, per-stage ms per round, and the AR mismatch count
   (bf16 near-ties may flip tokens, so reported, not a failure).
4. ``invariant``: the row-invariant mode's Triton path on the bf16 target (:func:`check_invariant`): verify rows
   (9 and 17, chain and tree) bit-equal to AR steps with the default kernels and in the mode (in the mode every
   row must be: a failure else), ms per AR step and per verify in the mode vs the default kernels, and chain /
   pruned outputs in the mode equal to AR (a failure else).

Without CUDA (or with ``--dry``) the same sections run small: Triton under ``TRITON_INTERPRET=1`` on tiny shapes,
tree builds at B = 8, 16, a fp32 eval on the tiny random target, where every speculative output must equal
AR's exactly (a mismatch is a failure), and the ``invariant`` section on that target (9-row verifies, no timing). Exit status: 0 when every check passed, 1 on any kernel mismatch, dry
AR mismatch or a section that raised, 2 on bad arguments. The target and drafter of sections 2-4 are built by
:func:`dartree.decode.assembly.assemble`, as for ``dartree.load``, eval and the bench (:func:`load_models`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.decode.assembly import assemble
from dartree.decode.builders import BUILDERS, get_builder
from dartree.decode.draft import draft_block
from dartree.decode.generate import autoregressive_generate, speculative_generate
from dartree.decode.settings import DecodeSettings
from dartree.decode.harness.invariance import _tree_mask, verify_rows_vs_ar
from dartree.kernels.candidates import topk_candidates, topk_candidates_ref
from dartree.kernels.frontier import frontier_topk, frontier_topk_ref
from dartree.kernels.gru import gru_cell, gru_cell_ref
from dartree.kernels.tree_compile import tree_attention, tree_attention_ref
from dartree.models.chat import chat_prompt_ids
from dartree.models.checkpoint import save_dartree
from dartree.models.drafter import DFlashDrafter, DraftCache, DrafterConfig
from dartree.models.families.dspark import MarkovHead
from dartree.models.invariant import row_invariant
from dartree.models.target import TINY_TARGET

REPO = Path(__file__).resolve().parents[2]
SIZES = [1, 7, 63, 64, 65]  # tests/test_kernels.py: one row, odd, around a power of two
DRY_SIZES = [1, 7]
PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a Python function that reverses a string.",
           "A farmer has 12 cows and buys 7 more. Each cow gives 3 litres of milk. How much milk per day?"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(kernel: str, shape: dict, dtype, ok: bool, err: float = 0.0, note: str = "") -> dict:
    return {"kernel": kernel, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "ok": bool(ok),
            "max_abs_err": float(err), **({"note": note} if note else {})}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def check_kernels(dev: torch.device, dry: bool) -> list[dict]:
    """Every Triton kernel vs its torch twin over the shape table (tests/test_kernels.py).

    Args:
        dev: where the Triton kernel runs (cuda, or cpu under ``TRITON_INTERPRET=1``).
        dry: use the small table (interpreter cost grows with the number of programs).
    Returns:
        One row per (kernel, shape, dtype): ``ok`` (ids / picks / masks exactly equal, floats within
        each kernel's tolerance) and the largest absolute float error.
    """
    sizes = DRY_SIZES if dry else SIZES
    low = [torch.float32, torch.float16] if dry else [torch.float32, torch.float16, torch.bfloat16]
    rows = []
    for m in sizes:  # candidates: M rows over an odd vocabulary spanning two blocks, with exact ties
        x = torch.randn(m, 1100, generator=_gen(m))
        x[:, ::7] = x[:, :1]
        ids, vals, lse = topk_candidates(x.to(dev), 9, backend="triton")
        rids, rvals, rlse = topk_candidates_ref(x, 9)
        e = _err(lse, rlse)
        rows.append(_row("candidates", {"rows": m, "V": 1100, "K": 9}, torch.float32,
                         torch.equal(ids.cpu(), rids) and torch.equal(vals.cpu(), rvals) and e <= 1e-5, e))
    for k in sizes:
        for dt in low:
            x = (torch.randn(3, 97, generator=_gen(k)) * 4).to(dt)
            ids, vals, lse = topk_candidates(x.to(dev), k, backend="triton")
            rids, rvals, rlse = topk_candidates_ref(x, k)
            e = _err(lse, rlse)
            rows.append(_row("candidates", {"rows": 3, "V": 97, "K": k}, dt,
                             torch.equal(ids.cpu(), rids) and torch.equal(vals.cpu(), rvals) and e <= 1e-5, e))
    for f in sizes:  # frontier: F parents x K candidates, rank R of the head's low-rank form (0: identity)
        for r in ([0, 5] if dry else [0, 5, 64]):
            g = _gen(100 * f + r)
            k = 64 if f != 7 else 33
            base, s = torch.randn(k, generator=g) * 3, -torch.rand(f, generator=g) * 4
            act = torch.randn(f, r, generator=g) if r else None
            w = torch.randn(k, r, generator=g) * 0.3 if r else None
            q = {1: 1, 7: 12, 63: 64, 64: 4, 65: 30}[f]
            mv = (lambda t: None if t is None else t.to(dev))
            pick, path = frontier_topk(base.to(dev), s.to(dev), q, mv(act), mv(w), backend="triton")
            rpick, rpath = frontier_topk_ref(base, s, q, act, w)
            e = _err(path, rpath)
            rows.append(_row("frontier", {"F": f, "K": k, "R": r, "quota": q}, torch.float32,
                             torch.equal(pick.cpu(), rpick) and e <= 1e-5 * (1 + float(rpath.abs().max())), e))
    for n in sizes:  # GRU cell: N rows, hidden G
        g_dim = {1: 5, 7: 64, 63: 17, 64: 33, 65: 65}[n]
        for dt in (torch.float32, torch.float16):
            gen = _gen(n)
            gi = torch.randn(n, 3 * g_dim, generator=gen).to(dt)
            h = torch.randn(n, g_dim, generator=gen).to(dt)
            w = (torch.randn(3 * g_dim, g_dim, generator=gen) / g_dim**0.5).to(dt)
            got = gru_cell(gi.to(dev), h.to(dev), w.to(dev), backend="triton")
            ref = gru_cell_ref(gi, h, w)
            e = _err(got, ref)
            rows.append(_row("gru", {"N": n, "G": g_dim}, dt, e <= 1e-4 * (1 + float(ref.abs().max())), e))
    for m in [0] + sizes:  # tree compile: random, chain and star trees
        g = _gen(m)
        rnd = torch.tensor([int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(m)], dtype=torch.long)
        for dt in low:
            ok = True
            for parents in (rnd, torch.arange(m), torch.zeros(m, dtype=torch.long)):
                got = tree_attention(parents.to(dev), 11, dt, backend="triton")
                ref = tree_attention_ref(parents, 11, dt)
                ok = ok and all(a.dtype == b.dtype and torch.equal(a.cpu(), b) for a, b in zip(got, ref))
            rows.append(_row("tree_compile", {"M": m, "start": 11}, dt, ok))
    return rows


def _median_ms(fn, dev: torch.device, reps: int) -> float:
    fn()  # warm-up (Triton compile, allocator)
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out)


def time_tree_builds(block, head, root_id: int, budgets: list[int], dev: torch.device, reps: int) -> list[dict]:
    """Milliseconds per tree build, ``pruned`` (W = B, K = 64) vs ``heap-sequential`` (K = 64), per budget B.

    Args:
        block: a DraftBlock on ``dev``; head: its correction head; root_id: the anchor token.
        budgets: the B values. reps: timed builds per point (median, after one warm-up, synchronised).
    Returns:
        Rows {budget, pruned_ms, heap_sequential_ms, speedup, same_nodes}; ``same_nodes`` compares the two node
        sets as (depth, token, parent token path) sets (equal in exact arithmetic, DARTree Lemma 1).
    """
    def paths(tree):
        out, toks, par = set(), tree.tokens.tolist(), tree.parents.tolist()
        for i in range(len(toks)):
            p, j = [], i + 1
            while j:
                p.append(toks[j - 1])
                j = par[j - 1]
            out.add(tuple(reversed(p)))
        return out

    pruned, heap = get_builder("pruned"), get_builder("heap-sequential")
    rows = []
    for b in budgets:
        fp = lambda: pruned(block, head, root_id, b, k=64, width=b)  # noqa: E731
        fh = lambda: heap(block, head, root_id, b, k=64)  # noqa: E731
        tp, th = _median_ms(fp, dev, reps), _median_ms(fh, dev, reps)
        rows.append({"budget": b, "pruned_ms": tp, "heap_sequential_ms": th, "speedup": th / tp if tp else None,
                     "same_nodes": paths(fp()) == paths(fh())})
    return rows


def run_eval(models, prompts: list[list[int]], budgets: list[int], max_new_tokens: int,
             deadline: float) -> list[dict]:
    """Greedy eval of every registered builder (one name per builder function) at each budget vs AR.

    Args:
        models: the :class:`~dartree.decode.assembly.Assembly` (:func:`load_models`); prompts: chat-templated
            token id lists.
        budgets: tree budgets B; max_new_tokens: per prompt; deadline: ``time.time()`` after which the
            remaining runs are skipped.
    Returns:
        Rows {method, budget, tau, ms_per_token, stage_ms_per_round, mismatches, skipped}; the first row is
        ``ar`` (ms per token of plain decoding).
    """
    target, drafter, head = models.target, models.drafter, models.head
    dev = target.device
    names, seen = [], set()
    for name, fn in BUILDERS.items():  # aliases share a function: run each builder once
        if id(fn) not in seen:
            seen.add(id(fn))
            names.append(name)
    autoregressive_generate(target, prompts[0], max_new_tokens=4)  # warm-up
    ar, ar_s, ar_n = [], 0.0, 0
    for p in prompts:
        _sync(dev)
        o = autoregressive_generate(target, p, max_new_tokens=max_new_tokens)
        _sync(dev)
        ar.append(o.tokens)
        ar_s, ar_n = ar_s + o.stats.decode_s, ar_n + max(o.stats.new_tokens - 1, 1)
    rows = [{"method": "ar", "budget": 0, "ms_per_token": 1000 * ar_s / ar_n}]
    for b in budgets:
        for name in names:
            row = {"method": name, "budget": b}
            if time.time() > deadline:
                rows.append({**row, "skipped": "time limit"})
                continue
            speculative_generate(target, drafter, head, prompts[0], DecodeSettings(name, b, max_new_tokens=4))
            lens, dec, n_tok, mism = [], 0.0, 0, 0
            stages: dict[str, float] = {}
            for p, ref in zip(prompts, ar):
                _sync(dev)
                o = speculative_generate(target, drafter, head, p,
                                         DecodeSettings(name, b, max_new_tokens=max_new_tokens))
                _sync(dev)
                lens += o.stats.accept_lengths
                dec, n_tok = dec + o.stats.decode_s, n_tok + max(o.stats.new_tokens - 1, 1)
                mism += int(o.tokens != ref)
                for k, v in o.stats.stage_s.items():
                    stages[k] = stages.get(k, 0.0) + v
            rounds = max(len(lens), 1)
            rows.append({**row, "tau": sum(lens) / rounds, "ms_per_token": 1000 * dec / n_tok,
                         "stage_ms_per_round": {k: 1000 * v / rounds for k, v in stages.items()},
                         "mismatches": mism})
    return rows


def _verify_ms(target, prompt: list[int], rows: int, dev: torch.device, reps: int) -> float:
    """Milliseconds per target forward of ``rows`` tokens (1: an AR step; more: a chain verify under its mask)
    from a key/value cache of ``prompt``, median of ``reps`` synchronised calls; the cache is cropped back to the
    prompt after each call (slicing, outside the forward's own kernels, so a copy of the cache is not timed)."""
    from transformers import DynamicCache

    m, p = target.model, len(prompt)
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(input_ids=torch.tensor([prompt], device=dev), past_key_values=cache, use_cache=True)
    ids = torch.tensor([(prompt * rows)[:rows]], device=dev)
    pos = torch.arange(p, p + rows, device=dev)[None]
    mask = None if rows == 1 else _tree_mask(p, rows, m.dtype, False).to(dev)

    def call():
        with torch.no_grad():
            m(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache.crop(-rows)  # back to the prompt (transformers 5.23: a negative count removes tokens)
    return _median_ms(call, dev, reps)


def check_invariant(models, prompts: list[list[int]], dry: bool, deadline: float) -> dict:
    """The row-invariant mode's Triton path (``row_invariant(target, backend="triton")``): exactness and cost.

    1. ``rows``: for a verify of 9 and 17 rows (a chain, and siblings under the root), how many rows give logits
       bit-equal to the AR step's, with the default kernels (``off``) and inside the mode (``on``)
       (:func:`dartree.decode.harness.invariance.verify_rows_vs_ar`); in the mode every row must (a failure else).
    2. ``ms`` (CUDA only): milliseconds per AR step and per 9- and 17-row verify, default kernels vs the mode, and
       their ratios.
    3. ``eval``: chain and DARTree-pruned at B = 16 (dry: B = 4, one prompt, 6 tokens) inside the mode against AR
       inside the mode: tau and the prompts whose output differs (must be none).

    Args:
        models, prompts: as :func:`run_eval` (dry: the tiny fp32 target on CPU, under the Triton interpreter), the
            mode off as assembled. dry: small sizes, no timing. deadline: ``time.time()`` past which the eval is
            skipped.
    Returns:
        {"dtype", "rows": [{mode, rows, shape, equal, of}], "ms": {...} (CUDA), "eval": [...], "failures": [...]}.
    """
    target, drafter, head = models.target, models.drafter, models.head
    dev, prompt = target.device, prompts[0]
    sizes = [9] if dry else [9, 17]
    out: dict = {"dtype": str(target.dtype).replace("torch.", ""), "rows": [], "eval": [], "failures": []}
    for mode in ("off", "on"):
        for rows in sizes:
            for shape in ("chain", "tree"):
                if mode == "on":
                    with row_invariant(target, backend="triton"):
                        eq = verify_rows_vs_ar(target, prompt, rows, tree=shape == "tree")
                else:
                    eq = verify_rows_vs_ar(target, prompt, rows, tree=shape == "tree")
                out["rows"].append({"mode": mode, "rows": rows, "shape": shape, "equal": sum(eq), "of": len(eq)})
                if mode == "on" and not all(eq):
                    out["failures"].append(f"invariant: {rows}-row {shape} verify in the mode: rows "
                                           f"{[i for i, e in enumerate(eq) if not e]} differ from the AR step")
    if not dry:
        ms: dict = {}
        for mode in ("off", "on"):
            for rows in (1, 9, 17):
                if mode == "on":
                    with row_invariant(target, backend="triton"):
                        ms[f"{mode}_{rows}"] = _verify_ms(target, prompt, rows, dev, 20)
                else:
                    ms[f"{mode}_{rows}"] = _verify_ms(target, prompt, rows, dev, 20)
        for rows in (1, 9, 17):
            ms[f"ratio_{rows}"] = ms[f"on_{rows}"] / ms[f"off_{rows}"]
        out["ms"] = ms
    if time.time() > deadline:
        out["eval"] = {"skipped": "time limit"}
        return out
    new, budget = (6, 4) if dry else (64, 16)  # dry: one prompt, small (the interpreter runs a program per row)
    prompts = prompts[:1] if dry else prompts
    with row_invariant(target, backend="triton"):
        ar = [autoregressive_generate(target, p, max_new_tokens=new).tokens for p in prompts]
        for name in ("chain", "pruned"):
            lens, diff = [], []
            for i, (p, ref) in enumerate(zip(prompts, ar)):
                o = speculative_generate(target, drafter, head, p, DecodeSettings(name, budget, max_new_tokens=new))
                lens += o.stats.accept_lengths
                if list(o.tokens) != list(ref):
                    diff.append(i)
            out["eval"].append({"method": name, "budget": budget, "tau": sum(lens) / max(len(lens), 1),
                                "differs_from_ar": diff})
            if diff:
                out["failures"].append(f"invariant: {name} B={budget} in the mode differs from AR on prompts {diff}")
    return out


def load_models(target: str, dev: torch.device, dry: bool):
    """The target and drafter the check runs on, through :func:`dartree.decode.assembly.assemble` (the assembly
    eval, the bench and :func:`dartree.load` use), with the default kernels (``invariant="off"``: the
    ``invariant`` section enters the Triton mode itself) and plain F.linear.

    Args:
        target: ``--target`` (the CUDA run's target). dev: the CUDA device. dry: the tiny random fp32 target
            (``tiny-qwen3``, 96 tokens) on CPU with a random one-layer DFlash drafter and Markov head (seed 0), which
            are written as a dartree checkpoint in a temporary folder and assembled from there.
    Returns:
        (:class:`~dartree.decode.assembly.Assembly`, the prompts' token ids: random for the dry run, else
        :data:`PROMPTS` through the chat template).
    Raises:
        ValueError: the target does not load, or the drafter does not fit it (from ``assemble``).
    """
    import tempfile

    if not dry:
        models = assemble(REPO / "checkpoints" / "dspark_b16", target, dtype="bfloat16", linear="aten",
                          invariant="off", device=dev)
        return models, [chat_prompt_ids(models.target.tokenizer, t) for t in PROMPTS]
    torch.manual_seed(0)  # the test suite's tiny shapes, random weights
    drafter = DFlashDrafter(DrafterConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        target_layer_ids=[1, 2], mask_token_id=0, block_size=8)).eval()
    head = MarkovHead(96, 8).eval()
    torch.nn.init.normal_(head.w2.weight, std=0.5)
    with tempfile.TemporaryDirectory() as tmp:
        save_dartree(Path(tmp) / "drafter", drafter, head, {"name": TINY_TARGET, "vocab_size": 96, "hidden_size": 32,
                                                              "num_layers": 4}, dtype=torch.float32)
        models = assemble(Path(tmp) / "drafter", TINY_TARGET, dtype="float32", linear="aten", invariant="off")
    g = _gen(7)
    return models, [torch.randint(2, 96, (6 + i,), generator=g).tolist() for i in range(2)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/gpu_check.json", help="JSON report path")
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--dry", action="store_true", help="tiny CPU run (Triton interpreter, tiny target)")
    ap.add_argument("--target", default="smollm2",
                    help="the CUDA run's target: smollm2 (the packaged default) or a local Hugging Face folder of "
                         "the same architecture (e.g. one with random weights where the 94 MB GGUF cannot travel)")
    return ap.parse_args(argv)


def new_report(dry: bool) -> dict:
    """The report before any section ran: mode, device, torch / python / triton versions (triton None when it is
    not installed) and empty ``failures``, ``kernels``, ``tree_build`` and ``eval``."""
    report: dict = {"mode": "dry" if dry else "cuda", "device": torch.cuda.get_device_name(0) if not dry else "cpu",
                    "torch": torch.__version__, "python": platform.python_version(), "failures": [],
                    "kernels": [], "tree_build": [], "eval": []}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    return report


def main(argv=None) -> int:
    """Run the check and write the JSON report; returns the exit status (0 ok, 1 a failure, 2 bad arguments)."""
    args = parse_args(argv)
    if not args.time_limit > 0:
        return fail(f"--time-limit must be > 0, got {args.time_limit}")
    cuda = torch.cuda.is_available()
    dry = args.dry or not cuda
    if dry and not cuda and not args.dry:
        print("no CUDA device: running the --dry check", file=sys.stderr)
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before the lazily imported kernel modules define their kernels
    t_start = time.time()
    deadline = t_start + args.time_limit
    dev = torch.device("cpu" if dry else "cuda")
    report = new_report(dry)

    def section(name: str, fn) -> None:
        if time.time() > deadline:
            report[name] = {"skipped": "time limit"}
            return
        t0 = time.time()
        try:
            report[name] = fn()
        except Exception as exc:  # a section that raises is a failure, reported with its traceback tail
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            report["failures"].append(f"{name}: {type(exc).__name__}: {exc}")
        report.setdefault("section_s", {})[name] = time.time() - t0

    section("kernels", lambda: check_kernels(dev, dry))
    if isinstance(report["kernels"], list):
        report["failures"] += [f"kernels: {r['kernel']} {r['shape']} {r['dtype']} mismatch (max err "
                               f"{r['max_abs_err']:.3g})" for r in report["kernels"] if not r["ok"]]

    models: dict = {}

    def load() -> dict:
        assembled, prompts = load_models(args.target, dev, dry)
        target, drafter, head = assembled.target, assembled.drafter, assembled.head
        cache = target.new_cache()
        ids = torch.tensor([prompts[0]], device=target.device)
        feats = target.forward(ids, cache=cache).features[0]
        block = draft_block(target, drafter, prompts[0][-1], len(prompts[0]) - 1, feats[:-1],
                            DraftCache(len(drafter.layers)))
        models.update(assembled=assembled, prompts=prompts, block=block, root=prompts[0][-1])
        return {"target": getattr(target, "name", "tiny"), "dtype": str(target.dtype).replace("torch.", ""),
                "drafter_block_size": drafter.cfg.block_size, "head": type(head).__name__}

    section("models", load)
    if models:
        section("tree_build", lambda: time_tree_builds(models["block"], models["assembled"].head, models["root"],
                                                       [8, 16] if dry else [64, 128, 256], dev, 2 if dry else 10))
        section("eval", lambda: run_eval(models["assembled"], models["prompts"], [4] if dry else [16, 64],
                                         8 if dry else 64, deadline))
        if dry and isinstance(report["eval"], list):
            report["failures"] += [f"eval: {r['method']} B={r['budget']} differs from AR on {r['mismatches']} "
                                   "prompt(s) in fp32" for r in report["eval"] if r.get("mismatches")]
        section("invariant", lambda: check_invariant(models["assembled"], models["prompts"], dry, deadline))
        if isinstance(report.get("invariant"), dict):
            report["failures"] += report["invariant"].get("failures", [])
    report["elapsed_s"] = time.time() - t_start
    report["ok"] = not report["failures"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(out, json.dumps(report, indent=2, default=str))
    print(f"gpu_check ({report['mode']}): {'ok' if report['ok'] else 'FAILED'} in {report['elapsed_s']:.0f}s; "
          f"{sum(r['ok'] for r in report['kernels']) if isinstance(report['kernels'], list) else 0} kernel checks "
          f"passed; report {out}")
    for f in report["failures"]:
        print("  " + f, file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Round-cost benchmark: where one speculative round spends its time, in units of one AR step.

``python decode/bench.py [--tree chain pruned] [--budget 2 4 8 16] [--dtype float32 bfloat16] [--invariant] [--profile]
[--datasets ... | --prompts FILE]``

For every dtype the target and drafter are assembled once (:func:`dartree.decode.assembly.assemble`, the assembly
eval and :func:`dartree.load` use; ``--dtype`` is ``float32`` by default, not eval's ``auto``, and never a measured
choice: the bench measures the dtypes it is given side by side, the row-invariant mode off, or on in the
``DTYPE/invariant`` pass of ``--invariant``) and, in that one process:

1. the AR step t_AR (ms per token of plain greedy decoding, prefill excluded) is measured over the prompts;
2. the verify cost curve t_verify(M) is measured for M+1 = 1, 2, 5, 9, 17, 33, 65 tree tokens (a chain of M
   draft tokens after the root, on a context of ``--context`` tokens; median of ``--reps`` forwards, the cache
   rolled back after each), with its ratio to t_AR;
3. every method x budget decodes the prompts; per round it reports ms per stage (draft, tree_build,
   tree_compile, verify, commit) and each as a multiple of t_AR, tau, speedup over AR, and the break-even
   tau = t_round / t_AR (the acceptance length at which the method would match AR).

speedup = tau x t_AR / t_round (docs/performance.md). ``--replay`` also replays each method's rounds at its largest budget
for every smaller budget, under the ``--budget auto`` policy and under a hindsight per-round choice
(:mod:`dartree.decode.replay`), with round times modelled from this run's stages and verify curve: a budget sweep and
a check of the auto policy from one decode per method. ``--profile`` adds a torch.profiler table of the ops of one
method's decoding. Results go to ``--out`` (JSON, written atomically). Run it alone: the figures depend on what
else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dartree.decode.budget import CostModel, calibrate
from dartree.decode.generate import (POLICY_PROMPT, STAGES, autoregressive_generate, seed_policy, speculative_generate,
                                     warm_paths)
from dartree.decode.harness.flags import add_decode_flags
from dartree.decode.harness.prompts import load_prompt_file, load_prompts
from dartree.decode.harness.runner import PromptDecode, decode_one
from dartree.decode.settings import DecodeSettings
from dartree.decode.harness.session import encode_prompts, prompt_encoder
from dartree.decode.inputs import check_prompt_set
from dartree.models.chat import chat_prompt_ids
from dartree.decode.builders import builder_beta, builder_name
from dartree.decode.trees import Tree
from dartree.decode.verify import compile_tree
from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.dtypes import DTYPES
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.packed import choose_linear
from dartree.models.target import compact_cache
from dartree.decode.assembly import ModeUnavailable, assemble
from dartree.decode.replay import recorded_round, replay_auto, replay_fixed, replay_hindsight

VERIFY_SIZES = (1, 2, 5, 9, 17, 33, 65)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (argparse); ``--help`` lists every default."""
    ap = argparse.ArgumentParser(prog="dartree-bench", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_decode_flags(ap, sweep=True, tree=["chain", "pruned"], budget=[2, 4, 8, 16], dtype=["float32"],
                     linear=["auto"], limit=1, max_new_tokens=128, out="reports/decode-bench.json", helps={
        "tree": "methods (registered tree builders)",
        "budget": "budgets B for tree builders (chain runs once, with its full length)",
        "dtype": "dtypes to measure side by side (no auto: the bench reports named modes, eval measures the choice)",
        "linear": "linear-layer matmul paths to measure (dartree.models.packed); several give a before/after table "
                  "per dtype, e.g. --linear aten onednn",
        "tune": "keep the fixed single-row rule instead of timing F.linear against the packed call per row count "
                "(dartree.models.packed.tune_linears), for a before/after comparison",
        "invariant": "also measure every dtype in the row-invariant mode (dartree.models.invariant), labelled "
                     "DTYPE/invariant: its AR step, verify curve and rounds beside the default kernels' (its cost)"})
    ap.add_argument("--auto", action="store_true", help="also run every method with budget auto (cost model)")
    ap.add_argument("--context", type=int, default=400, help="context tokens for the verify cost curve")
    ap.add_argument("--reps", type=int, default=5, help="forwards per verify size (median)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the first method's decoding")
    ap.add_argument("--replay", action="store_true",
                    help="replay every method's rounds at its largest budget for each smaller budget, the auto policy "
                         "and a hindsight per-round choice (dartree.decode.replay), times modelled from this run")
    ap.add_argument("--replay-orders", type=int, default=1,
                    help="with --replay: also replay the auto policy (both rules) over this many shuffled orders of "
                         "the prompts, each from a fresh policy, and report the mean and worst against the best "
                         "fixed budget (1: the order the prompts ran in only)")
    return ap.parse_args(argv)


@torch.inference_mode()
def verify_curve(target, context_ids: list[int], sizes=VERIFY_SIZES, reps: int = 5) -> dict[int, float]:
    """Median seconds of one tree-verify forward of ``T`` = M+1 tokens (a chain of M nodes) after ``context_ids``.

    Args:
        target: a :class:`dartree.models.target.Target`.
        context_ids: committed token ids already in the cache (prefilled once here).
        sizes: token counts T >= 1 (root included).
        reps: forwards per size; the cache is rolled back to the context after each.
    Returns:
        {T: seconds} (median over ``reps`` after one warm-up forward).
    Raises:
        ValueError: an empty context or a size < 1.
    """
    if not context_ids:
        raise ValueError("verify_curve needs a non-empty context")
    if min(sizes) < 1:
        raise ValueError(f"verify sizes must be >= 1 (root included), got {sorted(sizes)}")
    cache = target.new_cache()
    start = len(context_ids) - 1
    target.forward(torch.tensor([context_ids[:-1]], device=target.device), cache=cache, logits_slice=slice(-1, None))
    out = {}
    for t in sizes:
        m = t - 1
        tree = Tree(torch.full((m,), int(context_ids[-1]), dtype=torch.long), torch.arange(m, dtype=torch.long),
                    torch.arange(1, m + 1, dtype=torch.long), torch.zeros(m))
        inp = compile_tree(tree, int(context_ids[-1]), start, dtype=target.dtype, device=target.device)
        times = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask, cache=cache)
            dt = time.perf_counter() - t0
            compact_cache(cache, start, torch.zeros(0, dtype=torch.long))
            if r:
                times.append(dt)
        out[t] = statistics.median(times)
    return out


def round_costs(stats_list, t_ar: float) -> dict:
    """Per-round stage costs of several decodes of one method.

    Args:
        stats_list: ``DecodeStats`` of the decodes.
        t_ar: seconds of one AR step (same process).
    Returns:
        dict with ``rounds``, ``tau``, ``<stage>_ms`` and ``<stage>_ar`` per stage, ``round_ms``, ``round_ar``
        (= the break-even tau), ``tokens_per_s`` and ``predicted_speedup`` = tau x t_AR / t_round.
    """
    rounds = sum(s.rounds for s in stats_list)
    committed = sum(sum(s.accept_lengths) for s in stats_list)
    out = {"rounds": rounds, "tau": committed / rounds if rounds else float("nan")}
    total = 0.0
    for st in STAGES:
        sec = sum(s.stage_s.get(st, 0.0) for s in stats_list) / max(rounds, 1)
        total += sec
        out[f"{st}_ms"] = 1000 * sec
        out[f"{st}_ar"] = sec / t_ar
    out["round_ms"] = 1000 * total
    out["round_ar"] = total / t_ar
    out["break_even_tau"] = total / t_ar
    dec_tok = sum(max(s.new_tokens - 1, 0) for s in stats_list)
    dec_s = sum(s.decode_s for s in stats_list)
    out["tokens_per_s"] = dec_tok / dec_s if dec_s else float("nan")
    out["speedup"] = out["tokens_per_s"] * t_ar
    out["mean_tree_nodes"] = (sum(sum(s.tree_nodes) for s in stats_list) / rounds) if rounds else float("nan")
    return out


REPLAY_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def replay_orders(prompts: list, orders: int, new_policy, beta: float, round_s, t_ar: float, best_rate: float) -> dict:
    """The ``--budget auto`` policy of both rules replayed over ``orders`` orders of the recorded prompts (the order
    they ran in, then seeded shuffles), each from a fresh policy.

    Args:
        prompts: per prompt, its recorded rounds (:func:`~dartree.decode.replay.recorded_round` pairs).
        orders: how many orders (>= 1).
        new_policy: rule -> a fresh :class:`~dartree.decode.budget.CostModel` with this run's times.
        beta, round_s, t_ar: as :func:`~dartree.decode.replay.replay_auto` takes them.
        best_rate: tokens per second of the best fixed budget on the same rounds (order-independent).
    Returns:
        {rule: {"mean", "worst": rate / best_rate - 1 over the orders, "orders"}} for ``outcomes`` and ``scores``.
    """
    import random

    out = {rule: [] for rule in ("outcomes", "scores")}
    for k in range(orders):
        order = list(prompts)
        if k:
            random.Random(k).shuffle(order)
        rounds = [r for p in order for r in p]
        for rule in out:
            out[rule].append(replay_auto(rounds, new_policy(rule), beta, round_s, t_ar)["rate"] / best_rate - 1.0)
    return {rule: {"mean": sum(v) / len(v), "worst": min(v), "orders": len(v)} for rule, v in out.items()}


def replay_tables(console: Console, label: str, entry: dict, recorded: dict, curve: dict, t_ar: float,
                  orders: int = 1) -> dict:
    """Print and return, per method recorded at budget B_max, the replayed budget sweep (:mod:`dartree.decode.replay`).

    Round times are modelled from what this run measured in the loop: a drafted round that verifies b nodes costs the
    recorded run's per-round draft, build, compile and commit time plus t_verify(b + 1), where t_verify is pinned to
    the in-loop verify time per round of every fixed budget the bench ran for the method (and t_verify(1) = t_AR) and
    follows the shape of the start-up ``curve`` between those knots (the curve alone overestimates a round's speedup:
    docs/evaluation.md); a plain AR step costs ``t_ar``. Rows: each budget b <= B_max (tau replayed, modelled round and
    speedup, and the measured speedup where the bench ran that budget), the best of them, the ``--budget auto`` policy
    replayed from a fresh cost model with these times (its default rule, and the per-round ``rule="scores"``), and
    the hindsight per-round choice (an upper bound). ``orders`` > 1: also :func:`replay_orders`, printed as one line.
    """
    shape = CostModel(t_ar=t_ar, t_draft=0.0, verify_s=dict(curve)).verify_time  # monotone, interpolated
    out = {}
    for m, (bmax, stats, rc) in recorded.items():
        rounds = [recorded_round(r) for s in stats for r in s.trees]
        if bmax < 1 or not rounds:
            console.print(f"{label}: {m}: nothing to replay (budget {bmax}, {len(rounds)} rounds)")
            continue
        beta = builder_beta(m)  # the builder's declared default, as the bench runs it
        ran = {int(b): v for key, v in entry["methods"].items()
               for name, _, b in [key.partition("@")] if name == m and b.isdigit()}  # this method's fixed budgets
        knots = {1: t_ar, bmax + 1: rc["verify_ms"] / 1000}
        knots.update({b + 1: v["verify_ms"] / 1000 for b, v in ran.items() if 1 <= b < bmax})
        pts = sorted(knots.items())

        def verify_s(t: int, pts=pts) -> float:
            for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
                if t <= t1:
                    c0, c1 = shape(t0), shape(t1)
                    frac = (shape(t) - c0) / (c1 - c0) if c1 > c0 else (t - t0) / (t1 - t0)
                    return s0 + frac * (s1 - s0)
            return pts[-1][1]

        other = (rc["round_ms"] - rc["verify_ms"]) / 1000

        def round_s(b: int, verify_s=verify_s, other=other) -> float:
            return other + verify_s(b + 1)

        table = Table(title=f"{label}: {m} rounds recorded at B = {bmax} ({len(rounds)} rounds), replayed; per round "
                            f"{1000 * other:.1f} ms of draft, build and commit + t_verify(b + 1) pinned at T = "
                            + ", ".join(str(t) for t, _ in pts))
        for col in ("B", "tau (replayed)", "round (x AR)", "speedup (modelled)", "speedup (measured)",
                    "budgets chosen"):
            table.add_column(col, justify="right")
        rows = {}
        for b in sorted({b for b in REPLAY_BUDGETS if b < bmax} | {bmax}):
            r = replay_fixed(rounds, b, beta, round_s)
            rows[b] = {**r, "round_ar": round_s(b) / t_ar, "speedup": r["rate"] * t_ar}
            table.add_row(str(b), f"{r['tau']:.3f}", f"{round_s(b) / t_ar:.2f}", f"{r['rate'] * t_ar:.3f}x",
                          f"{ran[b]['speedup']:.3f}x" if b in ran else "", "")
        best = max(rows, key=lambda b: rows[b]["rate"])
        def new_policy(rule: str, verify_s=verify_s, other=other, bmax=bmax) -> CostModel:
            return CostModel(t_ar=t_ar, t_draft=other, max_budget=bmax, rule=rule,
                             verify_s={t: verify_s(t) for t in range(1, bmax + 2)})

        auto, scores = (replay_auto(rounds, new_policy(rule), beta, round_s, t_ar) for rule in ("outcomes", "scores"))
        hind = replay_hindsight(rounds, bmax, beta, round_s, t_ar)
        for name, r in ((f"best fixed (B = {best})", rows[best]), ("auto (replayed)", auto),
                        ("auto, per-round rule (replayed)", scores), ("hindsight", hind)):
            table.add_row(name, f"{r['tau']:.3f}", "", f"{r['rate'] * t_ar:.3f}x", "",
                          " ".join(f"{b}:{n}" for b, n in r.get("chosen", {}).items()))
        console.print(table)
        out[m] = {"budget": bmax, "rounds": len(rounds), "beta": beta, "other_ms": 1000 * other,
                  "verify_knots_ms": {t: 1000 * s for t, s in pts}, "fixed": rows, "best_fixed": best,
                  "auto": {**auto, "speedup": auto["rate"] * t_ar},
                  "auto_scores": {**scores, "speedup": scores["rate"] * t_ar},
                  "hindsight": {**hind, "speedup": hind["rate"] * t_ar}}
        if orders > 1:
            prompts = [[recorded_round(r) for r in s.trees] for s in stats]
            out[m]["orders"] = o = replay_orders(prompts, orders, new_policy, beta, round_s, t_ar, rows[best]["rate"])
            console.print(f"{label}: {m}: auto replayed over {orders} prompt orders against the best fixed budget "
                          f"(B = {best}): outcomes rule {o['outcomes']['mean']:+.2%} (worst {o['outcomes']['worst']:+.2%}),"
                          f" per-round rule {o['scores']['mean']:+.2%} (worst {o['scores']['worst']:+.2%})")
    return out


def main(argv=None) -> int:
    """Console entry point; returns the exit status (2 on bad arguments)."""
    args = parse_args(argv)
    try:
        args.tree = list(dict.fromkeys(builder_name(n) for n in args.tree))
    except ValueError as exc:
        return fail(f"--tree: {exc}")
    if min(args.budget) < 0 or args.limit < 1 or args.max_new_tokens < 2 or args.context < 2 or args.reps < 1 \
            or args.replay_orders < 1:
        return fail("--budget >= 0, --limit >= 1, --max-new-tokens >= 2, --context >= 2, --reps >= 1, "
                    "--replay-orders >= 1")
    prompt_file = None  # the --prompts file's record (path, sha256, ...), checked before any model loads
    file_prompts: list = []
    if args.prompts is not None:
        try:
            file_prompts, prompt_file = load_prompt_file(args.prompts, args.limit)
        except ValueError as exc:
            return fail(f"--prompts {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=140)
    result = {"environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                              "checkpoint": args.checkpoint, "max_new_tokens": args.max_new_tokens,
                              "datasets": [prompt_file["name"]] if prompt_file else args.datasets,
                              "prompt_file": prompt_file}, "dtypes": {}}
    combos: dict = {}  # (dtype, backend) -> the --linear word asking for it; auto and the backend it picks run once
    for dname in args.dtype:
        for lin in args.linear:
            try:
                backend, _ = choose_linear(lin, DTYPES[dname])
            except ValueError as exc:
                return fail(str(exc))
            combos.setdefault((dname, backend), lin)
    modes = [False, True] if args.invariant else [False]
    for (dname, backend), lin in combos.items():
        label = dname if len({b for d, b in combos if d == dname}) == 1 else f"{dname}/{backend}"
        for invariant in modes:
            code = _bench_one(args, console, result, label, dname, lin, invariant, file_prompts, prompt_file)
            if code:
                return code
    write_file_atomically(Path(args.out), json.dumps(result, indent=1))
    console.print(f"wrote {args.out}")
    return 0


def _bench_one(args, console, result: dict, label: str, dname: str, linear: str, invariant: bool,
               file_prompts: list, prompt_file: dict | None) -> int:
    """One dtype x matmul path (x row-invariant mode): assemble the target and drafter
    (:func:`dartree.decode.assembly.assemble`, the assembly eval and the API use: ``--dtype`` DTYPE, ``--linear``,
    ``--no-tune``, the mode off, or on for ``--invariant``'s second pass), then :func:`_measure` it; returns the exit
    status (0, or 2 with a one-line error for a target, a checkpoint or a mode that cannot run here)."""
    try:
        models = assemble(args.checkpoint, args.target, dtype=dname, linear=linear,
                          invariant="on" if invariant else "off", tune=args.tune)
    except ModeUnavailable as exc:
        return fail(f"--invariant: {exc}")
    except ValueError as exc:  # a target that does not load, a checkpoint that is not one or does not fit it
        return fail(str(exc))
    with models.modes:
        console.print(f"{dname}, linear layers {models.linear}: {models.linear_note}")
        if models.linear_tuning:
            console.print("F.linear beats the packed call at rows: "
                          + "; ".join(f"{k}: {v}" for k, v in models.linear_tuning.items()))
        mode = models.invariant
        if mode is not None:
            label += "/invariant"
            console.print(f"{label}: row-invariant target forwards (linear {mode.linear}: {mode.why})")
        return _measure(args, console, result, label, models, file_prompts, prompt_file)


def _measure(args, console, result: dict, label: str, models, file_prompts: list, prompt_file: dict | None) -> int:
    """Measure one assembly (:class:`~dartree.decode.assembly.Assembly`): the AR step, the verify curve and every
    method; print the tables and store them in ``result["dtypes"][label]``; returns the exit status (0, or 2 with
    a one-line error for a prompt that does not fit)."""
    target, dm, mode = models.target, models.draft, models.invariant
    stop = target_stop_ids(target)  # every id at which the target's own generate stops
    chosen = file_prompts if prompt_file else [p for d in args.datasets for p in load_prompts(d, args.limit, 0)]
    try:  # the checks eval applies, in the same words: each prompt fits the context, the target allows a tree
        prompts = encode_prompts(prompt_encoder(target.tokenizer, "auto", {}), chosen, target, args.max_new_tokens)
        check_prompt_set(target, prompts, [f"{p.dataset}:{p.id}" for p in chosen], args.max_new_tokens,
                         dm.drafter.cfg.num_proposals)
    except ValueError as exc:
        return fail(str(exc))
    ar, t_ar = _ar_baseline(args, target, prompts, stop)
    # context for the verify curve: a prompt followed by its AR continuation, cut to --context tokens
    ctx = (prompts[0] + ar[0].tokens + prompts[-1] * 8)[: args.context]
    curve = verify_curve(target, ctx, reps=args.reps)
    entry = {"row_invariant": {"linear": mode.linear, "why": mode.why} if mode is not None else None,
             "linear": models.linear, "linear_reason": models.linear_note, "linear_aten_rows": models.linear_tuning,
             "t_ar_ms": 1000 * t_ar, "verify_ms": {t: 1000 * s for t, s in curve.items()},
             "verify_ar": {t: s / t_ar for t, s in curve.items()}, "methods": {}}
    _print_curve(console, label, len(ctx), curve, t_ar)
    runs = _bench_runs(args)
    recorded = _bench_methods(args, console, label, models, prompts, ar, t_ar, runs, stop, entry["methods"])
    if args.replay:
        entry["replay"] = replay_tables(console, label, entry, recorded, curve, t_ar, args.replay_orders)
    if args.profile:
        entry["profile_top"] = _profile(console, target, dm, prompts[0], runs[-1], stop)
    result["dtypes"][label] = entry
    return 0


def _ar_baseline(args, target, prompts: list, stop: list) -> tuple[list[PromptDecode], float]:
    """A short warm-up decode, then AR on every prompt (:func:`~dartree.decode.harness.runner.decode_one`);
    returns (the decodes, t_AR: seconds per AR token, prefill and first token excluded)."""
    autoregressive_generate(target, chat_prompt_ids(target.tokenizer, "Say hello."), max_new_tokens=8, stop_ids=stop)
    ar_settings = DecodeSettings(None, max_new_tokens=args.max_new_tokens, stop_ids=tuple(stop))
    ar = [decode_one(target, ids, ar_settings) for ids in prompts]
    return ar, sum(o.stats.decode_s for o in ar) / max(1, sum(o.stats.new_tokens - 1 for o in ar))


def _print_curve(console, label: str, context: int, curve: dict, t_ar: float) -> None:
    """The verify cost table: per T = M + 1 tokens, ms and multiples of the AR step."""
    table = Table(title=f"{label}: verify cost t_verify(M) (context {context}); AR step {1000 * t_ar:.1f} ms")
    table.add_column("M+1 tokens", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("x AR step", justify="right")
    for t, s in curve.items():
        table.add_row(str(t), f"{1000 * s:.1f}", f"{s / t_ar:.2f}")
    console.print(table)


def _bench_runs(args) -> list[tuple[str, int | str | None]]:
    """(method, budget) per timed run: chain once at full length (None), every other builder at each ``--budget``;
    with ``--auto`` each method also at ``"auto"``."""
    runs = []
    for m in args.tree:
        if m == "chain":
            runs += [(m, None)] + ([(m, "auto")] if args.auto else [])
        else:
            runs += [(m, b) for b in args.budget]
            if args.auto:
                runs.append((m, "auto"))
    return runs


def _bench_methods(args, console, label: str, models, prompts: list, ar: list, t_ar: float, runs: list, stop: list,
                   methods: dict) -> dict:
    """Decode every prompt with every (method, budget) of ``runs`` (each warmed first, an ``"auto"`` one with a cost
    model calibrated and seeded outside the timing), check each output against AR's where the arithmetic is exact,
    store the round costs in ``methods`` and print their table. Returns the runs recorded for ``--replay``:
    method -> (budget, its decodes' stats with recorded trees, its round costs)."""
    target, dm = models.target, models.draft
    exact = models.dtype == torch.float32 or models.invariant is not None  # where a split from AR is a real mismatch
    recorded: dict = {}
    mt = Table(title=f"{label}: ms per round by stage (x AR step), tau, speedup, break-even tau")
    for col in ["method", "B", "tau", "draft", "tree_build", "tree_compile", "verify", "commit", "round",
                "break-even tau", "speedup", "nodes"]:
        mt.add_column(col, justify="right")
    policy_ids = chat_prompt_ids(target.tokenizer, POLICY_PROMPT)
    for m, b in runs:
        record = args.replay and b != "auto" and (m == "chain" or b == max(args.budget))
        settings = DecodeSettings(m, b, max_new_tokens=args.max_new_tokens, stop_ids=tuple(stop), record_trees=record)
        cm = _warm_run(target, dm, policy_ids, prompts[0], settings)
        outs = []
        for i, ids in enumerate(prompts):
            o = decode_one(target, ids, settings, drafter=dm.drafter, head=dm.head, cost_model=cm,
                           reference=ar[i].tokens)
            if o.mismatch and exact:
                console.print(f"[bold red]{m}@{b}: output differs from AR on prompt {i}[/bold red]")
            outs.append(o.stats)
        rc = round_costs(outs, t_ar)
        if record:
            recorded[m] = (b if b is not None else dm.drafter.cfg.num_proposals, outs, rc)
        if cm is not None:
            rc["cost_model"] = cm.summary()
            console.print(f"{m}@auto: budgets chosen {rc['cost_model']['chosen_budgets']}, calibration "
                          f"c = {cm.calibration:.2f}")
        methods[f"{m}@{b}" if b is not None else m] = rc
        mt.add_row(m, str(b if b is not None else dm.drafter.cfg.num_proposals), f"{rc['tau']:.3f}",
                   *[f"{rc[f'{st}_ms']:.1f} ({rc[f'{st}_ar']:.2f})" for st in STAGES],
                   f"{rc['round_ms']:.1f} ({rc['round_ar']:.2f})", f"{rc['break_even_tau']:.2f}",
                   f"{rc['speedup']:.3f}x", f"{rc['mean_tree_nodes']:.1f}")
    console.print(mt)
    return recorded


def _warm_run(target, dm, policy_ids: list, first_prompt: list, settings: DecodeSettings) -> CostModel | None:
    """Every path of ``settings`` warmed before its timing (:func:`~dartree.decode.generate.warm_paths`); for
    ``"auto"`` a cost model calibrated on the first prompt and seeded on the policy prompt, so nothing of it falls in
    a timed policy. Returns that model, or None for a fixed budget."""
    warm_paths(target, dm.drafter, dm.head, policy_ids, [settings])
    if settings.budget != "auto":
        return None
    cm = calibrate(target, dm.drafter, first_prompt, max_budget=dm.drafter.cfg.num_proposals)
    seed_policy(cm, target, dm.drafter, dm.head, policy_ids, settings)
    return cm


def _profile(console, target, dm, prompt: list, run: tuple, stop: list) -> str:
    """A torch.profiler table (top 25 ops by self CPU time) of a 64-token decode of ``prompt`` by ``run``
    (method, budget); printed and returned."""
    from torch.profiler import ProfilerActivity, profile  # lazy: only --profile needs the profiler

    m, b = run
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        speculative_generate(target, dm.drafter, dm.head, prompt,
                             DecodeSettings(m, b, max_new_tokens=64, stop_ids=tuple(stop)))
    text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    console.print(f"profile of {m}@{b} (64 tokens):\n{text}")
    return text


if __name__ == "__main__":
    sys.exit(main())

"""One eval report (:class:`~dartree.decode.harness.report_rows.EvalReport`) built from the per-prompt rows of a run
(:func:`aggregate` per method and data set, :func:`build_report`; :func:`report_warnings`; :func:`write_report_files`),
and its tables rendered from the report alone: :func:`report_markdown` (report.md) and :func:`report_console` (the
end of a run). Its figures are :mod:`dartree.decode.harness.report_figures`'; redrawing and comparing saved reports is
:mod:`dartree.decode.harness.report_command`'s (``dartree-report``).
"""

from __future__ import annotations

import json
from pathlib import Path

from dartree.base.files import write_file_atomically
from dartree.decode.harness.break_even import break_even_fields, break_even_lines, break_even_markdown, needs_tau_cell
from dartree.decode.harness.report_rows import EvalReport, MethodSummary, PromptRow


# the eval report's tables: report.md and the console, from report.json alone


def lossless_cell(r: MethodSummary, peer: bool = False) -> str:
    """The report table's lossless column for a method's aggregate ``r`` (:func:`aggregate`)."""
    if r.lossless is None:
        return "n/a"
    if r.lossless:
        return "yes"
    if r.exact is not False:
        return f"NO ({r.mismatches})"
    return f"split ({r.mismatches}){', own arithmetic' if peer else ', near-ties'}"


def _paired_cols(report: EvalReport) -> bool:
    """Whether the tables have a paired x AR column: --paired with a method to pair (--tree ar alone has none)."""
    return bool(report.environment["paired"]) and any(m != "ar" and not r.peer for m, r in report.methods.items())


def _report_header(report: EvalReport) -> list[str]:
    """report.md's title and the lines above the tables (the run's settings, sampling and exactness)."""
    env = report.environment
    bp, rec, done, planned = env["builder_params"], env["sampling"], env["prompts_done"], env["prompts_planned"]
    exact_rows = env["dtype"] == "float32" or env["row_invariant"] is not None
    return ["# dartree eval report", "",
            f"target `{env['target']}` ({env['dtype']}, {env['linear']} linears, {env['device']}), checkpoint "
            f"`{env['checkpoint']}`, T={env['temperature']}, max_new_tokens={env['max_new_tokens']}, "
            f"budget B={env['budget']}, K={bp['k']}, W={bp['width']}, beta={bp['beta']}, children={bp['children']}, "
            f"{done} of {planned} prompts" + (f" (interrupted by {env['interrupted']})" if env["interrupted"] else ""),
            "",
            f"stop ids {env['stop_ids']}; sampling: {rec['rule']}"
            + (f" (target generation_config {rec['ignored']} not applied: --ignore-generation-config)"
               if rec["ignored"] else "")
            + ("; prompts: the tokenizer's chat template" if env["chat_template"] == "tokenizer" else
               "; prompts: raw text, no chat template (--chat-template none)")
            + (f" with {json.dumps(env['chat_template_kwargs'])}" if env["chat_template_kwargs"] else ""), "",
            ("exactness: row-invariant verify (--invariant; on by default in bf16 on a CPU): a verify row "
             "computes an AR step's bits, so any split from AR is a MISMATCH" if env["row_invariant"] else
             "exactness: fp32, so any split from AR is a MISMATCH" if exact_rows else
             f"exactness: {env['dtype']} without the row-invariant mode: a verify row may round a near-tie the other way from "
             "an AR step, so a split is reported with its first differing token and top-2 margin, not as a MISMATCH"),
            ""]


def _report_tables(report: EvalReport) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """Every table of the report, all prompts first, then one per data set: (scope, columns, rows of cells, the
    notes under it: the AR timing spread, the paired x AR column)."""
    paired_cols = _paired_cols(report)
    out = []
    for scope, data in [("all", report.methods)] + list(report.datasets.items()):
        cols = ["method", "tau", "needs tau", "tokens/s", "speedup", *(["paired x AR"] if paired_cols else []),
                "lossless", "nodes", "draft ms", "tree ms", "verify ms"]
        cells = []
        for m, r in data.items():
            loss = "baseline" if m == "ar" else lossless_cell(r, bool(r.peer))
            paired_cell = ([f"{r.paired_speedup:.3f}x" if r.paired_speedup is not None else ""] if paired_cols else [])
            nodes = 1.0 if r.mean_tree_nodes is None else r.mean_tree_nodes
            cells.append([m, f"{r.tau:.3f}", needs_tau_cell(r), f"{r.tokens_per_s:.1f}", f"{r.speedup:.3f}x",
                          *paired_cell, loss, f"{nodes:.1f}",
                          *(f"{r.stage_ms.get(st, 0):.1f}" for st in ("draft", "tree_build", "verify"))])
        notes = []
        spread = data["ar"].repeat_spread
        if spread is not None:
            notes.append(f"AR timing spread over its {report.environment['ar_repeats']} runs per prompt ({scope}): "
                         f"{100 * spread:.1f}% (mean of (slowest - fastest) / mean); speedup differences of that size "
                         "are this machine's noise")
        if paired_cols:
            notes.append("paired x AR: each method's time per token against an AR decode of the same prompt that ran "
                         "in lockstep with it (one AR step after another until level with each round), pooled over "
                         "the prompts")
        out.append((scope, cols, cells, notes))
    return out


def _budget_lines(report: EvalReport) -> list[str]:
    """Per ``--budget auto`` row, the rounds at each budget the cost model chose, how many drafted, what a fixed
    budget of the same builder gave on the same prompts (when the run has one) and what the policy started from."""
    auto = report.environment["cost_models"]
    lines = []
    for m, r in report.methods.items():
        if not r.budget_histogram or m not in auto:
            continue
        line = f"{m}: " + ", ".join(f"B={b}: {n}" for b, n in r.budget_histogram.items())
        if r.drafted_rounds is not None:
            line += f"; drafted in {r.drafted_rounds} of {r.rounds} rounds"
            if r.drafted_rounds:
                line += f" ({r.drafted_tau:.2f} tokens per drafted round)"
        vs = _vs_text(report, m)
        if vs:
            line += f"; auto: tau {r.tau:.3f}, {r.speedup:.3f}x AR{_paired_text(r)}, against {vs}"
        if "prior" in auto[m]:
            line += f"; started from {prior_text(auto[m]['prior'])}"
        lines.append(line)
    return lines


def report_markdown(report: EvalReport) -> str:
    """report.md for an eval report (:func:`build_report`): the settings, one table per scope with its notes, the
    skipped peers, the cost model's budget choices and what a round costs here (:mod:`.break_even`)."""
    md = _report_header(report)
    for scope, cols, cells, notes in _report_tables(report):
        md += [f"## {scope}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(c) + " |" for c in cells] + [""]
        for note in notes:
            md += [note, ""]
    if report.peers_skipped:
        md += ["## peers skipped", ""] + [f"- {m}: {why}" for m, why in report.peers_skipped.items()] + [""]
    lines = _budget_lines(report)
    if lines:
        md += ["## budgets chosen by the cost model (--budget auto; rounds per budget, 0 = plain AR step), against "
               "a fixed budget of the same builder", ""]
        md += [f"- {line}" for line in lines] + [""]
    return "\n".join(md + break_even_markdown(report)) + "\n"


def report_console(report: EvalReport) -> list:
    """What the end of a run prints for ``report``, in order: per scope a rich table and its notes, the cost
    model's budget choices, then per method what a round costs here and the tau that pays for it."""
    from rich.table import Table

    out: list = []
    for scope, cols, cells, notes in _report_tables(report):
        table = Table(title=f"{scope}")
        for col in cols:
            table.add_column(col, justify="right")
        for c in cells:
            table.add_row(*c)
        out += [table, *notes]
    return out + [f"budgets chosen, {line}" for line in _budget_lines(report)] + break_even_lines(report)


# report.json, built from the per-prompt rows of a run


def aggregate(rows: list[PromptRow], ar_rows: list[PromptRow]) -> MethodSummary:
    """Aggregate per-prompt rows of one method (and the matching AR rows) into tau / speed figures, with the
    break-even tau of a speculative method (``break_even``, :func:`.break_even.break_even_fields`)."""
    rounds = sum(len(r.accept_lengths) for r in rows)
    dec_tok, dec_s = sum(r.decode_tokens for r in rows), sum(r.decode_s for r in rows)
    ar_tok, ar_s = sum(r.decode_tokens for r in ar_rows), sum(r.decode_s for r in ar_rows)
    tps = dec_tok / dec_s if dec_s > 0 else float("nan")
    ar_tps = ar_tok / ar_s if ar_s > 0 else float("nan")
    out = MethodSummary(tau=sum(sum(r.accept_lengths) for r in rows) / rounds if rounds else float("nan"),
                        tokens_per_s=tps, speedup=tps / ar_tps if ar_tps and ar_tps == ar_tps else float("nan"),
                        rounds=rounds, decode_tokens=dec_tok, prompts=len(rows))
    if rows and rows[0].stage_s is not None:
        out.stage_ms = {st: 1000 * sum(r.stage_s[st] for r in rows) / max(rounds, 1) for st in rows[0].stage_s}
        out.mean_tree_nodes = sum(sum(r.tree_nodes) for r in rows) / max(rounds, 1)
    if rows and rows[0].budgets is not None:  # verification budget per round (with --budget auto: the model's choice)
        hist: dict[int, int] = {}
        for b in (int(b) for r in rows for b in r.budgets):
            hist[b] = hist.get(b, 0) + 1
        out.budget_histogram = {b: hist[b] for b in sorted(hist)}
        drafted = [(n, d) for r in rows for b, n, d in zip(r.budgets, r.accept_lengths,
                                                          r.accepted_depths or [0] * len(r.budgets))
                   if b > 0]  # rounds that verified drafted nodes: (tokens committed, drafts accepted)
        out.drafted_rounds = len(drafted)
        out.drafted_tau = sum(n for n, _ in drafted) / len(drafted) if drafted else float("nan")
        out.drafted_accepted = sum(d for _, d in drafted)
    paired = [r for r in rows if r.paired_ar_decode_s is not None]
    if paired:  # against the AR decode that ran in lockstep with each row (--paired)
        p_tok = sum(max(r.paired_ar_new_tokens - 1, 0) for r in paired)
        p_s = sum(r.paired_ar_decode_s for r in paired)
        m_tok, m_s = sum(r.decode_tokens for r in paired), sum(r.decode_s for r in paired)
        out.paired_speedup = (m_tok / m_s) / (p_tok / p_s) if m_s > 0 and p_s > 0 and p_tok else float("nan")
        per = [(r.decode_tokens / r.decode_s) / ((r.paired_ar_new_tokens - 1) / r.paired_ar_decode_s)
               for r in paired if r.decode_s > 0 and r.paired_ar_decode_s > 0 and r.paired_ar_new_tokens > 1]
        if per:
            out.paired_speedup_range = [min(per), max(per)]
    reps = [r.decode_s_repeats for r in rows if len(r.decode_s_repeats or ()) > 1]
    if reps:  # the baseline's own timing noise: (slowest - fastest) / mean of one prompt's repeats, averaged
        out.repeat_spread = sum((max(t) - min(t)) / (sum(t) / len(t)) for t in reps) / len(reps)
    out.mismatches = sum(1 for r in rows if r.mismatch)
    if rows and rows[0].mismatch is not None:  # a split only counts as a loss where the arithmetic is exact
        out.lossless = out.mismatches == 0
        out.exact = all(r.exact is not False for r in rows)
    out.break_even = break_even_fields(rows, ar_rows, out)  # what tau pays here, from these figures
    return out


def split_label(row: PromptRow) -> str:
    """How one prompt's output that differs from AR's is named: ``MISMATCH`` where the run's arithmetic makes a
    verify row equal an AR step (fp32, or ``--invariant``), so the split is a real loss of exactness; else
    ``split@N (top-2 margin M)``, the first differing token N and the target's margin there (a near-tie that bf16
    verify rows may round the other way; a peer's own arithmetic splits the same way). Empty when equal."""
    if not row.mismatch:
        return ""
    if row.exact is not False:
        return "MISMATCH"
    margin = float("nan") if row.margin_at_divergence is None else row.margin_at_divergence
    return f"split@{row.first_divergence} (top-2 margin {margin:.3f})"


def prior_text(prior: dict | None) -> str:
    """What a ``--budget auto`` policy started from (:attr:`dartree.decode.budget.CostModel.prior`), in one line."""
    if not prior:
        return "no calibration pass (the policy started from its first rounds)"
    if not prior.get("rounds") or prior.get("tokens_per_round") is None:
        return f"a calibration pass on the {prior['source']} that drafted no round"
    ar = f", plain AR steps beside them {prior['ar_step']:.2f}" if prior.get("ar_step") else ""
    return (f"{prior['rounds']} drafted rounds on the {prior['source']}: {prior['tokens_per_round']:.2f} tokens a "
            f"round at {prior['ar_steps_per_round']:.2f} AR steps{ar} (calibration c = {prior['calibration']:.2f}), "
            f"kept as a prior worth {prior['weight']:.0f} rounds")


def _paired(r: MethodSummary) -> float:
    """``r``'s paired speedup where the run paired it, else its speedup (how fixed budgets are ranked)."""
    return r.speedup if r.paired_speedup is None else r.paired_speedup


def _paired_text(r: MethodSummary) -> str:
    """``, 1.234x AR paired``, or empty where ``r`` was not paired."""
    return "" if r.paired_speedup is None else f", {r.paired_speedup:.3f}x AR paired"


def fixed_sibling(report: EvalReport, m: str) -> str | None:
    """The fixed-budget row of the same builder as the ``--budget auto`` row ``m`` (``pruned@auto`` ->
    ``pruned@B8``, ``chain@auto`` -> ``chain``; the best paired one when a sweep has several), or None."""
    auto = report.environment.get("cost_models", {})
    base = m.split("@")[0]
    rows = [(n, r) for n, r in report.methods.items() if n != m and n not in auto and not r.peer
            and n.split("@")[0] == base and (n == base or n.startswith(base + "@B"))]
    if not rows:
        return None
    return max(rows, key=lambda nr: _paired(nr[1]))[0]


def _vs_text(report: EvalReport, m: str) -> str:
    """``m``'s fixed-budget sibling as a clause: its tau and (paired) speedup, or empty."""
    f = fixed_sibling(report, m)
    if f is None:
        return ""
    r = report.methods[f]
    return (f"{f} (a fixed budget of the same builder, same prompts): tau {r.tau:.3f}, {r.speedup:.3f}x "
            f"AR{_paired_text(r)}")


def _drafter_warnings(report: EvalReport, m: str, r: MethodSummary, auto: bool, tau_floor: float) -> list[str]:
    """The drafter warnings of one method's aggregate ``r``: drafted rounds that accepted nothing (the drafter
    contributes nothing) kept apart from a policy that chose not to draft (B=0 in N of M rounds)."""
    hist = r.budget_histogram or {}
    rounds, skipped = r.rounds, hist.get(0, 0)
    drafted = r.drafted_rounds
    if drafted is None:  # a report from before drafted_rounds was recorded
        drafted = rounds - skipped if hist else (0 if r.mean_tree_nodes == 0 else None)
    dtau = r.tau if r.drafted_tau is None else r.drafted_tau
    vs = _vs_text(report, m)
    if drafted == 0 and auto:
        return [f"WARNING: {m} took a plain AR step every round (B=0 in all {rounds}): the policy (--budget auto) "
                "chose not to draft, so its tau says nothing about the drafter" + (f"; {vs}" if vs else "")]
    if drafted == 0:
        return [f"WARNING: {m} drafted no tree nodes (budget 0), so tau is 1: raise --budget"]
    if dtau < tau_floor:
        accepted = f" and its {drafted} drafted rounds accepted {r.drafted_accepted} drafts in all" \
            if r.drafted_accepted is not None else ""
        return [f"WARNING: {m} tau = {r.tau:.3f} is about 1{accepted}: the drafter contributes nothing "
                "(untrained, mismatched to the target, or the wrong checkpoint)"]
    out = []
    if auto and r.tau < tau_floor:
        out.append(f"WARNING: {m} tau = {r.tau:.3f}: the policy (--budget auto) chose not to draft (B=0 in "
                   f"{skipped} of {rounds} rounds); its {drafted} drafted rounds committed {dtau:.2f} tokens each, so "
                   "the drafter does contribute" + (f"; {vs}" if vs else ""))
    f = fixed_sibling(report, m) if auto else None
    if f is not None and skipped > rounds / 2 and (report.methods[f].paired_speedup or 0.0) > 1.0 and not out:
        out.append(f"WARNING: {m} chose B=0 in {skipped} of {rounds} rounds while {vs}: the policy missed what a "
                   "fixed budget gained here")
    return out


def report_warnings(report: EvalReport, tau_floor: float = 1.05) -> list[str]:
    """Loud warnings for a report: a method whose drafted rounds accepted about nothing (the drafter contributes
    nothing), kept apart from a ``--budget auto`` method whose policy chose not to draft (B=0 in N of M rounds, set
    against the fixed-budget row of the same builder when the run has one); and a method whose T = 0 output differs
    from AR's."""
    out = []
    auto = report.environment.get("cost_models", {})  # the --budget auto rows
    for m, r in report.methods.items():
        if m == "ar":
            continue
        if not r.peer:  # a peer's tau is its own business (hf-generate: 1 by construction)
            out += _drafter_warnings(report, m, r, m in auto, tau_floor)
        if r.lossless is False and r.exact is not False:
            out.append(f"WARNING: {m} differs from AR on {r.mismatches} prompts: MISMATCH, a loss of exactness "
                       "where verify rows and AR steps compute the same bits (see per_prompt first_divergence)")
        elif r.lossless is False:
            out.append(f"note: {m} splits from AR on {r.mismatches} prompts at near-ties (per_prompt: "
                       "first_divergence, margin_at_divergence): "
                       + ("its own arithmetic" if r.peer else "bf16 verify rows round differently from AR steps; "
                          "--invariant on makes them equal"))
    return out


def build_report(environment: dict, rows: dict[str, list[PromptRow]], trees: dict, methods: list[str],
                 peers: list[str], datasets: list[str], peers_skipped: dict) -> EvalReport:
    """The report from the per-prompt ``rows`` (method -> rows) and the run's ``environment``: every method's and
    peer's aggregate (:func:`aggregate`) over all prompts and per data set, the skipped peers, the rows themselves and
    the first prompt's verify ``trees``."""
    names, ar_all = ["ar", *methods, *peers], rows["ar"]
    report = EvalReport(environment=environment, methods={m: aggregate(rows[m], ar_all) for m in names},
                        per_prompt=rows, trees=trees, peers_skipped=peers_skipped)
    for d in datasets:
        ar_d = [r for r in ar_all if r.dataset == d]
        report.datasets[d] = {m: aggregate([r for r in rows[m] if r.dataset == d], ar_d) for m in names}
    for m in peers:  # dartree.decode.harness.peers rows: tau = committed tokens per target forward, prefill excluded
        for agg in [report.methods[m]] + [report.datasets[d][m] for d in datasets]:
            agg.peer = True
    return report


def write_report_files(out: Path, report: EvalReport | dict, md: str) -> None:
    """Write ``out/report.json`` (``report``: an eval report, or a batch sweep's dict) and ``out/report.md``
    (``md``, made from the same report), each atomically under a unique temporary name
    (:func:`dartree.base.files.write_file_atomically`), so two runs writing one folder never share a temporary file.
    Call it inside ``Signals.held`` (``decode/eval.py``), so that SIGINT / SIGTERM cannot fall between the two files
    and leave one a prompt behind the other.

    Raises:
        OSError: ``out`` cannot be written.
    """
    data = report.to_json() if isinstance(report, EvalReport) else report
    write_file_atomically(out / "report.json", json.dumps(data, indent=1))
    write_file_atomically(out / "report.md", md)

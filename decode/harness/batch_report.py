"""The report of a batch sweep (``decode/eval.py --batch``; :mod:`dartree.decode.harness.batch_sweep`): report.md's
tables, the warnings, and the figure of throughput against batch, all from report.json's ``batch_sweep`` section, so
``dartree-report DIR`` redraws them.

Section layout read here: ``batches`` (N values), ``methods`` (row names, ``ar`` first), ``rows`` (one per method
and N, read as :class:`~dartree.decode.harness.report_rows.BatchRow` s: ``tokens_per_s``, ``speedup`` over batched
AR at that N, ``tau_mean`` and ``tau_per_row``, ``rows_per_forward``, ``mismatches``, ``exact``, ``peer``,
``budgets``), ``one_prompt`` (per method: the one-prompt
path's ``tokens_per_s``, ``speedup``, ``mismatches``), ``batch1_vs_one_prompt``, ``row_costs``, ``requests``,
``distinct_prompts``, ``cpu``.
"""

from __future__ import annotations

import platform
from pathlib import Path

from dartree.decode.harness.report_rows import BatchRow, sweep_rows

TITLE = "Throughput against batch"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; ``platform.processor()`` where that file is
    missing), for the report: figures mean little without it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _lossless(mismatches: int | None, exact: bool = True) -> str:
    if mismatches is None:
        return "n/a (T > 0)"
    if mismatches == 0:
        return "yes"
    return f"NO ({mismatches})" if exact else f"split ({mismatches})"


def _tau(r: BatchRow) -> str:
    taus = r.tau_per_row
    return f"{r.tau_mean:.3f} ({min(taus):.2f}-{max(taus):.2f})" if taus else "-"


def sweep_markdown(report: dict) -> str:
    """report.md of a batch sweep: the settings, the table per batch size (tokens/s, speedup over batched AR, tau per
    row, rows per forward, lossless), batch 1 against the one-prompt path, the budgets the auto policies chose and
    the row table they were timed with."""
    env, sw, rows = report["environment"], report["batch_sweep"], sweep_rows(report)
    md = ["# dartree batch sweep: " + TITLE.lower(), "",
          f"target `{env['target']}` ({env['dtype']}, {env['linear']} linears, {env['device']}, {env['threads']} "
          f"threads, CPU {sw.get('cpu', '?')}), checkpoint `{env['checkpoint']}`, T={env['temperature']}, "
          f"max_new_tokens={sw['max_new_tokens']}, budget {env['budget']}; {sw['requests']} requests from "
          f"{sw['distinct_prompts']} prompts (cycled into a queue of {sw.get('queue', 1)} x the largest batch), batch "
          f"sizes {sw['batches']}"
          + (f" (interrupted by {env['interrupted']})" if env.get("interrupted") else ""), "",
          "tokens/s: all requests' new tokens over the decode's wall time, prefills excluded (each request's prefill "
          "runs alone); speedup: over dartree's batched AR loop at the same batch size, in this process (with several "
          "passes, the median over the passes of AR's time in the pass over the row's); tau per row: "
          "committed tokens per verify forward a request took part in (mean over requests, min-max); rows/forward: "
          "mean rows in a target forward (rows drain as the queue empties); lossless: requests whose tokens differ "
          "from their prompt's own AR decode (one prompt at a time).", "",
          "| batch | method | tokens/s | speedup | tau per row | rows/forward | lossless |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r.batch} | {r.method}{' (peer)' if r.peer else ''} | {r.tokens_per_s:.1f} | "
                  f"{r.speedup:.3f}x | {_tau(r)} | {r.rows_per_forward:.2f} | {_lossless(r.mismatches, r.exact)} |")
    spreads = [(r.batch, r.repeat_spread, len(r.decode_s_repeats)) for r in rows
               if r.method == "ar" and r.repeat_spread is not None]
    if spreads:
        md += ["", "every row ran once per pass, the passes in rotated orders; a row's time is the mean of its "
               "passes, and the spread of batched AR's ((slowest - fastest) / mean) is this machine's own noise at "
               "that size, to read every speedup against: " + ", ".join(f"N={b}: {100 * sp:.1f}% over {k} runs"
                                                                  for b, sp, k in spreads)]
    one = sw.get("one_prompt") or {}
    if one:
        md += ["", "## batch 1 against the one-prompt path", "",
               "Each request decoded alone (`speculative_generate`, `autoregressive_generate`) in the same run; ratio: "
               "the batch-1 speedup over the one-prompt speedup.", "",
               "| method | one-prompt tokens/s | one-prompt speedup | batch-1 speedup | ratio | lossless |",
               "|---|---|---|---|---|---|"]
        b1 = {r.method: r for r in rows if r.batch == 1}
        for m, o in one.items():
            if m == "ar":
                md.append(f"| ar | {o['tokens_per_s']:.1f} | baseline | "
                          f"{b1['ar'].tokens_per_s / o['tokens_per_s']:.3f}x of one-prompt AR |  |  |"
                          if "ar" in b1 else f"| ar | {o['tokens_per_s']:.1f} | baseline |  |  |  |")
                continue
            ratio, loss = sw["batch1_vs_one_prompt"].get(m), _lossless(o.get("mismatches"), o.get("exact", True))
            md.append(f"| {m} | {o['tokens_per_s']:.1f} | {o['speedup']:.3f}x | "
                      f"{b1[m].speedup:.3f}x | {ratio:.3f} | {loss} |" if m in b1 else
                      f"| {m} | {o['tokens_per_s']:.1f} | {o['speedup']:.3f}x |  |  | {loss} |")
    budgets = [r for r in rows if r.budgets and r.method in sw.get("policies", {})]
    if budgets:
        md += ["", "## nodes per row the auto policies kept (rounds per width; 0: the root alone)", ""]
        md += [f"- {r.method} at batch {r.batch}: " + ", ".join(f"{b}: {n}" for b, n in r.budgets.items())
               for r in budgets]
    table = sw.get("row_costs") or {}
    if table:
        sizes = sorted({int(t) for v in table.values() for t in v["verify_ratio"]})
        md += ["", "## row table: a forward over N rows against one row (measured at start-up)", "",
               "| rows | " + " | ".join(f"verify({t})" for t in sizes) + " | draft |", "|---|" + "---|" * (len(sizes) + 1)]
        for n, v in table.items():
            md.append(f"| {n} | " + " | ".join(f"{v['verify_ratio'].get(t, v['verify_ratio'].get(str(t), 0)):.2f}"
                                                for t in sizes) + f" | {v['draft_ratio']:.2f} |")
    return "\n".join(md) + "\n"


def sweep_warnings(report: dict) -> list[str]:
    """One line per problem of a sweep: a method whose rows split from AR where the arithmetic is exact."""
    out = []
    for r in sweep_rows(report):
        if r.mismatches and r.exact:
            out.append(f"WARNING: {r.method} at batch {r.batch}: {r.mismatches} requests differ from their AR "
                       f"output (first: {r.first_mismatch}); decoding is not lossless here")
    return out


def fig_throughput(report: dict):
    """Tokens per second against the batch size (left) and the speedup over batched AR (right), one line per
    method (``gid`` = its name; the peer dashed; batched AR at 1x dotted on the right).

    Returns:
        a ``matplotlib.figure.Figure``, or None when the sweep has no row yet.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sw, rows = report["batch_sweep"], sweep_rows(report)
    if not rows:
        return None
    fig = Figure(figsize=(10.0, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tp, ax_sp = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["tab10"]
    for i, m in enumerate(sw["methods"]):
        pts = [(r.batch, r.tokens_per_s, r.speedup) for r in rows if r.method == m]
        if not pts:
            continue
        ls = "--" if any(r.peer for r in rows if r.method == m) else "-"
        bs = [p[0] for p in pts]
        ax_tp.plot(bs, [p[1] for p in pts], marker="o", ls=ls, color=cmap(i % 10), gid=m, label=m)
        if m != "ar":
            ax_sp.plot(bs, [p[2] for p in pts], marker="o", ls=ls, color=cmap(i % 10), gid=m, label=m)
    ax_sp.axhline(1.0, color="0.6", ls=":", lw=1, gid="ar", label="batched AR (1x)")
    for ax, name in ((ax_tp, "tokens/s (all rows)"), (ax_sp, "speedup over batched AR")):
        ax.set_xlabel("batch size (rows decoded together)")
        ax.set_ylabel(name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sw["batches"], [str(b) for b in sw["batches"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{TITLE} ({sw['requests']} requests, {sw['max_new_tokens']} new tokens each)", fontsize=10)
    return fig


def render_batch_figures(report: dict, out_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Draw a batch sweep's figure, ``throughput.png``, in ``out_dir`` (as
    :func:`dartree.decode.harness.report_figures.render_figures` draws an eval's): (figures written, as dicts with
    ``title``, ``file``, ``caption``; warnings, one line each). Never raises for a plotting problem."""
    try:
        # lazy: matplotlib loads only when a figure is drawn
        from dartree.base.figures import save_png

        fig = fig_throughput(report)
        if fig is None:
            return [], []
        save_png(fig, Path(out_dir) / "throughput.png")
    except Exception as exc:  # a broken figure is a warning; the report stands
        return [], [f"WARNING: figure throughput.png failed: {type(exc).__name__}: {exc}"]
    return [{"title": TITLE, "file": "throughput.png", "caption": throughput_caption(report)}], []


def throughput_caption(report: dict) -> str:
    """The figure's caption: every row's tokens/s and speedup per batch size."""
    rows, methods = sweep_rows(report), report["batch_sweep"]["methods"]
    return "; ".join(f"{m}: " + ", ".join(f"N={r.batch} {r.tokens_per_s:.1f} tok/s {r.speedup:.2f}x"
                                         for r in rows if r.method == m) for m in methods) + "."

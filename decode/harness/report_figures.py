"""The figures of one eval report: every figure drawn as a PNG (:func:`render_figures`; a batch sweep's by
:func:`dartree.decode.harness.batch_report.render_batch_figures`) and embedded in report.md as its figure section,
below :data:`FIGURES_MARKER` (:func:`write_figures`, :func:`attach_figures`); :func:`annotate_trees` gives
recorded verify rounds their token texts, so they can be drawn without a tokenizer.

Plotting never costs a report: every figure is drawn on its own, a failure becomes a warning, and the tables
are written before any figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from dartree.base.files import write_file_atomically
from dartree.decode.harness.batch_report import render_batch_figures
from dartree.decode.harness.report_rows import EvalReport

FIGURES_MARKER = "<!-- dartree-report figures: everything below is redrawn by dartree-report -->"


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name.replace("@", "_at_"))


def annotate_trees(rounds: list[dict], decode: Callable[[int], str]) -> list[dict]:
    """Add token texts to recorded verify rounds (``DecodeStats.trees``) so they can be drawn without a tokenizer.

    Args:
        rounds: per-round dicts with ``root``, ``tokens``, ``bonus`` (token ids).
        decode: token id -> its text (e.g. ``lambda i: tok.decode([i])``); called once per distinct id.
    Returns:
        new dicts with ``root_text``, ``texts`` (one per tree token) and ``bonus_text`` added.
    """
    seen: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in seen:
            seen[i] = decode(int(i))
        return seen[i]

    return [{**r, "root_text": text(r["root"]), "texts": [text(t) for t in r["tokens"]], "bonus_text": text(r["bonus"])}
            for r in rounds]


def render_figures(report: EvalReport, out_dir: str | Path,
                   draw_round: int | None = None) -> tuple[list[dict], list[str]]:
    """Draw every figure of ``report`` as PNGs in ``out_dir``, each on its own (one failing never stops another).

    Figures: ``acceptance.png`` (Pr(L >= t)), ``sweep.png`` (budget sweeps only), ``stages.png``, ``tree_shape.png``
    and ``tree_<method>.png`` per method whose verify trees were recorded (a batch sweep's figure is drawn by
    :func:`dartree.decode.harness.batch_report.render_batch_figures` instead).
    Args:
        report: an eval report (:class:`~dartree.decode.harness.report_rows.EvalReport`).
        out_dir: folder for the PNGs (created).
        draw_round: 1-based round of the recorded prompt to draw for every method (None: per method, the round
            with the longest accepted path).
    Returns:
        (figures written, as dicts with ``title``, ``file`` (name in ``out_dir``), ``caption``; warnings, one line
        each: a figure that failed, or a requested round that a method does not have).
    """
    out_dir = Path(out_dir)
    written: list[dict] = []
    notes: list[str] = []
    try:
        # lazy: matplotlib and networkx are optional here: without them the report is tables only (except below)
        from dartree.base.figures import save_png
        from dartree.decode.harness import plots
    except Exception as exc:  # matplotlib / networkx missing or broken: tables only
        return [], [f"WARNING: no figures: cannot import the plotting libraries ({type(exc).__name__}: {exc})"]

    def attempt(file: str, title: str, make: Callable, caption: Callable[[], str] = lambda: "") -> None:
        try:
            fig = make()
            if fig is None:
                return
            save_png(fig, out_dir / file)
            written.append({"title": title, "file": file, "caption": caption()})
        except Exception as exc:  # a broken figure is a warning; the report stands
            notes.append(f"WARNING: figure {file} failed: {type(exc).__name__}: {exc}")

    ms = plots.tree_methods(report)
    if not ms:  # AR alone: nothing to draw
        return written, notes

    def acc_caption() -> str:
        parts = [f"{m} {report.methods[m].tau:.3f}" for m in ms]
        return "L = tokens a round commits (accepted drafts + bonus); tau = Σ_t Pr(L ≥ t): " + ", ".join(parts) + "."

    def stage_caption() -> str:
        ar = ", ".join(f"{m} {v:.1f} ms" for m, v in plots.ar_step_ms(report).items())
        tot = ", ".join(f"{m} {sum(report.methods[m].stage_ms.get(s, 0.0) for s in plots.STAGES):.1f} ms"
                        for m in ms)
        return f"per verify round: {tot}; one AR step: {ar}."

    attempt("acceptance.png", "Acceptance length distribution Pr(L ≥ t)", lambda: plots.fig_acceptance(report),
            acc_caption)
    def sweep_caption() -> str:
        return "; ".join(f"{b}: " + ", ".join(f"B={n} tau {t:.3f} {sp:.3f}x" for n, t, sp in v)
                         for b, v in plots.sweep_points(report).items()) + "."

    attempt("sweep.png", "tau and speedup against the budget B", lambda: plots.fig_sweep(report), sweep_caption)
    attempt("stages.png", "Time per round by stage", lambda: plots.fig_stages(report), stage_caption)
    attempt("tree_shape.png", "Tree shape: nodes and acceptance per depth", lambda: plots.fig_tree_shape(report),
            lambda: "left: mean nodes at each depth over all rounds; right: of the rounds that reached depth d - 1 "
                    "and drafted a node at depth d, the fraction that accepted one.")
    for m, rec in report.trees.items():
        rounds = rec.get("rounds") or []
        if not rounds:
            continue
        if draw_round is None:
            i = plots.default_round(rounds)
        elif 1 <= draw_round <= len(rounds):
            i = draw_round - 1
        else:
            notes.append(f"WARNING: {m} has {len(rounds)} recorded rounds; --draw-round {draw_round} skipped for it")
            continue
        r = rounds[i]
        a = len(r["accepted"]) - 1
        where = f"{rec.get('dataset', '?')}:{rec.get('id', '?')}"
        title = f"{m}: round {i + 1} of {len(rounds)} ({where}); {len(r['tokens'])} nodes, accepted depth {a} + bonus"
        attempt(f"tree_{_safe_name(m)}.png", f"Verify tree: {m}", lambda r=r, title=title: plots.fig_tree(r, title),
                lambda title=title: title + ("" if draw_round else " (the round with the longest accepted path)") + ".")
    return written, notes


def figures_markdown(written: Sequence[dict]) -> str:
    """The ``report.md`` figure section (starts with :data:`FIGURES_MARKER`) embedding the written PNGs."""
    md = [FIGURES_MARKER, "", "## Figures", ""]
    for f in written:
        md += [f"### {f['title']}", "", f"![{f['title']}]({f['file']})", ""]
        if f.get("caption"):
            md += [f["caption"], ""]
    return "\n".join(md)


def attach_figures(md_path: str | Path, written: Sequence[dict]) -> None:
    """Replace (or append) the figure section of ``md_path`` with ``written``'s; the tables above it are kept.
    A missing file gets the section alone."""
    md_path = Path(md_path)
    head = md_path.read_text() if md_path.exists() else ""
    head = head.split(FIGURES_MARKER)[0].rstrip("\n")
    write_file_atomically(md_path, (head + "\n\n" if head else "") + figures_markdown(written))


def write_figures(report: EvalReport | dict, out_dir: str | Path, draw_round: int | None = None) -> list[str]:
    """Draw the figures of ``report`` (an eval report, or a batch sweep's report dict) into ``out_dir`` and embed
    them in ``out_dir/report.md``; never raises for a plotting problem (call it after report.json and the tables
    are written).

    Returns:
        the warnings, one line each (the caller prints them).
    """
    try:
        if not isinstance(report, EvalReport):  # decode/eval.py --batch's dict: the throughput curve
            written, notes = render_batch_figures(report, out_dir)
        else:
            written, notes = render_figures(report, out_dir, draw_round)
        attach_figures(Path(out_dir) / "report.md", written)
    except Exception as exc:  # the report was written before; a figure problem must not lose it
        notes = [f"WARNING: figures not written: {type(exc).__name__}: {exc}"]
    return notes

"""Figures of evaluation reports, redrawn or overlaid; learning-curve pictures.

``dartree-report DIR`` (or ``python decode/harness/report.py DIR``) redraws the figures of one eval report (the
``report.json`` that ``decode/eval.py`` wrote in DIR) and refreshes the figure section of its ``report.md``.
``dartree-report DIR DIR ... --out OUT`` overlays several reports (different checkpoints, targets, dtypes or
runs) in one side-by-side ``OUT/report.md``: tau / speedup tables with a column pair per run, and every figure
with one line or bar per (run, method), methods named ``RUN/METHOD``.
:func:`report_markdown` and :func:`report_console` render one eval report's tables (report.md, the console)
from its report dict alone.
``dartree-report --curves RUN_OR_CKPT ... --out curves.png`` draws learning curves (``curve.json`` of a training
run, ``learning_curve.json`` of a checkpoint folder, or the JSON files themselves) in one picture.

Plotting never costs a report: every figure is drawn on its own, a failure becomes a warning, and the tables
are written before any figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.fields import folder_problem
from dartree.decode.harness.batch_report import render_batch_figures
from dartree.decode.harness.break_even import break_even_fields, break_even_lines, break_even_markdown, needs_tau_cell

FIGURES_MARKER = "<!-- dartree-report figures: everything below is redrawn by dartree-report -->"


def _write(path: Path, text: str) -> None:
    """Write ``path`` atomically under a unique temporary name (:func:`dartree.base.files.write_file_atomically`,
    imported here so that this module does not load torch until it writes)."""
    write_file_atomically(path, text)


def _read_json(f: Path, fix: str):
    """``f`` parsed as JSON; a truncated, corrupt or non-JSON file is one ValueError naming ``f`` and ``fix``."""
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{f} is not valid JSON ({exc}): {fix}") from None


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


def render_figures(report: dict, out_dir: str | Path, draw_round: int | None = None) -> tuple[list[dict], list[str]]:
    """Draw every figure of ``report`` as PNGs in ``out_dir``, each on its own (one failing never stops another).

    Figures: ``acceptance.png`` (Pr(L >= t)), ``sweep.png`` (budget sweeps only), ``stages.png``, ``tree_shape.png``
    and ``tree_<method>.png`` per method whose verify trees were recorded (a batch sweep's figure is drawn by
    :func:`dartree.decode.harness.batch_report.render_batch_figures` instead).
    Args:
        report: an eval report (``report.json`` contents; see ``dartree.decode.harness.plots``).
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
        from dartree.decode.harness import plots
    except Exception as exc:  # matplotlib / networkx missing or broken: tables only
        return [], [f"WARNING: no figures: cannot import the plotting libraries ({type(exc).__name__}: {exc})"]

    def attempt(file: str, title: str, make: Callable, caption: Callable[[], str] = lambda: "") -> None:
        try:
            fig = make()
            if fig is None:
                return
            plots.save_figure(fig, out_dir / file)
            written.append({"title": title, "file": file, "caption": caption()})
        except Exception as exc:  # a broken figure is a warning; the report stands
            notes.append(f"WARNING: figure {file} failed: {type(exc).__name__}: {exc}")

    ms = plots.tree_methods(report)
    if not ms:  # AR alone: nothing to draw
        return written, notes

    def acc_caption() -> str:
        parts = [f"{m} {report['methods'][m]['tau']:.3f}" for m in ms]
        return "L = tokens a round commits (accepted drafts + bonus); tau = Σ_t Pr(L ≥ t): " + ", ".join(parts) + "."

    def stage_caption() -> str:
        ar = ", ".join(f"{m} {v:.1f} ms" for m, v in plots.ar_step_ms(report).items())
        tot = ", ".join(f"{m} {sum(report['methods'][m].get(f'{s}_ms_per_round', 0.0) for s in plots.STAGES):.1f} ms"
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
    for m, rec in report.get("trees", {}).items():
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
    _write(md_path, (head + "\n\n" if head else "") + figures_markdown(written))


def write_figures(report: dict, out_dir: str | Path, draw_round: int | None = None) -> list[str]:
    """Draw the figures of ``report`` into ``out_dir`` and embed them in ``out_dir/report.md``; never raises for a
    plotting problem (call it after report.json and the tables are written).

    Returns:
        the warnings, one line each (the caller prints them).
    """
    try:
        if "batch_sweep" in report:  # decode/eval.py --batch: the throughput curve
            written, notes = render_batch_figures(report, out_dir)
        else:
            written, notes = render_figures(report, out_dir, draw_round)
        attach_figures(Path(out_dir) / "report.md", written)
    except Exception as exc:  # the report was written before; a figure problem must not lose it
        notes = [f"WARNING: figures not written: {type(exc).__name__}: {exc}"]
    return notes


# the eval report's tables: report.md and the console, from report.json alone


def lossless_cell(r: dict, peer: bool = False) -> str:
    """The report table's lossless column for a method's aggregate ``r`` (:func:`aggregate`)."""
    if r.get("lossless") is None:
        return "n/a"
    if r["lossless"]:
        return "yes"
    if r.get("exact", True):
        return f"NO ({r['mismatches']})"
    return f"split ({r['mismatches']}){', own arithmetic' if peer else ', near-ties'}"


def _paired_cols(report: dict) -> bool:
    """Whether the tables have a paired x AR column: --paired with a method to pair (--tree ar alone has none)."""
    return bool(report["environment"]["paired"]) and any(
        m != "ar" and not r.get("peer", False) for m, r in report["methods"].items())


def _report_header(report: dict) -> list[str]:
    """report.md's title and the lines above the tables (the run's settings, sampling and exactness)."""
    env = report["environment"]
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


def _report_tables(report: dict) -> list[tuple[str, list[str], list[list[str]], list[str]]]:
    """Every table of the report, all prompts first, then one per data set: (scope, columns, rows of cells, the
    notes under it: the AR timing spread, the paired x AR column)."""
    paired_cols = _paired_cols(report)
    out = []
    for scope, data in [("all", report["methods"])] + list(report["datasets"].items()):
        cols = ["method", "tau", "needs tau", "tokens/s", "speedup", *(["paired x AR"] if paired_cols else []),
                "lossless", "nodes", "draft ms", "tree ms", "verify ms"]
        cells = []
        for m, r in data.items():
            loss = "baseline" if m == "ar" else lossless_cell(r, r.get("peer", False))
            paired_cell = ([f"{r['paired_speedup']:.3f}x" if "paired_speedup" in r else ""] if paired_cols else [])
            cells.append([m, f"{r['tau']:.3f}", needs_tau_cell(r), f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.3f}x",
                          *paired_cell, loss, f"{r.get('mean_tree_nodes', 1.0):.1f}",
                          *(f"{r.get(f'{st}_ms_per_round', 0):.1f}" for st in ("draft", "tree_build", "verify"))])
        notes = []
        spread = data["ar"].get("repeat_spread")
        if spread is not None:
            notes.append(f"AR timing spread over its {report['environment']['ar_repeats']} runs per prompt ({scope}): "
                         f"{100 * spread:.1f}% (mean of (slowest - fastest) / mean); speedup differences of that size "
                         "are this machine's noise")
        if paired_cols:
            notes.append("paired x AR: each method's time per token against an AR decode of the same prompt that ran "
                         "in lockstep with it (one AR step after another until level with each round), pooled over "
                         "the prompts")
        out.append((scope, cols, cells, notes))
    return out


def _budget_lines(report: dict) -> list[str]:
    """Per ``--budget auto`` row, the rounds at each budget the cost model chose, how many drafted, what a fixed
    budget of the same builder gave on the same prompts (when the run has one) and what the policy started from."""
    auto = report["environment"]["cost_models"]
    lines = []
    for m, r in report["methods"].items():
        if not r.get("budget_histogram") or m not in auto:
            continue
        line = f"{m}: " + ", ".join(f"B={b}: {n}" for b, n in r["budget_histogram"].items())
        if "drafted_rounds" in r:
            line += f"; drafted in {r['drafted_rounds']} of {r['rounds']} rounds"
            if r["drafted_rounds"]:
                line += f" ({r['drafted_tau']:.2f} tokens per drafted round)"
        paired = f", {r['paired_speedup']:.3f}x AR paired" if "paired_speedup" in r else ""
        vs = _vs_text(report, m)
        if vs:
            line += f"; auto: tau {r['tau']:.3f}, {r['speedup']:.3f}x AR{paired}, against {vs}"
        if "prior" in auto[m]:
            line += f"; started from {prior_text(auto[m]['prior'])}"
        lines.append(line)
    return lines


def report_markdown(report: dict) -> str:
    """report.md for an eval report (:func:`build_report`): the settings, one table per scope with its notes, the
    skipped peers, the cost model's budget choices and what a round costs here (:mod:`.break_even`)."""
    md = _report_header(report)
    for scope, cols, cells, notes in _report_tables(report):
        md += [f"## {scope}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(c) + " |" for c in cells] + [""]
        for note in notes:
            md += [note, ""]
    if report["peers_skipped"]:
        md += ["## peers skipped", ""] + [f"- {m}: {why}" for m, why in report["peers_skipped"].items()] + [""]
    lines = _budget_lines(report)
    if lines:
        md += ["## budgets chosen by the cost model (--budget auto; rounds per budget, 0 = plain AR step), against "
               "a fixed budget of the same builder", ""]
        md += [f"- {line}" for line in lines] + [""]
    return "\n".join(md + break_even_markdown(report)) + "\n"


def report_console(report: dict) -> list:
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


def load_report(path: str | Path) -> dict:
    """Read ``path/report.json`` (or ``path`` itself when it is a file).

    Raises:
        FileNotFoundError: no report there.
        ValueError: not valid JSON (the file and the fix named), or not an eval report (no ``methods``, no
            ``batch_sweep``).
    """
    path = Path(path)
    f = path / "report.json" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"{path} holds no report.json (write one with decode/eval.py --out {path})")
    rep = _read_json(f, "re-run decode/eval.py or point at a complete report")
    if not isinstance(rep, dict) or ("methods" not in rep and "batch_sweep" not in rep):
        raise ValueError(f"{f} is not an eval report (no 'methods' or 'batch_sweep')")
    return rep


def run_labels(paths: Sequence[str | Path]) -> list[str]:
    """Short distinct labels for several report folders: the shortest tail of their paths that tells them apart
    (``reports/dflash``, ``reports/dspark`` -> ``dflash``, ``dspark``)."""
    parts = [Path(p).resolve().parts for p in paths]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"run{i}" for i in range(len(paths))]


def merge_reports(reports: dict[str, dict]) -> dict:
    """One report holding several: every method ``m`` of run ``label`` becomes ``label/m`` (in methods, datasets,
    per_prompt and trees); ``environment`` keeps each run's under ``runs`` and the largest ``proposals``.

    Raises:
        ValueError: a label containing ``/`` (it would be ambiguous in method names), a batch sweep's report, or no
            report.
    """
    if not reports:
        raise ValueError("no reports to merge")
    out: dict = {"methods": {}, "datasets": {}, "per_prompt": {}, "trees": {},
                 "environment": {"runs": {}, "proposals": 0}}
    for label, rep in reports.items():
        if "/" in label:
            raise ValueError(f"run label {label!r} contains '/'; pass --labels without '/'")
        if "methods" not in rep:
            raise ValueError(f"run {label!r} is a batch sweep (decode/eval.py --batch); redraw it alone")
        for m, row in rep["methods"].items():
            out["methods"][f"{label}/{m}"] = row
        for d, rows in rep.get("datasets", {}).items():
            for m, row in rows.items():
                out["datasets"].setdefault(d, {})[f"{label}/{m}"] = row
        for m, rows in rep.get("per_prompt", {}).items():
            out["per_prompt"][f"{label}/{m}"] = rows
        for m, rec in rep.get("trees", {}).items():
            out["trees"][f"{label}/{m}"] = rec
        env = rep.get("environment", {})
        out["environment"]["runs"][label] = env
        out["environment"]["proposals"] = max(out["environment"]["proposals"], int(env.get("proposals") or 0))
    return out


def comparison_markdown(reports: dict[str, dict]) -> str:
    """Side-by-side tables of several reports: what each run was, then per scope (all prompts, each data set) a
    row per method with tau and speedup columns for every run (``-`` where a run lacks the method)."""
    labels = list(reports)
    md = ["# dartree eval comparison", "", "| run | target | checkpoint | dtype | budget | prompts | max_new_tokens |",
          "|---|---|---|---|---|---|---|"]
    for lab, rep in reports.items():
        e = rep.get("environment", {})
        md.append(f"| {lab} | {e.get('target', '?')} | {e.get('checkpoint', '?')} | {e.get('dtype', '?')} | "
                  f"{e.get('budget', '?')} | {e.get('prompts_done', '?')} | {e.get('max_new_tokens', '?')} |")
    scopes = [("all prompts", None)] + [(d, d) for d in dict.fromkeys(d for r in reports.values() for d in r.get("datasets", {}))]
    for title, d in scopes:
        tables = {lab: (rep["methods"] if d is None else rep.get("datasets", {}).get(d, {})) for lab, rep in reports.items()}
        methods = list(dict.fromkeys(m for t in tables.values() for m in t))
        md += ["", f"## {title}", "", "| method | " + " | ".join(f"{lab} tau | {lab} speedup" for lab in labels) + " |",
               "|---|" + "---|---|" * len(labels)]
        for m in methods:
            cells = []
            for lab in labels:
                r = tables[lab].get(m)
                cells += ["-", "-"] if r is None else [f"{r['tau']:.3f}", f"{r['speedup']:.3f}x"]
            md.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


def load_curve(path: str | Path) -> list[dict]:
    """Learning-curve points from a training run folder (``curve.json``), a checkpoint folder
    (``learning_curve.json``) or a JSON file.

    Raises:
        FileNotFoundError: none of those exists.
        ValueError: the file is not valid JSON or not a list of curve points (objects with ``train_tokens`` and
            ``holdout_chain_tau``); the file and the fix named.
    """
    path = Path(path)
    fix = ("point --curves at a training run folder, a checkpoint folder or a complete curve.json / "
           "learning_curve.json (training/train.py writes them)")
    for f in ([path] if path.is_file() else [path / "curve.json", path / "learning_curve.json"]):
        if f.is_file():
            pts = _read_json(f, fix)
            if not isinstance(pts, list) or not all(isinstance(p, dict) and "train_tokens" in p
                                                    and "holdout_chain_tau" in p for p in pts):
                raise ValueError(f"{f} is not a learning curve (a list of points with train_tokens and "
                                 f"holdout_chain_tau): {fix}")
            return pts
    raise FileNotFoundError(f"{path} holds no curve.json or learning_curve.json")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dartree-report", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("dirs", nargs="*", help="eval report folders (each with report.json)")
    ap.add_argument("--out", default=None,
                    help="output: folder for several reports (default reports/compare), folder for one report "
                         "(default: the report's own), or the PNG file for --curves (default curves.png)")
    ap.add_argument("--labels", nargs="+", default=None, help="run names (default: the folders' distinct tails)")
    ap.add_argument("--draw-round", type=int, default=None,
                    help="1-based round of the recorded prompt to draw as a verify tree (default: per method the "
                         "round with the longest accepted path)")
    ap.add_argument("--curves", nargs="+", default=None, metavar="PATH",
                    help="learning curves to draw in one picture: training run folders (curve.json), checkpoint "
                         "folders (learning_curve.json) or JSON files")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Console entry point (``dartree-report``): 0 on success, 1 when a figure failed, 2 for bad arguments."""
    args = parse_args(argv)
    if args.curves and args.dirs:
        return fail("give report folders or --curves, not both")
    if not args.curves and not args.dirs:
        return fail("give at least one report folder (or --curves PATH ...)")
    sources = args.curves or args.dirs
    labels = args.labels or run_labels(sources)
    if len(labels) != len(sources):
        return fail(f"{len(labels)} --labels for {len(sources)} inputs")
    if args.draw_round is not None and args.draw_round < 1:
        return fail(f"--draw-round is 1-based, got {args.draw_round}")
    if args.curves:
        png = Path(args.out or "curves.png")
        problem = "is an existing folder, not a PNG file" if png.is_dir() else folder_problem(png.parent)
        if problem:
            where = "" if png.is_dir() else f": its folder {png.parent}"
            return fail(f"--out '{png}'{where} {problem}; give a PNG path in a writable folder")
        try:
            curves = {lab: load_curve(p) for lab, p in zip(labels, args.curves)}
            # lazy: matplotlib loads only for --curves
            from dartree.base.figures import fig_curves, save_png

            png = save_png(fig_curves(curves), args.out or "curves.png")
        except (FileNotFoundError, ValueError, json.JSONDecodeError) as exc:
            return fail(f"{exc}")
        print(f"wrote {png}")
        return 0
    out = Path(args.out or (args.dirs[0] if len(args.dirs) == 1 else "reports/compare"))
    problem = folder_problem(out)
    if problem:
        what = "--out" if args.out else "output folder (default of --out)"
        return fail(f"{what} '{out}' {problem}; give a writable folder for report.md and its figures as --out")
    try:
        reports = {lab: load_report(d) for lab, d in zip(labels, args.dirs)}
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as exc:
        return fail(f"{exc}")
    if len(reports) == 1:
        report, out = next(iter(reports.values())), Path(args.out or args.dirs[0])
        out.mkdir(parents=True, exist_ok=True)
        src_md = Path(args.dirs[0]) / "report.md"
        if out.resolve() != Path(args.dirs[0]).resolve() and src_md.exists():
            _write(out / "report.md", src_md.read_text())
    else:
        try:
            report = merge_reports(reports)
        except ValueError as exc:
            return fail(f"{exc}")
        out = Path(args.out or "reports/compare")
        out.mkdir(parents=True, exist_ok=True)
        _write(out / "report.json", json.dumps(report, indent=1))
        _write(out / "report.md", comparison_markdown(reports))
    notes = write_figures(report, out, args.draw_round)
    for n in notes:
        print(n, file=sys.stderr)
    print(f"wrote {out / 'report.md'} and its figures")
    return 1 if any("failed" in n or "not written" in n or "no figures" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())


def aggregate(rows: list[dict], ar_rows: list[dict]) -> dict:
    """Aggregate per-prompt rows of one method (and the matching AR rows) into tau / speed figures, with the
    break-even tau of a speculative method (``break_even``, :func:`.break_even.break_even_fields`)."""
    committed = sum(sum(r["accept_lengths"]) for r in rows)
    rounds = sum(len(r["accept_lengths"]) for r in rows)
    dec_tok = sum(max(r["new_tokens"] - 1, 0) for r in rows)
    dec_s = sum(r["decode_s"] for r in rows)
    ar_tok = sum(max(r["new_tokens"] - 1, 0) for r in ar_rows)
    ar_s = sum(r["decode_s"] for r in ar_rows)
    tps = dec_tok / dec_s if dec_s > 0 else float("nan")
    ar_tps = ar_tok / ar_s if ar_s > 0 else float("nan")
    out = {
        "tau": committed / rounds if rounds else float("nan"),
        "tokens_per_s": tps,
        "speedup": tps / ar_tps if ar_tps and ar_tps == ar_tps else float("nan"),
        "rounds": rounds,
        "decode_tokens": dec_tok,
        "prompts": len(rows),
    }
    if rows and "stage_s" in rows[0]:
        for st in rows[0]["stage_s"]:
            out[f"{st}_ms_per_round"] = 1000 * sum(r["stage_s"][st] for r in rows) / max(rounds, 1)
        out["mean_tree_nodes"] = sum(sum(r["tree_nodes"]) for r in rows) / max(rounds, 1)
    if rows and "budgets" in rows[0]:  # verification budget per round (with --budget auto: the cost model's choice)
        hist: dict[int, int] = {}
        for r in rows:
            for b in r["budgets"]:
                hist[int(b)] = hist.get(int(b), 0) + 1
        out["budget_histogram"] = {b: hist[b] for b in sorted(hist)}
        drafted = [(n, d) for r in rows for b, n, d in zip(r["budgets"], r["accept_lengths"],
                                                          r.get("accepted_depths") or [0] * len(r["budgets"]))
                   if b > 0]  # rounds that verified drafted nodes: (tokens committed, drafts accepted)
        out["drafted_rounds"] = len(drafted)
        out["drafted_tau"] = sum(n for n, _ in drafted) / len(drafted) if drafted else float("nan")
        out["drafted_accepted"] = sum(d for _, d in drafted)
    paired = [r for r in rows if "paired_ar_decode_s" in r]
    if paired:  # against the AR decode that ran in lockstep with each row (--paired)
        p_tok = sum(max(r["paired_ar_new_tokens"] - 1, 0) for r in paired)
        p_s = sum(r["paired_ar_decode_s"] for r in paired)
        m_tok = sum(max(r["new_tokens"] - 1, 0) for r in paired)
        m_s = sum(r["decode_s"] for r in paired)
        out["paired_speedup"] = (m_tok / m_s) / (p_tok / p_s) if m_s > 0 and p_s > 0 and p_tok else float("nan")
        per = [(max(r["new_tokens"] - 1, 0) / r["decode_s"]) / (max(r["paired_ar_new_tokens"] - 1, 0) / r["paired_ar_decode_s"])
               for r in paired if r["decode_s"] > 0 and r["paired_ar_decode_s"] > 0 and r["paired_ar_new_tokens"] > 1]
        if per:
            out["paired_speedup_range"] = [min(per), max(per)]
    reps = [r["decode_s_repeats"] for r in rows if len(r.get("decode_s_repeats", ())) > 1]
    if reps:  # the baseline's own timing noise: (slowest - fastest) / mean of one prompt's repeats, averaged
        out["repeat_spread"] = sum((max(t) - min(t)) / (sum(t) / len(t)) for t in reps) / len(reps)
    mism = [r for r in rows if r.get("mismatch")]
    out["mismatches"] = len(mism)
    out["lossless"] = (len(mism) == 0) if rows and rows[0].get("mismatch") is not None else None
    if rows and rows[0].get("mismatch") is not None:  # a split only counts as a loss where the arithmetic is exact
        out["exact"] = all(r.get("exact", True) for r in rows)
    return {**out, **break_even_fields(rows, ar_rows, out)}  # what tau pays here, from these figures


def split_label(row: dict) -> str:
    """How one prompt's output that differs from AR's is named: ``MISMATCH`` where the run's arithmetic makes a
    verify row equal an AR step (fp32, or ``--invariant``), so the split is a real loss of exactness; else
    ``split@N (top-2 margin M)``, the first differing token N and the target's margin there (a near-tie that bf16
    verify rows may round the other way; a peer's own arithmetic splits the same way). Empty when equal."""
    if not row.get("mismatch"):
        return ""
    if row.get("exact", True):
        return "MISMATCH"
    return f"split@{row.get('first_divergence')} (top-2 margin {row.get('margin_at_divergence', float('nan')):.3f})"


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


def fixed_sibling(report: dict, m: str) -> str | None:
    """The fixed-budget row of the same builder as the ``--budget auto`` row ``m`` (``pruned@auto`` ->
    ``pruned@B8``, ``chain@auto`` -> ``chain``; the best paired one when a sweep has several), or None."""
    auto = report.get("environment", {}).get("cost_models", {})
    base = m.split("@")[0]
    rows = [(n, r) for n, r in report["methods"].items() if n != m and n not in auto and not r.get("peer", False)
            and n.split("@")[0] == base and (n == base or n.startswith(base + "@B"))]
    if not rows:
        return None
    return max(rows, key=lambda nr: nr[1].get("paired_speedup", nr[1]["speedup"]))[0]


def _vs_text(report: dict, m: str) -> str:
    """``m``'s fixed-budget sibling as a clause: its tau and (paired) speedup, or empty."""
    f = fixed_sibling(report, m)
    if f is None:
        return ""
    r = report["methods"][f]
    paired = f", {r['paired_speedup']:.3f}x AR paired" if "paired_speedup" in r else ""
    return f"{f} (a fixed budget of the same builder, same prompts): tau {r['tau']:.3f}, {r['speedup']:.3f}x AR{paired}"


def _drafter_warnings(report: dict, m: str, r: dict, auto: bool, tau_floor: float) -> list[str]:
    """The drafter warnings of one method's aggregate ``r``: drafted rounds that accepted nothing (the drafter
    contributes nothing) kept apart from a policy that chose not to draft (B=0 in N of M rounds)."""
    hist = {int(b): n for b, n in (r.get("budget_histogram") or {}).items()}
    rounds, skipped = r.get("rounds", sum(hist.values())), hist.get(0, 0)
    drafted = r.get("drafted_rounds")
    if drafted is None:  # a report from before drafted_rounds was recorded
        drafted = rounds - skipped if hist else (0 if r.get("mean_tree_nodes", 1.0) == 0 else None)
    dtau = r.get("drafted_tau", r["tau"])
    vs = _vs_text(report, m)
    if drafted == 0 and auto:
        return [f"WARNING: {m} took a plain AR step every round (B=0 in all {rounds}): the policy (--budget auto) "
                "chose not to draft, so its tau says nothing about the drafter" + (f"; {vs}" if vs else "")]
    if drafted == 0:
        return [f"WARNING: {m} drafted no tree nodes (budget 0), so tau is 1: raise --budget"]
    if dtau < tau_floor:
        accepted = f" and its {drafted} drafted rounds accepted {r['drafted_accepted']} drafts in all" \
            if "drafted_accepted" in r else ""
        return [f"WARNING: {m} tau = {r['tau']:.3f} is about 1{accepted}: the drafter contributes nothing "
                "(untrained, mismatched to the target, or the wrong checkpoint)"]
    out = []
    if auto and r["tau"] < tau_floor:
        out.append(f"WARNING: {m} tau = {r['tau']:.3f}: the policy (--budget auto) chose not to draft (B=0 in "
                   f"{skipped} of {rounds} rounds); its {drafted} drafted rounds committed {dtau:.2f} tokens each, so "
                   "the drafter does contribute" + (f"; {vs}" if vs else ""))
    f = fixed_sibling(report, m) if auto else None
    if f is not None and skipped > rounds / 2 and report["methods"][f].get("paired_speedup", 0.0) > 1.0 \
            and not out:
        out.append(f"WARNING: {m} chose B=0 in {skipped} of {rounds} rounds while {vs}: the policy missed what a "
                   "fixed budget gained here")
    return out


def report_warnings(report: dict, tau_floor: float = 1.05) -> list[str]:
    """Loud warnings for a report: a method whose drafted rounds accepted about nothing (the drafter contributes
    nothing), kept apart from a ``--budget auto`` method whose policy chose not to draft (B=0 in N of M rounds, set
    against the fixed-budget row of the same builder when the run has one); and a method whose T = 0 output differs
    from AR's."""
    out = []
    auto = report.get("environment", {}).get("cost_models", {})  # the --budget auto rows
    for m, r in report["methods"].items():
        if m == "ar":
            continue
        peer = r.get("peer", False)  # a peer's tau is its own business (hf-generate: 1 by construction)
        if not peer:
            out += _drafter_warnings(report, m, r, m in auto, tau_floor)
        if r["lossless"] is False and r.get("exact", True):
            out.append(f"WARNING: {m} differs from AR on {r['mismatches']} prompts: MISMATCH, a loss of exactness "
                       "where verify rows and AR steps compute the same bits (see per_prompt first_divergence)")
        elif r["lossless"] is False:
            out.append(f"note: {m} splits from AR on {r['mismatches']} prompts at near-ties (per_prompt: "
                       "first_divergence, margin_at_divergence): "
                       + ("its own arithmetic" if peer else "bf16 verify rows round differently from AR steps; "
                          "--invariant on makes them equal"))
    return out


def build_report(environment: dict, rows: dict[str, list[dict]], trees: dict, methods: list[str], peers: list[str],
                 datasets: list[str], peers_skipped: dict) -> dict:
    """report.json from the per-prompt ``rows`` (method -> rows) and the run's ``environment``: every method's and
    peer's aggregate (:func:`aggregate`) over all prompts and per data set, the skipped peers, the rows themselves and
    the first prompt's verify ``trees``."""
    report = {"methods": {}, "datasets": {}, "environment": environment}
    ar_all = rows["ar"]
    report["methods"]["ar"] = aggregate(ar_all, ar_all)
    for m in [*methods, *peers]:
        report["methods"][m] = aggregate(rows[m], ar_all)
    for d in datasets:
        ar_d = [r for r in ar_all if r["dataset"] == d]
        report["datasets"][d] = {m: aggregate([r for r in rows[m] if r["dataset"] == d], ar_d)
                                 for m in ["ar", *methods, *peers]}
    for m in peers:  # dartree.decode.harness.peers rows: tau = committed tokens per target forward, prefill excluded
        for agg in [report["methods"][m]] + [report["datasets"][d][m] for d in datasets]:
            agg["peer"] = True
    report["peers_skipped"] = peers_skipped
    report["per_prompt"] = rows
    report["trees"] = trees  # every verify tree of the first prompt, per method, for drawing
    return report


def write_report_files(out: Path, report: dict, md: str) -> None:
    """Write ``out/report.json`` (``report``) and ``out/report.md`` (``md``, made from the same report), each
    atomically under a unique temporary name (:func:`dartree.base.files.write_file_atomically`), so two runs
    writing one folder never share a temporary file. Call it inside ``Signals.held`` (``decode/eval.py``), so that
    SIGINT / SIGTERM cannot fall between the two files and leave one a prompt behind the other.

    Raises:
        OSError: ``out`` cannot be written.
    """
    write_file_atomically(out / "report.json", json.dumps(report, indent=1))
    write_file_atomically(out / "report.md", md)

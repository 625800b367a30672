"""Figures of evaluation reports, redrawn or overlaid; learning-curve pictures.

``dartree-report DIR`` (or ``python decode/harness/report_command.py DIR``) redraws the figures of one eval report
(the ``report.json`` that ``decode/eval.py`` wrote in DIR) and refreshes the figure section of its ``report.md``.
``dartree-report DIR DIR ... --out OUT`` overlays several reports (different checkpoints, targets, dtypes or
runs) in one side-by-side ``OUT/report.md``: tau / speedup tables with a column pair per run, and every figure
with one line or bar per (run, method), methods named ``RUN/METHOD``.
``dartree-report --curves RUN_OR_CKPT ... --out curves.png`` draws learning curves (``curve.json`` of a training
run, ``learning_curve.json`` of a checkpoint folder, or the JSON files themselves) in one picture.

This module holds that command and what it reads saved reports with: :func:`load_report`, :func:`merge_reports`,
:func:`comparison_markdown`, :func:`load_curve`. The figures themselves are
:mod:`dartree.decode.harness.report_figures`'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.fields import folder_problem
from dartree.decode.harness.report_figures import write_figures
from dartree.decode.harness.report_rows import EvalReport


def _read_json(f: Path, fix: str):
    """``f`` parsed as JSON; a truncated, corrupt or non-JSON file is one ValueError naming ``f`` and ``fix``."""
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{f} is not valid JSON ({exc}): {fix}") from None


def load_report(path: str | Path) -> EvalReport | dict:
    """Read ``path/report.json`` (or ``path`` itself when it is a file): an eval report as an
    :class:`~dartree.decode.harness.report_rows.EvalReport`, a batch sweep's (``decode/eval.py --batch``) as its dict.

    Raises:
        FileNotFoundError: no report there.
        ValueError: not valid JSON (the file and the fix named), not an eval report (no ``methods``, no
            ``batch_sweep``), or a row without a required field.
    """
    path = Path(path)
    f = path / "report.json" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"{path} holds no report.json (write one with decode/eval.py --out {path})")
    rep = _read_json(f, "re-run decode/eval.py or point at a complete report")
    if not isinstance(rep, dict) or ("methods" not in rep and "batch_sweep" not in rep):
        raise ValueError(f"{f} is not an eval report (no 'methods' or 'batch_sweep')")
    return rep if "methods" not in rep else EvalReport.from_json(rep, str(f))


def run_labels(paths: Sequence[str | Path]) -> list[str]:
    """Short distinct labels for several report folders: the shortest tail of their paths that tells them apart
    (``reports/dflash``, ``reports/dspark`` -> ``dflash``, ``dspark``)."""
    parts = [Path(p).resolve().parts for p in paths]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"run{i}" for i in range(len(paths))]


def merge_reports(reports: dict[str, EvalReport | dict]) -> EvalReport:
    """One report holding several: every method ``m`` of run ``label`` becomes ``label/m`` (in methods, datasets,
    per_prompt and trees); ``environment`` keeps each run's under ``runs`` and the largest ``proposals``.

    Raises:
        ValueError: a label containing ``/`` (it would be ambiguous in method names), a batch sweep's report, or no
            report.
    """
    if not reports:
        raise ValueError("no reports to merge")
    out = EvalReport(environment={"runs": {}, "proposals": 0}, methods={})
    for label, rep in reports.items():
        if "/" in label:
            raise ValueError(f"run label {label!r} contains '/'; pass --labels without '/'")
        if not isinstance(rep, EvalReport):
            raise ValueError(f"run {label!r} is a batch sweep (decode/eval.py --batch); redraw it alone")
        out.methods.update({f"{label}/{m}": row for m, row in rep.methods.items()})
        for d, rows in rep.datasets.items():
            out.datasets.setdefault(d, {}).update({f"{label}/{m}": row for m, row in rows.items()})
        out.per_prompt.update({f"{label}/{m}": rows for m, rows in rep.per_prompt.items()})
        out.trees.update({f"{label}/{m}": rec for m, rec in rep.trees.items()})
        out.environment["runs"][label] = rep.environment
        out.environment["proposals"] = max(out.environment["proposals"], int(rep.environment.get("proposals") or 0))
    return out


def comparison_markdown(reports: dict[str, EvalReport]) -> str:
    """Side-by-side tables of several reports: what each run was, then per scope (all prompts, each data set) a
    row per method with tau and speedup columns for every run (``-`` where a run lacks the method)."""
    labels = list(reports)
    md = ["# dartree eval comparison", "", "| run | target | checkpoint | dtype | budget | prompts | max_new_tokens |",
          "|---|---|---|---|---|---|---|"]
    for lab, rep in reports.items():
        e = rep.environment
        md.append(f"| {lab} | {e.get('target', '?')} | {e.get('checkpoint', '?')} | {e.get('dtype', '?')} | "
                  f"{e.get('budget', '?')} | {e.get('prompts_done', '?')} | {e.get('max_new_tokens', '?')} |")
    scopes = [("all prompts", None)] + [(d, d) for d in dict.fromkeys(d for r in reports.values() for d in r.datasets)]
    for title, d in scopes:
        tables = {lab: (rep.methods if d is None else rep.datasets.get(d, {})) for lab, rep in reports.items()}
        methods = list(dict.fromkeys(m for t in tables.values() for m in t))
        md += ["", f"## {title}", "", "| method | " + " | ".join(f"{lab} tau | {lab} speedup" for lab in labels) + " |",
               "|---|" + "---|---|" * len(labels)]
        for m in methods:
            cells = []
            for lab in labels:
                r = tables[lab].get(m)
                cells += ["-", "-"] if r is None else [f"{r.tau:.3f}", f"{r.speedup:.3f}x"]
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
            write_file_atomically(out / "report.md", src_md.read_text())
    else:
        try:
            report = merge_reports(reports)
        except ValueError as exc:
            return fail(f"{exc}")
        out = Path(args.out or "reports/compare")
        out.mkdir(parents=True, exist_ok=True)
        write_file_atomically(out / "report.json", json.dumps(report.to_json(), indent=1))
        write_file_atomically(out / "report.md", comparison_markdown(reports))
    notes = write_figures(report, out, args.draw_round)
    for n in notes:
        print(n, file=sys.stderr)
    print(f"wrote {out / 'report.md'} and its figures")
    return 1 if any("failed" in n or "not written" in n or "no figures" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())

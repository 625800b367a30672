"""The results page: ``python -m dartree.training.tools.results`` (``make results``) renders docs/results.md from data.

Sources, all committed:

- ``campaign/train_state.json``: every campaign run (shards, steps, predictions, held-out and eval chain tau, CPU,
  ``parent``) and the baseline; the shipped drafters' lineage is the ``parent`` chain of each ``shipped_run``;
- ``campaign/manifest.json``: the campaign's regenerated data, shard by shard (tokens, seconds, dtype, CPU);
- ``checkpoints/<name>/learning_curve.json``: each shipped folder's training curve (held-out tau against steps);
- ``checkpoints/results.json``: every other measurement, each with its drafter, command, machine and dtype; per
  campaign run its training dtype and time (``shipped.runs``); remarks per section (``notes``).

The page is generated: edit the data and render again (``--check`` exits 1 when the page differs from its data, and
says at which line, in which section and figure). A source that does not parse or lacks what the page reads is one
line naming the file and the place in it (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.records import NUMBER, read_json

REPO = Path(__file__).resolve().parents[2]
RECIPES = ("dflash_b16", "domino_b16", "dspark_b16")


class ResultsError(ValueError):
    """A results source is missing or malformed; the message names the file and the fix."""


_TAU = (*NUMBER, None)
# What the page reads from each source (dartree.base.records shapes); other keys are free
STATE_SHAPE = {"path_roots?": dict,
               "baseline?": {"*": {"predictions?": NUMBER, "holdout_chain_tau?": _TAU, "eval_chain_tau?": _TAU}},
               "*": {"shipped_run?": (str, None), "runs": [{
                   "output_dir": str, "parent?": (str, None), "shards": int, "steps?": (int, None),
                   "predictions": NUMBER, "holdout_chain_tau?": _TAU, "eval_chain_tau?": _TAU, "device?": (str, None),
                   "cpu?": (str, None), "updated?": (str, None)}]}}
MANIFEST_SHAPE = {"shards?": [{"conversations": int, "response_tokens": int, "seconds": NUMBER}],
                  "totals?": {"shards?": int, "conversations?": int, "response_tokens?": int,
                              "regeneration_seconds?": NUMBER}}
CURVE_SHAPE = [{"step": int, "train_tokens?": (int, None), "holdout_chain_tau?": _TAU}]
COMPARE_SHAPE = {"arms": {"*": {"settings": {"recipe": str, "steps": int, "overrides": [str]}, "note?": str,
                                 "command": str, "steps": int, "cpu_s": NUMBER, "holdout_chain_tau?": _TAU,
                                 "eval_chain_tau?": _TAU, "eval_mismatches?": (int, None), "draft_ms?": (*NUMBER, None),
                                 "curve": [{"step": int, "holdout_chain_tau?": _TAU}], "cpu": str,
                                 "updated": str}}}
RESULTS_SHAPE = {"shipped?": {"runs?": {"*": str}, "eval?": dict},
                 "notes?": {"*": [str]},
                 "measurements?": [{"table?": {"columns": list, "rows": [list]}, "notes?": [str]}]}


@dataclass
class ResultSources:
    """What the page is rendered from (the parsed files; see the module docstring).

    Attributes:
        state: ``campaign/train_state.json`` as stored ({recipe: {"runs": [...], "shipped_run"}, "baseline"}).
        manifest: ``campaign/manifest.json`` ({"shards": [...], "holdout", "totals"}).
        curves: {checkpoint name: its learning_curve.json points}.
        results: ``checkpoints/results.json`` ({"shipped": {...}, "measurements": [...]}).
        compare: ``campaign/compare.json`` ({"arms": {name: record}}; ``training/tools/compare.py``).
    """

    state: dict
    manifest: dict
    curves: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    compare: dict = field(default_factory=dict)


def run_name(path: str | None) -> str:
    """The folder name of a recorded run path (``runs:dspark_b16-00027`` or an old absolute path) -> its last part."""
    if not path:
        return ""
    return Path(path.split(":", 1)[1] if ":" in path.split("/", 1)[0] else path).name


def _table(columns: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines; cells are str()-ed, ``|`` escaped."""
    def cell(v) -> str:
        return str(v).replace("|", "\\|")
    out = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _tau(v) -> str:
    return "" if v is None else f"{v:.3f}"


def lineage(state: dict, recipe: str, run: str) -> list[dict]:
    """The runs from the baseline to ``run`` (its ``parent`` chain, oldest first), by run name.

    Raises:
        ResultsError: ``run`` or a parent is not recorded for ``recipe``, or the chain loops.
    """
    by_name = {run_name(r["output_dir"]): r for r in state.get(recipe, {}).get("runs", [])}
    chain, name = [], run_name(run)
    while name:
        if name not in by_name or len(chain) > len(by_name):
            raise ResultsError(f"campaign/train_state.json: {recipe} has no run {name} (or its parents loop); "
                               "restore the file with git or fix shipped_run / parent")
        chain.append(by_name[name])
        name = run_name(by_name[name].get("parent"))
    return chain[::-1]


def shipped_section(src: ResultSources) -> list[str]:
    """The shipped drafters: per recipe its lineage from the baseline, predictions, held-out and eval chain tau."""
    shipped = src.results.get("shipped", {})
    notes, ev = shipped.get("runs", {}), shipped.get("eval", {})
    base = src.state.get("baseline", {})
    rows = []
    for recipe in [r for r in RECIPES if r in src.state] + [r for r in src.state if r not in RECIPES + ("baseline",)]:
        if "shipped_run" not in src.state[recipe]:
            continue
        chain = lineage(src.state, recipe, src.state[recipe]["shipped_run"])
        steps = " -> ".join(f"{run_name(r['output_dir'])} ({r['shards']} shards, {r['steps']} steps"
                            + (f"; {notes[run_name(r['output_dir'])]}" if run_name(r["output_dir"]) in notes else "")
                            + ")" for r in chain)
        b, last = base.get(recipe, {}), chain[-1]
        rows.append([f"`{recipe}`", f"baseline -> {steps}", f"{sum(r['predictions'] for r in chain) / 1e6:.2f}M",
                     f"{_tau(b.get('holdout_chain_tau'))} -> {_tau(last.get('holdout_chain_tau'))}",
                     f"{_tau(b.get('eval_chain_tau'))} -> {_tau(last.get('eval_chain_tau'))}"])
    if not rows:
        return []
    out = ["## The shipped drafters", "",
           "Each shipped drafter is the last run of its lineage in the training campaign (docs/campaign.md), "
           "started from the pre-campaign drafter (the baseline).", ""]
    out += _table(["checkpoint", "lineage (run: shards, steps; training dtype and time)", "campaign predictions",
                   "held-out chain tau, baseline -> shipped", "eval chain tau, baseline -> shipped"], rows)
    out += [""]
    if ev:
        out += [f"Eval chain tau: {ev.get('setting', '')}; `{ev.get('command', '')}` on {ev.get('machine', '')}."
                + (f" Baseline: {ev['baseline']}." if ev.get("baseline") else ""), ""]
    if shipped.get("holdout"):
        out += [f"Held-out chain tau: {shipped['holdout']}.", ""]
    return out


def runs_section(src: ResultSources) -> list[str]:
    """Every campaign run, per recipe in recording order, with the baseline first."""
    rows = []
    for recipe, b in src.state.get("baseline", {}).items():
        rows.append([f"`{recipe}`", "baseline", "", "", f"{b.get('predictions', 0) / 1e6:.2f}M",
                     _tau(b.get("holdout_chain_tau")), _tau(b.get("eval_chain_tau")), "", ""])
    for recipe in [r for r in src.state if r not in ("baseline",)]:
        shipped = run_name(src.state[recipe].get("shipped_run"))
        for r in src.state[recipe].get("runs", []):
            name = run_name(r["output_dir"])
            rows.append([f"`{recipe}`", name + (" (shipped)" if name == shipped else ""),
                         run_name(r.get("parent")) or ("scratch" if r.get("from_scratch") else "baseline"),
                         f"{r['shards']} / {r.get('steps')}", f"{r['predictions'] / 1e6:.2f}M",
                         _tau(r.get("holdout_chain_tau")), _tau(r.get("eval_chain_tau")),
                         r.get("device") or r.get("cpu", ""), (r.get("updated") or "")[:10]])
    if not rows:
        return []
    return ["## Campaign runs", "", "From `campaign/train_state.json`; predictions of the run alone (the baseline: "
            "its own training). Held-out chain tau on the campaign's held-out set.", "",
            *_table(["recipe", "run", "continues", "shards / steps", "predictions", "held-out chain tau",
                     "eval chain tau", "machine", "date"], rows), ""]


def data_section(manifest: dict) -> list[str]:
    """The campaign's data, consecutive shards grouped by machine and dtype: response tokens and their rate."""
    groups: list[dict] = []
    for i, s in enumerate(manifest.get("shards", [])):
        key = (s.get("device") or s.get("cpu", ""), s.get("gen_dtype", ""), s.get("threads"))
        if not groups or groups[-1]["key"] != key:
            groups.append({"key": key, "first": i, "shards": [], "date": (s.get("created") or "")[:10]})
        groups[-1]["shards"].append(s)
    if not groups:
        return []
    rows = []
    for g in groups:
        sh = g["shards"]
        tok, sec = sum(s["response_tokens"] for s in sh), sum(s["seconds"] for s in sh)
        rates = [s["response_tokens"] / s["seconds"] for s in sh if s["seconds"]]
        rows.append([f"{g['first']}-{g['first'] + len(sh) - 1}", g["date"], g["key"][0], g["key"][1], g["key"][2],
                     f"{sum(s['conversations'] for s in sh):,}", f"{tok:,}",
                     f"{min(rates):.1f}-{max(rates):.1f} ({tok / sec:.1f} over the group)" if rates else ""])
    t = manifest.get("totals") or {}
    return ["## Campaign data", "", "From `campaign/manifest.json` (`python training/tools/campaign.py stage=status` prints "
            "the same); response tokens/s of regeneration on the threads given.", "",
            *_table(["shards", "from", "machine", "dtype", "threads", "conversations", "response tokens",
                     "response tokens/s per shard"], rows), "",
            f"In all: {t.get('shards', 0)} shards, {t.get('conversations', 0):,} conversations, "
            f"{t.get('response_tokens', 0):,} response tokens, {t.get('regeneration_seconds', 0) / 3600:.1f} hours "
            "of regeneration.", ""]


def curves_section(curves: dict) -> list[str]:
    """Held-out chain tau against steps from each checkpoint's learning_curve.json: one table per group of
    checkpoints whose curves share their steps and token counts (the same training data), names without points
    left out."""
    groups: dict = {}
    for n, pts in curves.items():
        if pts:
            groups.setdefault(tuple((p["step"], p.get("train_tokens")) for p in pts), []).append(n)
    if not groups:
        return []
    out = ["## Learning curves of the shipped folders", "", "Held-out chain tau on each training run's own held-out "
           "set, from `checkpoints/NAME/learning_curve.json` (the training the folder's weights started from; "
           "`dartree-report --curves checkpoints/NAME ...` plots them).", ""]
    for key, names in groups.items():
        rows = []
        for i, (st, tokens) in enumerate(key):
            pts = [curves[n][i] for n in names]
            rows.append([st, f"{tokens or 0:,} ({pts[0].get('distinct_sequences', '')})",
                         *[_tau(p.get("holdout_chain_tau")) for p in pts]])
        out += [*_table(["step", "sequence tokens seen (distinct sequences)", *[f"`{n}`" for n in names]], rows), ""]
    return out


def compare_section(compare: dict) -> list[str]:
    """The equal-compute comparison (``campaign/compare.json``): one row per arm (its overrides, steps, CPU seconds,
    held-out chain tau at each curve step and at the end, eval chain tau with its mismatches, draft ms per round, CPU,
    date), then each arm's training command; empty without arms."""
    arms = compare.get("arms", {})
    if not arms:
        return []
    steps = sorted({p["step"] for a in arms.values() for p in a["curve"]})
    rows = []
    for name, a in arms.items():
        at = {p["step"]: p.get("holdout_chain_tau") for p in a["curve"]}
        over = " ".join(f"`{w}`" for w in a["settings"]["overrides"]) or "(the recipe)"
        ev = _tau(a.get("eval_chain_tau"))
        if a.get("eval_mismatches"):
            ev += f" ({a['eval_mismatches']} mismatches)"
        cpu = f"{a['cpu_s'] / 60:.0f}" + (" (resumed: part)" if a.get("resumed") else "")
        rows.append([f"`{name}`", over, a["steps"], cpu, *[_tau(at.get(s)) for s in steps],
                     _tau(a.get("holdout_chain_tau")), ev, a.get("draft_ms") or "", a["cpu"], a["updated"][:10]])
    recipe = next(iter(arms.values()))["settings"]["recipe"]
    out = ["## Equal-compute comparison of training choices", "",
           f"`python training/tools/compare.py` (`campaign/compare.yaml`): every arm trains `{recipe}` (or the recipe "
           "its overrides name) from the same seed on the same data, in the same order, for the same number of steps "
           "unless its overrides say otherwise; each arm's full training command is listed below the table. Held-out "
           "chain tau at each step shown and at the end; eval chain tau of the arm's checkpoint as its eval command "
           "says (for `campaign/compare.yaml`: 15 prompts x 128 tokens, 5 each of HumanEval, MT-Bench, GSM8K, fp32, "
           "budget 16, greedy); CPU minutes of the training process (a resumed arm's: the resuming process only); "
           "draft ms per round from the eval run. Curves: `campaign/compare_curves.png`.",
           "", *_table(["arm", "overrides", "steps", "CPU min", *[f"held-out @{s}" for s in steps], "held-out end",
                        "eval chain tau", "draft ms", "machine", "date"], rows), ""]
    for name, a in arms.items():
        out += [f"- `{name}`" + (f": {a['note']}" if a.get("note") else "") + f". `{a['command']}`"]
    return out + [""]


def measurement_section(m: dict) -> list[str]:
    """One entry of ``results.json["measurements"]``: title, what/where/how, its table, its notes.

    Raises:
        ResultsError: the entry lacks ``title`` or ``command`` or ``machine``.
    """
    missing = [k for k in ("title", "command", "machine") if not m.get(k)]
    if missing:
        raise ResultsError(f"checkpoints/results.json: measurement {m.get('id') or m.get('title')!r} lacks "
                           f"{missing}; every figure needs its command and machine")
    out = [f"### {m['title']}", ""]
    facts = [f"Command: `{m['command']}`", f"machine: {m['machine']}"]
    facts += [f"{k}: {m[k]}" for k in ("drafter", "dtype", "date", "commit") if m.get(k)]
    out += ["; ".join(facts) + ".", ""]
    if m.get("table"):
        out += [*_table(m["table"]["columns"], m["table"]["rows"]), ""]
    for note in m.get("notes", []):
        out += [note, ""]
    return out


def render_results(src: ResultSources) -> str:
    """The results page (Markdown): the shipped drafters' lineage, the campaign's runs and data, the learning
    curves (each section followed by its remarks, ``results.json["notes"][shipped|runs|data|curves]``) and every
    measurement of ``results.json``, in that order; ends with one newline.

    Raises:
        ResultsError: a lineage or a measurement is malformed (named).
    """
    out = ["# Results", "",
           "Generated by `python -m dartree.training.tools.results` (`make results`) from `campaign/train_state.json`, "
           "`campaign/manifest.json`, `campaign/compare.json`, `checkpoints/*/learning_curve.json` and "
           "`checkpoints/results.json`; edit "
           "those, not this page. Every figure names its command and machine; shared VMs drift by 10-50% within "
           "minutes, so compare timings only within one table.", ""]
    notes = src.results.get("notes", {})
    for key, lines in (("shipped", shipped_section(src)), ("runs", runs_section(src)),
                       ("data", data_section(src.manifest)), ("curves", curves_section(src.curves)),
                       ("compare", compare_section(src.compare))):
        out += lines
        if lines:  # the section's remarks, from results.json["notes"][key]
            for note in notes.get(key, []):
                out += [note, ""]
    ms = src.results.get("measurements", [])
    if ms:
        out += ["## Measurements", ""]
        for m in ms:
            out += measurement_section(m)
    return "\n".join(out).rstrip("\n") + "\n"


def _load(path: Path, default, shape):
    return read_json(path, shape, fix="fix it or restore it with git", absent=default, error=ResultsError)


def load_sources(repo: Path = REPO) -> ResultSources:
    """The committed sources under ``repo`` (absent files read as empty).

    Raises:
        ResultsError: a file does not parse or lacks what the page reads (one line naming the file and the place:
            :data:`STATE_SHAPE`, :data:`MANIFEST_SHAPE`, :data:`CURVE_SHAPE`, :data:`RESULTS_SHAPE`).
    """
    state = _load(repo / "campaign" / "train_state.json", {}, STATE_SHAPE)
    state.pop("path_roots", None)
    curves = {p.parent.name: _load(p, [], CURVE_SHAPE)
              for p in sorted((repo / "checkpoints").glob("*/learning_curve.json"))}
    order = [n for n in RECIPES if n in curves] + [n for n in curves if n not in RECIPES]
    return ResultSources(state=state, manifest=_load(repo / "campaign" / "manifest.json", {}, MANIFEST_SHAPE),
                         curves={n: curves[n] for n in order},
                         results=_load(repo / "checkpoints" / "results.json", {}, RESULTS_SHAPE),
                         compare=_load(repo / "campaign" / "compare.json", {}, COMPARE_SHAPE))


def where_differs(page: str, rendered: str) -> str:
    """Where ``page`` first differs from ``rendered``: the line number and the section (``##``) and figure
    (``###``) of the rendered page that hold it (``line 42, section 'Campaign runs'``)."""
    a, b = page.splitlines(), rendered.splitlines()
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    section = figure = None
    for line in b[: i + 1]:
        if line.startswith("## "):
            section, figure = line[3:], None
        elif line.startswith("### "):
            figure = line[4:]
    where = f"line {i + 1}, " + (f"section {section!r}" if section else "the page's head")
    return where + (f", figure {figure!r}" if figure else "")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: write the page (``--out``, default docs/results.md) atomically, or with ``--check``
    exit 1 when it differs from its data; 2 for a malformed source."""
    ap = argparse.ArgumentParser(prog="python -m dartree.training.tools.results", description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the repository whose data to render")
    ap.add_argument("--out", type=Path, default=None, help="the page (default: REPO/docs/results.md)")
    ap.add_argument("--check", action="store_true", help="exit 1 when the page differs from what its data renders")
    args = ap.parse_args(argv)
    out = args.out or args.repo / "docs" / "results.md"
    try:
        page = render_results(load_sources(args.repo))
    except ResultsError as exc:
        return fail(str(exc))
    if args.check:
        if not out.exists():
            print(f"{out}: missing; run make results")
            return 1
        old = out.read_text()
        same = old == page
        print(f"{out}: " + ("up to date" if same else f"differs from its data at {where_differs(old, page)}; run make "
                            "results"))
        return 0 if same else 1
    write_file_atomically(out, page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

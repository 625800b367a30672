"""The figures of an evaluation report (matplotlib, Agg canvas, no pyplot state).

Every figure is drawn from an eval report (:class:`~dartree.decode.harness.report_rows.EvalReport`, read back from
the ``report.json`` that ``decode/eval.py`` writes), so it can be redrawn without re-running anything
(``dartree-report``). The pictures are those the DARTree, DDTree and
PCTree papers are read through:

- :func:`fig_acceptance`: the acceptance-length distribution Pr(L >= t), t = 1 .. P + 1, one line per method
  (all prompts, then one panel per data set). L is the number of tokens a round commits (accepted drafts +
  bonus), so ``sum_t Pr(L >= t)`` equals the method's tau exactly.
- :func:`fig_sweep`: tau and speedup against the tree budget B, one line per builder (budget sweeps only).
- :func:`fig_stages`: stacked bars of milliseconds per round by stage, with one AR step as a reference line.
- :func:`fig_tree_shape`: mean tree nodes per depth and the acceptance rate per depth.
- :func:`fig_tree`: one verify tree drawn with its token texts, depth left to right, the accepted path
  highlighted (networkx ``multipartite_layout``).

What is read here (all lists are per verify round, in order): ``report.methods[m]``, the summary of method ``m``
(``tau``, ``speedup``, ``stage_ms``); ``report.per_prompt[m]``, its per-prompt rows (``dataset``, ``decode_s``,
``accept_lengths`` and, for tree methods, ``depth_nodes``, nodes at depth 1, 2, ..., and ``accepted_depths``, the
deepest accepted depth before truncation); ``report.trees[m]["rounds"]``, the recorded verify trees of one prompt;
and ``report.environment["proposals"]`` (P). Method names ``ar`` or ``LABEL/ar`` are the AR baseline; ``NAME@B<n>``
is builder NAME at budget n. Every ``fig_*`` function returns a ``matplotlib.figure.Figure`` whose artists carry
``gid`` s naming what they show (a method, a stage, a tree node), so tests read the drawn values back.
"""

from __future__ import annotations

import re
import textwrap
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dartree.decode.harness.report_rows import EvalReport

STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")  # dartree.decode.generate.STAGES
_SWEEP = re.compile(r"^(?P<builder>.+)@B(?P<budget>\d+)$")
_ACCEPTED, _REJECTED, _ROOT, _BONUS = "#98df8a", "#eeeeee", "#c6dbef", "#ffffff"  # node fills
_PATH = "#2ca02c"  # accepted path edges and outlines
_STAGE_COLORS = {"draft": "#4c72b0", "tree_build": "#dd8452", "tree_compile": "#937860", "verify": "#c44e52",
                 "commit": "#8c8c8c"}


# ----------------------------------------------------------------------------------------------- data


def is_ar(method: str) -> bool:
    """True for the AR baseline's method name (``ar``, or ``LABEL/ar`` in a merged report)."""
    return method == "ar" or method.endswith("/ar")


def tree_methods(report: EvalReport) -> list[str]:
    """Names of the speculative methods of a report (everything but the AR baseline), in report order."""
    return [m for m in report.methods if not is_ar(m)]


def method_styles(report: EvalReport) -> dict[str, dict]:
    """Line style per speculative method, the same in every figure: one colour per method (tab10, or tab20 beyond
    ten) and, in a merged report (``RUN/METHOD``), one line style per run, so a method keeps its colour across runs.

    Returns:
        ``{method: {"color": RGBA, "ls": str}}``.
    """
    import matplotlib

    ms = tree_methods(report)
    base = list(dict.fromkeys(m.split("/", 1)[-1] for m in ms))
    runs = list(dict.fromkeys(m.split("/", 1)[0] for m in ms if "/" in m))
    cmap = matplotlib.colormaps["tab10" if len(base) <= 10 else "tab20"]
    dashes = ("-", "--", ":", "-.")
    return {m: {"color": cmap(base.index(m.split("/", 1)[-1]) % cmap.N),
                "ls": dashes[runs.index(m.split("/", 1)[0]) % len(dashes)] if "/" in m else "-"} for m in ms}


def survival(lengths: Sequence[int], tmax: int) -> list[float]:
    """Empirical Pr(L >= t) for t = 1 .. tmax.

    Args:
        lengths: per-round committed tokens L (ints >= 0).
        tmax: last t (>= 1).
    Returns:
        tmax probabilities (nan for every t when ``lengths`` is empty).
    """
    n = len(lengths)
    if n == 0:
        return [float("nan")] * tmax
    return [sum(1 for x in lengths if x >= t) / n for t in range(1, tmax + 1)]


def mean_depth_nodes(depth_nodes: Sequence[Sequence[int]], dmax: int) -> list[float]:
    """Mean tree nodes at depth d = 1 .. dmax over rounds (a round with no node at d counts 0).

    Args:
        depth_nodes: per round, node counts at depth 1, 2, ...
        dmax: deepest depth reported.
    Returns:
        dmax means (nan when there is no round).
    """
    n = len(depth_nodes)
    if n == 0:
        return [float("nan")] * dmax
    return [sum(r[d] for r in depth_nodes if len(r) > d) / n for d in range(dmax)]


def depth_acceptance(depth_nodes: Sequence[Sequence[int]], accepted_depths: Sequence[int], dmax: int) -> list[float]:
    """Acceptance rate per depth: at depth d, of the rounds whose walk reached depth d - 1 (accepted depth
    >= d - 1) and whose tree has a node at depth d, the fraction that accepted a node at depth d.

    This is the conditional per-depth acceptance the tree builders trade off (a chain's rate at every depth is
    the drafter's conditional accuracy there); the unconditional form is :func:`survival`.
    Args:
        depth_nodes: per round, node counts at depth 1, 2, ...
        accepted_depths: per round, the deepest accepted depth (0 = none), same length.
        dmax: deepest depth reported.
    Returns:
        dmax rates in [0, 1] (nan where no round tried that depth).
    Raises:
        ValueError: the two lists differ in length.
    """
    if len(depth_nodes) != len(accepted_depths):
        raise ValueError(f"{len(depth_nodes)} rounds of depth_nodes but {len(accepted_depths)} accepted_depths")
    out = []
    for d in range(1, dmax + 1):
        tried = [a for r, a in zip(depth_nodes, accepted_depths) if a >= d - 1 and len(r) >= d and r[d - 1] > 0]
        out.append(sum(1 for a in tried if a >= d) / len(tried) if tried else float("nan"))
    return out


def rounds_of(report: EvalReport, method: str, dataset: str | None = None) -> dict[str, list]:
    """Per-round lists of one method, concatenated over its prompts (optionally of one data set).

    Returns:
        ``{"accept_lengths": [...], "depth_nodes": [...], "accepted_depths": [...]}`` (the last two empty for
        reports written before they were recorded, and for AR).
    """
    out: dict[str, list] = {"accept_lengths": [], "depth_nodes": [], "accepted_depths": []}
    for row in report.per_prompt.get(method, []):
        if dataset is not None and row.dataset != dataset:
            continue
        for k in out:
            out[k] += list(getattr(row, k) or [])
    return out


def ar_step_ms(report: EvalReport) -> dict[str, float]:
    """Milliseconds of one AR decode step per AR baseline of the report: AR decode seconds / AR rounds.

    Returns:
        ``{ar method name: ms}`` (a merged report has one AR per run).
    """
    out = {}
    for m, rows in report.per_prompt.items():
        if is_ar(m):
            rounds = sum(len(r.accept_lengths) for r in rows)
            if rounds:
                out[m] = 1000.0 * sum(r.decode_s for r in rows) / rounds
    return out


def sweep_points(report: EvalReport) -> dict[str, list[tuple[int, float, float]]]:
    """Budget-sweep points per builder: ``{builder: [(B, tau, speedup), ...]}`` sorted by B, from methods named
    ``BUILDER@B<n>`` (empty when the report is not a sweep)."""
    out: dict[str, list] = {}
    for m, row in report.methods.items():
        hit = _SWEEP.match(m)
        if hit:
            out.setdefault(hit["builder"], []).append((int(hit["budget"]), row.tau, row.speedup))
    return {b: sorted(v) for b, v in out.items()}


def proposals(report: EvalReport) -> int:
    """P, the proposals per block, from the report's environment (a merged report keeps the largest); falls back
    to the longest committed length observed minus one."""
    p = report.environment.get("proposals")
    if p:
        return int(p)
    longest = [max(r.accept_lengths) for rows in report.per_prompt.values() for r in rows if r.accept_lengths]
    return max([1, *longest]) - 1 if longest else 1


def default_round(rounds: Sequence[dict]) -> int:
    """Index of the round with the longest accepted path (the earliest among equals), for drawing.

    Raises:
        ValueError: no rounds.
    """
    if not rounds:
        raise ValueError("no recorded rounds to choose from")
    best = max(len(r["accepted"]) for r in rounds)
    return next(i for i, r in enumerate(rounds) if len(r["accepted"]) == best)


# -------------------------------------------------------------------------------------------- figures


def _new_figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def fig_acceptance(report: EvalReport) -> Figure:
    """Pr(L >= t) for t = 1 .. P + 1, one line per speculative method; panels: all prompts, then each data set.

    Each line has ``gid`` = method name, x = t and y = the fractions; the AR baseline (L = 1 always) is left out,
    and so are the per-data-set panels when the report has only one data set.
    """
    ms, styles = tree_methods(report), method_styles(report)
    tmax = proposals(report) + 1
    datasets = list(report.datasets)
    scopes = [None, *datasets] if len(datasets) > 1 else [None]  # one data set: its panel would repeat "all"
    fig = _new_figure(4.2 * len(scopes) + 1.0, 3.6)
    axes = fig.subplots(1, len(scopes), sharey=True, squeeze=False)[0]
    ts = list(range(1, tmax + 1))
    for ax, scope in zip(axes, scopes):
        for m in ms:
            lens = rounds_of(report, m, scope)["accept_lengths"]
            if not lens:
                continue
            tau = sum(lens) / len(lens)
            ax.plot(ts, survival(lens, tmax), marker="o", ms=3, **styles[m], gid=m, label=f"{m} (tau {tau:.2f})")
        ax.set_title("all prompts" if scope is None else scope)
        ax.set_xlabel("t (tokens committed per round)")
        ax.set_xlim(0.5, tmax + 0.5)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_ylabel("Pr(L ≥ t)")
    fig.suptitle(f"Acceptance length distribution (P = {tmax - 1} proposals; tau = Σ_t Pr(L ≥ t))", fontsize=10)
    return fig


def fig_sweep(report: EvalReport) -> Figure | None:
    """tau and speedup against the budget B, one line per builder (x = B, gid = builder); methods without a
    budget (chain) are dashed horizontal lines (gid = method) and speedup 1 (AR) is a dotted line.

    Returns:
        the figure, or None when the report holds no budget sweep.
    """
    pts = sweep_points(report)
    if not pts:
        return None
    fig = _new_figure(10.0, 3.8)
    ax_tau, ax_sp = fig.subplots(1, 2)
    styles = method_styles(report)
    style = {b: next(st for m, st in styles.items() if _SWEEP.match(m) and _SWEEP.match(m)["builder"] == b) for b in pts}
    flat = [m for m in tree_methods(report) if not _SWEEP.match(m)]
    for b, v in pts.items():
        bs = [p[0] for p in v]
        ax_tau.plot(bs, [p[1] for p in v], marker="o", **style[b], gid=b, label=b)
        ax_sp.plot(bs, [p[2] for p in v], marker="o", **style[b], gid=b, label=b)
    for i, m in enumerate(flat):
        row = report.methods[m]
        style = dict(color=styles[m]["color"], ls=(0, (4, 2 + 2 * i)), lw=1, gid=m, label=f"{m} (no budget)")
        ax_tau.axhline(row.tau, **style)
        ax_sp.axhline(row.speedup, **style)
    ax_sp.axhline(1.0, color="0.6", ls=":", lw=1, gid="ar", label="AR (1x)")
    allb = sorted({p[0] for v in pts.values() for p in v})
    for ax, name in ((ax_tau, "tau (tokens per verify)"), (ax_sp, "speedup over AR")):
        ax.set_xlabel("tree budget B (nodes per round)")
        ax.set_ylabel(name)
        if allb and min(allb) > 0 and max(allb) / min(allb) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(allb, [str(b) for b in allb])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Budget sweep", fontsize=10)
    return fig


def fig_stages(report: EvalReport) -> Figure:
    """Stacked bars of milliseconds per round by stage (draft, tree_build, tree_compile, verify, commit) per
    speculative method (one bar container per stage, labelled with it; each bar's ``gid`` is ``STAGE:METHOD``), with a
    horizontal line per AR baseline at its ms per step (``gid`` = the AR method name; in a merged report each
    run's line spans that run's bars). Rows without stage times (peers such as hf-prompt-lookup) get no bar."""
    ms = [m for m in tree_methods(report) if any(st in report.methods[m].stage_ms for st in STAGES)]
    fig = _new_figure(max(5.0, 1.1 * len(ms) + 3.0), 4.2)
    ax = fig.subplots()
    x = list(range(len(ms)))
    bottom = [0.0] * len(ms)
    for st in STAGES:
        h = [float(report.methods[m].stage_ms.get(st, 0.0)) for m in ms]
        bars = ax.bar(x, h, bottom=bottom, color=_STAGE_COLORS[st], label=st, width=0.6)
        for m, patch in zip(ms, bars.patches):
            patch.set_gid(f"{st}:{m}")
        bottom = [b + v for b, v in zip(bottom, h)]
    for xi, tot in zip(x, bottom):
        ax.annotate(f"{tot:.1f}", (xi, tot), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")
    for i, (m, step) in enumerate(ar_step_ms(report).items()):
        run = m[: -len("ar")]  # "" or "LABEL/": the line spans the bars of its own run
        xs = [xi for xi, name in zip(x, ms) if name.startswith(run)] or [0]
        ax.plot([min(xs) - 0.4, max(xs) + 0.4], [step, step], color="black", ls=(0, (5, 2 + 2 * i)), lw=1.2, gid=m,
                label=f"{m}: one step {step:.1f} ms")
    ax.set_xticks(x, ms, rotation=20 if len(ms) > 3 else 0, ha="right" if len(ms) > 3 else "center", fontsize=8)
    ax.set_ylabel("ms per round")
    ax.set_title("Time per verify round by stage (AR: time per decode step)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def fig_tree_shape(report: EvalReport) -> Figure | None:
    """Left: mean tree nodes per depth per method; right: acceptance rate per depth (:func:`depth_acceptance`).

    Lines have ``gid`` = method, x = depth 1 .. deepest node seen. Methods without per-depth records are skipped;
    None when no method has them (a report written before they were recorded).
    """
    ms, styles = tree_methods(report), method_styles(report)
    data = {m: rounds_of(report, m) for m in ms}
    data = {m: d for m, d in data.items() if d["depth_nodes"]}
    if not data:
        return None
    dmax = max([1, *(len(r) for d in data.values() for r in d["depth_nodes"])])
    fig = _new_figure(10.0, 3.8)
    ax_n, ax_a = fig.subplots(1, 2)
    ds = list(range(1, dmax + 1))
    for m, d in data.items():
        ax_n.plot(ds, mean_depth_nodes(d["depth_nodes"], dmax), marker="o", ms=3, **styles[m], gid=m, label=m)
        ax_a.plot(ds, depth_acceptance(d["depth_nodes"], d["accepted_depths"], dmax), marker="o", ms=3,
                  **styles[m], gid=m, label=m)
    ax_n.set_ylabel("mean nodes at depth d")
    ax_n.set_title("How each builder spends its budget", fontsize=10)
    ax_a.set_ylabel("Pr(accept at d | reached d - 1, nodes at d)")
    ax_a.set_ylim(-0.02, 1.02)
    ax_a.set_title("Acceptance rate per depth", fontsize=10)
    for ax in (ax_n, ax_a):
        ax.set_xlabel("depth d")
        ax.set_xticks(ds if dmax <= 20 else ds[::2])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def token_label(text: str, limit: int = 12) -> str:
    """A token's text as a one-line plot label: newlines/tabs/spaces made visible, mathtext ``$`` escaped,
    long texts cut with an ellipsis."""
    s = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if s.startswith(" "):
        s = "␣" + s[1:]
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    return s.replace("$", r"\$") if s else "∅"


def _tree_layout(rec: dict) -> tuple[dict, list, list, dict]:
    """The drawing plan of one recorded round (:func:`fig_tree`'s ``rec``): (label per node, the accepted node
    indices, every node in depth-first pre-order with the builder's child order kept (best first), the nodes per
    depth in that order); node 0 is the root, ``"bonus"`` the bonus token one depth after the accepted path.

    Raises:
        ValueError: a parent index that is not lower than its node's.
    """
    tokens, parents, depth = list(rec["tokens"]), list(rec["parents"]), list(rec["depth"])
    m = len(tokens)
    for i, p in enumerate(parents):
        if not 0 <= p <= i:
            raise ValueError(f"node {i + 1} has parent {p}; parents must precede their children")
    texts = rec.get("texts") or [str(t) for t in tokens]
    labels = {0: token_label(rec.get("root_text", str(rec["root"]))),
              "bonus": token_label(rec.get("bonus_text", str(rec["bonus"])))}
    labels.update({i + 1: token_label(texts[i]) for i in range(m)})
    accepted = [int(a) for a in rec["accepted"]]
    children: dict = {i: [] for i in range(m + 1)} | {"bonus": []}
    for i, p in enumerate(parents):
        children[p].append(i + 1)
    children[accepted[-1]].append("bonus")
    level = {0: 0, "bonus": len(accepted)}
    level.update({i + 1: int(depth[i]) for i in range(m)})
    order, stack = [], [0]
    while stack:  # depth-first pre-order; children keep the builder's order (best first)
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children[n]))
    layers: dict[int, list] = {}
    for n in order:
        layers.setdefault(level[n], []).append(n)
    return labels, accepted, order, layers


def _depth_axis(ax, pos: dict, depths: list[int]) -> None:
    """Depth captions ("root", "d=1", ...) above the columns of node positions ``pos`` and axis limits around them."""
    xs = sorted({x for x, _ in pos.values()})
    ys = [y for _, y in pos.values()]
    span_y = max(ys) - min(ys) or 1.0
    top = max(ys) + 0.12 * span_y + 0.05
    for d, x in zip(depths, xs):
        ax.text(x, top, "root" if d == 0 else f"d={d}", ha="center", va="bottom", fontsize=7, color="0.45")
    dx = (xs[-1] - xs[0]) / max(len(xs) - 1, 1) if len(xs) > 1 else 1.0
    ax.set_xlim(xs[0] - 0.6 * dx, xs[-1] + 0.6 * dx)
    ax.set_ylim(min(ys) - 0.12 * span_y - 0.05, top + 0.1 * span_y + 0.05)
    ax.set_axis_off()


def fig_tree(rec: dict, title: str = "") -> Figure:
    """Draw one verify tree: depth left to right (root at depth 0), nodes labelled with their token texts,
    the accepted path green with bold edges, the bonus token (the target's own next token) as a dashed node
    after it. Layout: networkx ``multipartite_layout`` with each depth's nodes in depth-first order (so no
    edges cross), first-ranked child on top.

    Args:
        rec: one recorded round: ``root``, ``tokens`` [M], ``parents`` [M] (0 = root), ``depth`` [M],
            ``accepted`` (node indices, root 0 first), ``bonus``; optional ``texts`` [M], ``root_text``,
            ``bonus_text`` (token ids are shown otherwise).
        title: figure title.
    Returns:
        the figure; each node label is a Text with ``gid`` ``node:<i>`` (``node:bonus`` for the bonus).
    Raises:
        ValueError: a parent index that is not lower than its node's (not a topologically ordered tree).
    """
    import networkx as nx

    parents, m = list(rec["parents"]), len(rec["tokens"])
    labels, accepted, order, layers = _tree_layout(rec)
    g = nx.DiGraph()
    g.add_nodes_from(order)
    g.add_edges_from((p, i + 1) for i, p in enumerate(parents))
    g.add_edge(accepted[-1], "bonus")
    pos = nx.multipartite_layout(g, subset_key=layers, align="vertical")
    pos = {n: (float(xy[0]), -float(xy[1])) for n, xy in pos.items()}  # first child on top
    widest = max(len(v) for v in layers.values())
    width = min(max(1.6 + 0.95 * len(layers), 4.5), 30.0)
    ncol = 4 if width >= 7.5 else 2  # legend columns that fit the width
    fig = _new_figure(width, min(1.5 + 0.42 * widest + (0.25 if ncol == 2 else 0.0), 24.0))
    ax = fig.subplots()
    path_edges = list(zip(accepted, accepted[1:]))
    on_path = set(path_edges)
    other = [(p, i + 1) for i, p in enumerate(parents) if (p, i + 1) not in on_path]
    nx.draw_networkx_edges(g, pos, edgelist=other, ax=ax, arrows=False, edge_color="#b0b0b0", width=1.0)
    nx.draw_networkx_edges(g, pos, edgelist=path_edges, ax=ax, arrows=False, edge_color=_PATH, width=2.6)
    nx.draw_networkx_edges(g, pos, edgelist=[(accepted[-1], "bonus")], ax=ax, arrows=False, edge_color=_PATH,
                           width=1.4, style="dashed")
    groups = (
        ([0], dict(boxstyle="round,pad=0.3", fc=_ROOT, ec="#3182bd")),
        ([n for n in accepted if n != 0], dict(boxstyle="round,pad=0.3", fc=_ACCEPTED, ec=_PATH, lw=1.5)),
        ([n for n in range(1, m + 1) if n not in set(accepted)], dict(boxstyle="round,pad=0.3", fc=_REJECTED, ec="#999999")),
        (["bonus"], dict(boxstyle="round,pad=0.3", fc=_BONUS, ec=_PATH, ls="--")),
    )
    for nodes, box in groups:
        if nodes:
            drawn = nx.draw_networkx_labels(g, pos, labels={n: labels[n] for n in nodes}, ax=ax, font_size=8,
                                            bbox=box, font_family="DejaVu Sans")
            for n, t in drawn.items():
                t.set_gid(f"node:{n}")
    _depth_axis(ax, pos, sorted(layers))
    ax.legend(handles=[Patch(fc=_ROOT, ec="#3182bd", label="root (last committed)"),
                       Patch(fc=_ACCEPTED, ec=_PATH, label="accepted"),
                       Patch(fc=_REJECTED, ec="#999999", label="rejected"),
                       Patch(fc=_BONUS, ec=_PATH, ls="--", label="bonus (target's token)")],
              fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=ncol, frameon=False)
    if title:
        fig.suptitle(textwrap.fill(title, width=max(int(width * 12), 40)), fontsize=9)  # ~12 characters per inch
    return fig

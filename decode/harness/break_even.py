"""What tau a drafter needs to beat AR on this machine, from the costs an evaluation already measured.

A speculative round costs its stages' seconds (draft, tree build, tree compile, verify, commit: ``DecodeStats.stage_s``)
and commits tau tokens on average; AR commits one token per step. Measured in AR steps (the AR time per token of the
same run), a round's mean cost is therefore the break-even tau: a method beats AR exactly when the tau it reached
exceeds it, and tau / cost is the speedup those costs predict. :func:`break_even` computes that from a method's
figures (a pure function); :func:`break_even_fields` takes them from a report's rows, :func:`break_even_markdown`
and :func:`break_even_lines` say it in report.md and on the console. Nothing is timed here: every figure is one the
run recorded. Imports nothing heavy (no torch), as :mod:`dartree.decode.harness.report` loads it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from dartree.decode.harness.report_rows import EvalReport, MethodSummary, PromptRow

_STAGE_WORDS = {"draft": "draft", "tree_build": "build", "tree_compile": "compile", "verify": "verify",
                "commit": "commit"}


def break_even(stage_ms: Mapping[str, float], ar_ms_per_token: float, tau: float, verify_tokens: float) -> dict:
    """The break-even tau of a method from its mean stage times per round and the AR time per token of one run.

    Args:
        stage_ms: mean milliseconds per round of each stage (``draft``, ``tree_build``, ``tree_compile``,
            ``verify``, ``commit``; any stage names, all summed), over every round of the method.
        ar_ms_per_token: milliseconds AR decoding took per token in the same run (> 0).
        tau: the method's mean tokens committed per round (bonus included).
        verify_tokens: mean tokens a verify forward took (drafted tree nodes + the root), for the wording.
    Returns:
        dict: ``ar_ms_per_token``, ``round_ms`` (sum of ``stage_ms``), ``stage_ar_steps`` (each stage / AR ms per
        token), ``verify_tokens``, ``verify_ar_steps``, ``round_ar_steps`` (the round's cost in AR steps),
        ``break_even_tau`` (= ``round_ar_steps``: the tau at which the method only matches AR), ``tau``,
        ``predicted_speedup`` (tau / ``round_ar_steps``) and ``pays`` (tau > ``break_even_tau``).
    Raises:
        ValueError: ``ar_ms_per_token`` is not a positive number, or ``stage_ms`` is empty or holds a negative or
            non-finite time.
    """
    if not isinstance(ar_ms_per_token, (int, float)) or not ar_ms_per_token > 0 or ar_ms_per_token == float("inf"):
        raise ValueError(f"ar_ms_per_token must be a positive number of milliseconds, got {ar_ms_per_token!r}; "
                         "pass the AR decode time per token measured in the same run")
    bad = [s for s, v in stage_ms.items() if not (isinstance(v, (int, float)) and 0 <= v < float("inf"))]
    if not stage_ms or bad:
        raise ValueError(f"stage_ms must map each stage to its mean milliseconds per round (>= 0), got "
                         f"{dict(stage_ms)!r}{f' (bad: {bad})' if bad else ''}; pass the method's <stage>_ms_per_round "
                         "figures")
    round_ms = float(sum(stage_ms.values()))
    cost = round_ms / ar_ms_per_token
    return {"ar_ms_per_token": float(ar_ms_per_token), "round_ms": round_ms,
            "stage_ar_steps": {s: v / ar_ms_per_token for s, v in stage_ms.items()},
            "verify_tokens": float(verify_tokens), "verify_ar_steps": stage_ms.get("verify", 0.0) / ar_ms_per_token,
            "round_ar_steps": cost, "break_even_tau": cost, "tau": float(tau),
            "predicted_speedup": tau / cost if cost > 0 else float("inf"), "pays": tau > cost}


def _tokens_text(n: float) -> str:
    """``9`` for 9.0, ``5.27`` for 5.2712: a mean token count as it reads best."""
    return f"{round(n, 2):g}"


def break_even_sentence(be: Mapping, measured: str = "") -> str:
    """One sentence explaining a method's figures from its :func:`break_even` record ``be``: what its verify and a
    whole round cost in AR steps here, the tau it needs, the tau it reached and what that gives (the report puts
    the method's name before it).

    Args:
        be: the method's :func:`break_even` dict. measured: how its speed was measured against AR, appended in
            parentheses (e.g. ``"measured: 0.97x AR paired"``), or empty.
    """
    parts = ", ".join(f"{_STAGE_WORDS.get(s, s)} {v:.2f}" for s, v in be["stage_ar_steps"].items())
    n = be["verify_tokens"]
    avg = ", on average" if n != round(n) else ""
    verify = ("a verify of 1 token (the root alone: no drafted node)" if n <= 1.0 else
              f"a verify of {_tokens_text(n)} tokens ({_tokens_text(n - 1.0)} drafted + the root{avg})")
    verdict = (f"above it, so it pays here: {be['predicted_speedup']:.2f}x AR by these costs" if be["pays"] else
               f"short of it, so it cannot beat AR here: {be['predicted_speedup']:.2f}x AR by these costs")
    return (f"{verify} costs {be['verify_ar_steps']:.2f} AR steps here, a whole round {be['round_ar_steps']:.2f} "
            f"({parts}), so it needs tau >= {be['break_even_tau']:.2f} to beat AR; it reached {be['tau']:.2f}, "
            f"{verdict}" + (f" ({measured})" if measured else "") + ".")


def break_even_fields(rows: Sequence[PromptRow], ar_rows: Sequence[PromptRow], agg: MethodSummary) -> dict | None:
    """A method's break-even record for its report aggregate ``agg`` (its ``tau``, ``stage_ms``,
    ``mean_tree_nodes``; :class:`~dartree.decode.harness.report_rows.MethodSummary`): the AR time per token is that of
    the AR decodes that ran in lockstep with ``rows`` (``paired_ar_*``, with ``--paired``) when every row has one, else
    that of the AR baseline's ``ar_rows``.

    Returns:
        the record (:func:`break_even`, plus ``ar_basis``: ``paired`` or ``baseline``, and ``explanation``:
        :func:`break_even_sentence`), or None when the run has no AR time or no stage times to go by (an empty
        scope, rows without ``stage_s``, no round).
    """
    stages = list(rows[0].stage_s or {}) if rows else []
    if not stages or not agg.rounds:
        return None
    if all(r.paired_ar_decode_s is not None for r in rows):
        basis, secs = "paired", sum(r.paired_ar_decode_s for r in rows)
        toks = sum(max(r.paired_ar_new_tokens - 1, 0) for r in rows)
    else:
        basis, secs = "baseline", sum(r.decode_s for r in ar_rows)
        toks = sum(r.decode_tokens for r in ar_rows)
    if toks <= 0 or not secs > 0:
        return None
    be = break_even({s: agg.stage_ms.get(s, 0.0) for s in stages}, 1000.0 * secs / toks, agg.tau,
                    (agg.mean_tree_nodes or 0.0) + 1.0)
    be["ar_basis"] = basis
    if basis == "paired" and agg.paired_speedup is not None:
        measured = f"measured: {agg.paired_speedup:.2f}x AR paired"
    else:
        measured = f"measured: {agg.speedup:.2f}x AR"
    be["explanation"] = break_even_sentence(be, measured)
    return be


def needs_tau_cell(agg: MethodSummary) -> str:
    """The report table's ``needs tau`` cell of a method's aggregate: its break-even tau, or empty (AR, a peer, a
    report written before the figure was recorded)."""
    return f"{agg.break_even['break_even_tau']:.2f}" if agg.break_even else ""


def break_even_lines(report: EvalReport) -> list[str]:
    """One line per method of ``report.methods`` with a break-even record: ``method: explanation``."""
    return [f"{m}: {r.break_even['explanation']}" for m, r in report.methods.items() if r.break_even]


def break_even_markdown(report: EvalReport) -> list[str]:
    """report.md's section that explains the speedups from the run's own costs (empty when no method has a
    break-even record): a heading, what the figures are, then one bullet per method."""
    lines = break_even_lines(report)
    if not lines:
        return []
    bases = {r.break_even["ar_basis"] for r in report.methods.values() if r.break_even}
    ar = ("the AR decode that ran in lockstep with each method (--paired)" if bases == {"paired"} else
          "the AR baseline" if bases == {"baseline"} else "the lockstep AR decode where paired, else the AR baseline")
    return ["## what a round costs here, and the tau that pays for it", "",
            "A round's cost in AR steps is its mean draft + build + compile + verify + commit time over all rounds, "
            f"divided by the time per token of {ar} in this run; a method beats AR only when its tau exceeds that "
            "cost (the break-even tau, the table's `needs tau`), and tau / cost is the speedup these costs predict.",
            ""] + [f"- {line}" for line in lines] + [""]

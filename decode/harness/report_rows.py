"""The typed records of an eval report: :class:`PromptRow` (one decode of one prompt), :class:`MethodSummary` (a
method's figures over a scope of prompts) and :class:`EvalReport` (``report.json`` as a whole); and a batch sweep's
row, :class:`BatchRow` (:func:`sweep_rows`).

The evaluation builds them (:mod:`dartree.decode.harness.prompt_rows`,
:func:`~dartree.decode.harness.report.aggregate`), the tables, warnings and figures read their attributes, and
``report.json`` is their JSON form (:meth:`EvalReport.to_json` / :meth:`EvalReport.from_json`, a lossless round trip;
a figure left unmeasured, None, is left out of the file). A batch sweep's report (``decode/eval.py --batch``) is
another layout, :mod:`dartree.decode.harness.batch_report`'s, whose rows are :class:`BatchRow` s. Imports nothing
heavy (no torch).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Mapping

_MS = "_ms_per_round"  # a stage's figure in report.json: "<stage>_ms_per_round"


class _Record:
    """JSON round trip of a flat dataclass: :meth:`to_json` leaves out the None fields (except ``KEEP_NONE``),
    :meth:`from_json` takes the fields it knows."""

    KEEP_NONE: ClassVar[frozenset] = frozenset()

    def to_json(self) -> dict:
        """The record as report.json stores it (a dict of JSON values, None fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None or f.name in self.KEEP_NONE}

    @classmethod
    def from_json(cls, data: Any, where: str = "report row"):
        """The record from its JSON dict ``data``; keys this version does not know (a later version's) are left out.

        Raises:
            ValueError: ``data`` is not a dict, or lacks a required field (``where`` and the fix named).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} is not a JSON object (got {type(data).__name__}); re-run decode/eval.py")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}; it is not a complete dartree eval report "
                             "(re-run decode/eval.py)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class PromptRow(_Record):
    """One decode of one prompt (``report.json``'s ``per_prompt[method][i]``): the AR baseline's (its repeats'
    mean time), a speculative method's (:func:`~dartree.decode.generate.speculative_generate`'s ``DecodeStats``) or a
    peer's (:mod:`dartree.decode.harness.peers`). Lists are per round, in order.

    Attributes:
        dataset, id: the prompt's data set and id.
        new_tokens: tokens generated (the prefill's token included); decode_s: seconds after the prefill.
        accept_lengths: tokens each round committed (AR: 1 per step).
        decode_s_repeats: AR: every repeat's decode seconds (``--ar-repeats``). prefill_s: a peer's prefill seconds.
        stage_s: seconds per stage (draft, tree_build, tree_compile, verify, commit), summed over the rounds.
        tree_nodes, budgets: drafted nodes verified and the budget B of each round (0: a plain AR step).
        depth_nodes: per round, nodes at depth 1, 2, ...; accepted_depths: per round, the deepest accepted depth.
        paired_ar_decode_s, paired_ar_new_tokens: the AR decode that ran in lockstep with this one (``--paired``).
        mismatch: whether the output differs from AR's (None: not compared, T > 0); exact: whether such a split is a
            loss of exactness (fp32 or the row-invariant mode; :func:`~dartree.decode.harness.report.split_label`);
        first_divergence, margin_at_divergence: where it split and the target's top-2 logit margin there.
    """

    dataset: str
    id: str | int
    new_tokens: int
    decode_s: float
    accept_lengths: list[int]
    decode_s_repeats: list[float] | None = None
    prefill_s: float | None = None
    stage_s: dict[str, float] | None = None
    tree_nodes: list[int] | None = None
    budgets: list[int] | None = None
    depth_nodes: list[list[int]] | None = None
    accepted_depths: list[int] | None = None
    paired_ar_decode_s: float | None = None
    paired_ar_new_tokens: int | None = None
    mismatch: bool | None = None
    exact: bool | None = None
    first_divergence: int | None = None
    margin_at_divergence: float | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens the decode loop produced (``new_tokens`` less the prefill's one, never below 0)."""
        return max(self.new_tokens - 1, 0)


@dataclass
class MethodSummary(_Record):
    """One method's figures over a scope of prompts (``report.json``'s ``methods[m]`` and ``datasets[d][m]``), from
    its rows and the AR baseline's (:func:`~dartree.decode.harness.report.aggregate`).

    Attributes:
        tau: tokens committed per round; tokens_per_s: decode tokens per second; speedup: that over AR's.
        rounds, decode_tokens, prompts: what it is taken over.
        stage_ms: mean milliseconds per round of each stage (report.json: ``<stage>_ms_per_round``); mean_tree_nodes.
        budget_histogram: rounds per budget B; drafted_rounds, drafted_tau, drafted_accepted: the rounds with B > 0,
            their tokens per round and the drafts they accepted.
        paired_speedup, paired_speedup_range: against the lockstep AR decodes (pooled; per prompt [min, max]).
        repeat_spread: AR: mean (slowest - fastest) / mean of one prompt's repeats (the machine's timing noise).
        mismatches: prompts whose output differs from AR's; lossless: none does (None: not compared); exact: every
            such split is a loss of exactness.
        break_even: :func:`~dartree.decode.harness.break_even.break_even_fields`' record; peer: a peer's row.
    """

    KEEP_NONE: ClassVar[frozenset] = frozenset({"lossless"})

    tau: float
    tokens_per_s: float
    speedup: float
    rounds: int
    decode_tokens: int
    prompts: int
    stage_ms: dict[str, float] = field(default_factory=dict)
    mean_tree_nodes: float | None = None
    budget_histogram: dict[int, int] | None = None
    drafted_rounds: int | None = None
    drafted_tau: float | None = None
    drafted_accepted: int | None = None
    paired_speedup: float | None = None
    paired_speedup_range: list[float] | None = None
    repeat_spread: float | None = None
    mismatches: int = 0
    lossless: bool | None = None
    exact: bool | None = None
    break_even: dict | None = None
    peer: bool | None = None

    def to_json(self) -> dict:
        """As :meth:`_Record.to_json`, each stage's mean a ``<stage>_ms_per_round`` key in ``stage_ms``'s place and
        the budget histogram's keys strings (as JSON keeps them)."""
        out = {}
        for k, v in super().to_json().items():
            out.update({f"{st}{_MS}": ms for st, ms in v.items()} if k == "stage_ms" else
                       {k: {str(b): n for b, n in v.items()}} if k == "budget_histogram" else {k: v})
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "method summary") -> "MethodSummary":
        """As :meth:`_Record.from_json`, the ``<stage>_ms_per_round`` keys gathered into ``stage_ms`` and the budget
        histogram's keys read back as ints (JSON stores them as strings)."""
        s = super().from_json(data, where)
        s.stage_ms = {k[: -len(_MS)]: v for k, v in data.items() if k.endswith(_MS)}
        if s.budget_histogram is not None:
            s.budget_histogram = {int(b): n for b, n in s.budget_histogram.items()}
        return s


@dataclass
class EvalReport:
    """An eval report (``report.json``): the run's ``environment`` (machine, versions, every setting; a dict of
    JSON values), each method's :class:`MethodSummary` over all prompts (``methods``) and per data set
    (``datasets[d][m]``), the peers skipped and why, the :class:`PromptRow` s (``per_prompt[m]``) and the first
    prompt's recorded verify trees per method (``trees[m]``: ``{"dataset", "id", "rounds": [...]}``,
    :func:`~dartree.decode.harness.report_figures.annotate_trees`)."""

    environment: dict
    methods: dict[str, MethodSummary]
    datasets: dict[str, dict[str, MethodSummary]] = field(default_factory=dict)
    per_prompt: dict[str, list[PromptRow]] = field(default_factory=dict)
    trees: dict[str, dict] = field(default_factory=dict)
    peers_skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        """report.json's object (:meth:`from_json` reads it back to an equal report)."""
        return {"methods": {m: s.to_json() for m, s in self.methods.items()},
                "datasets": {d: {m: s.to_json() for m, s in ms.items()} for d, ms in self.datasets.items()},
                "environment": self.environment, "peers_skipped": self.peers_skipped,
                "per_prompt": {m: [r.to_json() for r in rows] for m, rows in self.per_prompt.items()},
                "trees": self.trees}

    @classmethod
    def from_json(cls, data: Any, where: str = "report.json") -> "EvalReport":
        """The report from report.json's object.

        Raises:
            ValueError: not an eval report's object (no ``methods``), or a row or summary without a required field;
                ``where`` and the fix named.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("methods"), Mapping):
            raise ValueError(f"{where} is not an eval report (no 'methods'); re-run decode/eval.py")
        summary = MethodSummary.from_json
        return cls(environment=dict(data.get("environment") or {}),
                   methods={m: summary(s, f"{where}: methods.{m}") for m, s in data["methods"].items()},
                   datasets={d: {m: summary(s, f"{where}: datasets.{d}.{m}") for m, s in ms.items()}
                             for d, ms in (data.get("datasets") or {}).items()},
                   per_prompt={m: [PromptRow.from_json(r, f"{where}: per_prompt.{m}[{i}]") for i, r in enumerate(rows)]
                               for m, rows in (data.get("per_prompt") or {}).items()},
                   trees=dict(data.get("trees") or {}), peers_skipped=dict(data.get("peers_skipped") or {}))


@dataclass
class BatchRow(_Record):
    """One row of a batch sweep (``decode/eval.py --batch``; ``report.json``'s ``batch_sweep.rows[i]``): a method
    decoding every request at one batch size (:class:`~dartree.decode.harness.batch_sweep.BatchRun`).

    Attributes:
        method: ``ar``, ``hf-generate`` or a run name (``pruned@auto``, ...); batch: N, rows decoded together;
            requests: how many were decoded.
        new_tokens: all requests' generated tokens; decode_s: seconds of decoding, prefills excluded (the mean of the
            passes); prefill_s: the requests' prefill seconds; tokens_per_s: ``new_tokens / decode_s``.
        tau_per_row, tau_mean: per request (and their mean), committed tokens per verify forward it took part in.
        forwards: target forwards after the prefills; rows_per_forward: mean rows in one.
        budgets: rounds per nodes-per-row (tree methods).
        exact: whether a split from AR is a loss of exactness; mismatches: requests whose tokens differ from their
            prompt's AR decode (None at T > 0); first_mismatch: ``{"request", "index"}`` of the first, or None.
        peer: a peer's row (``hf-generate``); speedup: the median over the passes of batched AR's time over this
            row's in the same pass (``speedup_passes``); decode_s_repeats, repeat_spread: with several passes, their
            times and (slowest - fastest) / mean.
    """

    KEEP_NONE: ClassVar[frozenset] = frozenset({"mismatches", "first_mismatch"})

    method: str
    batch: int
    requests: int
    new_tokens: int
    decode_s: float
    prefill_s: float
    tokens_per_s: float
    tau_per_row: list[float]
    tau_mean: float
    forwards: int
    rows_per_forward: float
    budgets: dict[int, int] = field(default_factory=dict)
    exact: bool = True
    mismatches: int | None = None
    first_mismatch: dict | None = None
    peer: bool | None = None
    speedup: float | None = None
    speedup_passes: list[float] | None = None
    decode_s_repeats: list[float] | None = None
    repeat_spread: float | None = None

    def to_json(self) -> dict:
        """As :meth:`_Record.to_json`, the budgets' keys strings (as JSON keeps them)."""
        return {**super().to_json(), "budgets": {str(b): n for b, n in self.budgets.items()}}

    @classmethod
    def from_json(cls, data: Any, where: str = "batch sweep row") -> "BatchRow":
        """As :meth:`_Record.from_json`, the budgets' keys read back as ints."""
        row = super().from_json(data, where)
        row.budgets = {int(b): n for b, n in (row.budgets or {}).items()}
        return row


def sweep_rows(report: Mapping) -> list[BatchRow]:
    """The rows of a batch sweep's report (its ``batch_sweep.rows``), typed.

    Raises:
        ValueError: a row without a required field (named).
    """
    return [BatchRow.from_json(r, f"batch_sweep.rows[{i}]") for i, r in enumerate(report["batch_sweep"]["rows"])]

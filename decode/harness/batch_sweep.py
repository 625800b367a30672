"""The throughput curve: ``decode/eval.py --batch 1 2 4 8`` decodes the run's requests at every batch size with every
method, batched AR and transformers' batched ``generate``, in one process.

The requests are the run's prompts, cycled until there are at least ``--queue`` (default 2) times as many as the
largest batch (:func:`sweep_requests`): served batches are refilled from a queue, and with no more requests than rows
the largest batch would be measured draining (batched AR's rows all reach their cap in the same step, speculative rows
one after another, so the batch runs its tail at fewer rows than AR's). Per batch size N, in ``--ar-repeats`` passes,
each in an order rotated per pass and batch size (the machine's speed drifts over minutes), each row decodes all
requests N at a time:

* ``ar``: dartree's batched AR loop (:func:`dartree.decode.batch_ar.batched_autoregressive`: per-row KV cache with
  masked holes, a finished row's place refilled from the queue), the baseline every speedup at N divides by;
* ``hf-generate`` (with ``--peers hf-generate``): transformers ``generate`` with left padding, N requests per call
  (:func:`dartree.decode.harness.peers.hf_generate_batch`; static batches, as a user batches with it);
* each method (``--tree``, ``--budget``): :func:`dartree.decode.batched.batched_generate` with the same queue; a
  ``--budget auto`` method's policy is a :class:`~dartree.decode.batch_budget.BatchCostModel` made from the method's
  seeded batch-1 policy before anything else used it, over a row table measured on the calibration prompt at the row
  counts of the sweep (:class:`~dartree.decode.row_costs.RowCosts`).

A row's time is the mean of its passes and its speedup the median over the passes of batched AR's time in the pass over
the row's (a paired ratio: both timed minutes apart at most, so a drift of the machine between passes does not decide
it); the spread of batched AR's passes is reported beside every speedup (:meth:`BatchSweep.order`). Before any of
that, the one-prompt path runs every request alone (AR, then every method through
:func:`~dartree.decode.harness.runner.decode_one`, each auto method on its own batch-1 policy): its AR tokens are the
losslessness oracle (at T = 0 every row of every batch must equal its prompt's own AR tokens) and its speedups are
what the batch-1 rows are compared with. Every batched setting is run once untimed on a few requests first.

Measured per method and N: tokens per second (all requests' new tokens over the decode's wall time less the
requests' prefills, which run alone as at batch 1), the speedup over batched AR at N, tau per row (committed tokens
per verify forward the row took part in), rows per forward and the mismatches. Rendering is
:mod:`dartree.decode.harness.batch_report`'s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from dartree.decode.batch_ar import batched_autoregressive
from dartree.decode.batch_budget import BatchCostModel
from dartree.decode.batched import batched_generate
from dartree.decode.generate import POLICY_PROMPT
from dartree.decode.harness.batch_report import cpu_name
from dartree.decode.harness.peers import hf_generate_batch
from dartree.decode.harness.report_rows import BatchRow
from dartree.decode.harness.runner import against_ar
from dartree.decode.row_costs import RowCosts, batch_rows

HF_BATCH = "hf-generate"  # the one peer with a batched form
BATCH_PEERS = (HF_BATCH,)
WARM_TOKENS = 12  # tokens of the untimed decode of every batched setting


def sweep_requests(prompts: int, batches: list[int], queue: int = 2) -> list[int]:
    """The prompt index of every request: the ``prompts`` prompts in order, cycled until there are at least
    ``queue`` x ``max(batches)`` requests, e.g. (6, [1, 2, 4, 8], 1) -> [0, 1, 2, 3, 4, 5, 0, 1]; with ``queue`` = 2
    the largest batch has as many requests waiting as it has rows when it starts.

    Raises:
        ValueError: no prompt, no batch size, a batch size below 1 or a ``queue`` below 1.
    """
    if prompts < 1 or not batches or min(batches) < 1 or queue < 1:
        raise ValueError(f"a batch sweep needs prompts ({prompts}), batch sizes >= 1 ({batches}) and --queue >= 1 "
                         f"({queue})")
    n = max(prompts, queue * max(batches))
    return [i % prompts for i in range(n)]


@dataclass
class BatchRun:
    """One row of the sweep: a method decoding every request at one batch size.

    Attributes:
        method: ``ar``, ``hf-generate`` or a run name (``pruned@auto``, ...). batch: N, rows decoded together.
        tokens: per request, its generated ids. taus: per request, committed tokens per verify forward it took part
            in. new_tokens: all requests' generated tokens. decode_s: seconds of decoding (prefills excluded).
        prefill_s: the requests' prefill seconds. forwards: target forwards after the prefills. rows_per_forward:
            mean rows in a forward. budgets: {nodes per row: rounds} over all rows (tree methods).
    """

    method: str
    batch: int
    tokens: list
    taus: list
    new_tokens: int
    decode_s: float
    prefill_s: float
    forwards: int
    rows_per_forward: float
    budgets: dict = field(default_factory=dict)

    def row(self, reference: list, exact: bool, temperature: float) -> BatchRow:
        """The report row: the figures above plus tokens per second and, at T = 0, the mismatches against each
        request's ``reference`` (its prompt's AR tokens; ``exact``: whether a split is a loss of exactness)."""
        out = BatchRow(method=self.method, batch=self.batch, requests=len(self.tokens), new_tokens=self.new_tokens,
                       decode_s=self.decode_s, prefill_s=self.prefill_s,
                       tokens_per_s=self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan"),
                       tau_per_row=self.taus, tau_mean=sum(self.taus) / len(self.taus) if self.taus else float("nan"),
                       forwards=self.forwards, rows_per_forward=self.rows_per_forward,
                       budgets={int(b): c for b, c in sorted(self.budgets.items())}, exact=exact)
        if temperature == 0:
            splits = [against_ar(t, ref) for t, ref in zip(self.tokens, reference)]
            out.mismatches = sum(d for d, _ in splits)
            bad = next((i for i, (d, _) in enumerate(splits) if d), None)
            if bad is not None:
                out.first_mismatch = {"request": bad, "index": splits[bad][1]}
        return out


def _from_batch(method: str, batch: int, out) -> BatchRun:
    """A :class:`BatchRun` from a :class:`~dartree.decode.batched.BatchOutput`."""
    prefill = sum(o.stats.prefill_s for o in out)
    budgets: dict = {}
    for o in out:
        for b in o.stats.budgets:
            budgets[b] = budgets.get(b, 0) + 1
    taus = [o.stats.tau if o.stats.rounds else 1.0 for o in out]
    return BatchRun(method, batch, [list(o.tokens) for o in out], taus, out.new_tokens, out.seconds - prefill,
                    prefill, out.forwards, sum(out.rows) / len(out.rows) if out.rows else 0.0, budgets)


class BatchSweep:
    """One ``--batch`` sweep over an opened :class:`~dartree.decode.harness.session.EvalSession` (warmed up, its auto
    policies seeded): :meth:`prepare`, :meth:`one_prompt`, then :meth:`run_batch` per batch size; :attr:`rows` holds
    the report rows so far.

    Args:
        session: the eval session. batches: the batch sizes, in order.
    """

    def __init__(self, session, batches: list[int]):
        self.s, self.batches = session, list(batches)
        self.requests = sweep_requests(len(session.prompt_ids), self.batches, session.config.queue)
        self.ids = [session.prompt_ids[i] for i in self.requests]
        self.row_costs = RowCosts()
        self.models: dict[str, BatchCostModel] = {}
        self.reference: list = []  # per request: its prompt's AR tokens (the one-prompt path's)
        self.one: dict = {}  # method -> {"tokens_per_s", "tau_mean", "mismatches", ...}
        self.rows: list[BatchRow] = []

    @property
    def names(self) -> list[str]:
        """The rows of every batch size: ar, hf-generate when asked, then the methods."""
        return ["ar", *[p for p in self.s.peers if p in BATCH_PEERS], *self.s.methods]

    def prepare(self) -> None:
        """The batch policies (each auto method's seeded batch-1 policy copied before the one-prompt path uses it),
        the row table at every row count of the sweep, and one untimed decode of every batched setting at every
        batch size (the auto ones on scratch copies that draft every round but every third)."""
        s = self.s
        rows = sorted({n for b in self.batches for n in batch_rows(b)})
        if s.cost_models:
            t0 = time.time()
            policy_ids = s.encode(POLICY_PROMPT)
            self.row_costs.measure(s.target, s.dm.drafter, policy_ids, rows,
                                   max_budget=s.dm.drafter.cfg.num_proposals)
            s.console.print(f"row table measured in {time.time() - t0:.1f}s at rows {rows}: " + "; ".join(
                f"N={n}: verify(2) {self.row_costs.verify[n][2]:.2f}x, verify(17) "
                f"{self.row_costs.verify[n].get(17, float('nan')):.2f}x, draft {self.row_costs.draft[n]:.2f}x"
                for n in self.row_costs.rows) + " of one row")
        self.models = {m: BatchCostModel.from_model(cm, self.row_costs) for m, cm in s.cost_models.items()}
        for b in self.batches:
            for name in self.names:
                scratch = None
                if name in self.models:
                    scratch = BatchCostModel.from_model(self.models[name], self.row_costs)
                    scratch.start_seeding(1 << 30)
                self.decode(name, b, self.ids[:b], WARM_TOKENS, scratch)

    def one_prompt(self, bar=None) -> None:
        """Every request alone: AR (the oracle, the one-prompt baseline), then every method
        (:meth:`EvalSession.run`, the batch-1 path with the method's own policy)."""
        s, a = self.s, self.s.config
        acc = {m: {"new_tokens": 0, "decode_s": 0.0, "taus": [], "splits": 0} for m in ["ar", *s.methods]}
        for k, ids in enumerate(self.ids):
            seed = a.seed * 100003 + self.requests[k]
            ar = s.run("ar", ids, seed, a.max_new_tokens)
            self.reference.append(list(ar.tokens))
            for m in ["ar", *s.methods]:
                o = ar if m == "ar" else s.run(m, ids, seed, a.max_new_tokens)
                rec = acc[m]
                rec["new_tokens"] += len(o.tokens)
                rec["decode_s"] += o.stats.decode_s
                rec["taus"].append(o.stats.tau if o.stats.rounds else 1.0)
                rec["splits"] += int(list(o.tokens) != self.reference[-1])
                if bar is not None:
                    bar.update()
        for m, rec in acc.items():
            sec = rec["decode_s"]
            self.one[m] = {"new_tokens": rec["new_tokens"], "decode_s": sec,
                           "tokens_per_s": rec["new_tokens"] / sec if sec > 0 else float("nan"),
                           "tau_mean": sum(rec["taus"]) / len(rec["taus"]),
                           "mismatches": rec["splits"] if a.temperature == 0 and m != "ar" else None}
        for m in s.methods:
            self.one[m]["speedup"] = self.one[m]["tokens_per_s"] / self.one["ar"]["tokens_per_s"]

    def decode(self, name: str, batch: int, ids: list, max_new: int, cost_model=None) -> BatchRun:
        """Decode ``ids`` ``batch`` at a time with row ``name`` (``cost_model``: an auto method's policy; default
        its sweep policy)."""
        s, a = self.s, self.s.config
        gen = torch.Generator().manual_seed(a.seed * 100003 + batch) if a.temperature > 0 else None
        if name == "ar":
            out = batched_autoregressive(s.target, ids, max_new_tokens=max_new, temperature=a.temperature,
                                         stop_ids=s.stop_ids, generator=gen, batch_size=batch)
            return _from_batch(name, batch, out)
        if name == HF_BATCH:
            tokens, dec, pre, forwards = [], 0.0, 0.0, 0
            for at in range(0, len(ids), batch):
                rows, d, p = hf_generate_batch(s.target, ids[at: at + batch], max_new_tokens=max_new,
                                               stop_ids=s.stop_ids)
                tokens += [r.tokens for r in rows]
                dec, pre, forwards = dec + d, pre + p, forwards + max(len(r.tokens) for r in rows) - 1
            return BatchRun(name, batch, tokens, [1.0] * len(tokens), sum(len(t) for t in tokens), dec, pre,
                            forwards, float(min(batch, len(ids))))
        out = batched_generate(s.target, s.dm.drafter, s.dm.head, ids, s.settings(name, max_new_tokens=max_new),
                               generator=gen, batch_size=batch,
                               cost_model=cost_model if cost_model is not None else self.models.get(name))
        return _from_batch(name, batch, out)

    def order(self, bi: int) -> list[str]:
        """The decodes of the ``bi``-th batch size: ``--ar-repeats`` passes over every row (batched AR included), pass
        k in the order rotated by ``bi`` + k, so that over the passes every row runs early and late in a pass and a
        drift of the machine's speed reaches the baseline as it reaches the rows it divides."""
        names, k = self.names, len(self.names)
        return [names[(bi + p + j) % k] for p in range(self.s.config.ar_repeats) for j in range(k)]

    def run_batch(self, bi: int, bar=None) -> list[BatchRow]:
        """Every row at the ``bi``-th batch size (:meth:`order`); returns its report rows (also added to
        :attr:`rows`): tokens/s from the mean of a row's passes, and its speedup the median over the passes of
        batched AR's time over the row's in the same pass (``speedup_passes``); with more than one pass the times
        (``decode_s_repeats``) and their spread ``repeat_spread`` ((slowest - fastest) / mean: the machine's own
        noise)."""
        s, a, b = self.s, self.s.config, self.batches[bi]
        runs: dict[str, list[BatchRun]] = {}
        for name in self.order(bi):
            runs.setdefault(name, []).append(self.decode(name, b, self.ids, a.max_new_tokens))
            if bar is not None:
                bar.update()
        rows, ar_times = [], [r.decode_s for r in runs["ar"]]
        for n in self.names:
            row = runs[n][0].row(self.reference, s.exact_rows and n != HF_BATCH, a.temperature)
            times = [r.decode_s for r in runs[n]]
            mean = sum(times) / len(times)
            ratios = [t_ar / t for t_ar, t in zip(ar_times, times)]
            row.decode_s, row.tokens_per_s, row.peer = mean, row.new_tokens / mean, n == HF_BATCH
            row.speedup, row.speedup_passes = statistics.median(ratios), ratios
            if len(times) > 1:
                row.decode_s_repeats, row.repeat_spread = times, (max(times) - min(times)) / mean
            rows.append(row)
        self.rows += rows
        return rows

    def section(self) -> dict:
        """report.json's ``batch_sweep``: the batch sizes, the requests, the rows so far, the one-prompt path, the
        batch-1 rows' speedups against it, the row table and the batch policies' summaries."""
        s = self.s
        one_ratio = {r.method: r.speedup / self.one[r.method]["speedup"]
                     for r in self.rows if r.batch == 1 and r.method in s.methods}
        return {"batches": self.batches, "requests": len(self.requests), "queue": s.config.queue,
                "distinct_prompts": len(s.prompt_ids),
                "cpu": cpu_name(),
                "request_prompts": [f"{s.prompts[i].dataset}:{s.prompts[i].id}" for i in self.requests],
                "max_new_tokens": s.config.max_new_tokens, "methods": self.names,
                "rows": [r.to_json() for r in self.rows],
                "one_prompt": self.one, "batch1_vs_one_prompt": one_ratio, "row_costs": self.row_costs.summary(),
                "policies": {m: cm.summary() for m, cm in self.models.items()}}

"""Batched speculative decoding: N requests decoded together, each row lossless on its own.

:func:`batched_generate` runs the round of :func:`~dartree.decode.generate.speculative_generate` for a batch of rows:
one drafter forward for all rows (:func:`~dartree.decode.batch_rounds.draft_blocks`), each row's own tree (the same
registered builders, heads and kernels, its own budget and prompt-lookup graft), one target verify forward over all
rows' trees padded to a shared width with per-row tree masks and depth positions
(:func:`~dartree.decode.batch_rounds.verify_batch`), each row's accepted path committed to its own row of the batch's
KV cache (:mod:`dartree.models.batch_cache`: rows of different lengths, hidden holes). A row that finishes (a stop
id, its ``max_new_tokens``) leaves the batch and the next prompt of the queue takes its place, prefilled alone as at
batch 1. No engine the design was compared with ships trees of different sizes per request: SGLang verifies the
same width for every request (``sgl-project/sglang``, its DDTree pull request pads to max(block size, budget + 1));
here each row keeps its own tree and the padding is masked out.

Losslessness per row: at T = 0 row i's tokens are the target's greedy output for prompt i whatever the other rows
are and however they are padded (in fp32; in bf16 inside the row-invariant mode, :mod:`dartree.models.invariant`,
whose attention reads each row's own keys in position order); above 0 each row's tokens are distributed as the
target's samples (exact target-sample matching, as batch 1). The batch-1 loop
(:func:`~dartree.decode.generate.speculative_generate`) is a separate function and is not changed by any of this.

The budget is a fixed node count per row (:class:`RowBudgets`), or ``"auto"``: the batch-aware cost model
(:mod:`dartree.decode.batch_budget`) decides per round whether the batch drafts at all and the width every row's tree
is cut to, for the batch's throughput, with verify and draft costs timed by rows as well as nodes per row
(:mod:`dartree.decode.row_costs`). Both go through the same calls (``new_row``, ``drafts``, ``choose``, ``observe``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from dartree.base.fields import describe, is_int
from dartree.decode.batch_budget import AutoRowBudgets, BatchCostModel, batch_policy
from dartree.decode.batch_rounds import compile_batch, draft_blocks, verify_batch
from dartree.decode.builders import builder_beta, get_builder
from dartree.decode.generate import (DecodeStats, GenerateOutput, _commit, _prefill, check_speculative,
                                     speculative_generate)
from dartree.decode.rounds import FixedBudget, GreedyMatch, LookupGraft
from dartree.decode.settings import DecodeSettings, check_settings
from dartree.decode.trees import Tree
from dartree.models.batch_cache import BatchKV, RowDraftCache
from dartree.models.drafter import DFlashDrafter
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target


@dataclass
class BatchOutput:
    """The outputs of a batched decode, in prompt order, and what the batch did.

    Attributes:
        outputs: one :class:`~dartree.decode.generate.GenerateOutput` per prompt (tokens as batch 1 gives them;
            ``stats`` per row: its rounds, accept lengths and trees; its stage seconds are those of the batch rounds
            it took part in, its ``prefill_s`` its own prefill, its ``decode_s`` the wall time from its prefill to its
            last round).
        widths: per verify forward, the shared width W (the widest row's tree + 1).
        rows: per verify forward, the rows N in it.
        seconds: wall time of the whole decode (prefills included).
    Iterating, ``len`` and indexing go over :attr:`outputs`.
    """

    outputs: list
    widths: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, i):
        return self.outputs[i]

    def __iter__(self):
        return iter(self.outputs)

    @property
    def forwards(self) -> int:
        """Verify forwards run (each over all rows then in the batch)."""
        return len(self.widths)

    @property
    def new_tokens(self) -> int:
        """Tokens generated over all prompts."""
        return sum(len(o.tokens) for o in self.outputs)


class RowBudgets:
    """The batch's fixed budget: every row its own :class:`~dartree.decode.rounds.FixedBudget` of ``nodes`` nodes
    (with its own prompt-lookup statistics, as a batch-1 decode has); every round drafts.

    The calls the loop makes, which the batch-aware policy (:class:`~dartree.decode.batch_budget.AutoRowBudgets`)
    answers too: :meth:`new_row` gives a request's part when it enters the batch, :meth:`drafts` says whether a
    round of N rows drafts, :meth:`choose` sees every row's built tree before the shared verify forward and
    :meth:`observe` the round's outcome.

    Args:
        nodes: B >= 0, tree nodes per row and round.
    """

    def __init__(self, nodes: int):
        self.nodes = int(nodes)

    def new_row(self) -> FixedBudget:
        """The policy of a request entering the batch."""
        return FixedBudget(self.nodes)

    def drafts(self, rows: int) -> bool:
        """Whether a round of ``rows`` rows drafts: always."""
        return True

    def choose(self, policies: Sequence[FixedBudget], trees: list[Tree], chain_pos: list,
               build_started: float, drafted: bool = True) -> tuple[list[Tree], list]:
        """Every row's tree as its policy keeps it (:meth:`FixedBudget.choose`); returns (trees, chain positions)."""
        out = [p.choose(t, c, drafted, build_started) for p, t, c in zip(policies, trees, chain_pos)]
        return [t for t, _ in out], [c for _, c in out]

    def observe(self, trees: list[Tree], vers: list, chain_pos: list, ngrams: list, drafted: bool, *,
                draft_s: float, verify_s: float, round_s: float) -> None:
        """Nothing: each row's :class:`FixedBudget` learns its own lookup chain's acceptance."""


@dataclass
class _Row:
    """One request in the batch: its prompt's index, its committed output, its next root and its state."""

    index: int
    prompt: list
    max_new: int
    out: list
    stats: DecodeStats
    anchor: int
    pending: list
    policy: object  # FixedBudget, or the auto budget's row part
    graft: LookupGraft
    started: float  # clock reading after its prefill


def _lengths(max_new_tokens, n: int) -> list[int]:
    """``max_new_tokens`` as one cap per prompt (an int for all, or a sequence of N ints)."""
    if is_int(max_new_tokens):
        return [int(max_new_tokens)] * n
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(max_new_tokens, Sequence):
        raise TypeError(f"max_new_tokens is {describe(max_new_tokens)}; give an int >= 0 or one int per prompt")
    caps = list(max_new_tokens)
    if len(caps) != n:
        raise ValueError(f"max_new_tokens holds {len(caps)} caps for {n} prompts; give one per prompt or one int")
    for i, c in enumerate(caps):
        if not is_int(c):
            raise TypeError(f"max_new_tokens[{i}]={c!r} must be an integer >= 0")
    return [int(c) for c in caps]


def check_batched(target, drafter, head, prompts, settings: DecodeSettings, *, generator, batch_size) -> tuple:
    """Every check of :func:`batched_generate` before any forward (arguments as it takes them); each prompt gets the
    checks of :func:`~dartree.decode.generate.speculative_generate` with its own cap. Returns (prompt id lists,
    caps, stop ids, the settings with the builder's registered name and exact matching, rows decoded together).

    Raises:
        TypeError / ValueError: one line naming the argument (``prompts[i]`` for a prompt's own problem: its ids,
            its length against the context) and the fix.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or (
            hasattr(prompts, "shape") and hasattr(prompts, "dtype")):
        raise TypeError(f"prompts is {describe(prompts)}; give a list of prompts, each a list of token ids")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    settings = check_settings(settings).with_(acceptance="match")
    caps = _lengths(settings.max_new_tokens, len(prompts))
    ids, stops, checked = [], [], settings
    for i, (p, cap) in enumerate(zip(prompts, caps)):
        try:
            pid, stops, checked, _, _ = check_speculative(target, drafter, head, p, settings.with_(max_new_tokens=cap),
                                                          generator=generator)
        except (TypeError, ValueError) as exc:  # a prompt's own problem is named by its index
            msg = str(exc)
            if msg.startswith("prompt_ids"):
                raise type(exc)(f"prompts[{i}]{msg[len('prompt_ids'):]}") from None
            raise
        ids.append(pid)
    if batch_size is None:
        rows = len(prompts)
    elif not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (rows decoded together) or None (all)")
    else:
        rows = min(int(batch_size), len(prompts))
    return ids, caps, stops, checked.with_(max_new_tokens=caps), rows


@torch.inference_mode()
def batched_generate(
    target: Target, drafter: DFlashDrafter, head: CorrectionHead, prompts: Sequence, settings: DecodeSettings, *,
    generator: torch.Generator | None = None, batch_size: int | None = None, cost_model: BatchCostModel | None = None,
) -> BatchOutput:
    """Speculative decoding of several prompts together; every row lossless (see the module docstring).

    Args:
        target, drafter, head: as :func:`~dartree.decode.generate.speculative_generate`.
        prompts: N prompts, each token ids as ``speculative_generate`` takes one ([T] or [1, T]).
        settings: the :class:`~dartree.decode.settings.DecodeSettings`, as ``speculative_generate`` takes them
            (acceptance is always exact target-sample matching), except: ``max_new_tokens`` is one int for all
            prompts or one per prompt, and ``budget`` is tree nodes per row and round (default: P, the drafter's
            proposals) or ``"auto"``: per round the batch-aware cost model decides whether the batch drafts and the
            width of every row's tree (:mod:`dartree.decode.batch_budget`).
        generator: a seeded torch.Generator for T > 0 (one stream for the batch: a row's samples depend on the seed
            and on the other rows, its distribution does not).
        batch_size: rows decoded together (default: all prompts); with fewer, the prompts wait in a queue and a
            finished row's place goes to the next one. One row at a time (``batch_size=1`` or one prompt) is
            :func:`~dartree.decode.generate.speculative_generate` per prompt, the one-prompt loop and its speed (the
            ``"auto"`` policy at one row is the batch-1 one).
        cost_model: the ``budget="auto"`` policy (:class:`~dartree.decode.batch_budget.BatchCostModel`, calibrated
            and seeded; shared across calls, updated in place); None builds one for this call
            (:func:`~dartree.decode.batch_budget.batch_policy`: calibration, row table, warm-up, seeding).
    Returns:
        :class:`BatchOutput`: per prompt, in order, the tokens :func:`~dartree.decode.generate.autoregressive_generate`
        gives at T = 0 (distributed as the target's samples at T > 0), with its stats.
    Raises (all before any forward):
        TypeError / ValueError: the checks of ``speculative_generate`` per prompt (named ``prompts[i]``), an empty
            prompt list, caps that are not one per prompt, a ``batch_size`` below 1.
        TypeError: a ``cost_model`` that is not a :class:`~dartree.decode.batch_budget.BatchCostModel`.
    """
    t_run = time.perf_counter()
    ids, caps, stop_list, s, width = check_batched(target, drafter, head, prompts, settings, generator=generator,
                                                   batch_size=batch_size)
    if s.budget == "auto":
        if cost_model is None:
            cost_model = batch_policy(target, drafter, head, ids, s.with_(stop_ids=stop_list, max_new_tokens=max(caps)),
                                      rows=width)
        if width == 1:
            cost_model.set_rows(1)
    if width == 1:  # one row at a time is the one-prompt decode: its own loop, at its own speed
        return _one_at_a_time(t_run, lambda i, cap: speculative_generate(
            target, drafter, head, ids[i], s.with_(max_new_tokens=cap, stop_ids=stop_list), generator=generator,
            cost_model=cost_model), caps)
    if s.budget == "auto":
        budgets = AutoRowBudgets(cost_model, builder_beta(s.builder, s.params), time.perf_counter)
    else:
        budgets = RowBudgets(drafter.cfg.num_proposals if s.budget is None else int(s.budget))
    loop = _BatchLoop(target, drafter, ids, caps, stops=set(int(t) for t in stop_list), budgets=budgets,
                      rule=GreedyMatch(get_builder(s.builder), head, s.params, s.temperature, generator),
                      lookup=(s.lookup, s.lookup_ngram), record_trees=s.record_trees)
    loop.fill(width)
    while loop.rows:
        loop.round()
    loop.result.seconds = time.perf_counter() - t_run
    return loop.result


def _one_at_a_time(t_run: float, decode, caps: list, plain: bool = False) -> BatchOutput:
    """A batch of one row: every prompt decoded alone, in order, by ``decode(i, cap)`` (the one-prompt loop,
    :func:`~dartree.decode.generate.speculative_generate` or :func:`~dartree.decode.generate.autoregressive_generate`),
    gathered as a :class:`BatchOutput` (a width per round: its tree's nodes + 1, or 1 per token after the first with
    ``plain``, the AR loop; one row per forward). ``t_run``: the clock reading when the call started."""
    out = BatchOutput([None] * len(caps))
    for i, cap in enumerate(caps):
        o = decode(i, cap)
        out.outputs[i] = o
        rounds = [0] * max(len(o.tokens) - 1, 0) if plain else o.stats.tree_nodes
        out.widths += [n + 1 for n in rounds]
        out.rows += [1] * len(rounds)
    out.seconds = time.perf_counter() - t_run
    return out


def prefill_next(target: Target, ids: list, caps: list, queue: deque, result: BatchOutput, stops: set,
                 temperature: float, generator) -> tuple | None:
    """Take the next prompt of ``queue`` and prefill it alone into a fresh cache (its batch-1 prefill, bit for bit):
    returns (index, its output so far [the first token], its :class:`DecodeStats` with ``prefill_s``, the first
    token, the prefill's capture-layer features [T, F], the cache), or None when the queue is empty. A prompt done at
    its prefill (cap 0 or 1, a stop id first) is stored in ``result.outputs`` and the next one taken. Shared by the
    batched speculative loop and the batched AR loop (:mod:`dartree.decode.batch_ar`), so both admit alike."""
    while queue:
        i = queue.popleft()
        stats, out = DecodeStats(), []
        if caps[i] == 0:
            result.outputs[i] = GenerateOutput([], stats)
            continue
        cache, t0 = target.new_cache(), time.perf_counter()
        first, feats = _prefill(target, ids[i], cache, temperature, generator)
        stats.prefill_s = time.perf_counter() - t0
        _, done = _commit(out, [first], caps[i], stops)
        if done:
            stats.new_tokens = len(out)
            result.outputs[i] = GenerateOutput(out, stats)
            continue
        return i, out, stats, first, feats, cache
    return None


class _BatchLoop:
    """The state of one batched decode and its steps: admitting prompts from the queue (:meth:`admit`), one round
    for all rows (:meth:`round`), finished rows leaving and the queue refilling their places (:meth:`refill`).
    Arguments as :func:`batched_generate` resolved them."""

    def __init__(self, target: Target, drafter: DFlashDrafter, ids: list, caps: list, *, stops: set,
                 budgets: RowBudgets | AutoRowBudgets, rule: GreedyMatch, lookup: tuple, record_trees: bool):
        self.target, self.drafter, self.ids, self.caps, self.stops = target, drafter, ids, caps, stops
        self.budgets, self.rule, self.lookup, self.record_trees = budgets, rule, lookup, record_trees
        self.result = BatchOutput([None] * len(ids))
        self.queue = deque(range(len(ids)))
        self.kv, self.dcache, self.rows = BatchKV(target), RowDraftCache(len(drafter.layers)), []

    def admit(self) -> tuple | None:
        """The next prompt of the queue, prefilled alone into a fresh cache (its batch-1 prefill): (row, its cache),
        or None when the queue is empty; a prompt that finishes at its prefill (cap 0 or 1, a stop id first) is
        stored as done here and the next one taken."""
        got = prefill_next(self.target, self.ids, self.caps, self.queue, self.result, self.stops, self.rule.temperature,
                           self.rule.generator)
        if got is None:
            return None
        i, out, stats, first, feats, cache = got
        return _Row(i, self.ids[i], self.caps[i], out, stats, first, [feats], self.budgets.new_row(),
                    LookupGraft(self.ids[i], *self.lookup), time.perf_counter()), cache

    def fill(self, width: int) -> None:
        """Admit up to ``width`` rows into the empty batch."""
        while len(self.rows) < width:
            got = self.admit()
            if got is None:
                return
            self.rows.append(got[0])
            self.kv.add_row(got[1])
            self.dcache.add_row()

    def round(self) -> None:
        """One round for every row: draft (unless the budget says the batch takes a plain step) -> build, graft,
        budget -> compile, verify -> commit; then the finished rows leave (:meth:`refill`)."""
        rows, kv, rule, target = self.rows, self.kv, self.rule, self.target
        ta = time.perf_counter()  # draft (a round without it: every row's features wait for the next draft)
        starts, anchors = list(kv.lens), [r.anchor for r in rows]
        drafted = self.budgets.drafts(len(rows))
        if drafted:
            blocks = draft_blocks(target, self.drafter, anchors, starts,
                                  [r.pending[0] if len(r.pending) == 1 else torch.cat(r.pending) for r in rows],
                                  self.dcache)
            for r in rows:
                r.pending.clear()
        tb = time.perf_counter()  # build, graft, budget
        built = [r.graft(rule.build(blocks[j], r.anchor, r.policy.nodes) if drafted else Tree.empty(), r.out,
                         r.policy.lookup_stats) for j, r in enumerate(rows)]
        trees, chain_pos = self.budgets.choose([r.policy for r in rows], [b[0] for b in built],
                                               [b[1] for b in built], tb, drafted)
        tc = time.perf_counter()  # compile, verify
        inputs = compile_batch(trees, anchors, starts, kv.width, target.dtype, target.device)
        tc2 = time.perf_counter()
        vers = verify_batch(target, trees, anchors, kv, rule.temperature, rule.generator, inputs)
        td = time.perf_counter()  # commit
        self.result.widths.append(int(inputs.input_ids.shape[1]))
        self.result.rows.append(len(rows))
        finished = []
        for j, (r, tree, ver) in enumerate(zip(rows, trees, vers)):
            n, done = _commit(r.out, ver.tokens + [ver.bonus_id], r.max_new, self.stops)
            r.stats.add_round(n, tree, ver, r.policy.recorded_budget(tree), r.anchor, self.record_trees)
            r.anchor = ver.bonus_id
            r.pending.append(ver.features)
            r.policy.observe(tree, ver.accepted, chain_pos[j], built[j][2], drafted, draft_s=tb - ta,
                             verify_s=td - tc2, round_s=td - ta)
            if done:
                finished.append(j)
        te = time.perf_counter()
        self.budgets.observe(trees, vers, chain_pos, [b[2] for b in built], drafted, draft_s=tb - ta,
                             verify_s=td - tc2, round_s=te - ta)
        for r in rows:
            r.stats.add_stage_times(ta, tb, tc, tc2, td, te)
        if finished:
            self.refill(finished, te)

    def refill(self, finished: list, now: float) -> None:
        """Finished rows leave: each stores its output, and its place goes to the next prompt of the queue (its
        prefill cache into that row of the target's cache, its drafter context reset); places left empty are
        dropped from both caches."""
        vacant = []
        for j in finished:
            row = self.rows[j]
            row.stats.decode_s, row.stats.new_tokens = now - row.started, len(row.out)
            self.result.outputs[row.index] = GenerateOutput(row.out, row.stats)
            got = self.admit()
            if got is None:
                vacant.append(j)
                continue
            self.rows[j] = got[0]
            self.kv.replace_row(j, got[1])
            self.dcache.reset_row(j)
        if not vacant:
            return
        keep = [j for j in range(len(self.rows)) if j not in set(vacant)]
        if keep:
            self.kv.keep_rows(keep)
            self.dcache.keep_rows(keep)
        self.rows = [self.rows[j] for j in keep]

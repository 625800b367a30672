"""Plain autoregressive decoding of several prompts together: the batched baseline speculative batches are timed
against (``decode/eval.py --batch``).

Each round is one target forward of one token per row over the batch's KV cache (:class:`~dartree.models.batch_cache
.BatchKV`: rows of different lengths, each row's hole hidden by an additive mask, positions per row), the rows
admitted and refilled from a queue exactly as :func:`dartree.decode.batched.batched_generate` admits them (each
prompt's prefill alone, its batch-1 prefill), so the two loops differ only in what a round verifies. When no row has
a hole (always at batch 1, and while the rows keep equal lengths) no mask is passed, as the batch-1 AR loop
(:func:`~dartree.decode.generate.autoregressive_generate`) passes none. The layout is that of the padded caches of
batched serving engines (one tensor, per-row lengths, masked padding); transformers' ``generate`` with left padding
is the peer beside it (:func:`dartree.decode.harness.peers.hf_generate_batch`).

Row i's tokens equal :func:`~dartree.decode.generate.autoregressive_generate`'s for prompt i at T = 0 (fp32; bf16 in
the row-invariant mode), whatever the other rows.

Shapes: N rows, S the cache's width, V vocabulary; token ids int64.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from dartree.base.fields import describe, is_int
from dartree.decode.batch_rounds import compile_batch
from dartree.decode.batched import BatchOutput, _lengths, _one_at_a_time, prefill_next
from dartree.decode.generate import DecodeStats, GenerateOutput, _commit, autoregressive_generate
from dartree.decode.inputs import check_generate_args
from dartree.decode.trees import Tree
from dartree.decode.verify import target_tokens
from dartree.models.batch_cache import BatchKV
from dartree.models.target import Target


@dataclass
class _ARRow:
    """One request in the batch: its prompt's index, its output so far, its next input token and its stats."""

    index: int
    max_new: int
    out: list
    stats: DecodeStats
    token: int
    started: float


def _check(target, prompts, max_new_tokens, temperature, stop_ids, generator, batch_size) -> tuple:
    """The checks of :func:`batched_autoregressive` before any forward; returns (prompt id lists, caps, stop ids,
    rows decoded together). Raises TypeError / ValueError naming the argument (``prompts[i]`` for a prompt's own)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or (
            hasattr(prompts, "shape") and hasattr(prompts, "dtype")):
        raise TypeError(f"prompts is {describe(prompts)}; give a list of prompts, each a list of token ids")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    caps = _lengths(max_new_tokens, len(prompts))
    ids, stops = [], []
    for i, (p, cap) in enumerate(zip(prompts, caps)):
        try:
            pid, stops = check_generate_args(target, p, max_new_tokens=cap, temperature=temperature,
                                             stop_ids=stop_ids, generator=generator)
        except (TypeError, ValueError) as exc:
            msg = str(exc)
            if msg.startswith("prompt_ids"):
                raise type(exc)(f"prompts[{i}]{msg[len('prompt_ids'):]}") from None
            raise
        ids.append(pid)
    if batch_size is not None and (not is_int(batch_size) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (rows decoded together) or None (all)")
    return ids, caps, stops, len(prompts) if batch_size is None else min(int(batch_size), len(prompts))


@torch.inference_mode()
def batched_autoregressive(target: Target, prompts: Sequence, *, max_new_tokens: int | Sequence[int],
                           temperature: float = 0.0, stop_ids: Sequence[int] = (),
                           generator: torch.Generator | None = None, batch_size: int | None = None) -> BatchOutput:
    """Plain one-token-per-forward decoding of N prompts together (see the module docstring).

    Args:
        target: the :class:`~dartree.models.target.Target`.
        prompts: N prompts, each [T_i] (or [1, T_i]) token ids.
        max_new_tokens: the cap on generated tokens, one int for all prompts or one per prompt.
        temperature: 0 for greedy; > 0 samples softmax(logits / T), the rows in order from ``generator``.
        stop_ids: ids that end a row (inclusive). generator: a seeded torch.Generator for T > 0.
        batch_size: rows decoded together (default: all prompts); with fewer, a finished row's place goes to the next
            prompt of the queue. One row at a time is :func:`~dartree.decode.generate.autoregressive_generate` per
            prompt (the one-prompt loop: nothing to batch).
    Returns:
        :class:`~dartree.decode.batched.BatchOutput`: per prompt, in order, its tokens (those of
        :func:`~dartree.decode.generate.autoregressive_generate` at T = 0) and stats (one committed token per forward;
        ``prefill_s`` its own prefill, ``decode_s`` from its prefill to its last step); ``widths`` all 1, ``rows``
        per forward, ``seconds`` the whole wall time, prefills included.
    Raises (all before any forward):
        TypeError / ValueError: the checks of ``autoregressive_generate`` per prompt (named ``prompts[i]``), an
            empty prompt list, caps that are not one per prompt, a ``batch_size`` below 1.
    """
    t_run = time.perf_counter()
    ids, caps, stop_list, width = _check(target, prompts, max_new_tokens, temperature, stop_ids, generator,
                                         batch_size)
    if width == 1:  # one row at a time is the one-prompt AR loop, at its own speed
        return _one_at_a_time(t_run, lambda i, cap: autoregressive_generate(
            target, ids[i], max_new_tokens=cap, temperature=temperature, stop_ids=stop_list, generator=generator),
            caps, plain=True)
    loop = _ARLoop(target, ids, caps, set(int(s) for s in stop_list), temperature, generator)
    while len(loop.rows) < width and (got := loop.admit()) is not None:
        loop.rows.append(got[0])
        loop.kv.add_row(got[1])
    while loop.rows:
        loop.step()
    loop.result.seconds = time.perf_counter() - t_run
    return loop.result


class _ARLoop:
    """The state of one batched AR decode: the queue, the rows, the batch's cache; :meth:`admit` takes the next
    prompt (its prefill alone), :meth:`step` runs one forward for every row and refills the finished rows' places.
    Arguments as :func:`batched_autoregressive` resolved them."""

    def __init__(self, target: Target, ids: list, caps: list, stops: set, temperature: float, generator):
        self.target, self.ids, self.caps, self.stops = target, ids, caps, stops
        self.temperature, self.generator = temperature, generator
        self.result, self.queue = BatchOutput([None] * len(ids)), deque(range(len(ids)))
        self.kv, self.rows = BatchKV(target), []

    def admit(self) -> tuple | None:
        """The next prompt of the queue prefilled alone: (row, its cache), or None when the queue is empty; a
        prompt done at its prefill (cap 0 or 1, a stop id first) is stored and the next one taken."""
        got = prefill_next(self.target, self.ids, self.caps, self.queue, self.result, self.stops, self.temperature,
                           self.generator)
        if got is None:
            return None
        i, out, stats, first, _, cache = got
        return _ARRow(i, self.caps[i], out, stats, first, time.perf_counter()), cache

    def step(self) -> None:
        """One target forward of one token per row ([N, 1] ids at positions ``lens``; a mask only where a row has a
        hole), each row's token committed, finished rows replaced from the queue or dropped."""
        target, kv, rows = self.target, self.kv, self.rows
        past = kv.width
        # every row's root alone: [N, 1] ids at positions lens, a mask only where some row has a hole
        inp = compile_batch([Tree.empty()] * len(rows), [r.token for r in rows], kv.lens, past, target.dtype,
                            target.device)
        logits = target.forward(inp.input_ids, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                                cache=kv.cache).logits[:, -1]
        nxt = target_tokens(logits, self.temperature, self.generator).tolist()
        kv.commit(past, [torch.zeros(1, dtype=torch.long)] * len(rows))
        self.result.widths.append(1)
        self.result.rows.append(len(rows))
        now, finished = time.perf_counter(), []
        for j, (r, tok) in enumerate(zip(rows, nxt)):
            n, done = _commit(r.out, [tok], r.max_new, self.stops)
            r.stats.accept_lengths.append(n)
            r.token = int(tok)
            if done:
                finished.append(j)
        vacant = []
        for j in finished:
            r = rows[j]
            r.stats.decode_s, r.stats.new_tokens = now - r.started, len(r.out)
            self.result.outputs[r.index] = GenerateOutput(r.out, r.stats)
            got = self.admit()
            if got is None:
                vacant.append(j)
            else:
                rows[j] = got[0]
                kv.replace_row(j, got[1])
        if vacant:
            keep = [j for j in range(len(rows)) if j not in set(vacant)]
            if keep:
                kv.keep_rows(keep)
            self.rows = [rows[j] for j in keep]

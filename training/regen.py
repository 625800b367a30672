"""Greedy regeneration of training responses with continuous batching on a fixed set of slots.

``transformers``' ``generate`` keeps a batch together until its longest row stops, grows its key/value cache
by concatenation at every step and, on CPU, sends one-token queries through the flash-attention kernel; its
own continuous-batching ``generate_batch`` is slower still on a small CPU (figures: docs/performance.md,
"Regeneration"). This module keeps the Hugging Face model (every forward is the model's own), and replaces only
the batching and the cache:

- ``S`` slots, each a row of preallocated key/value slabs ``[S, H_kv, T_max, d]`` per layer (no concatenation);
- prompts enter in length order; a slot whose row stops (stop token or ``max_new_tokens``) is refilled with
  the next prompt at the following step (prefilled right-padded, so no padding mask is needed there);
- one decode step runs all busy slots at their own positions, with an additive mask ``[S, 1, 1, L]`` that
  lets slot ``s`` see keys ``0..pos[s]`` only (``L`` = longest busy row + 1);
- when no prompt is left and under half the slots are busy, the slabs are compacted to the busy rows;
- prefill attention is the model's own (``sdpa``); the one-token decode queries go through
  :func:`decode_attention` (registered with ``transformers``' ``AttentionInterface`` around each decode step):
  grouped-query attention as two batched matmuls in the model dtype with an fp32 softmax, on whole
  (contiguous) slabs, because the CPU ``sdpa`` kernel is slow for one query over many slots; scores stay in the
  model dtype, since converting bf16 slabs to fp32 costs more traffic than it saves;
- the model's linear layers run prepacked oneDNN weights for the duration of the call where the CPU supports
  them (:func:`dartree.models.packed.pack_linears`, ``linear="auto"``), restored afterwards: ``F.linear``
  repacks every weight at every call.

The tokens are those of greedy decoding of the target (argmax at every step). In fp32 they equal plain
one-prompt-at-a-time decoding (tested); in bf16 a row can differ where batched and single-row arithmetic round
differently, as with ``generate`` in batches (how often: docs/performance.md, "Regeneration").
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from dartree.models.packed import choose_linear, is_packed, pack_linears

ATTN_NAME = "dartree_decode"
PREFILL_TOKENS = 4096  # padded tokens per prefill forward (rows x longest prompt of the group)


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """Attention for one-token queries (``transformers`` ``AttentionInterface`` signature); longer queries and
    options it does not implement (dropout, softcapping, sinks) go to the library's ``sdpa`` function.

    Args:
        query: [B, H, 1, d]; key, value: [B, H_kv, L, d] (H a multiple of H_kv; query head j reads key/value
            head j // (H / H_kv), ``repeat_kv``'s order). attention_mask: additive [B, 1, 1, L] or None.
        scaling: score scale (default d ** -0.5).
    Returns:
        ([B, 1, H, d] in the value dtype, None): softmax(q k^T * scaling + mask) v, scores and softmax in fp32.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.shape[2] != 1 or dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            or query.shape[1] % key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape
    hkv = key.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, hkv, h // hkv, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale)  # [B, H_kv, G, L]
    if attention_mask is not None:
        scores += attention_mask[..., : key.shape[2]].float()
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # [B, H_kv, G, d]
    return out.reshape(b, 1, h, d), None


class _decode_attention_on:
    """Context manager: the model's attention implementation is :func:`decode_attention` inside, restored after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, decode_attention)
        self.prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(ATTN_NAME)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.prev)
        return False


class _SlotCache:
    """The duck-typed cache the model's attention layers write into: ``update(k, v, layer_idx) -> (K, V)``.

    In prefill mode (``self.prefill`` holds a DynamicCache) it defers to that cache; in decode mode it writes
    the step's key/value ``[S, H_kv, 1, d]`` at ``pos[s]`` of slot ``s`` and returns the whole slabs
    ``[S, H_kv, T, d]``. T grows in steps of ``grow`` keys (:meth:`ensure`; the slabs are copied once per step),
    so the slabs handed to attention are contiguous (a slice of a longer slab is not, and batched matmuls
    would copy it in every layer at every step); keys past a slot's position are masked by the caller.
    """

    def __init__(self, num_layers: int, slots: int, t_max: int, grow: int = 64):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.slots, self.t_max, self.grow = slots, t_max, grow
        self.t_alloc = 0
        self.rows = torch.arange(slots)
        self.pos = torch.zeros(slots, dtype=torch.long)
        self.view_len = 0
        self.prefill = None

    def ensure(self, length: int) -> None:
        """Make the slabs at least ``length`` keys long (rounded up to ``grow``, at most ``t_max``)."""
        if length <= self.t_alloc:
            return
        t = min(self.t_max, -(-length // self.grow) * self.grow)
        for lst in (self.k, self.v):
            for i, old in enumerate(lst):
                if old is not None:
                    new = old.new_zeros((old.shape[0], old.shape[1], t, old.shape[3]))
                    new[:, :, : self.t_alloc] = old
                    lst[i] = new
        self.t_alloc = t

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.prefill is not None:
            return self.prefill.update(key_states, value_states, layer_idx, *args, **kwargs)
        k, v = self._slab(layer_idx, key_states, value_states)
        k[self.rows, :, self.pos] = key_states[:, :, 0]
        v[self.rows, :, self.pos] = value_states[:, :, 0]
        if self.view_len == self.t_alloc:
            return k, v
        return k[:, :, : self.view_len], v[:, :, : self.view_len]

    def _slab(self, i, key_states, value_states):
        if self.k[i] is None:
            _, h, _, d = key_states.shape
            self.k[i] = key_states.new_zeros((self.slots, h, self.t_alloc, d))
            self.v[i] = value_states.new_zeros((self.slots, h, self.t_alloc, value_states.shape[-1]))
        return self.k[i], self.v[i]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view_len

    def keep(self, idx: torch.Tensor) -> None:
        """Compact every slab to the slots ``idx`` (in that order)."""
        self.k = [None if t is None else t[idx].contiguous() for t in self.k]
        self.v = [None if t is None else t[idx].contiguous() for t in self.v]
        self.slots = int(idx.numel())
        self.rows = torch.arange(self.slots)
        self.pos = self.pos[idx]


@torch.no_grad()
def continuous_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_id: int | None = None,
    stop_ids: Sequence[int] = (),
    slots: int = 48,
    order: Sequence[int] | None = None,
    linear: str = "auto",
    feed: bool = False,
    max_len: int | None = None,
    follow: Callable[[int, list[int]], tuple[int, list[int]] | None] | None = None,
    min_free: int = 1,
    prefill_tokens: int | None = None,
) -> Iterator[tuple[int, list[int]]]:
    """Greedy responses of a Hugging Face causal LM to ``prompts``, yielded as ``(prompt index, response ids)``
    in the order rows finish; a response ends with a stop id when the model stopped, else has
    ``max_new_tokens`` tokens.

    Args:
        model: a ``*ForCausalLM`` whose attention layers call ``past_key_values.update(k, v, layer_idx)``
            (Llama, Qwen2/3, Mistral families in transformers 5) and accept a 4D additive mask.
        prompts: token ids (each non-empty).
        max_new_tokens: response cap in tokens (>= 1).
        stop_id: one end-of-turn token (the older spelling of ``stop_ids=[stop_id]``).
        stop_ids: the end-of-turn tokens (e.g. :func:`dartree.models.generation.stop_ids` of the target: every id
            at which its own ``generate`` stops); a row ends at the first of them. Both may be given (the union).
        slots: rows decoded together (the batch size).
        order: the order in which prompts enter (default: shortest first, which keeps prefills small and
            similar); only these indices are generated.
        linear: ``auto`` (prepacked oneDNN linears where supported, else ``F.linear``), ``onednn`` or ``aten``
            (:func:`dartree.models.packed.choose_linear`); the model's modules are restored when the generator ends.
        feed: the caller may append prompts to ``prompts`` (a list) and their indices to ``order`` (a list, used
            as the queue itself) while the generator is suspended at a yield, for example the next turn of the
            conversation whose answer was just yielded; they enter as slots free up. Needs ``order`` and
            ``max_len``.
        max_len: the longest prompt plus response any row will reach (keys per slot); default: the longest
            prompt of ``order`` plus ``max_new_tokens``.
        follow: called as ``follow(j, response)`` after row j is yielded; it returns None (the slot frees up) or
            ``(j2, extra)``: row j2's prompt is row j's prompt + ``response`` + ``extra`` (the next turn of a
            conversation: the turn end and the next user turn), and it continues in the same slot, on the keys
            and values already there, so only ``extra`` is prefilled (not the whole history again). j2 must be
            an index of ``prompts`` (the caller appends it first).
        min_free: refill only once at least this many slots are free (or no slot is busy): each refill is one
            more prefill forward, which on a GPU costs about a decode step whatever its size, so with many slots a
            threshold (e.g. ``slots // 16``) keeps the refills from running at nearly every step. 1 (the default)
            refills at every step that frees a slot.
        prefill_tokens: padded tokens per prefill forward (rows x longest prompt of the group); default
            :data:`PREFILL_TOKENS` (sized for a CPU; a GPU takes 64k at about the cost of 4k).
    Raises:
        ValueError: an empty prompt, ``max_new_tokens < 1``, ``slots < 1``, ``min_free < 1`` or
            ``prefill_tokens < 1``; no stop id at all (neither ``stop_id`` nor ``stop_ids``); ``onednn`` where it
            cannot run.
    """
    stops = frozenset(int(s) for s in ([] if stop_id is None else [stop_id]) + list(stop_ids))
    _check_arguments(prompts, stops, max_new_tokens, slots, min_free, prefill_tokens, feed, order, max_len)
    if feed:
        pending = order
    else:
        pending = list(order) if order is not None else sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    if not pending:
        return
    device = next(model.parameters()).device
    backend, _ = choose_linear(linear, next(model.parameters()).dtype, device)
    # pack only what is plain nn.Linear now; a caller's packed modules stay packed afterwards
    swapped = [m for m in model.modules() if type(m) is torch.nn.Linear] if backend == "onednn" else []
    for m in swapped:
        pack_linears(m, "onednn")
    try:
        yield from _continuous_greedy(model, prompts, pending, max_new_tokens=max_new_tokens, stops=stops,
                                      slots=slots, max_len=max_len, feed=feed, follow=follow, min_free=min_free,
                                      prefill_tokens=prefill_tokens or PREFILL_TOKENS)
    finally:
        for m in swapped:
            if is_packed(m):
                pack_linears(m, "aten")


def _check_arguments(prompts, stops, max_new_tokens, slots, min_free, prefill_tokens, feed, order, max_len) -> None:
    """:func:`continuous_greedy`'s argument checks (its Raises)."""
    if not stops:
        raise ValueError("continuous_greedy: give the end-of-turn token(s) as stop_ids (or stop_id)")
    if max_new_tokens < 1 or slots < 1 or min_free < 1 or (prefill_tokens is not None and prefill_tokens < 1):
        raise ValueError(f"continuous_greedy: max_new_tokens ({max_new_tokens}), slots ({slots}), min_free "
                         f"({min_free}) and prefill_tokens ({prefill_tokens}) must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("continuous_greedy: every prompt needs at least one token")
    if feed and (not isinstance(order, list) or max_len is None):
        raise ValueError("continuous_greedy(feed=True) needs order as a list (the queue) and max_len")


class _SlotRun:
    """The state of one :func:`continuous_greedy` run: the slot cache, and per slot its row (``owner``, -1 = free),
    the answer so far (``out``) and the token it feeds next (``last``). Its methods are the stages of a run: fill
    free slots (:meth:`refill` / :meth:`prefill`), continue a slot as a follow-up row (:meth:`extend`), compact the
    slabs (:meth:`compact`) and one decode step of every busy slot (:meth:`decode_step`)."""

    def __init__(self, model, prompts, pending: list, *, max_new_tokens: int, stops: frozenset, slots: int,
                 max_len: int | None, feed: bool, prefill_tokens: int = PREFILL_TOKENS):
        self.model, self.prompts, self.pending = model, prompts, pending
        self.prefill_tokens = prefill_tokens
        self.max_new_tokens, self.stops = max_new_tokens, stops
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.n_layers = model.config.num_hidden_layers
        self.t_max = max_len if max_len is not None else max(len(prompts[i]) for i in pending) + max_new_tokens
        if not feed:
            slots = min(slots, len(pending))
        self.cache = _SlotCache(self.n_layers, slots, self.t_max)
        self.owner = [-1] * slots  # prompt index per slot, -1 = free
        self.out: list[list[int]] = [[] for _ in range(slots)]
        self.last = torch.zeros(slots, dtype=torch.long)  # the token each slot feeds next
        self.neg = torch.finfo(self.dtype).min

    def refill(self, free: list[int]) -> None:
        """Give the free slots the next prompts of the queue. Prefill runs in groups of similar length (the queue
        is shortest first) of at most ``prefill_tokens`` padded tokens (:data:`PREFILL_TOKENS` unless the run was
        given another), so one long prompt does not pad every other row of the batch to its length."""
        take = [self.pending.pop(0) for _ in range(min(len(free), len(self.pending)))]
        group: list[int] = []
        for i in take:
            if group and (len(group) + 1) * max(len(self.prompts[q]) for q in group + [i]) > self.prefill_tokens:
                self.prefill(free[: len(group)], group)
                free = free[len(group):]
                group = []
            group.append(i)
        if group:
            self.prefill(free[: len(group)], group)

    def prefill(self, free: list[int], take: list[int]) -> None:
        """Prefill prompts ``take`` (right-padded: causal attention never lets a real query see a pad key) into
        slots ``free`` and take each one's first greedy token."""
        from transformers import DynamicCache

        lens = [len(self.prompts[i]) for i in take]
        width = max(lens)
        if width + self.max_new_tokens > self.t_max:
            raise ValueError(f"continuous_greedy: a prompt of {width} tokens plus {self.max_new_tokens} new ones "
                             f"exceeds max_len={self.t_max}")
        ids = torch.zeros((len(take), width), dtype=torch.long)
        for r, i in enumerate(take):
            ids[r, : lens[r]] = torch.as_tensor(list(self.prompts[i]), dtype=torch.long)
        cache = self.cache
        cache.prefill = DynamicCache(config=self.model.config)
        hid = self.decoder(input_ids=ids.to(self.device), past_key_values=cache.prefill,
                           use_cache=True).last_hidden_state
        lastpos = torch.tensor(lens) - 1
        tok = self.head(hid[torch.arange(len(take)), lastpos.to(self.device)]).float().argmax(-1).cpu()
        slot_idx = torch.tensor(free)
        cache.ensure(width)
        for li, layer in enumerate(cache.prefill.layers):
            k, v = cache._slab(li, layer.keys, layer.values)
            k[slot_idx, :, :width] = layer.keys
            v[slot_idx, :, :width] = layer.values
        cache.prefill = None
        for r, s in enumerate(free):
            self.owner[s], self.out[s] = take[r], [int(tok[r])]
            cache.pos[s] = lens[r]
            self.last[s] = tok[r]

    def finished(self, s: int) -> bool:
        """Slot s's answer ended with a stop id or reached ``max_new_tokens``."""
        return self.out[s][-1] in self.stops or len(self.out[s]) >= self.max_new_tokens

    def extend(self, s: int, j: int, ids: list[int]) -> None:
        """Slot s continues as row j: prefill ``ids`` (the previous answer's last token, not yet fed, and the next
        turn's template and user text) on the slot's own keys/values, then decode j's answer."""
        from transformers import DynamicCache

        cache = self.cache
        p0, n = int(cache.pos[s]), len(ids)
        if p0 + n + self.max_new_tokens > self.t_max:
            raise ValueError(f"continuous_greedy: row {j} reaches {p0 + n + self.max_new_tokens} tokens, over "
                             f"max_len={self.t_max}")
        past = DynamicCache(config=self.model.config)
        for li in range(self.n_layers):
            past.update(cache.k[li][s : s + 1, :, :p0], cache.v[li][s : s + 1, :, :p0], li)
        hid = self.decoder(input_ids=torch.tensor([ids], device=self.device),
                           position_ids=torch.arange(p0, p0 + n, device=self.device)[None], past_key_values=past,
                           use_cache=True).last_hidden_state
        tok = int(self.head(hid[0, -1:]).float().argmax(-1))
        cache.ensure(p0 + n)
        for li, layer in enumerate(past.layers):
            cache.k[li][s, :, p0 : p0 + n] = layer.keys[0, :, p0 : p0 + n]
            cache.v[li][s, :, p0 : p0 + n] = layer.values[0, :, p0 : p0 + n]
        self.owner[s], self.out[s] = j, [tok]
        cache.pos[s] = p0 + n
        self.last[s] = tok

    def compact(self, busy: list[int]) -> None:
        """Keep only the slots ``busy`` (in that order): slabs, rows, answers and next tokens."""
        idx = torch.tensor(busy)
        self.cache.keep(idx)
        self.owner, self.out, self.last = [self.owner[s] for s in busy], [self.out[s] for s in busy], self.last[idx]

    def decode_step(self) -> None:
        """One greedy token for every busy slot, each at its own position: the additive mask [S, 1, 1, L] lets
        slot s see keys 0..pos[s] only (whole contiguous slabs; :func:`decode_attention`)."""
        cache = self.cache
        busy_mask = torch.tensor([o >= 0 for o in self.owner])
        pos = torch.where(busy_mask, cache.pos, 0)
        cache.pos = pos
        cache.ensure(int(pos.max()) + 1)
        cache.view_len = cache.t_alloc  # whole (contiguous) slabs; keys past each slot's position are masked
        keys = torch.arange(cache.view_len)
        mask = torch.where(keys[None, :] <= pos[:, None], 0.0, self.neg).to(self.dtype)[:, None, None, :]
        with _decode_attention_on(self.model):
            hid = self.decoder(input_ids=self.last[:, None].to(self.device), position_ids=pos[:, None].to(self.device),
                               attention_mask=mask.to(self.device), past_key_values=cache,
                               use_cache=True).last_hidden_state
        tok = self.head(hid[:, -1]).float().argmax(-1).cpu()
        ids = tok.tolist()  # one device-to-host copy a step, not one per slot
        for s in range(cache.slots):
            if self.owner[s] >= 0:
                self.out[s].append(ids[s])
        self.last = torch.where(busy_mask, tok, self.last)
        cache.pos = pos + busy_mask.long()


@torch.no_grad()
def _continuous_greedy(model, prompts, pending, *, max_new_tokens: int, stops: frozenset, slots: int,
                       max_len: int | None = None, feed: bool = False, follow=None, min_free: int = 1,
                       prefill_tokens: int = PREFILL_TOKENS):
    """The body of :func:`continuous_greedy` (arguments checked there; ``pending`` is the entry order): finished
    rows are yielded (and continued by ``follow`` or their slot freed), free slots refilled once ``min_free`` are
    free (or none is busy), and otherwise every busy slot decodes one token (:class:`_SlotRun`)."""
    run = _SlotRun(model, prompts, pending, max_new_tokens=max_new_tokens, stops=stops, slots=slots, max_len=max_len,
                   feed=feed, prefill_tokens=prefill_tokens)
    run.refill(list(range(run.cache.slots)))
    while True:
        done = [s for s in range(run.cache.slots) if run.owner[s] >= 0 and run.finished(s)]
        for s in done:
            j, resp = run.owner[s], run.out[s]
            yield j, resp
            nxt = follow(j, resp) if follow is not None else None
            if nxt is None:
                run.owner[s], run.out[s] = -1, []
            else:
                run.extend(s, nxt[0], [resp[-1]] + list(nxt[1]))
        if done and follow is not None:
            continue  # a continued row may already be finished (an immediate stop)
        free = [s for s in range(run.cache.slots) if run.owner[s] < 0]
        if free and pending and (len(free) >= min(min_free, run.cache.slots) or len(free) == run.cache.slots):
            run.refill(free)
            continue  # a refilled row may already be finished (max_new_tokens 1 or an immediate stop)
        busy = [s for s in range(run.cache.slots) if run.owner[s] >= 0]
        if not busy:
            return
        if not pending and len(busy) <= run.cache.slots // 2:
            run.compact(busy)
        run.decode_step()

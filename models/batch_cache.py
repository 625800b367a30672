"""KV caches of a batch of requests with different committed lengths: the target's and the drafter's.

The batched decoder (:mod:`dartree.decode.batched`) keeps one cache tensor per layer for all N rows, [N, H, S, d],
with a valid length per row (``lens``): row i's committed entries are its columns ``0 .. lens[i] - 1`` in position
order, and its columns from ``lens[i]`` up to the tensor's width S are a *hole*: stale or zero entries that every
attention mask of the row hides (``finfo.min``). A forward appends the same number of columns W to every row (the
batch's shared verify width, or the longest new drafter context); after it each row keeps its own entries of those
W columns (:func:`compact_rows`: the accepted tree path of a verify, the real context of a draft), moved down to
right after its committed ones, and the tensor is cropped to the longest row. Rotary positions are the rows' own
(the caller passes them per row), so a row's keys and its attention are those of its batch-1 decode whatever its
hole: the column index of an entry never enters the model.

Together with :mod:`dartree.models.target` this is the only module that touches Hugging Face cache internals (a
``DynamicCache``'s ``layers[l].keys`` / ``values``; docs/design.md, "Hugging Face internals"). The layout follows
the padded caches of batched serving engines (a shared tensor, per-row lengths, masked padding), written for
transformers' ``DynamicCache``; DDTree's per-request compaction (``liranringel/ddtree`` ``compact_dynamic_cache``)
applied per row.
Shapes: N rows, H (key/value) heads, S columns, d head size, A kept entries.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dartree.models.drafter import DraftCache


def compact_rows(t: torch.Tensor, lens: Sequence[int], keep: Sequence[torch.Tensor], past: int) -> torch.Tensor:
    """Move each row's kept entries of the appended columns down to right after its committed ones; crop.

    Row i keeps columns ``past + keep[i]`` (ascending indices into the columns appended after ``past``), copied to
    columns ``lens[i] .. lens[i] + len(keep[i]) - 1``; the result is cropped to ``max(lens[i] + len(keep[i]))``
    columns. Columns past a row's new length are left as they are (its hole). Done with one gather and one scatter
    per tensor, in place, for all rows at once (O(N * max kept), never O(S)).

    Args:
        t: [N, H, S, d] cache tensor (its own storage, not a view shared with a caller).
        lens: N committed lengths before the forward, each <= ``past``.
        keep: N int64 index tensors [A_i] into the appended columns (A_i >= 0).
        past: the tensor's width before the forward (where the appended columns start).
    Returns:
        [N, H, S', d], a narrowed view of ``t`` (S' = the longest new row).
    Raises:
        ValueError: row counts that differ, a length over ``past``, or an index outside the appended columns.
    """
    n, _, s, _ = t.shape
    if len(lens) != n or len(keep) != n:
        raise ValueError(f"compact_rows: {n} cache rows but {len(lens)} lengths and {len(keep)} keep lists; pass "
                         "one of each per row")
    counts = [int(k.numel()) for k in keep]
    a_max = max(counts, default=0)
    width = max((int(l) + c for l, c in zip(lens, counts)), default=0)
    if any(int(l) > past for l in lens):
        raise ValueError(f"compact_rows: a row length {max(lens)} exceeds the width {past} before the forward")
    if a_max:
        src = torch.zeros(n, a_max, dtype=torch.long)
        for i, k in enumerate(keep):
            if counts[i]:
                ki = k.detach().long().cpu()
                if int(ki.max()) >= s - past or int(ki.min()) < 0:
                    raise ValueError(f"compact_rows: row {i} keeps index {int(ki.max())} outside the {s - past} "
                                     "appended columns")
                src[i, : counts[i]] = ki + past
                src[i, counts[i]:] = ki[-1] + past  # padding: a valid column; its copies land in the row's hole
        dst = torch.tensor([int(l) for l in lens], dtype=torch.long)[:, None] + torch.arange(a_max)[None]
        shape = (n, t.shape[1], a_max, t.shape[3])
        src = src.to(t.device)[:, None, :, None].expand(shape)
        dst = dst.to(t.device)[:, None, :, None].expand(shape)
        t.scatter_(2, dst, t.gather(2, src))
    return t.narrow(2, 0, width)


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """[N, H, S, d] -> [N, H, width, d] with zero columns appended (``t`` itself when S >= width)."""
    extra = width - t.shape[2]
    if extra <= 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], extra, t.shape[3])], dim=2)


class BatchKV:
    """The target's KV cache of a batch: one ``DynamicCache`` over N rows, with each row's committed length.

    Rows enter from a batch-1 prefill (:meth:`add_row`, :meth:`replace_row`: the prompt's own cache, so a row's
    prefill is exactly its batch-1 prefill), leave with :meth:`keep_rows`, and after each verify forward keep their
    accepted path (:meth:`commit`). ``cache`` is what the target's forward takes; ``lens[i]`` is row i's committed
    positions (= the position of its next root).

    Args:
        target: the :class:`~dartree.models.target.Target` whose cache this is (``target.new_cache()``).
    """

    def __init__(self, target):
        self.cache = target.new_cache()
        self.lens: list[int] = []

    @property
    def rows(self) -> int:
        """N, the rows held."""
        return len(self.lens)

    @property
    def width(self) -> int:
        """S, the columns of every layer's tensors (>= every row's length)."""
        return int(self.cache.get_seq_length()) if self.lens else 0

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel()]

    def add_row(self, row_cache) -> None:
        """Append a row holding ``row_cache``'s entries (a batch-1 ``DynamicCache`` after a prefill, [1, H, T, d]).

        Raises:
            ValueError: a cache of more than one row, or of other layers than this one's.
        """
        rows = [(layer.keys, layer.values) for layer in row_cache.layers]
        if any(k.shape[0] != 1 for k, _ in rows):
            raise ValueError("BatchKV.add_row takes a one-row cache (a batch-1 prefill)")
        length = int(row_cache.get_seq_length())
        if not self.lens:  # the first row: the batch cache starts as a copy of it
            for idx, (k, v) in enumerate(rows):
                self.cache.update(k.clone(), v.clone(), idx)
        else:
            mine = self.cache.layers
            if len(mine) != len(rows):
                raise ValueError(f"BatchKV.add_row: a cache of {len(rows)} layers for a batch of {len(mine)}")
            width = max(self.width, length)
            for layer, (k, v) in zip(mine, rows):
                layer.keys = torch.cat([_pad_columns(layer.keys, width), _pad_columns(k, width)], dim=0)
                layer.values = torch.cat([_pad_columns(layer.values, width), _pad_columns(v, width)], dim=0)
        self.lens.append(length)

    def replace_row(self, i: int, row_cache) -> None:
        """Put a new request's batch-1 prefill cache into row ``i`` (its old entries become hole, hidden).

        Raises:
            IndexError: no row ``i``.
        """
        if not 0 <= i < self.rows:
            raise IndexError(f"BatchKV.replace_row: row {i} of {self.rows}")
        length = int(row_cache.get_seq_length())
        width = max(self.width, length)
        for layer, src in zip(self.cache.layers, row_cache.layers):
            layer.keys, layer.values = _pad_columns(layer.keys, width), _pad_columns(layer.values, width)
            layer.keys[i, :, :length].copy_(src.keys[0])
            layer.values[i, :, :length].copy_(src.values[0])
        self.lens[i] = length

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (finished requests leave the batch); crop to the longest.

        Raises:
            ValueError: no row kept (end the decode instead).
        """
        if not rows:
            raise ValueError("BatchKV.keep_rows: keep at least one row (an empty batch has no cache)")
        self.lens = [self.lens[i] for i in rows]
        width = max(self.lens)
        for layer in self._layers():
            idx = torch.tensor(list(rows), dtype=torch.long, device=layer.keys.device)
            layer.keys = layer.keys.index_select(0, idx).narrow(2, 0, width)
            layer.values = layer.values.index_select(0, idx).narrow(2, 0, width)

    def truncate(self, lens: Sequence[int]) -> None:
        """Roll every row back to its first ``lens[i]`` committed entries (the rest become hole); crop to the longest.

        Raises:
            ValueError: not one length per row, or a length over the row's own.
        """
        if len(lens) != self.rows or any(int(a) > b or int(a) < 0 for a, b in zip(lens, self.lens)):
            raise ValueError(f"BatchKV.truncate: lengths {list(lens)} for rows holding {self.lens}; give one length "
                             "per row, each at most the row's own")
        self.lens = [int(a) for a in lens]
        width = max(self.lens)
        for layer in self._layers():
            layer.keys, layer.values = layer.keys.narrow(2, 0, width), layer.values.narrow(2, 0, width)

    def commit(self, past: int, keep: Sequence[torch.Tensor]) -> None:
        """After a forward that appended columns from ``past`` on: row i keeps the appended columns ``keep[i]``
        (its accepted tree nodes, root = 0 first, ascending) as its next committed entries (:func:`compact_rows`).

        Raises:
            ValueError: as :func:`compact_rows`.
        """
        if len(keep) == self.rows and all(int(l) == past for l in self.lens) and all(
                k.numel() and int(k[0]) == 0 and int(k[-1]) == k.numel() - 1 for k in keep) and \
                past + max(int(k.numel()) for k in keep) <= self.width:
            # no hole and every row keeps a prefix of its appended columns (an AR step; a batch of one accepting a
            # path laid out in order): the entries are where they belong, only the width is cropped
            width = past + max(int(k.numel()) for k in keep)
            for layer in self._layers():
                layer.keys, layer.values = layer.keys.narrow(2, 0, width), layer.values.narrow(2, 0, width)
            self.lens = [l + int(k.numel()) for l, k in zip(self.lens, keep)]
            return
        for layer in self._layers():
            layer.keys = compact_rows(layer.keys, self.lens, keep, past)
            layer.values = compact_rows(layer.values, self.lens, keep, past)
        self.lens = [l + int(k.numel()) for l, k in zip(self.lens, keep)]


class RowDraftCache(DraftCache):
    """The drafter's context cache for a batch (a :class:`~dartree.models.drafter.DraftCache` over N rows): per
    layer [N, kv_heads, C, d], with row i's context in its columns ``0 .. lens[i] - 1``.

    A batched draft appends the rows' new context padded to the longest; :meth:`commit` then keeps each row's real
    entries. A refilled row starts again from nothing (:meth:`reset_row`).

    Args:
        num_layers: the drafter's layers.
    """

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.lens: list[int] = []

    @property
    def rows(self) -> int:
        """N, the rows held."""
        return len(self.lens)

    @property
    def width(self) -> int:
        """C, the columns of the tensors (0 before the first draft)."""
        return self.length

    def add_row(self) -> None:
        """A new row with no context yet (its features come with its first draft)."""
        if self.keys[0] is not None:
            for store in (self.keys, self.values):
                for i, t in enumerate(store):
                    store[i] = torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)
        self.lens.append(0)

    def reset_row(self, i: int) -> None:
        """Row ``i`` holds a new request: its context is empty again (the old entries become hole, hidden)."""
        self.lens[i] = 0

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order; crop to the longest."""
        self.lens = [self.lens[i] for i in rows]
        if self.keys[0] is None:
            return
        width = max(self.lens, default=0)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                idx = torch.tensor(list(rows), dtype=torch.long, device=t.device)
                store[i] = t.index_select(0, idx).narrow(2, 0, width)

    def commit(self, past: int, counts: Sequence[int]) -> None:
        """After a draft that appended context columns from ``past`` on: row i keeps the first ``counts[i]`` of them
        (its real new context; the rest was padding)."""
        keep = [torch.arange(int(c)) for c in counts]
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = compact_rows(t, self.lens, keep, past)
        self.lens = [l + int(c) for l, c in zip(self.lens, counts)]

"""The KV cache of a running batch, and the one place where rejected tokens are rolled back.

This module is bookkeeping only (columns, keep mask, positions, membership, compaction); running
the model over it (masks, position ids, the forward) is `runner.py`'s job.

Layout: all rows share one column space. Each forward appends W columns to every
row; row b's new tokens occupy the first n_b of them and the rest are holes. A per-row boolean
`keep` mask says which columns hold that row's live tokens, and each row carries its own logical
position (the number of live tokens), so RoPE positions stay exact whatever the holes. Rolling back
a rejected draft token is bookkeeping only: its column becomes a hole. Holes are compacted away when
they outgrow the live tokens. Buffers are preallocated and grow by doubling, so a step writes only
its new columns: nothing proportional to the context is copied per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_RECENT = 64  # columns remembered per row for rollback (more than any step ever rolls back)


class _BufferLayer(CacheLayerMixin):
    """One decoder layer's keys/values: buffers [batch, kv_heads, capacity, head_dim] written in place."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: BatchKV) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        cap = max(self.owner.capacity, 16)
        self.keys = key_states.new_zeros(b, h, cap, d)
        self.values = value_states.new_zeros(b, h, cap, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        end = start + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self._grow(end)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, needed: int) -> None:
        cap = self.keys.shape[-2]
        while cap < needed:
            cap *= 2
        keys = self.keys.new_zeros(*self.keys.shape[:2], cap, self.keys.shape[-1])
        values = self.values.new_zeros(*self.values.shape[:2], cap, self.values.shape[-1])
        keys[:, :, : self.keys.shape[-2]] = self.keys
        values[:, :, : self.values.shape[-2]] = self.values
        self.keys, self.values = keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


@dataclass(frozen=True)
class KVCheckpoint:
    """A `BatchKV`'s bookkeeping at one moment, and references to its buffers then (not copies).

    Restoring it is exact because nothing after the checkpoint rewrites columns below its `length`:
    forwards write only new columns, growth and membership changes allocate new buffers, rollback
    touches only the keep mask (copied here), and compaction (which moves columns in place) is
    deferred while a checkpoint is held.
    """

    rows: list[str]
    length: int
    capacity: int
    keep: torch.Tensor  # a copy
    positions: list[int]
    recent: list[deque[int]]
    buffers: list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]  # per layer: keys, values, initialized


class _BatchCache(Cache):
    def __init__(self, owner: BatchKV, num_layers: int) -> None:
        super().__init__(layers=[_BufferLayer(owner) for _ in range(num_layers)])


class BatchKV:
    """KV cache for the rows of one model's running batch.

    Rows are identified by request id. The model runner (`runner.py`) writes a forward's new columns
    through `cache` and then calls `advance`; `rollback` turns a row's most recent tokens into holes;
    `add_rows`/`remove_rows` change the batch between steps (the only operations that copy the cache).
    """

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.device = device
        self.num_layers = num_layers
        self.rows: list[str] = []
        self.length = 0  # columns used (shared by all rows)
        self.capacity = 16
        self.keep = torch.zeros(0, self.capacity, dtype=torch.bool, device=self.device)  # [batch, capacity]
        self.positions: list[int] = []  # live tokens per row = next RoPE position
        self._recent: list[deque[int]] = []  # per row: columns of its latest live tokens
        self.cache = _BatchCache(self, self.num_layers)
        self._held = False  # a checkpoint is held: compaction waits (it moves columns in place)

    # ---- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def index(self, request_id: str) -> int:
        return self.rows.index(request_id)

    @property
    def live_tokens(self) -> int:
        return sum(self.positions)

    # ---- after a forward -------------------------------------------------------------------------
    def advance(self, counts: list[int], width: int) -> None:
        """Record a forward that appended `width` columns, of which row b's first `counts[b]` are real."""
        self._ensure_capacity(self.length + width)
        steps = torch.arange(width, device=self.device)
        real = steps[None, :] < torch.tensor(counts, device=self.device)[:, None]  # [batch, W]
        self.keep[:, self.length : self.length + width] = real
        for b, n in enumerate(counts):
            self.positions[b] += n
            self._recent[b].extend(range(self.length, self.length + n))
        self.length += width

    # ---- rollback: the one place rejected tokens are undone --------------------------------------
    def rollback(self, row: int, num_tokens: int) -> None:
        """Forget row `row`'s last `num_tokens` live tokens: their columns become holes."""
        for _ in range(num_tokens):
            col = self._recent[row].pop()
            self.keep[row, col] = False
        self.positions[row] -= num_tokens

    # ---- batch membership ------------------------------------------------------------------------
    def add_rows(self, other: BatchKV) -> None:
        """Append `other`'s rows (prefilled separately) to this batch. Copies both caches once."""
        if not self.rows:
            self._adopt(other)
            return
        length = max(self.length, other.length)
        self._ensure_capacity(length)
        other._ensure_capacity(length)
        cap = max(self.capacity, other.capacity)
        self._resize(cap)
        other._resize(cap)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            if not (mine.is_initialized or theirs.is_initialized):
                continue  # neither side has run a forward yet: buffers are created lazily
            like = mine if mine.is_initialized else theirs
            mine.keys = torch.cat([_rows_of(mine, len(self), like.keys), _rows_of(theirs, len(other), like.keys)])
            mine.values = torch.cat(
                [_rows_of(mine, len(self), like.values, "values"), _rows_of(theirs, len(other), like.values, "values")]
            )
            mine.is_initialized = True
        self.keep = torch.cat([self.keep, other.keep], dim=0)
        self.length = length  # columns past a row's own length are holes in its keep mask
        self.rows += other.rows
        self.positions += other.positions
        self._recent += other._recent

    def remove_rows(self, request_ids: set[str]) -> None:
        """Drop rows (finished or aborted). Copies the cache once; nothing when none match."""
        stay = [b for b, rid in enumerate(self.rows) if rid not in request_ids]
        if len(stay) == len(self.rows):
            return
        index = torch.tensor(stay, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        self.keep = self.keep.index_select(0, index)
        self.rows = [self.rows[b] for b in stay]
        self.positions = [self.positions[b] for b in stay]
        self._recent = [self._recent[b] for b in stay]
        if not self.rows:
            self.length = 0
            self.keep[:] = False

    def new_rows(self, request_ids: list[str]) -> BatchKV:
        """An empty cache for rows about to be prefilled and then merged with `add_rows`."""
        fresh = BatchKV(self.num_layers, self.device)
        fresh.rows = list(request_ids)
        fresh.positions = [0] * len(request_ids)
        fresh._recent = [deque(maxlen=_RECENT) for _ in request_ids]
        fresh.keep = torch.zeros(len(request_ids), fresh.capacity, dtype=torch.bool, device=self.device)
        return fresh

    # ---- checkpoints: a step that fails is undone exactly (server/engine/engine.py) ---------------
    def checkpoint(self) -> KVCheckpoint:
        """The cache as it is now; `restore` returns to it, `release` forgets it. Cheap: the keep mask
        and per-row lists are copied, buffers only referenced."""
        self._held = True
        return KVCheckpoint(
            rows=list(self.rows),
            length=self.length,
            capacity=self.capacity,
            keep=self.keep.clone(),
            positions=list(self.positions),
            recent=[deque(r, maxlen=r.maxlen) for r in self._recent],
            buffers=[
                (getattr(layer, "keys", None), getattr(layer, "values", None), layer.is_initialized)
                for layer in self.cache.layers
            ],
        )

    def restore(self, ckpt: KVCheckpoint) -> None:
        """Return to `ckpt` (taken by `checkpoint` on this cache, with no `release` since); it stays held,
        so the same checkpoint can be restored again."""
        self.rows, self.length, self.capacity = list(ckpt.rows), ckpt.length, ckpt.capacity
        self.keep = ckpt.keep.clone()
        self.positions = list(ckpt.positions)
        self._recent = [deque(r, maxlen=r.maxlen) for r in ckpt.recent]
        for layer, (keys, values, initialized) in zip(self.cache.layers, ckpt.buffers, strict=True):
            if initialized:
                layer.keys, layer.values = keys, values
            layer.is_initialized = initialized

    def release(self) -> None:
        """Forget the checkpoint: compaction may run again."""
        self._held = False

    # ---- compaction ------------------------------------------------------------------------------
    def maybe_compact(self) -> None:
        """Squeeze holes out once they outnumber the live columns (amortised: rare and O(cache)).
        Deferred while a checkpoint is held."""
        if self._held:
            return
        longest = max(self.positions, default=0)
        if self.length - longest > max(64, longest):
            self.compact()

    def compact(self) -> None:
        if not self.rows:
            return
        keep = self.keep[:, : self.length]
        longest = int(keep.sum(dim=1).max())
        # Stable order of each row's live columns first, holes after: argsort on (not keep) is stable.
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :longest]  # [batch, longest]
        for layer in self.cache.layers:
            if layer.is_initialized:
                idx = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys[:, :, :longest] = layer.keys.gather(2, idx)
                layer.values[:, :, :longest] = layer.values.gather(2, idx)
        new_keep = keep.gather(1, order)
        # A live column's new index is its rank among the row's live columns.
        rank = torch.cumsum(keep.to(torch.long), dim=1) - 1  # [batch, length]
        rank_rows = rank.tolist()
        self._recent = [deque((rank_rows[b][c] for c in rec), maxlen=_RECENT) for b, rec in enumerate(self._recent)]
        self.keep[:] = False
        self.keep[:, :longest] = new_keep
        self.length = longest

    # ---- storage ---------------------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            cap = self.capacity
            while cap < needed:
                cap *= 2
            self._resize(cap)

    def _resize(self, cap: int) -> None:
        """Grow the keep mask and the KV buffers to `cap` columns (doubling keeps this amortised O(1))."""
        if cap <= self.capacity:
            return
        keep = torch.zeros(self.keep.shape[0], cap, dtype=torch.bool, device=self.device)
        keep[:, : self.capacity] = self.keep
        self.keep = keep
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.shape[-2] < cap:
                layer._grow(cap)
        self.capacity = cap

    def _adopt(self, other: BatchKV) -> None:
        self.rows, self.positions, self._recent = other.rows, other.positions, other._recent
        self.keep, self.length, self.capacity = other.keep, other.length, other.capacity
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys, mine.values, mine.is_initialized = theirs.keys, theirs.values, theirs.is_initialized


def _rows_of(layer: _BufferLayer, rows: int, like: torch.Tensor, which: str = "keys") -> torch.Tensor:
    """A layer's buffer, or zeros shaped like `like` for `rows` rows when it never ran a forward."""
    if layer.is_initialized:
        return getattr(layer, which)
    return like.new_zeros(rows, *like.shape[1:])

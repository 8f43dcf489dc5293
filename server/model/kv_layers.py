"""The batch KV cache as transformers' `Cache` sees it: per decoder layer, keys and values as views
[rows, kv_heads, capacity, head_dim] of one flat buffer each (server/model/kv_cache.py `BatchKV` owns the
bookkeeping: columns, keep mask, positions; this module owns the buffers and how rows and columns move
inside them)."""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from server.model.attention import Packing


class BatchKV(Protocol):
    """What a layer reads of the cache that owns it (server/model/kv_cache.py `BatchKV`)."""

    rows: list[str]
    capacity: int
    length: int
    slots: int | None
    packing: Packing | None


class KVBudgetExceeded(RuntimeError):
    """A budgeted cache was asked for more than its slots (admission should have prevented it)."""


class BufferLayer(CacheLayerMixin):
    """One decoder layer's keys/values: views [batch, kv_heads, capacity, head_dim] of flat buffers."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: BatchKV) -> None:
        super().__init__()
        # A weak reference: the cache holds its layers, so a strong one would make every `BatchKV` a
        # reference cycle, whose buffers (a join's prefill cache: tens of MB) wait for the cyclic garbage
        # collector instead of being freed when the last reference goes.
        self._owner = weakref.ref(owner)
        self.key_store: torch.Tensor | None = None  # flat
        self.value_store: torch.Tensor | None = None
        self.heads = self.head_dim = self.value_dim = 0

    @property
    def owner(self) -> BatchKV:
        owner = self._owner()
        assert owner is not None, "a cache layer outlived its cache"
        return owner

    def allocate(self, heads: int, head_dim: int, value_dim: int, like: torch.Tensor, slots: int) -> None:
        """Zeroed flat buffers of `slots` tokens (zeroing makes a budget's pages resident at once)."""
        self.heads, self.head_dim, self.value_dim = heads, head_dim, value_dim
        self.key_store = torch.zeros(slots * heads * head_dim, dtype=like.dtype, device=like.device)
        self.value_store = torch.zeros(slots * heads * value_dim, dtype=like.dtype, device=like.device)
        self.is_initialized = True
        self.view(len(self.owner.rows), self.owner.capacity)

    @property
    def slots(self) -> int:
        return 0 if self.key_store is None else self.key_store.numel() // (self.heads * self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's storage (allocated, whether rows use it or not)."""
        return sum(s.numel() * s.element_size() for s in (self.key_store, self.value_store) if s is not None)

    def free(self) -> None:
        """Drop the storage, and the views of it (a view alone keeps the whole buffer alive)."""
        self.key_store = self.value_store = self.keys = self.values = None
        self.is_initialized = False

    def view(self, rows: int, capacity: int) -> None:
        h = self.heads
        self.keys = self.key_store[: rows * h * capacity * self.head_dim].view(rows, h, capacity, self.head_dim)
        self.values = self.value_store[: rows * h * capacity * self.value_dim].view(rows, h, capacity, self.value_dim)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        owner = self.owner
        slots = owner.slots or len(owner.rows) * owner.capacity
        self.allocate(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states, slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        pack = self.owner.packing
        end = start + (pack.width if pack is not None else key_states.shape[-2])
        if end > self.owner.capacity:
            raise KVBudgetExceeded("a forward wrote past the reserved columns (runner.forward reserves them)")
        if pack is not None:  # packed [1, kv_heads, N, d]: each token into its row's column
            self.keys[pack.rows, :, start + pack.steps] = key_states[0].transpose(0, 1)
            self.values[pack.rows, :, start + pack.steps] = value_states[0].transpose(0, 1)
        else:
            self.keys[:, :, start:end] = key_states
            self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1

    def relayout(self, rows_from: list[int], capacity: int, rows: int, cols: int) -> None:
        """Row i < len(rows_from) of the new layout [rows, heads, capacity] takes columns [:cols] of old row
        rows_from[i] (ascending); rows after that are left for the caller. Moves inside the buffer
        when it is big enough (in an order that never overwrites a block not yet moved), else into a
        new buffer at least twice as big (unbudgeted: rows joining one at a time would otherwise copy
        every row already there at each join)."""
        old_k, old_v = self.keys, self.values
        needed = rows * capacity
        if needed > self.slots:
            if self.owner.slots is not None:
                raise KVBudgetExceeded(f"{rows} rows x {capacity} columns exceed the cache's {self.owner.slots} slots")
            like, slots = self.key_store, max(needed, 2 * self.slots)
            self.key_store = like.new_zeros(slots * self.heads * self.head_dim)
            self.value_store = like.new_zeros(slots * self.heads * self.value_dim)
            self.view(rows, capacity)
            for i, b in enumerate(rows_from):
                self.keys[i, :, :cols] = old_k[b, :, :cols]
                self.values[i, :, :cols] = old_v[b, :, :cols]
            return
        # In place. 1: rows move down at the old capacity (a destination block lies below its source).
        for i, b in enumerate(rows_from):
            if i != b:
                old_k[i, :, :cols] = old_k[b, :, :cols]
                old_v[i, :, :cols] = old_v[b, :, :cols]
        n, cap = len(rows_from), old_k.shape[2]
        self.view(rows, capacity)
        if capacity != cap and n and cols:
            # 2: a new row stride. Growing, rows move up: last first; shrinking, down: first first, so no
            # row is overwritten before it moved. Each row is cloned, as its old and new places may overlap.
            for r in reversed(range(n)) if capacity > cap else range(n):
                self.keys[r, :, :cols] = old_k[r, :, :cols].clone()
                self.values[r, :, :cols] = old_v[r, :, :cols].clone()


class BatchCache(Cache):
    """The `Cache` a forward writes through: one `BufferLayer` per decoder layer."""

    def __init__(self, owner: BatchKV, num_layers: int) -> None:
        super().__init__(layers=[BufferLayer(owner) for _ in range(num_layers)])

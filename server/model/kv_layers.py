"""The batch KV cache as transformers' `Cache` sees it: per decoder layer, keys and values as views
[rows, kv_heads, capacity, head_dim] of one flat buffer each (server/model/kv_cache.py `BatchKV` owns the
bookkeeping: columns, keep mask, positions; this module owns the buffers and how rows and columns move
inside them)."""

from __future__ import annotations

import mmap
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
    columns: int | None
    packing: Packing | None
    dtype: torch.dtype | None  # what the buffers hold (None: the first forward's dtype)


class KVBudgetExceeded(RuntimeError):
    """A budgeted cache was asked for more than its slots (admission should have prevented it)."""


LAZY_BYTES = 1 << 20  # a CPU buffer this large or larger is mapped (`zeroed`); smaller ones come from the allocator


def zeroed(numel: int, like: torch.Tensor, *, resident: bool = False) -> torch.Tensor:
    """A flat buffer of `numel` zeros of `like`'s dtype, on its device.

    On a CPU a large one, unless `resident`, is an anonymous private memory mapping: the kernel's zero pages.
    Allocating it then costs no memset and touches no page; a page becomes memory when something is written
    into it (reading an untouched one reads the shared zero page), and every page goes back to the system
    when the buffer is freed. An unbudgeted cache growing to a long prompt's columns gives every row those
    columns: zeroing them all (torch.zeros) took most of a growth's time (2,048 -> 4,096 columns for 5 rows
    of SmolLM2-135M: 0.3 s, 943 MB zeroed), and the rows that are short never use them."""
    nbytes = numel * like.element_size()
    if not resident and like.device.type == "cpu" and nbytes >= LAZY_BYTES:
        try:
            pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return torch.frombuffer(pages, dtype=like.dtype, count=numel)
        except (OSError, ValueError, TypeError):  # no mapping (limits) or a dtype frombuffer lacks: the allocator
            pass
    return torch.zeros(numel, dtype=like.dtype, device=like.device)


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
        """Zeroed flat buffers of `slots` tokens: a budget's resident at once (zeroed now), an unbudgeted cache's
        and a pinned one's (its rows sized for a whole context each) pages as its forwards write them (`zeroed`)."""
        self.heads, self.head_dim, self.value_dim = heads, head_dim, value_dim
        resident = self.owner.slots is not None and self.owner.columns is None
        self.key_store = zeroed(slots * heads * head_dim, like, resident=resident)
        self.value_store = zeroed(slots * heads * value_dim, like, resident=resident)
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
        like = key_states if owner.dtype in (None, key_states.dtype) else key_states.new_empty(0, dtype=owner.dtype)
        self.allocate(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], like, slots)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        computed = key_states.dtype
        if self.keys.dtype != computed:  # a narrower cache (kv_cache_dtype): rounded to nearest when written
            key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.keys.dtype)
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
        if self.keys.dtype != computed:  # attention reads every key and value as written, its own tokens' too
            return self.keys[:, :, :end].to(computed), self.values[:, :, :end].to(computed)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1

    def relayout(
        self, rows_from: list[int], capacity: int, rows: int, cols: int, live: list[torch.Tensor | None] | None = None
    ) -> None:
        """Row i < len(rows_from) of the new layout [rows, heads, capacity] takes columns [:cols] of old row
        rows_from[i] (ascending); rows after that are left for the caller. `live[i]`, when given and not None:
        the only columns of that row worth moving (its live tokens; the others are holes, whose contents no
        forward reads unmasked), copied alone. Moves inside the buffer when it is big enough (in an order that
        never overwrites a block not yet moved), else into a new buffer at least twice as big (unbudgeted:
        rows joining one at a time would otherwise copy every row already there at each join). Whatever a
        row's holes then hold is finite: zeros or keys and values written before."""
        old_k, old_v = self.keys, self.values
        needed = rows * capacity
        which = live if live is not None else [None] * len(rows_from)
        if needed > self.slots:
            if self.owner.slots is not None:
                raise KVBudgetExceeded(f"{rows} rows x {capacity} columns exceed the cache's {self.owner.slots} slots")
            like, slots = self.key_store, max(needed, 2 * self.slots)
            self.key_store = zeroed(slots * self.heads * self.head_dim, like)
            self.value_store = zeroed(slots * self.heads * self.value_dim, like)
            self.view(rows, capacity)
            for i, (b, columns) in enumerate(zip(rows_from, which, strict=True)):
                _move(self.keys[i], old_k[b], cols, columns)
                _move(self.values[i], old_v[b], cols, columns)
            return
        # In place. 1: rows move down at the old capacity (a destination block lies below its source).
        for i, (b, columns) in enumerate(zip(rows_from, which, strict=True)):
            if i != b:
                _move(old_k[i], old_k[b], cols, columns)
                _move(old_v[i], old_v[b], cols, columns)
        n, cap = len(rows_from), old_k.shape[2]
        self.view(rows, capacity)
        if capacity != cap and n and cols:
            # 2: a new row stride. Growing, rows move up: last first; shrinking, down: first first, so no
            # row is overwritten before it moved. Each row is copied out first, as its old and new places may
            # overlap.
            for r in reversed(range(n)) if capacity > cap else range(n):
                _move(self.keys[r], old_k[r], cols, which[r], copy=True)
                _move(self.values[r], old_v[r], cols, which[r], copy=True)


def _move(dst: torch.Tensor, src: torch.Tensor, cols: int, columns: torch.Tensor | None, copy: bool = False) -> None:
    """One row's keys or values ([heads, capacity, dim]) into another place: columns [:cols], or only `columns`
    (`copy`: read out before writing, where the two places may overlap; a gather always is)."""
    if columns is None:
        dst[:, :cols] = src[:, :cols].clone() if copy else src[:, :cols]
    elif len(columns):
        dst.index_copy_(1, columns, src.index_select(1, columns))


class BatchCache(Cache):
    """The `Cache` a forward writes through: one `BufferLayer` per decoder layer."""

    def __init__(self, owner: BatchKV, num_layers: int) -> None:
        super().__init__(layers=[BufferLayer(owner) for _ in range(num_layers)])

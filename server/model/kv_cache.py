"""The KV cache of a running batch, and the one place where rejected tokens are rolled back.

This module is bookkeeping only (columns, keep mask, positions, membership, compaction, storage);
running the model over it (masks, position ids, the forward) is `runner.py`'s job.

Layout: all rows share one column space. Each forward appends W columns to every row; row b's new
tokens occupy the first n_b of them and the rest are holes (a packed forward, `attention.Packing`,
writes only those n_b columns). A per-row boolean `keep` mask says which
columns hold that row's live tokens, and each row carries its own logical position (the number of
live tokens), so RoPE positions stay exact whatever the holes. Rolling back a rejected draft token is
bookkeeping only: its column becomes a hole. Holes are compacted away when they outgrow the live
tokens, or when a forward would not fit otherwise.

Storage: per layer, one flat buffer for keys and one for values; `keys`/`values` are views
[rows, kv_heads, capacity, head_dim] of its start, so a step writes only its new columns and nothing
proportional to the context is copied per step. Joins, leaves and capacity changes move rows and
columns inside the buffer (`relayout`). Without a budget the buffer grows (doubling, in columns and in
rows: requests join one at a time) as needed. With
a budget (`slots`: token slots, from `kv_cache_memory`) it is allocated and zeroed once, up front, and
never grows: rows x capacity <= slots, which admission guarantees (`fits`; server/engine/admission.py). With pinned
`columns` as well (static-shape steps, server/model/static_step.py) the capacity never changes either: every
row has those columns, so a row's keys and values always sit at the same place of the same storage, whatever
joins, leaves or compacts, and a pass captured once for R rows reads and writes the right memory ever after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.model.attention import Packing
from server.model.kv_layers import BatchCache, KVBudgetExceeded
from server.model.kv_shape import KVShape

_RECENT = 64  # columns remembered per row for rollback (more than any step ever rolls back)


@dataclass(frozen=True)
class KVCheckpoint:
    """A `BatchKV`'s bookkeeping at one moment (server/engine/isolation.py undoes a failed step with it).

    Buffers are not copied: nothing after the checkpoint loses the data of the live columns then.
    Forwards write only new columns; growth and membership changes move columns without reordering
    them; rollback (within a step, of that step's tokens only) touches the keep mask; compaction
    reorders columns but keeps each row's live tokens in order, so after one the checkpoint's live
    tokens are each row's first `positions[b]` columns.
    """

    rows: list[str]
    length: int
    keep: torch.Tensor  # a copy, [rows, its capacity]
    positions: list[int]
    recent: list[deque[int]]
    compactions: int


class BatchKV:
    """KV cache for the rows of one model's running batch.

    Rows are identified by request id. The model runner (`runner.py`) reserves a forward's columns
    (`reserve`), writes them through `cache` and then calls `advance`; `rollback` turns a row's most
    recent tokens into holes; `add_rows`/`remove_rows` change the batch between steps.

    `slots` (a budget in tokens: rows x capacity never exceed it) with `shape` allocates the storage
    once, now; without, storage is allocated at the first forward and grows as needed.
    """

    def __init__(
        self, num_layers: int, device: torch.device, slots: int | None = None, shape: KVShape | None = None,
        *, dtype: torch.dtype | None = None, columns: int | None = None,
    ) -> None:
        """`dtype`: what the buffers hold (`shape`'s when given; None: the first forward's). Narrower than the
        model computes (the `kv_cache_dtype` setting, kv_shape.py `kv_precision`), keys and values are rounded to
        it when written and read back widened (kv_layers.py); readers of live tokens (`live`: what the prefix
        cache stores) get it as it is."""
        self.device = device
        self.num_layers = num_layers
        self.slots = slots
        self.dtype = shape.dtype if shape is not None else dtype
        self.rows: list[str] = []
        self.length = 0  # columns used (shared by all rows)
        self.capacity = 16
        self.keep = torch.zeros(0, self.capacity, dtype=torch.bool, device=self.device)  # [batch, capacity]
        self.positions: list[int] = []  # live tokens per row = next RoPE position
        self._recent: list[deque[int]] = []  # per row: columns of its latest live tokens
        self.cache = BatchCache(self, self.num_layers)  # kv_layers.py: transformers' view
        self.packing: Packing | None = None  # the running forward's packed layout (runner.py sets it)
        self._compactions = 0
        # `columns`: every row's capacity, fixed (a budget of slots // columns rows of it); None: it moves
        self.columns = columns
        if columns is not None and (slots is None or not 0 < columns <= slots):
            raise ValueError("pinned columns need a budget of at least one row of them")
        if slots is not None:
            if shape is None:
                raise ValueError("a budgeted cache needs the model's KV shape")
            self.capacity = columns or slots
            self.keep = torch.zeros(0, self.capacity, dtype=torch.bool, device=self.device)
            like = torch.empty(0, dtype=shape.dtype, device=device)
            for layer in self.cache.layers:
                layer.allocate(shape.kv_heads, shape.head_dim, shape.value_dim, like, slots)

    # ---- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def index(self, request_id: str) -> int:
        return self.rows.index(request_id)

    @property
    def live_tokens(self) -> int:
        return sum(self.positions)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's storage: allocated, whether rows use it or not (a budget's from the start)."""
        return sum(layer.nbytes for layer in self.cache.layers)

    def storage(self) -> list[torch.Tensor]:
        """The flat buffers behind the cache (`nbytes` of them)."""
        return [s for layer in self.cache.layers for s in (layer.key_store, layer.value_store) if s is not None]

    # ---- a forward -------------------------------------------------------------------------------
    def reserve(self, width: int) -> None:
        """Make room for a forward that appends `width` columns: compact holes when they outgrow the
        live tokens or when that is what makes it fit, grow when needed (within the budget)."""
        longest = max(self.positions, default=0)
        if self.length - longest > max(64, longest):
            self.compact()
        if self.length + width <= self.capacity:
            return
        if self.slots is not None and self.length + width > self.row_columns(len(self)):
            self.compact()
        self._ensure_capacity(self.length + width)

    def expect(self, columns: int) -> None:
        """The rows will append at least `columns` more columns (a long prompt entered: every step appends its
        width to every row, so its chunks alone take that many): grow once to hold them, rather than doubling
        on the way and moving every row at each doubling. Unbudgeted only (a budget's capacity is fixed); on a
        CPU the columns not written yet are no memory (kv_layers.zeroed)."""
        if self.slots is None and self.rows and columns > 0:
            self._ensure_capacity(self.length + columns)

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

    def visible(self, counts: list[int], width: int, rows: int | None = None, span: int | None = None) -> torch.Tensor:
        """[rows, W, span] bool: the columns each of a forward's W new positions attends, row b feeding `counts[b]`
        real tokens at columns [length, length + W): the row's live columns, its real new tokens up to itself, and
        its own column (a padding query too, so no softmax row is empty). `rows` past the batch's (a static pass's
        padding, static_step.py) see their own column only; `span` (default length + W) the columns covered."""
        batch, length = len(self.rows), self.length
        rows = batch if rows is None else rows
        span = length + width if span is None else span
        if width == 1 and rows == batch and span == length + 1:  # a step of one token a row: live columns and its own
            own = torch.ones(batch, 1, dtype=torch.bool, device=self.device)
            return torch.cat([self.keep[:, :length], own], dim=-1)[:, None]
        allowed = torch.zeros(rows, width, span, dtype=torch.bool, device=self.device)
        allowed[:batch, :, :length] = self.keep[:, None, :length]
        steps = torch.arange(width, device=self.device)
        real = torch.zeros(rows, dtype=torch.long, device=self.device)
        real[:batch] = torch.tensor(counts, dtype=torch.long, device=self.device)
        causal = (steps[None, :] <= steps[:, None])[None] & (steps[None, None, :] < real[:, None, None])  # [R, W, W]
        allowed[:, :, length : length + width] = causal | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        return allowed

    # ---- rollback: the one place rejected tokens are undone --------------------------------------
    def rollback(self, row: int, num_tokens: int) -> None:
        """Forget row `row`'s last `num_tokens` live tokens: their columns become holes."""
        for _ in range(num_tokens):
            col = self._recent[row].pop()
            self.keep[row, col] = False
        self.positions[row] -= num_tokens

    # ---- batch membership ------------------------------------------------------------------------
    def add_rows(self, other: BatchKV) -> None:
        """Append `other`'s rows (prefilled separately, unbudgeted) to this batch: one copy of them."""
        rows = len(self) + len(other)
        if self.slots is not None and max(self.length, other.length) > self.row_columns(rows):
            self.compact()  # the batch's columns must fit the budget's share of each row
        length = max(self.length, other.length)
        capacity = self._capacity_for(length, rows)
        mine = list(range(len(self)))
        live = self._live_columns(mine)
        for layer, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            if not theirs.is_initialized:  # they prefilled nothing: their rows are all holes
                if layer.is_initialized:
                    layer.relayout(mine, capacity, rows, self.length, live)
                continue
            if not layer.is_initialized:
                layer.allocate(theirs.heads, theirs.head_dim, theirs.value_dim, theirs.key_store, rows * capacity)
            layer.relayout(mine, capacity, rows, self.length, live)
            layer.keys[len(self) :, :, : other.length] = theirs.keys[:, :, : other.length]
            layer.values[len(self) :, :, : other.length] = theirs.values[:, :, : other.length]
        self.keep = torch.cat([_columns(self.keep, capacity), _columns(other.keep, capacity)])
        self.capacity = capacity
        self.length = length  # columns past a row's own length are holes in its keep mask
        self.rows += other.rows
        self.positions += other.positions
        self._recent += other._recent

    def remove_rows(self, request_ids: set[str]) -> None:
        """Drop rows (finished or aborted): the rows after them move down; nothing when none match."""
        stay = [b for b, rid in enumerate(self.rows) if rid not in request_ids]
        if len(stay) == len(self.rows):
            return
        live = self._live_columns(stay)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.relayout(stay, self.capacity, len(stay), self.length, live)
        self.keep = self.keep[stay].clone()
        self.rows = [self.rows[b] for b in stay]
        self.positions = [self.positions[b] for b in stay]
        self._recent = [self._recent[b] for b in stay]
        if not self.rows:
            self.length = 0
            self.keep[:] = False
            if self.slots is None:  # an idle unbudgeted cache holds no memory
                for layer in self.cache.layers:
                    layer.free()
                self.capacity = 16
                self.keep = torch.zeros(0, self.capacity, dtype=torch.bool, device=self.device)

    def new_rows(self, request_ids: list[str], columns: int = 0) -> BatchKV:
        """An empty, unbudgeted cache for rows about to be prefilled and then merged with `add_rows`;
        `columns`: what the longest of them will hold, allocated at once (not doubled on the way there:
        this scratch copy of the prompts is working memory beside the batch's cache)."""
        fresh = BatchKV(self.num_layers, self.device, dtype=self.dtype)
        fresh.capacity = max(fresh.capacity, columns)
        fresh.rows = list(request_ids)
        fresh.positions = [0] * len(request_ids)
        fresh._recent = [deque(maxlen=_RECENT) for _ in request_ids]
        fresh.keep = torch.zeros(len(request_ids), fresh.capacity, dtype=torch.bool, device=self.device)
        return fresh

    def load_prefixes(self, prefixes: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Give the rows of a fresh cache (`new_rows`, nothing fed yet) their first tokens' keys and values,
        computed before (server/model/prefix_cache.py): row b's [layers, kv_heads, p_b, head_dim] pair, or
        None. Row b then holds p_b live tokens in columns [0, p_b); the others' columns there are holes."""
        assert self.length == 0 and len(prefixes) == len(self.rows), "prefixes load into a fresh cache"
        longest = max((kv[0].shape[2] for kv in prefixes if kv is not None), default=0)
        if longest == 0:
            return
        rows = len(self.rows)
        self.capacity = self._capacity_for(longest, rows)
        self.keep = _columns(self.keep, self.capacity)
        keys, values = next(kv for kv in prefixes if kv is not None)
        like = torch.empty(0, dtype=self.dtype or keys.dtype, device=self.device)
        for layer in self.cache.layers:
            layer.allocate(keys.shape[1], keys.shape[3], values.shape[3], like, rows * self.capacity)
        for b, kv in enumerate(prefixes):
            if kv is None:
                continue
            n = kv[0].shape[2]
            for i, layer in enumerate(self.cache.layers):
                layer.keys[b, :, :n] = kv[0][i]
                layer.values[b, :, :n] = kv[1][i]
            self.keep[b, :n] = True
            self.positions[b] = n
        self.length = longest

    def live(self, row: int) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """A reader of row `row`'s keys and values at its live token positions [start, end) (in order,
        whatever holes lie between them): [layers, kv_heads, end - start, head_dim] each, copies, in the cache's
        dtype."""
        found: list[torch.Tensor] = []  # the row's live columns, found at the first read

        def read(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not found:
                found.append(self.keep[row, : self.length].nonzero().flatten())
            columns = found[0]
            if not 0 <= start < end <= len(columns):
                raise ValueError(f"row {row} holds {len(columns)} live tokens, not [{start}, {end})")
            cols = columns[start:end]
            layers = self.cache.layers
            return (torch.stack([layer.keys[row, :, cols] for layer in layers]),
                    torch.stack([layer.values[row, :, cols] for layer in layers]))

        return read

    # ---- checkpoints: a failed step is undone exactly (server/engine/isolation.py) ---------------
    def checkpoint(self) -> KVCheckpoint:
        """The cache's bookkeeping now (see `KVCheckpoint`); cheap: the keep mask and per-row lists."""
        return KVCheckpoint(
            rows=list(self.rows),
            length=self.length,
            keep=self.keep.clone(),
            positions=list(self.positions),
            recent=[deque(r, maxlen=r.maxlen) for r in self._recent],
            compactions=self._compactions,
        )

    def restore(self, ckpt: KVCheckpoint) -> None:
        """Return to `ckpt`. Since it was taken, rows may only have been appended (a proposer's lazy
        join), never removed; it can be restored again."""
        n = len(ckpt.rows)
        assert self.rows[:n] == ckpt.rows, "rows left the cache since the checkpoint"
        if len(self.rows) > n:  # rows that joined since: the first n rows stay where they are
            for layer in self.cache.layers:
                if layer.is_initialized:
                    layer.view(n, self.capacity)
            self.rows = self.rows[:n]
        keep = torch.zeros(n, self.capacity, dtype=torch.bool, device=self.device)
        if self._compactions != ckpt.compactions:  # the checkpoint's live tokens are each row's first
            keep = torch.arange(self.capacity, device=self.device)[None, :] < torch.tensor(
                ckpt.positions, dtype=torch.long, device=self.device
            ).reshape(n, 1)
            self.length = max(ckpt.positions, default=0)
            self._recent = [deque(range(max(0, p - _RECENT), p), maxlen=_RECENT) for p in ckpt.positions]
        else:
            cols = min(self.capacity, ckpt.keep.shape[1])
            keep[:, :cols] = ckpt.keep[:, :cols]
            self.length = ckpt.length
            self._recent = [deque(r, maxlen=r.maxlen) for r in ckpt.recent]
        self.keep = keep
        self.positions = list(ckpt.positions)

    # ---- compaction ------------------------------------------------------------------------------
    def maybe_compact(self) -> None:
        """Squeeze holes out once they outnumber the live columns (amortised: rare and O(cache))."""
        longest = max(self.positions, default=0)
        if self.length - longest > max(64, longest):
            self.compact()

    def compact(self) -> None:
        """Move each row's live columns to its first columns, in order (one row at a time, so the extra
        memory is one row's keys and values)."""
        if not self.rows:
            return
        keep = self.keep[:, : self.length]
        longest = int(keep.sum(dim=1).max())
        # Stable order of each row's live columns first, holes after: argsort on (not keep) is stable.
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :longest]  # [batch, longest]
        for layer in self.cache.layers:
            if layer.is_initialized:
                for b in range(len(self.rows)):
                    layer.keys[b, :, :longest] = layer.keys[b, :, order[b]]
                    layer.values[b, :, :longest] = layer.values[b, :, order[b]]
        new_keep = keep.gather(1, order)
        # A live column's new index is its rank among the row's live columns.
        rank = torch.cumsum(keep.to(torch.long), dim=1) - 1  # [batch, length]
        rank_rows = rank.tolist()
        self._recent = [deque((rank_rows[b][c] for c in rec), maxlen=_RECENT) for b, rec in enumerate(self._recent)]
        self.keep[:] = False
        self.keep[:, :longest] = new_keep
        self.length = longest
        self._compactions += 1

    # ---- storage ---------------------------------------------------------------------------------
    def _live_columns(self, rows: list[int], cols: int | None = None) -> list[torch.Tensor | None]:
        """For moving rows (`relayout`): per row, its live columns below `cols` (default: the columns used)
        where holes are most of them, so a move copies its tokens alone; None where a row is mostly live (one
        contiguous copy of them all is cheaper). While a long prompt is computed every row gets its columns,
        and a short row beside it is mostly holes: moving each row whole when another left copied every later
        row's share of the long prompt's columns (0.2-0.3 s a leave with 4 chats beside a 2,000-token prompt)."""
        cols = self.length if cols is None else cols
        out: list[torch.Tensor | None] = []
        for b in rows:
            columns = self.keep[b, :cols].nonzero().flatten()
            out.append(columns if 2 * len(columns) < cols else None)
        return out

    def row_columns(self, rows: int) -> int:
        """The most columns each of `rows` rows can have within the budget (the pinned columns, when pinned)."""
        assert self.slots is not None, "an unbudgeted cache grows"
        if self.columns is not None:
            if rows * self.columns > self.slots:
                raise KVBudgetExceeded(f"{rows} rows of {self.columns} columns exceed the cache's {self.slots} slots")
            return self.columns
        return self.slots // max(rows, 1)

    def _capacity_for(self, needed: int, rows: int) -> int:
        """Columns per row for `rows` rows needing `needed` columns: doubling (amortised), within the budget;
        the pinned columns, when pinned."""
        if self.columns is not None:
            if needed > self.row_columns(rows):
                raise KVBudgetExceeded(f"{needed} columns a row: over the cache's pinned {self.columns}")
            return self.columns
        cap = self.capacity
        while cap < needed:
            cap *= 2
        if self.slots is not None:
            cap = min(cap, self.slots // max(rows, 1)) if needed <= self.slots // max(rows, 1) else needed
            if rows * cap > self.slots:
                raise KVBudgetExceeded(f"{rows} rows need {needed} columns each: over the {self.slots} slots")
        return cap

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            self._resize(self._capacity_for(needed, len(self)))

    def _resize(self, cap: int) -> None:
        """Give every row `cap` columns (moving them inside the storage, or into a bigger one)."""
        if cap == self.capacity:
            return
        rows = list(range(len(self)))
        cols = min(self.length, cap)
        live = self._live_columns(rows, cols)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.relayout(rows, cap, len(rows), cols, live)
        self.keep = _columns(self.keep, cap)
        self.capacity = cap


def _columns(keep: torch.Tensor, cap: int) -> torch.Tensor:
    """A keep mask cut or padded (with holes) to `cap` columns."""
    out = torch.zeros(keep.shape[0], cap, dtype=torch.bool, device=keep.device)
    cols = min(cap, keep.shape[1])
    out[:, :cols] = keep[:, :cols]
    return out

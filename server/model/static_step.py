"""Static-shape passes: decode steps and verify passes at a few fixed shapes, replayed (the `compile` setting).

An eager forward costs its operations' dispatch on every pass: on a GPU, where a small model's kernels take
microseconds, a step of SmolLM2-135M in bf16 took ~21-25 ms of Python and launches for ~20 us of attention. A
CUDA graph records a pass's kernels once and replays them with one launch, but only for fixed shapes and fixed
memory. So here a pass's shape is one of a few buckets: its rows padded up to 1, 2, 4, ... (`ROW_BUCKETS`, up to
the batch's most rows) and its tokens per row padded to the widest row's, up to `max_width` (a verify pass's K + 1).
Every per-pass input is copied into that bucket's own buffers (token ids, positions, the additive mask, the columns
the pass writes); the cache is a `BatchKV` with pinned columns (kv_cache.py), whose rows never move in memory, and
the pass attends over all of its columns (the mask hides the holes and the columns not written yet). A padded row
is a row of the storage no request holds; padded tokens of a real row write columns that become holes, as an eager
padded pass's do.

Where the pass replays from (`mode`): on CUDA a `torch.cuda.CUDAGraph` per bucket, captured at start-up
(`capture`, while `/health` says loading) or at a bucket's first use, in one memory pool. Elsewhere nothing
replays, and padding would only cost (`fixed` off): a pass runs at its own rows, width and the columns it reaches,
through the same buffers and cache writes, and passes whose rows feed unequal numbers of tokens stay eager (packed).
The tests run the fixed shapes on the CPU too: the padding, the buffers and the replay after rows leave or join are
what a graph relies on. On a CPU the C decoder (cpu_decoder.py) already runs every pass of a block-quantized model
as one call, so a model it serves keeps it (`StaticStep.build` says why not).

What a static pass cannot take runs eagerly, with the same cache: prompt chunks wider than `max_width`, more rows
than the largest bucket, fed embeddings (a draft head's chain), every layer's features. The outputs are copies,
taken right after the replay: the graphs share one memory pool, so a graph's outputs may sit where another's
replay works.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from server.model.lean_forward import LeanForward

if TYPE_CHECKING:
    from server.model.kv_cache import BatchKV

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def rows_bucket(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `rows` rows (None: more than the largest)."""
    return next((b for b in buckets if b >= rows), None)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """The row buckets for a batch of up to `max_rows` rows: powers of two up to the first that holds them."""
    top = rows_bucket(max_rows, ROW_BUCKETS)
    if top is None:
        raise ValueError(f"static-shape passes take up to {ROW_BUCKETS[-1]} rows, not {max_rows}")
    return tuple(b for b in ROW_BUCKETS if b <= top)


class _Columns:
    """The cache as a static pass writes it: each layer's keys and values viewed [R, kv_heads, C, d] of the pinned
    cache's storage, the pass's keys and values written at the columns in `cols` (a tensor, so one recorded pass
    writes wherever a step's columns are), the first `span` columns read (the mask decides which count)."""

    def __init__(self, kv: BatchKV, rows: int, cols: torch.Tensor, span: int) -> None:
        self.cols = cols
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        columns = kv.columns
        for layer in kv.cache.layers:
            h, d, dv = layer.heads, layer.head_dim, layer.value_dim
            self.keys.append(layer.key_store[: rows * h * columns * d].view(rows, h, columns, d)[:, :, :span])
            self.values.append(layer.value_store[: rows * h * columns * dv].view(rows, h, columns, dv)[:, :, :span])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, i: int, *args, **kwargs):
        keys, values = self.keys[i], self.values[i]
        computed = key_states.dtype
        keys.index_copy_(2, self.cols, key_states.to(keys.dtype))  # a narrower cache: rounded to nearest
        values.index_copy_(2, self.cols, value_states.to(values.dtype))
        if keys.dtype != computed:
            return keys.to(computed), values.to(computed)
        return keys, values


@dataclass(eq=False, repr=False)
class _Bucket:
    """One shape's buffers (inputs it reads, outputs it writes) and, on CUDA, its recorded graph."""

    rows: int
    width: int
    span: int  # the columns attended: all the pinned ones where shapes are fixed, else those this pass reaches
    ids: torch.Tensor  # [R, W] long
    positions: torch.Tensor  # [R, W] long
    mask: torch.Tensor  # [R, 1, W, span] additive
    cols: torch.Tensor  # [W] long: the columns the pass writes
    logits: torch.Tensor | None = None  # [R, W, vocab], set by the first run (a graph's own, replayed into)
    hidden: torch.Tensor | None = None  # [R, W, hidden]
    graph: object | None = None  # torch.cuda.CUDAGraph
    replays: int = 0


@dataclass
class StaticOutput:
    logits: torch.Tensor  # [rows, W, vocab]: copies of the real rows'
    hidden: torch.Tensor  # [rows, W, hidden]


@dataclass(eq=False, repr=False)
class StaticStep:
    """Passes of a runner's model over its pinned cache at the shapes `rows` x `widths` (see the module doc)."""

    call: LeanForward
    kv: BatchKV
    dtype: torch.dtype  # the additive mask's (float64 where the model attends wide, as the runner's)
    fill: float  # what a masked column gets (the runner's `mask_fill`)
    rows: tuple[int, ...]
    max_width: int
    mode: str  # "cuda-graph" or "eager"
    # shapes fixed (what a graph needs): rows padded to a bucket, tokens to the widest row's, every pinned column
    # attended. Not fixed (a CPU, where nothing replays): each pass at its own rows, width and columns reached,
    # through the same buffers and cache writes; rows feeding unequal numbers of tokens are left to the eager path,
    # which packs them (padded here, a pass of 8 rows feeding 1-5 tokens cost 1.8x the packed one on 2 cores)
    fixed: bool
    buckets: dict[tuple[int, int], _Bucket] = field(default_factory=dict)
    pool: object | None = None

    @classmethod
    def build(cls, call: object, kv: BatchKV, mask_dtype: torch.dtype, fill: float, max_rows: int, max_width: int,
              device: torch.device) -> StaticStep | None:
        """The static passes of a runner's forward `call` over `kv`, or None (logged) where they cannot serve it."""
        why = cls.refuses(call) or (None if kv.columns is not None else "the cache's columns are not pinned")
        if why is not None:
            log.info("compile=on: passes stay eager (%s)", why)
            return None
        mode = "cuda-graph" if device.type == "cuda" else "eager"
        step = cls(call, kv, mask_dtype, fill, row_buckets(max_rows), max_width, mode, fixed=mode == "cuda-graph")
        log.info("compile=on: static-shape passes (%s) for %s rows x 1-%d tokens over %d pinned columns", mode,
                 "/".join(map(str, step.rows)), max_width, kv.columns)
        return step

    @staticmethod
    def refuses(call: object) -> str | None:
        """Why a runner's forward cannot run as static passes (None: it can)."""
        if not isinstance(call, LeanForward):
            return "the model runs transformers' forward"
        if call.decoder is not None:
            return "the C decoder runs every pass of this model as one call"
        if call.lm_head is None:
            return "a model without an LM head (a draft head's decoder)"
        return None

    def serves(self, inputs: object, counts: list[int], layers: tuple[int, ...]) -> bool:
        """Whether a pass of rows feeding `counts` token ids runs here."""
        width = max(counts)
        if layers or width > self.max_width or rows_bucket(len(counts), self.rows) is None:
            return False
        if inputs and isinstance(inputs[0], torch.Tensor):  # fed embeddings
            return False
        if not self.fixed and min(counts) < width:
            return False
        return self.kv.length + width <= self.kv.columns

    # ---- buffers ----------------------------------------------------------------------------------
    def span(self, width: int) -> int:
        """The columns a pass of `width` tokens attends: every pinned column where the shapes are fixed, else the
        columns used and the pass's (eagerly a pass pays for every column it attends: all of them cost 0.7x the
        eager step's tokens/s on 2 CPU cores)."""
        return self.kv.columns if self.fixed else self.kv.length + width

    def _bucket(self, rows: int, width: int) -> _Bucket:
        span, device = self.span(width), self.kv.device
        found = self.buckets.get((rows, width))
        if found is None:
            found = self.buckets[rows, width] = _Bucket(
                rows, width, span,
                ids=torch.zeros(rows, width, dtype=torch.long, device=device),
                positions=torch.zeros(rows, width, dtype=torch.long, device=device),
                mask=torch.zeros(rows, 1, width, span, dtype=self.dtype, device=device),
                cols=torch.arange(width, dtype=torch.long, device=device),
            )
        elif found.span != span:  # not fixed: this pass's columns (a graph's never change)
            found.span, found.mask = span, torch.zeros(rows, 1, width, span, dtype=self.dtype, device=device)
        return found

    def _fill(self, bucket: _Bucket, inputs, counts: list[int]) -> None:
        """This pass's ids, positions, mask and columns into the bucket's buffers (rows past the batch's: padding
        that attends its own column only)."""
        kv = self.kv
        batch, (rows, width), length = len(counts), (bucket.rows, bucket.width), kv.length
        ids = torch.zeros(rows, width, dtype=torch.long)
        for b, row in enumerate(inputs):
            ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        steps = torch.arange(width)
        positions = torch.zeros(rows, dtype=torch.long)
        positions[:batch] = torch.tensor(kv.positions, dtype=torch.long)
        bucket.ids.copy_(ids)
        bucket.positions.copy_(positions[:, None] + steps[None, :])
        bucket.cols.copy_(steps + length)
        allowed = kv.visible(counts, width, rows, bucket.span)  # padded rows: their own column only
        bucket.mask.fill_(0.0).masked_fill_(~allowed[:, None], self.fill)

    # ---- running ----------------------------------------------------------------------------------
    def _run(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.call(attention_mask=bucket.mask, position_ids=bucket.positions, input_ids=bucket.ids,
                        cache=_Columns(self.kv, bucket.rows, bucket.cols, bucket.span))
        return out.logits, out.last_hidden_state

    def _record(self, bucket: _Bucket) -> None:
        """Run the bucket's pass on its buffers (what they hold is computed for real) and, on CUDA, record it
        (eagerly, every pass runs here)."""
        if self.mode != "cuda-graph":
            bucket.logits, bucket.hidden = self._run(bucket)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm: lazy initialisations and the allocator, off the capture
            for _ in range(2):
                self._run(bucket)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.logits, bucket.hidden = self._run(bucket)
        bucket.graph = graph
        graph.replay()  # the capture ran nothing: this pass's outputs and cache writes, for real

    def capture(self) -> int:
        """Record every bucket now, over the empty cache (the columns they write are holes nobody reads), so no
        request waits for a capture; returns how many. On a CPU nothing is recorded: nothing to do."""
        if self.mode != "cuda-graph":
            return 0
        assert not self.kv.rows, "buckets are captured over an empty cache"
        recorded = 0
        for rows in self.rows:
            for width in range(1, self.max_width + 1):
                bucket = self._bucket(rows, width)
                if bucket.graph is None:
                    with torch.no_grad():
                        self._record(bucket)
                    recorded += 1
        self.kv.keep.zero_()
        return recorded

    @torch.no_grad()
    def forward(self, inputs, counts: list[int], width: int) -> StaticOutput:
        """One pass of the batch's rows feeding `inputs` (token ids, up to `width` each): the cache written at
        its next `width` columns (the caller then `advance`s it, as after an eager pass)."""
        batch = len(counts)
        bucket = self._bucket(rows_bucket(batch, self.rows) if self.fixed else batch, width)
        self._fill(bucket, inputs, counts)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._record(bucket)
        bucket.replays += 1
        return StaticOutput(bucket.logits[:batch].clone(), bucket.hidden[:batch].clone())

    @property
    def passes(self) -> int:
        """Passes run statically so far (every bucket's)."""
        return sum(b.replays for b in self.buckets.values())

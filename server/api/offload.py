"""Model-sized work off the event loop: parsing request bodies, rendering chat templates, tokenizing
prompts and building large responses (logprobs detokenized token by token) run on a few worker threads,
so `/health`, streams and other requests keep being served meanwhile.

The tokenizer's batch path (what `tokenizer(text)` uses in transformers 5) and the JSON parser hold
the GIL only briefly, so the loop gets its turns while a thread tokenizes a multi-megabyte prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

OFFLOAD_THREADS = 4  # at most this many requests are parsed or tokenized at once; more wait their turn


class Offload:
    """`await offload(fn, *args)` runs `fn(*args)` on one of `threads` worker threads and returns its
    result (or raises its exception) on the event loop."""

    def __init__(self, threads: int = OFFLOAD_THREADS) -> None:
        self._limiter = anyio.CapacityLimiter(threads)

    async def __call__(self, fn: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

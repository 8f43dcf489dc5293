"""What the scheduler's worker hands one API request, and how it can fail: `RequestStream` (the outputs
of the request's sequences, delivered from the worker thread to the event loop) and the scheduler's
exceptions, which the API turns into HTTP errors (server/api/errors.py `scheduler_error`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from server.types import RequestOutput


class QueueFull(Exception):
    """More sequences than free batch slots plus `max_waiting`: the client should retry later."""


class ShuttingDown(Exception):
    """The server is draining: no new requests, and what is left at the deadline is dropped."""


class RequestRejected(ValueError):
    """The engine refused a request as invalid (its message is meant for the client)."""


class NeverFits(RequestRejected):
    """One request holds more sequences than an idle server admits (`Scheduler.check_fits`): retrying
    cannot help, unlike `QueueFull`."""


class EngineError(RuntimeError):
    """An engine step failed while this request was running (a bug, not bad input)."""


class RequestStream:
    """The outputs of one API request's n sequences, as `(choice index, RequestOutput)` pairs.

    Iterate with `async for index, output in stream.events()`; it ends once every sequence has
    finished and raises the scheduler's exception (`RequestRejected`, `EngineError`, `ShuttingDown`)
    if one was delivered.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = tuple(request_ids)
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._open = set(range(len(self.request_ids)))  # choices not finished (nor ended by `close`)

    @property
    def finished(self) -> bool:
        return not self._open

    def close(self, index: int) -> None:
        """Stop waiting for choice `index`: the API ended it (`Scheduler.finish`); outputs of it still on
        their way are dropped. Call from the event loop."""
        self._open.discard(index)

    def _put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._open:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._open.clear()
                raise item
            index, out = item
            if index not in self._open:
                continue  # ended by the API
            if out.finished:
                self._open.discard(index)
            yield item

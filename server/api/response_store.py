"""Stored responses of `POST /v1/responses`: what `previous_response_id` continues and `GET
/v1/responses/{id}` returns.

Bounded by bytes (`Settings.responses_store_bytes`, the JSON size of each entry: the response object
and the conversation it ends), least recently used first out; an entry larger than the whole bound is
not kept. Each entry keeps its whole conversation (the messages before it, its input and its answer)
as chat messages, so a response can be continued after its ancestors were evicted. In memory only: a
restart forgets every response. Safe to use from several threads (responses are stored from the worker
threads that build them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    messages: list[dict[str, Any]]  # its conversation as chat messages (without its instructions)
    size: int  # bytes it is counted as
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its `input` as item objects (input_items)


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry` (evicting the least recently used to make room); False when it alone is too big."""
        if entry.size > self.max_bytes:
            return False
        with self._lock:
            self._pop(entry.response["id"])
            while self._entries and self.bytes + entry.size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.size
            self._entries[entry.response["id"]] = entry
            self.bytes += entry.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._pop(response_id)

    def _pop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

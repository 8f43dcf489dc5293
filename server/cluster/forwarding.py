"""One HTTP request carried from the ingress to a replica, and served there by the replica's own app.

The ingress reads a request whole (`ForwardedRequest`: method, path, headers, body, and the `RoutingKey` the
cache-aware router reads) and hands it to a replica through a Ray Serve handle; the replica runs it through
`create_app`'s ASGI app in its own event loop (`serve_asgi`) and streams back the ASGI messages the app sends
(`http.response.start`, then `http.response.body` chunks: SSE events as they are written). So every route,
error, header and stream is the single server's, byte for byte.

A client that goes away is seen by the app as it would be behind uvicorn: when Ray cancels the replica's
stream (the ingress was cancelled by the proxy, or gave up), the app's `receive()` answers `http.disconnect`
and the app aborts the request's sequences before it is torn down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)

# Header every answer from a replica carries: which replica served it (a debugging aid; tests read it).
REPLICA_HEADER = b"x-specula-replica"
# How long a replica's app gets to answer a client's disconnect (abort its sequences, log the request) before
# its task is cancelled.
DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True)
class RoutingKey:
    """What the cache-aware router reads of a request (server/cluster/router.py).

    `text`: the prompt as text in the order the model reads it (tools, then messages), whose longest prefix a
    replica holds decides where the request goes; `salt`: its `cache_salt` (prefixes are only shared within
    one); `pin`: a replica that must serve it (it holds the stored response the request names), or None.
    """

    text: str = ""
    salt: str = ""
    pin: str | None = None


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress read it (pickled to a replica by Ray)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None
    scheme: str = "http"
    routing: RoutingKey = field(default_factory=RoutingKey)

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope the replica's app sees."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": self.client,
            "server": None,
            "state": {},
        }


async def serve_asgi(app: ASGIApp, request: ForwardedRequest, replica: str) -> AsyncIterator[Message]:
    """Run `request` through `app`; yield each message it sends, `replica` named in the response's headers.

    Closing or cancelling the iteration is a client disconnect: the app's `receive()` answers
    `http.disconnect`, and the app gets `DISCONNECT_GRACE_S` to finish before its task is cancelled.
    """
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, replica.encode())]}
        await sent.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            await sent.put(None)  # the end, whether the app answered or raised

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task  # an exception the app let escape is the caller's
    finally:
        if not task.done():
            disconnected.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            if not task.done():
                log.warning("the app did not finish %s %s within %.0f s of its client's disconnect",
                            request.method, request.path, DISCONNECT_GRACE_S)
                task.cancel()

"""The request body limit: an ASGI middleware that answers 413 (OpenAI's error shape) before a body
larger than `max_bytes` is read or parsed.

* A declared `Content-Length` over the limit is answered at once; the body is never read.
* A body without one (chunked) is counted as it streams in; the read that passes the limit raises a
  413 `HTTPException`, which the app's handlers turn into the same answer (`errors.py`). At most
  `max_bytes` plus one chunk is ever buffered.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError


def too_large_message(max_bytes: int) -> str:
    return f"the request body is larger than this server accepts ({max_bytes} bytes: max_request_body_bytes)"


def _over(digits: str, max_bytes: int) -> bool:
    """Whether a Content-Length of ASCII `digits` exceeds `max_bytes` (one too long for int() does)."""
    digits = digits.lstrip("0") or "0"
    return len(digits) > len(str(max_bytes)) or int(digits) > max_bytes


class BodyLimit:
    """Wraps an ASGI app; `on_error(413)` is called for each body refused before the app saw it."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = (Headers(scope=scope).get("content-length") or "").strip()
        if declared.isascii() and declared.isdigit() and _over(declared, self.max_bytes):
            if self._on_error is not None:
                self._on_error(413)
            response = APIError(413, too_large_message(self.max_bytes), code="request_too_large").response()
            response.headers["Connection"] = "close"  # the unread body is not drained
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counted, send)

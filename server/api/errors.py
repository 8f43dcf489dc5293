"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every non-2xx answer.

Routes raise `APIError`; `install_error_handlers` turns it, FastAPI's validation errors (malformed
JSON, wrong types, missing or unsupported fields), Starlette's HTTP errors (unknown route, wrong
method) and anything unexpected into that shape. Bad input is always a 4xx; a 500 means a bug.
`scheduler_error` says what a scheduler failure is to the client; `unless_disconnected` awaits work
for a request unless its client goes first (`ClientDisconnected`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.body_policy import REFUSED
from server.request_log import capped
from server.request_stream import EngineError, QueueFull, RequestRejected, ShuttingDown

log = logging.getLogger(__name__)

T = TypeVar("T")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready (its sequences are already aborted)."""


def scheduler_error(exc: BaseException) -> APIError:
    """What the client sees for a scheduler-side failure."""
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="rate_limit_exceeded")
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc))
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error")
    raise exc


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    param = _param(tuple(err.get("loc", ())))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if kind == "extra_forbidden":
        top = param.removeprefix("structured_outputs.") if param else None
        why = REFUSED.get(top or "", "this server does not implement it")
        return bad_request(f"unsupported field {param!r}: {why}", param, "unsupported_field")
    if kind == "missing" and param is None:
        return bad_request("request body is required (a JSON object)")
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return bad_request(f"{param}: {msg}" if param else msg, param)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Register handlers so that every error leaves the server in OpenAI's shape.

    `on_error(status)` is called once per error response (e.g. to count it in the metrics).
    """

    def respond(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route; see /docs for the API"
        code = "request_too_large" if exc.status_code == 413 else None  # a streamed body passed the limit
        response = respond(APIError(exc.status_code, message, code=code))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, _: ClientDisconnected) -> Response:
        # Nobody reads this answer; not an error of the server, so not counted as one.
        path = capped(request.url.path)
        log.info("client disconnected before its answer was ready: %s %s", request.method, path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return respond(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"))

"""Request bodies parsed and validated off the event loop (see `offload.py`).

FastAPI would parse and validate a declared body on the loop: a valid 8 MB body of many small
messages takes seconds to validate. The generation routes read the raw bytes instead (bounded by the
body limit, `body_limit.py`) and call `parse_body` on a worker thread; errors are the same
`RequestValidationError`s FastAPI raises, so they become the same 400s (`errors.py`). Valid JSON past
what the server reads (nested more than `client_json.MAX_DEPTH` deep, an integer too long to convert) is
a 400 naming the field it is in.
"""

from __future__ import annotations

import email.message
import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from server.api.client_json import JSONLimitError, loads
from server.api.errors import ClientDisconnected, bad_request
from server.api.offload import Offload

B = TypeVar("B", bound=BaseModel)


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_body(raw: bytes, content_type: str | None, model: type[B]) -> B:
    """`raw` as a `model`; raises `RequestValidationError` (locations under "body", as FastAPI's) or an
    `APIError` 400 for a body that is not JSON, or JSON past the server's limits."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not _is_json(content_type):
        raise bad_request("the request body must be JSON, sent with `Content-Type: application/json`")
    try:
        data: Any = loads(raw)
    except JSONLimitError as exc:
        raise bad_request(f"{exc.path or 'request body'}: {exc.message}", exc.path or None) from exc
    except json.JSONDecodeError as exc:
        ctx = {"error": exc.msg}
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}, "ctx": ctx}]
        ) from exc
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: not UTF-8 text ({exc.reason})") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from exc


async def read_body(request: Request, model: type[B], offload: Offload) -> B:
    """The request's body as a `model`, parsed and validated on a worker thread."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived, or cut off by body_timeout_s (connections.py)
        raise ClientDisconnected from None
    return await offload(parse_body, raw, request.headers.get("content-type"), model)

"""The OpenAPI document (`/openapi.json`) and the pages that show it (`/docs`, `/redoc`).

FastAPI's own document would say what the code does not: a 422 the server never answers (bad input
is a 400, `errors.py`), empty 200 schemas, `/metrics` as JSON, and no request body for the generation
routes (they parse theirs off the event loop, `bodies.py`). `build_openapi` writes it from this
module's table instead: per operation, the request body, the real 200 schemas (`response_schemas.py`)
per media type, and every error status it can answer, in OpenAI's error shape. It follows the
settings: 401 (and the bearer scheme) only where a key is required.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, params
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server.api import response_schemas as S
from server.api import responses_schemas as RS
from server.api.responses_request import ResponsesRequest
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.api.tokenize import DetokenizeRequest, TokenizeRequest
from server.config import Settings

REF = "#/components/schemas/{model}"

ERRORS: dict[int, str] = {
    400: "Bad input: a malformed body, a field out of range or not implemented, a prompt that does not fit "
    "the context, more sequences (n x prompts) than the server admits. `param` names the field.",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`).",
    404: "The model (or route) does not exist.",
    413: "The request body is larger than `max_request_body_bytes`.",
    429: "More sequences than free batch slots plus `max_waiting`: retry later.",
    500: "The engine failed while running this request (a bug; other requests keep running).",
    503: "The model is loading, failed to load, or the server is shutting down.",
}

STREAM = "JSON; with `stream: true`, a `text/event-stream` of `data: <chunk as JSON>` events, then `data: [DONE]`."


@dataclass(frozen=True)
class Operation:
    """What one route answers: 200 bodies by media type, error statuses, and whether the key guards it
    (`"api"`: with `api_key` set; `"ops"`: with `protect_metrics` too; None: never)."""

    ok: dict[str, dict[str, Any]]
    errors: tuple[int, ...]
    guard: str | None
    request: type[BaseModel] | None = None
    ok_description: str = "OK"
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)
    summary: str | None = None  # for routes that serve several operations


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"schema": {"$ref": REF.format(model=model.__name__)}}


def _sse(model: type[BaseModel]) -> dict[str, Any]:
    """An event stream whose events carry `model` (or an error) as JSON text in `data`, then `[DONE]`.
    Before OpenAPI 3.2's `itemSchema`, a `text/event-stream` media type's `schema` describes one event."""
    payload = {"anyOf": [_ref(model)["schema"], _ref(S.ErrorResponse)["schema"]]}
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {
        "schema": {
            "type": "object",
            "description": f"One server-sent event: `data` is a {model.__name__} (or, after a failure, an "
            "ErrorResponse) as JSON text; the last event's `data` is `[DONE]`.",
            "required": ["data"],
            "if": {"properties": {"data": {"const": "[DONE]"}}},
            "else": {"properties": {"data": json_data}},
        }
    }


def _event_stream(model: type[BaseModel]) -> dict[str, Any]:
    """A stream of named events (the Responses API's): `event:` is the event's type, `data:` one of the
    union `model.event` describes, as JSON text; no `[DONE]`."""
    union = models_json_schema([(model, "serialization")], ref_template=REF)[1]["$defs"][model.__name__]
    payload = union["properties"]["event"]
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {
        "schema": {
            "type": "object",
            "description": "One server-sent event: `event` names its type, `data` is the event as JSON text.",
            "required": ["event", "data"],
            "properties": {"event": {"type": "string"}, "data": json_data},
        }
    }


HEALTH = _ref(S.Health)
GENERATION_ERRORS = (400, 404, 413, 429, 500, 503)

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "post"): Operation(
        {"application/json": _ref(S.ChatCompletion), "text/event-stream": _sse(S.ChatCompletionChunk)},
        GENERATION_ERRORS,
        "api",
        ChatCompletionRequest,
        STREAM,
    ),
    ("/v1/completions", "post"): Operation(
        {"application/json": _ref(S.Completion), "text/event-stream": _sse(S.Completion)},
        GENERATION_ERRORS,
        "api",
        CompletionRequest,
        STREAM,
    ),
    ("/v1/responses", "post"): Operation(
        {"application/json": _ref(RS.ResponseObject), "text/event-stream": _event_stream(RS.ResponseStreamEvent)},
        GENERATION_ERRORS,
        "api",
        ResponsesRequest,
        "A response; with `stream: true`, a `text/event-stream` of the Responses API's events (`event:` and "
        "`data:`), ending with `response.completed` or `response.incomplete`.",
    ),
    ("/v1/responses/{response_id}", "get"): Operation(
        {"application/json": _ref(RS.ResponseObject)}, (404, 503), "api", ok_description="A stored response.",
        summary="A stored response",
    ),
    ("/v1/responses/{response_id}", "delete"): Operation(
        {"application/json": _ref(RS.ResponseDeleted)}, (404, 503), "api", ok_description="Deleted.",
        summary="Delete a stored response",
    ),
    ("/v1/responses/{response_id}/input_items", "get"): Operation(
        {"application/json": _ref(RS.InputItemList)}, (400, 404, 503), "api",
        ok_description="A page of the response's input items (`limit`, `order`, `after`, `before`).",
        summary="A stored response's input items",
    ),
    ("/v1/models", "get"): Operation({"application/json": _ref(S.ModelList)}, (503,), "api"),
    ("/v1/models/{model_id}", "get"): Operation({"application/json": _ref(S.Model)}, (404, 503), "api"),
    ("/health", "get"): Operation(
        {"application/json": HEALTH},
        (),
        None,
        ok_description="Ready.",
        extra={
            503: {
                "description": "Loading, failed to load, draining, or broken (the engine failed).",
                "content": {"application/json": HEALTH},
            }
        },
    ),
    ("/tokenize", "post"): Operation(
        {"application/json": _ref(S.TokenizeResponse)}, (400, 404, 413, 503), "api", TokenizeRequest
    ),
    ("/detokenize", "post"): Operation(
        {"application/json": _ref(S.DetokenizeResponse)}, (400, 404, 413, 503), "api", DetokenizeRequest
    ),
    ("/version", "get"): Operation({"application/json": _ref(S.Version)}, (), None),
    ("/metrics", "get"): Operation(
        {"text/plain": {"schema": {"type": "string"}}},
        (503,),
        "ops",
        ok_description="Prometheus text exposition (docs/metrics.md).",
    ),
}


def _guarded(op: Operation, settings: Settings) -> bool:
    if not settings.api_key or op.guard is None:
        return False
    return op.guard == "api" or settings.protect_metrics


def _responses(op: Operation, settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": op.ok_description, "content": op.ok}}
    statuses = sorted({*op.errors, *((401,) if _guarded(op, settings) else ())})
    for status in statuses:
        out[str(status)] = {"description": ERRORS[status], "content": {"application/json": _ref(S.ErrorResponse)}}
    out.update({str(status): body for status, body in op.extra.items()})
    return dict(sorted(out.items()))


def _components() -> dict[str, Any]:
    requests = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest)
    models: list[tuple[type[BaseModel], Any]] = [(m, "validation") for m in requests]
    models += [(m, "serialization") for m in (*S.DOCUMENTED, *RS.DOCUMENTED)]
    _, top = models_json_schema(models, ref_template=REF)
    return dict(sorted(top["$defs"].items()))


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The document for `app` as configured by `settings`. A route `OPERATIONS` does not describe keeps
    FastAPI's guesses minus the 422 (tests/test_openapi_contract.py fails until the table has it)."""
    with warnings.catch_warnings():
        # HEAD shares its route with GET (/health, /metrics), so both operations get one id; HEAD's is dropped:
        # it is GET without the body (RFC 9110), not an operation of its own. Other shared ids are made unique below.
        warnings.filterwarnings("ignore", message="Duplicate Operation ID", category=UserWarning)
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for methods in doc["paths"].values():
        methods.pop("head", None)
        shared = [op.get("operationId") for op in methods.values()]
        for method, operation in methods.items():  # one route, several methods (GET and DELETE of a response)
            if shared.count(operation.get("operationId")) > 1:
                operation["operationId"] += f"_{method}"
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            op = OPERATIONS.get((path, method))
            if op is None:
                operation.get("responses", {}).pop("422", None)
                continue
            operation["responses"] = _responses(op, settings)
            if op.summary is not None:
                operation["summary"] = op.summary
            if op.request is not None:
                schema = _ref(op.request)
                operation["requestBody"] = {"required": True, "content": {"application/json": schema}}
            if _guarded(op, settings):
                operation["security"] = [{"bearer": []}]
    doc["components"] = {"schemas": _components()}
    if settings.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def install_openapi(app: FastAPI, settings: Settings, dependencies: Sequence[params.Depends]) -> None:
    """Serve the document at `/openapi.json`, Swagger UI at `/docs` and ReDoc at `/redoc`, each behind
    `dependencies` (the key check when `protect_metrics`). Create `app` with `openapi_url=None,
    docs_url=None, redoc_url=None` so FastAPI's unguarded copies do not exist."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    router = APIRouter(include_in_schema=False, dependencies=list(dependencies))

    @router.get("/openapi.json")
    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi())

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @router.get("/redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    app.include_router(router)

"""The FastAPI application: `create_app(settings, engine_factory)`.

Routes (all errors in OpenAI's shape, see `errors.py`):

* `POST /v1/chat/completions`, `POST /v1/completions`: JSON or SSE (`stream: true`).
* `GET /v1/models`, `GET /v1/models/{id}`: the served model, with vLLM's fields (`max_model_len`, `root`, ...).
* `POST /v1/responses` (OpenAI's Responses API, `responses_serving.py`), `GET`/`DELETE /v1/responses/{id}`,
  `GET /v1/responses/{id}/input_items`.
* vLLM's `POST /tokenize`, `POST /detokenize` (`tokenize.py`; behind the key like `/v1`) and `GET /version`.
* `GET /health`: 503 while the model loads (or after SIGTERM), 200 when ready.
* `GET /metrics`: Prometheus exposition.
* `HEAD` on `/health` and `/metrics`: as GET, without the body.
* `GET /docs`, `GET /redoc`, `GET /openapi.json`: OpenAPI docs (`openapi.py`: every status each route answers).
* `GET /`: the playground page (`playground.py`), its files under `/static/`.

With `settings.api_key` set, `/v1/*` needs `Authorization: Bearer <key>` (else 401); with `protect_metrics`
too, so do `/metrics` and the docs. Request bodies over `max_request_body_bytes` get 413 (`body_limit.py`)
and are parsed off the event loop (`bodies.py`). CORS origins come
from `settings.cors_origins`. The model loads in a background thread at start-up.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from server import __version__
from server.api.bodies import read_body
from server.api.body_limit import BodyLimit
from server.api.errors import APIError, install_error_handlers
from server.api.openapi import install_openapi
from server.api.playground import install_playground
from server.api.responses_request import ResponsesRequest
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from server.api.state import EngineFactory, ServerState
from server.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from server.config import Settings


def _default_engine_factory(settings: Settings) -> Any:
    from server.engine.engine import build_engine  # imported lazily: the API layer never needs torch

    return build_engine(settings)


def get_state(request: Request) -> ServerState:
    return request.app.state.specula


def require_api_key(request: Request) -> None:
    """401 unless `Authorization: Bearer <settings.api_key>` (when a key is configured)."""
    key = get_state(request).settings.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`",
            type="invalid_request_error",
            code="invalid_api_key",
        )


def require_api_key_if_protected(request: Request) -> None:
    """`require_api_key` for /metrics and the docs when `settings.protect_metrics` (default: open, so
    Prometheus scrapes without a key)."""
    if get_state(request).settings.protect_metrics:
        require_api_key(request)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


# The bodies are parsed and validated off the event loop (bodies.py); `openapi.py` documents them.
@v1.post("/chat/completions", summary="Chat completion (JSON or SSE stream)")
async def chat_completions(request: Request) -> Any:
    state = get_state(request)
    body = await read_body(request, ChatCompletionRequest, state.offload)
    return await state.require_serving().chat(body, request)


@v1.post("/completions", summary="Text completion (JSON or SSE stream)")
async def completions(request: Request) -> Any:
    state = get_state(request)
    body = await read_body(request, CompletionRequest, state.offload)
    return await state.require_serving().completions(body, request)


@v1.post("/responses", summary="Responses API: a response (JSON or SSE stream)")
async def responses(request: Request) -> Any:
    state = get_state(request)
    body = await read_body(request, ResponsesRequest, state.offload)
    return await state.require_responses().create(body, request)


# One route for both methods, so a 405 on the path lists both in `Allow`; openapi.py gives each its own id.
@v1.api_route("/responses/{response_id}", methods=["GET", "DELETE"], operation_id="stored_response")
async def stored_response(response_id: str, request: Request) -> dict[str, Any]:
    responses = get_state(request).require_responses()
    return responses.get(response_id) if request.method == "GET" else responses.delete(response_id)


@v1.get("/responses/{response_id}/input_items", summary="A stored response's input items")
async def response_input_items(response_id: str, request: Request) -> dict[str, Any]:
    return get_state(request).require_responses().input_items(response_id, request.query_params)


def _model_card(state: ServerState) -> dict[str, Any]:
    info = state.require_serving().info
    return {
        "id": info.name,
        "object": "model",
        "created": state.created,
        "owned_by": "specula",
        # vLLM's fields (clients size prompts with max_model_len); root names the served model, never a path
        "root": info.name,
        "parent": None,
        "max_model_len": info.limits.max_context,
        "permission": [
            {
                "id": f"modelperm-{info.name}",
                "object": "model_permission",
                "created": state.created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
        "weights": info.weights,  # extension: how the weights are served (the `weights` setting, resolved)
        "kv_cache_dtype": info.kv_cache_dtype,  # extension: the precision of the cached keys and values (resolved)
        "activations": info.activations,  # extension: what the linear layers take their inputs in
        "architecture": info.architecture,  # extension: the family the model runs as (server/model/families)
        "architectures": list(info.architectures),  # extension: the families the server's own modules serve
        "speculation": {  # extension: what `speculation.method` accepts, and the server's defaults
            "methods": info.methods,
            "default_method": info.default_method,
            "default_num_tokens": info.num_speculative_tokens,  # the API's names for the two K defaults
            "auto_max_num_tokens": info.auto_max_speculative_tokens,
        },
    }


@v1.get("/models", summary="The served model")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(get_state(request))]}


@v1.get("/models/{model_id:path}", summary="One model")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    card = _model_card(get_state(request))
    if model_id != card["id"]:
        raise APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
    return card


# vLLM's tokenizer routes sit at the root, as in vLLM; they take the key like /v1 (they cost tokenizer time).
vllm = APIRouter(dependencies=[Depends(require_api_key)])


@vllm.post("/tokenize", summary="vLLM's tokenizer: a prompt or chat messages -> token ids")
async def tokenize_route(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = await read_body(request, TokenizeRequest, state.offload)
    return await state.offload(tokenize, state.require_serving().info, body)


@vllm.post("/detokenize", summary="vLLM's tokenizer: token ids -> text")
async def detokenize_route(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = await read_body(request, DetokenizeRequest, state.offload)
    return await state.offload(detokenize, state.require_serving().info, body)


ops = APIRouter()


@ops.get("/version", summary="The server's version (vLLM's route)")
async def version() -> dict[str, str]:
    return {"version": __version__}


# HEAD answers as GET without the body (load balancers probe with HEAD); the document lists GET only. The
# operation ids are spelled out: FastAPI's would name them after whichever of the two methods a set yields first.
@ops.api_route(
    "/health",
    methods=["GET", "HEAD"],
    summary="200 when ready; 503 while loading, after a failed load, while draining, or broken",
    operation_id="health_health_get",
)
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    body: dict[str, Any] = {"status": "ok" if state.status == "ready" else state.status}
    if state.error:
        body["error"] = state.error
    if (parts := getattr(state.engine, "parts", None)) is not None and (degraded := parts.report()):
        body["degraded"] = degraded  # optional parts that failed (server/failsafe.py): slower, still correct
    return JSONResponse(body, status_code=200 if state.status == "ready" else 503)


@ops.api_route(
    "/metrics",
    methods=["GET", "HEAD"],
    summary="Prometheus metrics",
    dependencies=[Depends(require_api_key_if_protected)],
    operation_id="metrics_metrics_get",
)
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if state.metrics is None:
        raise APIError(503, "metrics are available once the model has loaded", code="model_not_ready")
    data, content_type = state.metrics.render()
    return Response(data, media_type=content_type)


def create_app(settings: Settings, engine_factory: EngineFactory | None = None) -> FastAPI:
    """The app; its lifespan starts loading the model (see `ServerState`) and drains on shutdown."""
    state = ServerState(settings, engine_factory or _default_engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(state.load())
        try:
            yield
        finally:
            loading.cancel()
            await state.close()

    app = FastAPI(
        title="Specula",
        description="OpenAI-compatible inference server with lossless speculative decoding.",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,  # served by install_openapi, behind the key when protect_metrics
        docs_url=None,
        redoc_url=None,
        # Starlette's slash redirects (`/health/` -> `/health`) are absolute URLs built from the Host header,
        # an open redirect: off. `/static` -> `/static/` redirects to a path (playground.py), the rest are 404s.
        redirect_slashes=False,
    )
    app.state.specula = state
    install_error_handlers(app, state.observe_error)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes, on_error=state.observe_error)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in settings.cors_origins,
        )
    app.include_router(v1)
    app.include_router(vllm)
    app.include_router(ops)
    install_playground(app)
    install_openapi(app, settings, [Depends(require_api_key_if_protected)])
    return app

"""The cluster's HTTP entry: a Ray Serve ingress that hands each request to one engine replica.

Ray Serve's HTTP proxy delivers every request to `Ingress`, whose app does four things and nothing else:

* `/health`: 200 while at least one replica is ready (each replica's status in the body), else 503.
* `/metrics`: every replica's exposition merged into one (`server.metrics.merge_expositions`; each series
  labelled with its `replica`), behind the key with `protect_metrics` as on a single server.
* Any other request is read whole (bodies over `max_request_body_bytes` are a 413 first, as on a single
  server), given the `RoutingKey` the cache-aware router reads (`routing_key.py`), and sent to a replica
  through a Ray Serve handle; the replica's answer is relayed message by message (SSE as it is written). So
  routes, auth, errors, streams, usage and the playground are the replica's own (`create_app`).
* When the replica serving a request dies before its answer has begun, the request is sent once more (Ray
  routes it to a live replica); a stream that had begun ends with an error event in OpenAI's shape, as a
  single server's stream does when its engine fails. With every replica busy and Ray's queue for them full
  (`max_waiting`), a request gets the 429 a single server gives when its queue is full.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send

from server.api.app import require_api_key_if_protected
from server.api.body_limit import BodyLimit
from server.api.errors import APIError, install_error_handlers
from server.cluster.forwarding import ForwardedRequest, RoutingKey
from server.cluster.routing_key import request_routing
from server.config import Settings
from server.metrics import merge_expositions

log = logging.getLogger(__name__)

RETRIES = 1  # times a request whose replica died before answering is sent again
BROADCAST_TIMEOUT_S = 10.0  # /health and /metrics wait this long for the replicas' answers
LARGE_BODY_BYTES = 64 * 1024  # bodies above this are read for their routing key off the event loop
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ClusterState:
    """What the ingress app's routes read (`app.state.specula`: the single server's guards read `settings`)."""

    def __init__(self, settings: Settings, engines: DeploymentHandle) -> None:
        self.settings = settings
        self.engines = engines
        self.stream = engines.options(method_name="handle", stream=True)

    async def broadcast(self, method: str, *args: Any) -> list[Any]:
        """`method` called on every running replica; a replica that fails to answer is left out."""
        results = await self.engines.broadcast(method, *args).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
        )
        return [r for r in results if not isinstance(r, BaseException)]

    async def routing(self, request: ForwardedRequest) -> RoutingKey:
        """The request's routing key, pinned to the replica holding the stored response it names, if any."""
        if len(request.body) > LARGE_BODY_BYTES:  # parsing it would hold up the event loop: a thread does it
            key, response_id = await asyncio.to_thread(request_routing, request.method, request.path, request.body)
        else:
            key, response_id = request_routing(request.method, request.path, request.body)
        if response_id is None:
            return key
        holders = [name for name in await self.broadcast("holder_of", response_id) if name]
        return RoutingKey(key.text, key.salt, holders[0] if holders else None)


def _state(request: Request) -> ClusterState:
    return request.app.state.specula


def build_ingress_app(settings: Settings, engines: DeploymentHandle) -> FastAPI:
    """The ingress's ASGI app (see the module doc)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.specula = ClusterState(settings, engines)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> JSONResponse:
        replicas = await _state(request).broadcast("status")
        ready = sum(r["status"] == "ready" for r in replicas)
        body = {"status": "ok" if ready else "loading", "replicas": replicas}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"], dependencies=[Depends(require_api_key_if_protected)])
    async def metrics(request: Request) -> Response:
        bodies = await _state(request).broadcast("metrics")
        if not bodies:
            raise APIError(503, "metrics are available once a replica has loaded", code="model_not_ready")
        data, content_type = merge_expositions(bodies)
        return Response(data, media_type=content_type)

    @app.api_route("/{path:path}", methods=_METHODS, include_in_schema=False)
    async def forward(request: Request) -> Response:
        state = _state(request)
        scope = request.scope
        client = scope.get("client")
        forwarded = ForwardedRequest(
            method=request.method,
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
            body=await request.body(),
            client=(client[0], client[1]) if client else None,
            scheme=scope.get("scheme", "http"),
        )
        routing = await state.routing(forwarded)
        return Relay(state.stream, ForwardedRequest(**{**forwarded.__dict__, "routing": routing}))

    return app


class Relay(Response):
    """The replica's answer to one forwarded request, sent on as it arrives (see the module doc)."""

    def __init__(self, stream: DeploymentHandle, request: ForwardedRequest) -> None:
        super().__init__()
        self.stream, self.request = stream, request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.create_task(self._relay(send))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()  # a client gone: cancelling the relay cancels the replica's call (its abort)
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()

    async def _relay(self, send: Send) -> None:
        for attempt in range(RETRIES + 1):
            progress = _Progress()
            response = self.stream.remote(self.request)
            try:
                async for message in response:
                    progress.see(message)
                    await send(message)
                return
            except (RayActorError, ReplicaUnavailableError) as exc:  # the replica's process died (or is unreachable)
                log.warning("replica failed %s %s (%s)", self.request.method, self.request.path, exc)
                if not progress.started and attempt < RETRIES:
                    continue
                await _fail(send, progress, _replica_gone())
                return
            except BackPressureError:
                await _fail(send, progress, APIError(
                    429, "server busy: every replica is full and so is the cluster's queue (max_waiting); "
                    "retry later", code="rate_limit_exceeded"))
                return
            except DeploymentUnavailableError:
                await _fail(send, progress, _replica_gone())
                return
            finally:
                response.cancel()  # no-op once the answer is complete


class _Progress:
    """How far a relayed answer got: its start sent, an SSE stream, its last body message sent."""

    def __init__(self) -> None:
        self.started = self.sse = self.ended = False

    def see(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = {k.lower(): v for k, v in message.get("headers", ())}
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True


def _replica_gone() -> APIError:
    return APIError(
        503, "the replica serving this request stopped before it finished; retry the request",
        type="server_error", code="replica_unavailable",
    )


async def _fail(send: Send, progress: _Progress, error: APIError) -> None:
    """`error` to the client: the whole answer if none began, an SSE error event then `[DONE]` for a stream
    that had begun, else the end of the body already begun (the client sees it cut short)."""
    if progress.ended:
        return
    if not progress.started:
        await error.response()({"type": "http"}, _never, send)
        return
    tail = b""
    if progress.sse:
        tail = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@serve.ingress()
class Ingress:
    """The ingress deployment: `build_ingress_app` over a handle to the engine replicas."""

    def __init__(self, settings: Settings, engines: DeploymentHandle) -> None:
        self.settings, self.engines = settings, engines

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self.settings, self.engines)

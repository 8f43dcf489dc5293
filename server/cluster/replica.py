"""`EngineReplica`: one whole server (the API app, its scheduler and engine) as a Ray Serve replica.

Its life, in Ray Serve's terms:

1. Ray starts the replica's process and calls `__init__`: the app is built with `create_app` (the
   `replica_name` setting set to Ray's replica id, so every /metrics series says which replica), its lifespan
   starts (uvicorn's `LifespanOn`, as Ray's own `@serve.ingress` runs one) and the model loads. `__init__`
   returns once the model is loaded, so Ray routes nothing to a replica before it can serve; a load that fails
   raises, and Ray starts another replica in its place.
2. Requests arrive through `handle` (the ingress's `ForwardedRequest`) and run through the app in this
   process (`forwarding.serve_asgi`); `metrics`, `status` and `holder_of` answer the ingress's
   broadcasts.
3. Ray calls `check_health` every `health_check_period_s`: it raises once the engine worker died (`/health`
   would say `broken`), and Ray replaces the replica.
4. On scale-down or shutdown Ray stops routing to the replica, waits for its requests in flight
   (`graceful_shutdown_timeout_s`), then calls `__del__`: the lifespan's shutdown drains the scheduler as
   SIGTERM does for `serve`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from ray import serve
from starlette.types import Message
from uvicorn.lifespan.on import LifespanOn

from server.api.app import create_app
from server.api.serve import GIL_SWITCH_INTERVAL_S
from server.cluster.forwarding import ForwardedRequest, serve_asgi
from server.config import Settings

log = logging.getLogger(__name__)


class EngineReplica:
    """The Ray Serve deployment class of the engine replicas (`application.build_application` deploys it)."""

    async def __init__(self, settings: Settings) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as `serve` does (server/api/serve.py)
        self.name = serve.get_replica_context().replica_tag
        self.app = create_app(settings.model_copy(update={"replica_name": self.name}))
        self.state = self.app.state.specula
        self.lifespan = LifespanOn(uvicorn.Config(self.app, lifespan="on", log_config=None))
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise RuntimeError("the server's start-up failed; the replica's log says why")
        status = await self.state.wait_ready()
        if status != "ready":
            raise RuntimeError("the model failed to load; the replica's log says why")
        log.info("replica %s ready (pid %d)", self.name, os.getpid())

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """Serve one forwarded request; yields the app's ASGI messages as it sends them."""
        async for message in serve_asgi(self.app, request, self.name):
            yield message

    def metrics(self) -> bytes:
        """This replica's /metrics exposition (every series labelled `replica`)."""
        return self.state.metrics.render()[0] if self.state.metrics is not None else b""

    def status(self) -> dict[str, Any]:
        """What the ingress's /health reports of this replica."""
        scheduler = self.state.scheduler
        return {
            "replica": self.name,
            "status": self.state.status,
            "pid": os.getpid(),
            "running": scheduler.num_running if scheduler is not None else 0,
            "waiting": scheduler.num_waiting if scheduler is not None else 0,
        }

    def holder_of(self, response_id: str) -> str | None:
        """This replica's name if it stored the Responses API response `response_id` (only it can continue it)."""
        responses = self.state.responses
        return self.name if responses is not None and responses.store.get(response_id) is not None else None

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine worker (or a failed load) makes Ray replace the replica."""
        if self.state.status in ("broken", "failed"):
            raise RuntimeError(f"replica {self.name}: the engine is {self.state.status}")

    async def __del__(self) -> None:
        await self.lifespan.shutdown()  # drains the scheduler within shutdown_grace_s

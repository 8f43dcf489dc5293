"""Run the app under uvicorn, draining on SIGTERM/SIGINT.

The first signal stops admitting (new requests get 503, `/health` turns 503), lets running requests
finish for up to `settings.shutdown_grace_s`, aborts what is left, then lets uvicorn close the
connections and exit with status 0. A second signal exits at once. When the engine worker dies
(`ServerState` turns `broken`: /health 503, in-flight requests already have their errors), uvicorn
shuts down the same way and `serve` returns 1, so a supervisor (Kubernetes, docker's restart policy)
starts a fresh process. So does a model load that fails (`failed`: /health 503 with the reason until the
process has exited), instead of answering 503 forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn

from server.api.app import create_app
from server.api.connections import uvicorn_config
from server.api.state import EngineFactory, ServerState
from server.config import Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the scheduler before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self.exit_code = 0
        state.on_broken = self._engine_died
        state.on_failed = self._load_failed

    def _engine_died(self) -> None:
        log.critical("the engine worker died: shutting down with exit status 1 for a supervisor to restart")
        self.exit_code = 1
        self.should_exit = True

    def _load_failed(self) -> None:
        log.critical("the model failed to load (%s): shutting down with exit status 1 for a supervisor to "
                     "restart", self._state.error)
        self.exit_code = 1
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._draining is not None or self.should_exit:
            super().handle_exit(sig, frame)  # not started yet, or a second signal: exit now
            self.force_exit = self._draining is not None
            return
        log.info("%s: draining (grace %.0f s)", signal.Signals(sig).name, self._state.settings.shutdown_grace_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self._state.close()
        finally:
            self.should_exit = True


# The engine's worker thread and the event loop share the GIL. A decode step is ~1,500 torch calls, each
# releasing the GIL and taking it back; whenever the event loop grabbed it meanwhile (an SSE chunk, a
# request body), the worker waited until the loop's code gave it up, at most Python's switch interval
# (5 ms by default). At 0.5 ms, plain decoding over HTTP went from 0.937 / 0.959 / 0.979 of the same
# engine in-process to 1.018 / 1.043 (`python -m bench.overhead --rounds 4`, runs alternated; docs/bench.md).
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(settings: Settings, engine_factory: EngineFactory | None = None) -> int:
    """Serve until SIGTERM/SIGINT (returns 0 after a clean drain), or until loading fails or the engine
    worker dies (returns 1)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(settings, engine_factory)
    config = uvicorn_config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
        access_log=True,
    )
    server = DrainingServer(config, app.state.specula)
    server.run()
    return server.exit_code

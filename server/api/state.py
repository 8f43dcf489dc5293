"""The server's lifecycle: loading (models load in a background thread) -> ready -> draining, or
ready -> broken when the engine worker dies.

`ServerState` is the one object routes read. While the engine loads, `/health` and the API answer
503; once loaded it owns the scheduler, the metrics and the `OpenAIServing` handlers. When the worker
dies (scheduler.py) the state turns `broken` (503 everywhere) and `on_broken` (set by serve.py) makes
the process exit non-zero for its supervisor to restart it; a load that fails (`failed`, 503) calls
`on_failed`, which does the same.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from server.api.errors import APIError
from server.api.offload import Offload
from server.api.prompts import ModelInfo
from server.api.response_store import ResponseStore
from server.api.responses_serving import ResponsesServing
from server.api.serving import OpenAIServing
from server.config import Settings
from server.metrics import Metrics
from server.scheduler import Scheduler
from server.traffic import TrafficRecorder

log = logging.getLogger(__name__)

Status = Literal["loading", "ready", "failed", "draining", "broken"]

# What clients (/health and 503s, no key needed) are told when the server cannot serve: a fixed reason per
# status. The exception behind a failed load or a dead engine is logged, never answered: its text can hold
# file paths and other internals.
PUBLIC_ERRORS: dict[str, str] = {
    "loading": "the model is still loading",
    "failed": "the model failed to load; the server's log says why",
    "draining": "the server is shutting down",
    "broken": "the engine failed; the server is restarting",
}
EngineFactory = Callable[[Settings], Any]  # returns a server.engine.engine.Engine


class ServerState:
    def __init__(self, settings: Settings, engine_factory: EngineFactory) -> None:
        self.settings = settings
        self._engine_factory = engine_factory
        self.created = int(time.time())
        self.status: Status = "loading"
        self.error: str | None = None
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.metrics: Metrics | None = None
        self.serving: OpenAIServing | None = None
        self.responses: ResponsesServing | None = None
        self.recorder: TrafficRecorder | None = None
        self.offload = Offload()  # parsing and tokenizing off the event loop
        self._ready = asyncio.Event()
        self.on_broken: Callable[[], None] | None = None  # called once the engine worker has died
        self.on_failed: Callable[[], None] | None = None  # called once loading has failed

    async def load(self) -> None:
        """Build the engine in a daemon thread (never blocking the loop), then start the scheduler."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def build() -> None:
            try:
                engine = self._engine_factory(self.settings)
            except Exception as exc:  # reported on the loop below, not swallowed
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, engine, None)

        threading.Thread(target=build, name="specula-loader", daemon=True).start()
        try:
            engine = await done
        except Exception:
            log.exception("model loading failed")
            self.status, self.error = "failed", PUBLIC_ERRORS["failed"]
            self._ready.set()
            if self.on_failed is not None:
                self.on_failed()
            return
        self._start(engine)

    def _start(self, engine: Any) -> None:
        s = self.settings
        method = s.speculation  # the engine refused to build with a method it cannot run
        self.metrics = Metrics(
            model=engine.model_name,
            target=s.target or engine.model_name,
            draft=engine.draft_name,
            method=method,
            k=s.num_speculative_tokens,
            methods=engine.limits.methods,
            replica=s.replica_name,
            max_model_len=engine.limits.max_context,
        )
        if hasattr(engine, "memory"):  # specula_memory_bytes{part} (server/engine/memory.py)
            self.metrics.watch_memory(engine.memory.usage, engine.memory.peak)
        self.scheduler = Scheduler(
            engine,
            max_batch_size=s.max_batch_size,
            max_waiting=s.max_waiting,
            limits=engine.limits,
            metrics=self.metrics,
            on_fatal=self._engine_died,
        )
        self.scheduler.start()
        info = ModelInfo(
            name=engine.model_name,
            tokenizer=engine.tokenizer,
            limits=engine.limits,
            default_method=method,
            num_speculative_tokens=s.num_speculative_tokens,
            auto_max_speculative_tokens=s.auto_max_speculative_tokens,
            default_max_tokens=s.default_max_tokens,
            weights=engine.weights,
            kv_cache_dtype=engine.kv_cache_dtype,
            activations=engine.activations,
            architecture=engine.architecture,
            architectures=tuple(engine.architectures),
        )
        self.recorder = TrafficRecorder(s.record_traffic) if s.record_traffic is not None else None
        self.serving = OpenAIServing(info, self.scheduler, self.offload, self.recorder)
        self.responses = ResponsesServing(self.serving, ResponseStore(s.responses_store_bytes))
        self.engine = engine
        self.status = "ready"
        self._ready.set()
        log.info("ready: serving %s (speculation %s, K=%d, auto's K up to %d)", info.name, method,
                 s.num_speculative_tokens, s.auto_max_speculative_tokens)

    def _engine_died(self, exc: BaseException) -> None:
        """The worker died (its requests have their errors; the scheduler logged why): 503 from now on,
        and exit if serving."""
        self.status, self.error = "broken", PUBLIC_ERRORS["broken"]
        if self.on_broken is not None:
            self.on_broken()

    async def wait_ready(self, timeout: float | None = None) -> Status:
        """Wait until loading has ended (ready or failed); returns the status."""
        await asyncio.wait_for(self._ready.wait(), timeout)
        return self.status

    def require_serving(self) -> OpenAIServing:
        """The handlers, or a 503 while loading, after a failed load, or while draining."""
        if self.status == "ready" and self.serving is not None:
            return self.serving
        raise APIError(
            503, PUBLIC_ERRORS[self.status], code="model_not_ready" if self.status == "loading" else self.status
        )

    def require_responses(self) -> ResponsesServing:
        """The Responses API's handlers, or `require_serving`'s 503."""
        self.require_serving()
        assert self.responses is not None
        return self.responses

    def observe_error(self, status: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(status)

    def begin_drain(self) -> None:
        """Stop admitting requests (SIGTERM); accepted ones keep running."""
        if self.status == "ready":
            self.status = "draining"
        if self.scheduler is not None:
            self.scheduler.begin_drain()

    async def close(self) -> None:
        """Finish or abort what runs within the grace period, then stop the worker."""
        self.begin_drain()
        if self.scheduler is not None:
            await self.scheduler.shutdown(self.settings.shutdown_grace_s)
        if self.recorder is not None:
            self.recorder.close()


def _settle(fut: asyncio.Future[Any], result: Any, exc: Exception | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)

"""A real uvicorn server on 127.0.0.1 (free port) in a background thread, serving the tiny engine, with
the protocol and connection limits `serve` runs with (`server/api/connections.py`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from server.api.app import create_app
from server.api.connections import uvicorn_config
from server.config import Settings
from server.engine.engine import Engine
from server.model.loading import LoadedModel


@contextmanager
def serve_app(app: FastAPI, timeout_s: float = 120) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a thread; yields its base URL once
    /health is 200 and stops the server (lifespan drain included) after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "live server did not become healthy"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def live_server(target: LoadedModel, draft: LoadedModel | None, **overrides: Any) -> Iterator[tuple[str, FastAPI]]:
    """Yields (base URL, app) for the tiny engine once /health is 200."""
    app = create_app(Settings.load(**overrides), lambda s: Engine(target, draft, s))
    with serve_app(app) as url:
        yield url, app

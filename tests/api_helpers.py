"""Helpers for API tests: run the app in-process (lifespan included) and read SSE bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from server.api.app import create_app
from server.config import Settings

MODEL = "tiny-target"


@asynccontextmanager
async def running_app(
    engine_factory: Callable[..., Any], *, wait: bool = True, **overrides: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app on `engine_factory(**overrides)` (same overrides for the app's settings), started and ready."""
    settings = Settings.load(**overrides)  # draft=None is dropped here; the engine factory honours it
    app = create_app(settings, lambda _: engine_factory(**overrides))
    async with app.router.lifespan_context(app):
        if wait:
            await app.state.specula.wait_ready(120)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            yield app, client


def sse_data(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (events end with a blank line)."""
    assert body.endswith("\n\n"), body[-50:]
    events = [e for e in body.split("\n\n") if e]
    out = []
    for event in events:
        lines = [line for line in event.split("\n") if not line.startswith(":")]  # drop pings
        if lines:
            assert len(lines) == 1 and lines[0].startswith("data: "), event
            out.append(lines[0][len("data: ") :])
    return out


def sse_json(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body, checking it ends with `data: [DONE]`."""
    data = sse_data(body)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def chat_body(content: str = "Hello there", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }

"""Continuous batching over real HTTP: concurrent streams equal their solo output; disconnects free slots."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.api_helpers import MODEL
from tests.live_server import live_server

PROMPTS = [
    "The capital of France is",
    "def fib(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Roses are red",
    "The quick brown fox",
    "import numpy as np",
    "Dear colleague,",
]
LENGTHS = [4, 30, 12, 24, 7, 18, 2, 28]  # different lengths: requests leave while others run
METHODS = ["ngram", "draft", "none", "ngram", "draft", "none", "ngram", "draft"]


async def stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int, method: str) -> str:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "speculation": {"method": method, "num_tokens": 3},
    }
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.slow
async def test_eight_concurrent_streams_equal_their_solo_greedy_output(tiny_target, tiny_draft):
    with live_server(tiny_target, tiny_draft, max_batch_size=8) as (url, app):
        scheduler = app.state.specula.scheduler
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            solo = [await stream_text(client, p, n, "none") for p, n in zip(PROMPTS, LENGTHS, strict=True)]
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, scheduler.num_running)
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            together = await asyncio.gather(
                *(stream_text(client, p, n, m) for p, n, m in zip(PROMPTS, LENGTHS, METHODS, strict=True))
            )
            watcher.cancel()
    assert together == solo
    assert peak > 1  # they really shared the batch


@pytest.mark.slow
async def test_disconnect_mid_stream_frees_the_slot(tiny_target):
    with live_server(tiny_target, None, max_batch_size=1, speculation="none") as (url, app):
        scheduler = app.state.specula.scheduler
        engine = app.state.specula.engine
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            t0 = time.monotonic()
            await stream_text(client, "Hello", 8, "none")
            solo_s = time.monotonic() - t0

            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "stream": True, "temperature": 0}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                assert scheduler.num_running == 1
            # the client is gone: the slot is freed within a step
            deadline = time.monotonic() + 5
            while (scheduler.num_running or engine.running) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert scheduler.num_running == 0 and not engine.running

            t0 = time.monotonic()
            assert await stream_text(client, "Hello", 8, "none")
            assert time.monotonic() - t0 < solo_s * 3 + 0.5  # not queued behind the 1000-token request


@pytest.mark.slow
async def test_disconnect_of_a_non_streaming_request_aborts_it(tiny_target):
    with live_server(tiny_target, None, max_batch_size=1, speculation="none") as (url, app):
        scheduler = app.state.specula.scheduler
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000}  # several seconds of generation
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body)
        deadline = time.monotonic() + 2
        while scheduler.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert scheduler.num_running == 0

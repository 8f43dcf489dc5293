"""Disconnects end quietly (an info line, a 499 nobody reads, no error counted) and every request,
aborted ones included, gets its request-log line with every prompt's tokens."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.api_helpers import MODEL, running_app
from tests.live_server import live_server


def request_records(caplog) -> list[dict]:
    return [json.loads(r.getMessage().removeprefix("request ")) for r in caplog.records if r.name == "specula.request"]


async def wait_idle(scheduler, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while scheduler.num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert scheduler.num_running == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_goes_away_is_logged_not_counted_as_an_error(tiny_target, caplog, stream):
    caplog.set_level("INFO", logger="specula.request")
    caplog.set_level("INFO", logger="server.api.errors")
    with live_server(tiny_target, None, max_batch_size=1, speculation="none") as (url, app):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "stream": stream, "user": "u9"}
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as client:
            if stream:  # read the first chunk, then hang up
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", json=body)
        await wait_idle(app.state.specula.scheduler)
        deadline = time.monotonic() + 5
        while not request_records(caplog) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        metrics = httpx.get(f"{url}/metrics").text
    errors = [line for line in metrics.splitlines() if line.startswith("specula_request_errors_total{")]
    assert errors == [], errors  # neither a 500 nor the 499 is counted
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    if not stream:
        gone = [r for r in caplog.records if "client disconnected" in r.getMessage()]
        assert len(gone) == 1 and gone[0].levelname == "INFO"
    [record] = request_records(caplog)
    assert record["finish_reason"] == "abort" and record["user"] == "u9"
    assert record["completion_tokens"] < 1000


async def test_the_log_counts_every_prompt_of_a_list(tiny_engine_factory, tokenizer, caplog):
    caplog.set_level("INFO", logger="specula.request")
    async with running_app(tiny_engine_factory) as (_, client):
        body = {"model": MODEL, "prompt": ["one two three", "four"], "max_tokens": 2, "n": 2}
        r = (await client.post("/v1/completions", json=body)).json()
    [record] = request_records(caplog)
    lengths = [len(tokenizer(p)["input_ids"]) for p in body["prompt"]]
    assert record["prompt_tokens"] == r["usage"]["prompt_tokens"] == sum(lengths) > lengths[0]
    assert record["completion_tokens"] == r["usage"]["completion_tokens"]

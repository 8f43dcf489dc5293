"""The request shapes guidellm 0.8.1 sends (backends/openai/request_handlers.py), against a live server.

guidellm asks `GET /health` and `GET /v1/models` first, then per request: streamed bodies carry
`stream_options: {include_usage, continuous_usage_stats}`; a fixed output length adds
`max_completion_tokens` (chat) or `max_tokens` (completions), `stop: null` and `ignore_eos: true`;
chat content is a list of text parts. It reads token counts from `usage` (every chunk when streamed).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api_helpers import MODEL
from tests.live_server import live_server

OUTPUT_TOKENS = 5
PROMPT = "the quick brown fox jumps over the lazy dog " * 3


@pytest.fixture(scope="module")
def url(tiny_target, tiny_draft):
    with live_server(tiny_target, tiny_draft) as (base, _app):
        yield base


def chat(stream: bool, fixed_length: bool = True) -> dict:
    body: dict = {"model": MODEL}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    if fixed_length:
        body.update(max_completion_tokens=OUTPUT_TOKENS, stop=None, ignore_eos=True)
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    return body


def completion(stream: bool) -> dict:
    body: dict = {"model": MODEL}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    body.update(max_tokens=OUTPUT_TOKENS, stop=None, ignore_eos=True, prompt=PROMPT)
    return body


def events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_validation_requests(url):
    assert httpx.get(f"{url}/health").status_code == 200
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]


@pytest.mark.parametrize("path,make", [("/v1/chat/completions", chat), ("/v1/completions", completion)])
def test_guidellm_bodies(url, path, make):
    r = httpx.post(f"{url}{path}", json=make(stream=False), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == OUTPUT_TOKENS  # ignore_eos: exactly the length asked

    r = httpx.post(f"{url}{path}", json=make(stream=True), timeout=60)
    assert r.status_code == 200, r.text
    chunks = events(r)
    assert all(c.get("usage") for c in chunks)  # continuous usage: guidellm counts tokens from it
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == OUTPUT_TOKENS


def test_guidellm_chat_without_fixed_length_and_with_speculation_extras(url):
    body = {**chat(stream=True, fixed_length=False), "max_completion_tokens": 4, "temperature": 0,
            "speculation": {"method": "none"}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert events(r)[-1]["usage"]["speculation"]["method"] == "none"

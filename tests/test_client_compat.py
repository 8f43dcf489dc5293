"""Clients nobody here wrote: the bodies Open WebUI (31 tools), LibreChat, SillyTavern and LangChain
send (tests/compat_bodies.py) and the openai SDK's `model_dump()` history round-trip, each against a
live server on a tiny model with a long context (tool descriptions make long prompts). Each must get
200 with a well-formed answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.api.app import create_app
from server.config import Settings
from server.engine.engine import Engine
from tests.compat_bodies import BODIES
from tests.live_server import serve_app
from tests.models import as_loaded, tiny_llama

MODEL = "tiny-long"


@pytest.fixture(scope="module")
def url(tokenizer):
    target = as_loaded(tiny_llama(len(tokenizer), seed=3, max_positions=8192), tokenizer, MODEL)
    app = create_app(Settings.load(), lambda s: Engine(target, None, s))
    with serve_app(app) as base:
        yield base


def sse_chunks(text: str) -> list[dict]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", text[-200:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return chunks


@pytest.mark.parametrize("name", sorted(BODIES))
def test_client_body_gets_200(url, name):
    body = BODIES[name](MODEL)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        chunks = sse_chunks(r.text)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0] in ("stop", "length", "tool_calls")
        if body.get("stream_options", {}).get("include_usage"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    else:
        answer = r.json()
        assert answer["object"] == "chat.completion" and answer["choices"][0]["finish_reason"] in (
            "stop", "length", "tool_calls")
        assert answer["usage"]["prompt_tokens"] > 0


def test_open_webui_tools_reach_the_model(url, tokenizer):
    """The 31 tool definitions are rendered into the prompt (fallback: the template has no tool support)."""
    body = BODIES["open_webui_chat_with_tools"](MODEL)
    plain = {**body, "tools": None, "stream": False, "stream_options": None}
    with_tools = {**body, "stream": False, "stream_options": None}
    n_plain = httpx.post(f"{url}/v1/chat/completions", json=plain, timeout=120).json()["usage"]["prompt_tokens"]
    n_tools = httpx.post(f"{url}/v1/chat/completions", json=with_tools, timeout=120).json()["usage"]["prompt_tokens"]
    assert n_tools > n_plain + 31 * 10


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_model_dump_round_trip(url, stream):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": "Hi"}]
    for turn in range(3):
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True) if c.choices)
            messages.append({"role": "assistant", "content": text, "refusal": None, "tool_calls": []})
        else:
            resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=-1)
            messages.append(resp.choices[0].message.model_dump())
        messages.append({"role": "user", "content": f"And turn {turn}?", "name": "alice"})
    assert len(messages) == 7

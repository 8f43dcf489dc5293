"""The official `openai` package against a live server on loopback (tiny models)."""

from __future__ import annotations

import openai
import pytest

from server.config import Settings
from tests.api_helpers import MODEL
from tests.live_server import live_server

KEY = "test-key"
HELLO = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    with live_server(tiny_target, tiny_draft, api_key=KEY) as (url, _app):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_stream_and_not(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage.completion_tokens <= 8
    spec = resp.usage.model_extra["speculation"]
    assert spec["method"] == Settings.load().speculation and spec["decode_steps"] > 0

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_completions_stream_and_not(client):
    resp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == resp.choices[0].text
    assert resp.object == "text_completion" and resp.usage.prompt_tokens > 0


def test_n_choices(client):
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=3, seed=1)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=2, seed=1, stream=True)
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=12, temperature=0).choices[0].text
    stop = full[4:7]
    cut = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_speculation_extension_via_extra_body(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=6,
        temperature=0,
        extra_body={"speculation": {"method": "draft", "num_tokens": 2}},
    )
    spec = resp.usage.model_extra["speculation"]
    assert spec["method"] == "draft" and 0 < spec["draft_tokens"] <= 2 * spec["decode_steps"]


def test_typed_exceptions(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    bad_key = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.BadRequestError):  # also raised for a stream, before any chunk
        list(client.chat.completions.create(model=MODEL, messages=[], stream=True))

"""Every bad input is a 4xx in OpenAI's error shape, naming the field; the server keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.api_helpers import MODEL, chat_body, running_app

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def comp_body(**extra):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}


# (path, json body, status, expected `param`, expected `code` or None, a word in the message)
CASES = [
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, 400, "model", None, "required"),
    (CHAT, {"model": MODEL}, 400, "messages", None, "required"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", None, "at least 1"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", None, "list"),
    (CHAT, chat_body(temperature="hot"), 400, "temperature", None, "number"),
    (CHAT, chat_body(temperature=3), 400, "temperature", None, "less than or equal"),
    (CHAT, chat_body(top_p=-0.1), 400, "top_p", None, "greater than"),
    (CHAT, chat_body(max_tokens=0), 400, "max_tokens", None, "greater than"),
    (CHAT, chat_body(n=0), 400, "n", None, "greater than"),
    (CHAT, chat_body(top_logprobs=2), 400, None, None, "requires logprobs"),
    (CHAT, chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", None, "less than"),
    (CHAT, chat_body(stream_options={"include_usage": True}), 400, None, None, "only allowed when stream"),
    (CHAT, chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop", None, "at most 4"),
    (CHAT, chat_body(stop=""), 400, "stop", None, "empty"),
    (CHAT, chat_body(presence_penalty=5), 400, "presence_penalty", None, "less than"),
    (CHAT, chat_body(seed="x"), 400, "seed", None, "integer"),
    (
        CHAT,
        {**chat_body(), "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        None,
        "user",
    ),
    (
        CHAT,
        {
            **chat_body(),
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        400,
        "messages[0].content",
        None,
        "text",
    ),
    (CHAT, chat_body(tool_choice="required"), 400, None, None, "needs tools"),
    (
        CHAT,
        chat_body(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        None,
        "'g'",
    ),
    (
        CHAT,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
        400,
        "response_format.json_schema.schema",
        None,
        "strin",
    ),
    (CHAT, chat_body(response_format={"type": "json_schema"}), 400, "response_format", None, "needs json_schema"),
    (CHAT, chat_body(response_format={"type": "json_object"}, guided_regex="a+"), 400, None, None, "send one"),
    (COMP, comp_body(guided_regex="(unclosed"), 400, "guided_regex", None, "guided_regex"),
    (COMP, comp_body(guided_json="{not json"), 400, "guided_json", None, "not valid JSON"),
    (CHAT, chat_body(prediction={"type": "content", "content": "x"}), 400, "prediction", "unsupported_field", ""),
    (CHAT, chat_body(reasoning_effort="high"), 400, "reasoning_effort", "unsupported_field", ""),
    (CHAT, chat_body(audio={"voice": "x"}), 400, "audio", "unsupported_field", ""),
    (CHAT, chat_body(functions=[{"name": "f"}]), 400, "functions", "unsupported_field", ""),
    (
        CHAT,
        {**chat_body(), "messages": [{"role": "assistant", "content": "x", "refusal": "no"}]},
        400,
        "messages[0].refusal",
        "unsupported_field",
        "",
    ),
    (
        CHAT,
        {**chat_body(), "messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0]",
        None,
        "tool_call_id",
    ),
    (CHAT, {**chat_body(), "messages": [{"role": "user", "content": None}]}, 400, "messages[0]", None, "content"),
    (CHAT, chat_body(logit_bias={"50": 101}), 400, "logit_bias", None, "[-100, 100]"),
    (CHAT, chat_body(frobnicate=True), 400, "frobnicate", "unsupported_field", "frobnicate"),
    (CHAT, chat_body(speculation={"method": "eagle"}), 400, "speculation.method", None, "ngram"),
    (CHAT, chat_body(speculation={"num_tokens": 0}), 400, "speculation.num_tokens", None, "greater than"),
    (CHAT, chat_body(speculation={"k": 3}), 400, "speculation.k", "unsupported_field", "k"),
    (CHAT, {**chat_body(), "model": "gpt-4o"}, 404, "model", "model_not_found", "gpt-4o"),
    (CHAT, chat_body(max_tokens=5000), 400, "messages", "context_length_exceeded", "maximum context length"),
    (CHAT, chat_body("word " * 1100), 400, "messages", "context_length_exceeded", "maximum context length"),
    (COMP, {"model": MODEL, "max_tokens": 2}, 400, "prompt", None, "required"),
    (COMP, comp_body(prompt=""), 400, "prompt", None, "empty"),
    (COMP, comp_body(prompt=[]), 400, "prompt", None, "string"),
    (COMP, comp_body(prompt=[1, "a"]), 400, "prompt", None, "string"),
    (COMP, comp_body(prompt={"text": "a"}), 400, "prompt", None, "string"),
    (COMP, comp_body(prompt=[10**9]), 400, "prompt[0]", None, "vocabulary"),
    (COMP, comp_body(prompt=[[1, 2], [-1]]), 400, "prompt[1]", None, "vocabulary"),
    (COMP, comp_body(echo=True), 400, "echo", "unsupported_field", "echo"),
    (COMP, comp_body(best_of=3), 400, "best_of", "unsupported_field", "best_of"),
    (COMP, comp_body(suffix="end"), 400, "suffix", "unsupported_field", "suffix"),
    (
        COMP,
        comp_body(logprobs=True, top_logprobs=2),
        400,
        "top_logprobs",
        "unsupported_field",
        "top_logprobs",
    ),
    (COMP, comp_body(logprobs=50), 400, "logprobs", None, "less than"),
    (COMP, comp_body(max_tokens=1024), 400, "prompt", "context_length_exceeded", "maximum context length"),
    (COMP, {**comp_body(), "model": "nope"}, 404, "model", "model_not_found", "nope"),
]


@pytest.fixture
async def client(tiny_engine_factory):
    async with running_app(tiny_engine_factory, draft=None) as (_, c):
        yield c


def check_error(r, status: int, param: str | None = None, code: str | None = None, word: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["param"] == param and err["code"] == code, err
    assert word.lower() in err["message"].lower(), err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


async def test_bad_requests_are_4xx_in_openai_shape(client):
    for path, body, status, param, code, word in CASES:
        for stream in (False, True):
            r = await client.post(
                path, json={**body, "stream": True} if stream and "stream_options" not in body else body
            )
            check_error(r, status, param, code, word)
    # the worker survived all of it
    assert (await client.post(COMP, json=comp_body())).status_code == 200


async def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    neutral = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "store": False,
        "parallel_tool_calls": True,
        "metadata": None,
        "user": "u-1",
    }
    assert (await client.post(CHAT, json=chat_body(max_tokens=2, **neutral))).status_code == 200
    assert (await client.post(COMP, json=comp_body(echo=False, best_of=1, suffix=None))).status_code == 200


async def test_malformed_bodies(client):
    r = await client.post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    check_error(r, 400, None, None, "not valid JSON")
    r = await client.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    check_error(r, 400, None, None, "")
    r = await client.post(CHAT, content=b"", headers={"content-type": "application/json"})
    check_error(r, 400, None, None, "required")


async def test_draft_method_without_a_draft_model(client):
    r = await client.post(CHAT, json=chat_body(speculation={"method": "draft"}))
    check_error(r, 400, "speculation.method", None, "not available on this server")


async def test_unknown_routes_and_methods(client):
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await client.get(CHAT)
    assert r.status_code == 405 and r.json()["error"]["message"]


async def test_values_the_engine_cannot_take_are_400s_and_neighbours_are_unharmed(tiny_engine_factory):
    """Numbers past what the sampler represents, and text with half a character, are refused at the edge
    with the field named; nothing reaches the engine, so other requests are untouched."""
    async with running_app(tiny_engine_factory) as (_, c):
        check_error(await c.post(CHAT, json=chat_body(top_k=2**63)), 400, "top_k")
        check_error(await c.post(CHAT, json=chat_body(seed=2**64)), 400, "seed")
        json_ = {"Content-Type": "application/json"}  # json.dumps writes a lone surrogate as a \\udXXX escape
        lone = json.dumps(chat_body("a\ud800b", max_tokens=4))
        check_error(await c.post(CHAT, content=lone, headers=json_), 400, None, None, "surrogate")
        lone = json.dumps({"model": MODEL, "prompt": "x\udfffy", "max_tokens": 4})
        check_error(await c.post(COMP, content=lone, headers=json_), 400, None, None, "surrogate")
        ok = await c.post(CHAT, json=chat_body(temperature=0))
        assert ok.status_code == 200


async def test_a_temperature_that_would_underflow_samples_greedily(tiny_engine_factory):
    """1e-40 is inside the documented range; dividing logits by it would overflow fp32. The limit of
    sampling as T -> 0 is the argmax, which is what such a request gets."""
    async with running_app(tiny_engine_factory) as (_, c):
        texts = []
        for t in (0, 1e-40, 1e-300):
            r = await c.post(CHAT, json=chat_body("Count: 1 2 3", max_tokens=12, temperature=t))
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[0] == texts[1] == texts[2]

"""Structured output and forced tool calls through the API: what clients get back validates.

Tiny-model tests check the request path (response_format, vLLM's guided_* fields, streamed and not);
the real default model checks what users do: the openai SDK's `parse()` with a pydantic model, and
`tool_choice` required / named, with speculation on and identical to plain decoding (greedy).
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server.api.app import create_app
from server.config import Settings
from server.engine.engine import build_engine
from tests.api_helpers import MODEL, chat_body, running_app, sse_json
from tests.live_server import serve_app

SMALL = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


# ---- tiny models: the request path ----------------------------------------------------------------
@pytest.mark.slow
async def test_json_schema_reply_validates_streamed_and_not(tiny_engine_factory):
    fmt = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
    async with running_app(tiny_engine_factory) as (_, client):
        body = chat_body(max_tokens=40, temperature=0, response_format=fmt)
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), SMALL)
        assert choice["finish_reason"] == "stop"
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(streamed.text) if c["choices"])
        assert text == choice["message"]["content"]


@pytest.mark.slow
async def test_sampled_json_object_replies_parse(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        body = chat_body(max_tokens=200, temperature=1.0, seed=5, n=4, response_format={"type": "json_object"})
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop":  # a random model may write a long object
                assert isinstance(json.loads(choice["message"]["content"]), dict)
            else:
                assert choice["message"]["content"].startswith("{")


@pytest.mark.slow
async def test_guided_choice_and_regex_on_completions(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        base = {"model": MODEL, "prompt": "The answer is", "max_tokens": 20, "temperature": 1.0, "seed": 1, "n": 3}
        r = await client.post("/v1/completions", json={**base, "guided_choice": ["yes", "no", "maybe not"]})
        assert r.status_code == 200, r.text
        assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no", "maybe not"}
        r = await client.post("/v1/completions", json={**base, "guided_regex": "[0-9]{3}-[a-z]{2}"})
        for c in r.json()["choices"]:
            assert len(c["text"]) == 6 and c["text"][:3].isdigit() and c["text"][3] == "-", c["text"]


@pytest.mark.slow
async def test_required_tool_choice_returns_calls_that_validate_streamed_and_not(tiny_engine_factory):
    colour = {
        "type": "function",
        "function": {"name": "set_color", "parameters": SMALL},
    }
    async with running_app(tiny_engine_factory) as (_, client):
        body = chat_body(max_tokens=120, temperature=0, tools=[colour, TIME], tool_choice="required",
                         parallel_tool_calls=False)
        r = await client.post("/v1/chat/completions", json=body)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] in (["set_color"], ["get_time"])
        if calls[0]["function"]["name"] == "set_color":
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SMALL)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [c for c in sse_json(streamed.text) if c["choices"]]
        deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
        assert "".join(d["function"].get("arguments", "") for d in deltas) == calls[0]["function"]["arguments"]


FLAG = {
    "type": "function",
    "function": {"name": "set_flag", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                                     "required": ["on"], "additionalProperties": False}},
}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [None, False])
@pytest.mark.parametrize("stream", [False, True])
async def test_required_tool_calls_end_with_tool_calls_at_a_short_max_tokens(tiny_engine_factory, parallel, stream):
    """`tool_choice: required` at max_tokens 48 (what clients send): the grammar ends the reply after one call
    with `parallel_tool_calls: false`; allowed parallel calls end when the model stops, or where max_tokens cuts a
    later call (dropped): either way the reply is whole calls and finishes `tool_calls`, never `length`."""
    colour = {"type": "function", "function": {"name": "set_color", "parameters": SMALL}}
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    body = chat_body(max_tokens=48, temperature=1.0, seed=11, n=4, tools=[colour, FLAG], tool_choice="required",
                     stream=stream, **extra)
    async with running_app(tiny_engine_factory) as (_, client):
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        finish: dict[int, str] = {}
        calls: dict[int, dict[int, dict]] = {}
        for chunk in sse_json(r.text):
            for choice in chunk["choices"]:
                for d in choice["delta"].get("tool_calls") or []:
                    calls.setdefault(choice["index"], {})[d["index"]] = d["function"]
                finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
        per_choice = {i: list(calls.get(i, {}).values()) for i in range(4)}
    else:
        finish = {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
        per_choice = {c["index"]: [t["function"] for t in c["message"]["tool_calls"] or []]
                      for c in r.json()["choices"]}
    assert finish == dict.fromkeys(range(4), "tool_calls"), finish
    schemas = {"set_color": SMALL, "set_flag": FLAG["function"]["parameters"]}
    for functions in per_choice.values():
        assert functions and (parallel is None or len(functions) == 1), functions
        for f in functions:
            jsonschema.validate(json.loads(f["arguments"]), schemas[f["name"]])


# ---- the real default model: what SDK users do ---------------------------------------------------
class City(BaseModel):
    """(Free-form numbers are left out: greedy SmolLM2-135M repeats digits until max_tokens.)"""

    name: str
    country: str
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]
    is_capital: bool


@pytest.fixture(scope="module")
def real_client():
    app = create_app(Settings.load(device="cpu"), build_engine)
    with serve_app(app, timeout_s=600) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, method: str, **kwargs):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=120,
        extra_body={"speculation": {"method": method}}, **kwargs,
    )


@pytest.mark.slow
@pytest.mark.real_model
def test_sdk_parse_returns_a_validated_object_with_speculation(real_client):
    messages = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    parsed = real_client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=messages, response_format=City, temperature=0, max_tokens=120
    )
    message = parsed.choices[0].message
    assert isinstance(message.parsed, City), message.content
    plain = real_client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=messages, response_format=City, temperature=0, max_tokens=120,
        extra_body={"speculation": {"method": "none"}},
    )
    assert plain.choices[0].message.content == message.content, "speculation changed the constrained output"
    spec = parsed.usage.model_extra["speculation"]
    assert spec["accepted_tokens"] > 0, spec  # the schema's keys and separators are drafted for free


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("parallel", [None, False])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_and_match_plain_decoding(real_client, choice, parallel):
    """Greedy SmolLM2-135M, allowed parallel calls, repeats its call: the reply ends at the repeat (one
    call; finish_reason `tool_calls`, `stop` for a named function as OpenAI answers), the same with and
    without speculation, streamed or not."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    resp = ask(real_client, "auto", messages=messages, tools=[WEATHER, TIME], tool_choice=choice, **extra)
    assert resp.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop"), resp.choices[0]
    calls = resp.choices[0].message.tool_calls
    assert calls and (choice == "required" or all(c.function.name == "get_weather" for c in calls))
    assert len({(c.function.name, json.dumps(json.loads(c.function.arguments), sort_keys=True)) for c in calls}) == len(
        calls)  # no call repeated
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    plain = ask(real_client, "none", messages=messages, tools=[WEATHER, TIME], tool_choice=choice, **extra)
    assert [c.function.model_dump() for c in plain.choices[0].message.tool_calls] == [
        c.function.model_dump() for c in calls
    ]
    assert plain.usage.completion_tokens == resp.usage.completion_tokens
    streamed = real_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=120, messages=messages, tools=[WEATHER, TIME],
        tool_choice=choice, stream=True, **extra,
    )
    arguments: dict[int, str] = {}
    for chunk in streamed:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert [json.loads(a) for a in arguments.values()] == [json.loads(c.function.arguments) for c in calls]


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("parallel", [None, False])
def test_required_at_max_tokens_48_ends_with_its_calls(real_client, parallel):
    """What the issue saw: greedy SmolLM2-135M writes one good call, then starts it again; at max_tokens 48 the
    repeat is cut. The answer is the whole call, `tool_calls` (parse() and agents go on), streamed or not."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kwargs = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=48, messages=messages,
                  tools=[WEATHER, TIME], tool_choice="required", **extra)
    resp = real_client.chat.completions.create(**kwargs)
    assert resp.choices[0].finish_reason == "tool_calls", resp.choices[0]
    calls = resp.choices[0].message.tool_calls
    assert calls and (parallel is None or len(calls) == 1)
    for call in calls:
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(real_client.chat.completions.create(stream=True, **kwargs))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    streamed = [d.function.arguments for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert streamed == [c.function.arguments for c in calls]


@pytest.mark.slow
@pytest.mark.real_model
def test_the_responses_api_decodes_as_chat_does_with_and_without_speculation(real_client):
    """`/v1/responses` is the chat route underneath: `text_format` and `tool_choice: required` give what chat
    gives, and `auto` gives what `none` gives."""
    parsed = {
        method: real_client.responses.parse(
            model="SmolLM2-135M-Instruct", input="Tell me about Paris as JSON.", text_format=City, temperature=0,
            max_output_tokens=120, extra_body={"speculation": {"method": method}},
        )
        for method in ("auto", "none")
    }
    assert isinstance(parsed["auto"].output_parsed, City) and parsed["auto"].output_text == parsed["none"].output_text
    chat = real_client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=120,
    )
    assert chat.choices[0].message.content == parsed["auto"].output_text
    weather = {"type": "function", **WEATHER["function"]}
    calls = {
        method: [
            (item.name, json.loads(item.arguments))
            for item in real_client.responses.create(
                model="SmolLM2-135M-Instruct", input="What is the weather like in Paris today?", tools=[weather],
                tool_choice="required", temperature=0, max_output_tokens=120,
                extra_body={"speculation": {"method": method}},
            ).output
            if item.type == "function_call"
        ]
        for method in ("auto", "none")
    }
    assert calls["auto"] == calls["none"] and calls["auto"], calls
    distinct = {(name, json.dumps(args, sort_keys=True)) for name, args in calls["auto"]}
    assert len(distinct) == len(calls["auto"])  # here: Paris in celsius, then in fahrenheit; no repeat


@pytest.mark.slow
async def test_a_grammar_that_cannot_be_followed_is_a_400_for_that_request_only(tiny_engine_factory):
    """llguidance accepts `a{99999999}` and then hits its lexer limit mid-decode: bad input, so those
    requests get a 400 (even all of a batch at once) while a free request beside them finishes."""
    async with running_app(tiny_engine_factory) as (_, client):
        bad = {"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_regex": "a{99999999}"}
        good = {"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}
        answers = await asyncio.gather(
            client.post("/v1/completions", json=bad),
            client.post("/v1/completions", json=good),
            client.post("/v1/completions", json=bad),
        )
        assert [r.status_code for r in answers] == [400, 200, 400], [r.text for r in answers]
        assert answers[0].json()["error"]["type"] == "invalid_request_error"
        assert answers[1].json()["choices"][0]["finish_reason"] == "length"
        both_bad = await asyncio.gather(*(client.post("/v1/completions", json=bad) for _ in range(2)))
        assert [r.status_code for r in both_bad] == [400, 400]
        assert (await client.get("/health")).status_code == 200

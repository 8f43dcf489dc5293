"""Every bad input is a 4xx in OpenAI's error shape, naming the field; the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.api_helpers import MODEL, chat_body, running_app, sse_data, sse_json

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def comp_body(**extra):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}


def with_tool_call(arguments: str, **extra) -> dict:
    """A chat body whose history holds an assistant tool call with these `arguments` (messages[1])."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return {**chat_body(), "messages": history, **extra}


DEEP_TEXT = "[" * 100_000 + "]" * 100_000  # JSON text nested past Python's recursion limit
LONG_INT = "9" * 5000  # an integer literal past int()'s 4,300 digits
ARGS = "messages[1].tool_calls[0].function.arguments"
F = [{"type": "function", "function": {"name": "f"}}]

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
    (COMP, comp_body(best_of=3), 400, "best_of", "unsupported_field", "best_of"),
    (COMP, comp_body(suffix="end"), 400, "suffix", "unsupported_field", "suffix"),
    (
        COMP,
        comp_body(logprobs=1, top_logprobs=2),
        400,
        "top_logprobs",
        "unsupported_field",
        "top_logprobs",
    ),
    (COMP, comp_body(logprobs=50), 400, "logprobs", None, "less than"),
    (COMP, comp_body(max_tokens=1024), 400, "prompt", "context_length_exceeded", "maximum context length"),
    (COMP, {**comp_body(), "model": "nope"}, 404, "model", "model_not_found", "nope"),
    # client text inside fields that is parsed again: digits int() refuses, JSON past the parser's limits
    (CHAT, chat_body(logit_bias={"²": 1}), 400, "logit_bias", None, "token ids"),
    (CHAT, chat_body(logit_bias={"1" * 5000: 1}), 400, "logit_bias", None, "outside the vocabulary"),
    (COMP, comp_body(guided_json='{"a": ' * 5000 + "1" + "}" * 5000), 400, "guided_json", None, "nested more than 128"),
    (COMP, comp_body(guided_json=f'{{"maximum": {LONG_INT}}}'), 400, "guided_json", None, "5000 digits"),
    (COMP, comp_body(guided_json='{"const": "\\ud800"}'), 400, "guided_json", None, "surrogate"),
    (COMP, comp_body(guided_json={"x-guidance": []}), 400, "guided_json", None, "x-guidance"),
    (
        CHAT,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"maximum": 10**40}}}),
        400,
        "response_format.json_schema.schema",
        None,
        "cannot decode",
    ),
    (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"maximum": 10**40}}}],
                     tool_choice="required"), 400, "tools", None, "cannot decode"),
    (CHAT, with_tool_call(DEEP_TEXT), 400, ARGS, None, "nested more than 128"),
    (CHAT, with_tool_call("[" * 129 + "]" * 129), 400, ARGS, None, "nested more than 128"),
    (CHAT, with_tool_call(DEEP_TEXT, tools=F), 400, ARGS, None, "nested more than 128"),
    (CHAT, with_tool_call(f"[{LONG_INT}]"), 400, ARGS, None, "5000 digits"),
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


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"name": "s", "schema": {"type": "object"}}
RESP = "/v1/responses"
# Loose types OpenAI and vLLM refuse: a number or boolean sent as a string, a boolean as a number, a decimal as an
# integer. (path, body, the field named)
STRICT_CASES = [
    (CHAT, chat_body(max_tokens="10"), "max_tokens"),
    (CHAT, chat_body(max_tokens=True), "max_tokens"),
    (CHAT, chat_body(max_tokens=10.5), "max_tokens"),
    (CHAT, chat_body(max_completion_tokens="10"), "max_completion_tokens"),
    (CHAT, chat_body(temperature=True), "temperature"),
    (CHAT, chat_body(temperature="0.5"), "temperature"),
    (CHAT, chat_body(top_p=False), "top_p"),
    (CHAT, chat_body(n="2"), "n"),
    (CHAT, chat_body(stream="yes"), "stream"),
    (CHAT, chat_body(stream=1), "stream"),
    (CHAT, chat_body(logprobs="true"), "logprobs"),
    (CHAT, chat_body(seed=True), "seed"),
    (CHAT, chat_body(presence_penalty="1"), "presence_penalty"),
    (CHAT, chat_body(ignore_eos="false"), "ignore_eos"),
    (CHAT, chat_body(priority="1"), "priority"),
    (CHAT, chat_body(logit_bias={"5": "10"}), "logit_bias.5"),
    (CHAT, chat_body(tools=[{**FN, "function": {**FN["function"], "strict": "yes"}}]), "tools[0].function.strict"),
    (CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {**SCHEMA, "strict": "yes"}}),
     "response_format.json_schema.strict"),
    (CHAT, chat_body(parallel_tool_calls="false", tools=[FN]), "parallel_tool_calls"),
    (CHAT, chat_body(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (COMP, comp_body(max_tokens="10"), "max_tokens"),
    (COMP, comp_body(n="2"), "n"),
    (COMP, comp_body(stream="yes"), "stream"),
    (COMP, comp_body(logprobs=True), "logprobs"),
    (COMP, comp_body(echo="yes"), "echo"),
    (RESP, {"model": MODEL, "input": "x", "max_output_tokens": "10"}, "max_output_tokens"),
    (RESP, {"model": MODEL, "input": "x", "temperature": True}, "temperature"),
    (RESP, {"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
    (RESP, {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
     "tools[0].strict"),
    (RESP, {"model": MODEL, "input": "x", "store": "no"}, "store"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
]


async def test_loose_types_are_400s_naming_the_field(client):
    """`max_tokens: "10"`, `temperature: true`, `n: "2"`, `stream: "yes"`, `strict: "yes"`, ...: a 400 naming the
    field, as OpenAI's and vLLM's servers answer, never a 200 that read them some way."""
    for path, body, param in STRICT_CASES:
        r = await client.post(path, json=body)
        check_error(r, 400, param)
    # the right types pass
    ok = chat_body(max_tokens=3, temperature=0.5, top_p=1, n=1, stream=False, seed=1, logprobs=False)
    assert (await client.post(CHAT, json=ok)).status_code == 200
    assert (await client.post(CHAT, json=chat_body(temperature=1))).status_code == 200  # an integer is a number


def raw_body(base: dict, **members: str) -> str:
    """`base` as JSON text with `members` added as JSON text of their own (what json.dumps cannot write:
    nesting past the recursion limit, integers past int()'s digit limit)."""
    return json.dumps(base)[:-1] + "".join(f', "{key}": {text}' for key, text in members.items()) + "}"


HI = [{"role": "user", "content": "x"}]
# (path, body text, expected `param`, a word in the message): valid JSON past what the server reads
RAW_CASES = [
    (CHAT, raw_body(chat_body(), metadata='{"a": ' * 5000 + "1" + "}" * 5000), "metadata", "nested more than 128"),
    (CHAT, raw_body(chat_body(), metadata="[" * 500 + "]" * 500), "metadata", "nested more than 128"),
    (CHAT, raw_body({"model": MODEL}, messages=DEEP_TEXT), "messages", "nested more than 128"),
    (COMP, raw_body({"model": MODEL}, prompt=DEEP_TEXT), "prompt", "nested more than 128"),
    (CHAT, raw_body({"model": MODEL, "messages": HI}, max_tokens=LONG_INT), "max_tokens", "5000 digits"),
    (CHAT, raw_body({"model": MODEL, "messages": HI}, seed="-" + LONG_INT), "seed", "5000 digits"),
    (COMP, raw_body({"model": MODEL, "max_tokens": 2}, prompt=f"[1, {LONG_INT}]"), "prompt[1]", "5000 digits"),
    (COMP, raw_body({"model": MODEL, "max_tokens": 2}, prompt=f"[[1], [2, {LONG_INT}]]"), "prompt[1][1]", "digits"),
    (CHAT, raw_body(chat_body(), metadata=f'{{"n": {LONG_INT}, "d": {DEEP_TEXT}}}'), "metadata", "nested"),
    (CHAT, "[" * 100_000 + "]" * 100_000, None, "nested more than 128"),
    # numbers that are not finite: Python's parser reads NaN and Infinity (not JSON) and 1e999 (as inf)
    (CHAT, raw_body({"model": MODEL, "messages": HI}, repetition_penalty="Infinity"), "repetition_penalty", "finite"),
    (CHAT, raw_body({"model": MODEL, "messages": HI}, repetition_penalty="1e999"), "repetition_penalty", "1.8e308"),
    (COMP, raw_body({"model": MODEL, "prompt": "x"}, temperature="NaN"), "temperature", "not a JSON number"),
    (CHAT, raw_body(chat_body(), metadata='{"a": [1, -Infinity]}'), "metadata.a[1]", "finite"),
]


async def test_json_past_the_parsers_limits_is_a_400_naming_the_field(tiny_engine_factory):
    """Nesting deeper than 128 levels (past ~1,000 Python's parser raised RecursionError) and integer
    literals int() refuses (over 4,300 digits: ValueError) were 500s; each is a 400 naming the top-level
    field, the worker serves on, and a stream in flight meanwhile is untouched."""
    json_ = {"content-type": "application/json"}
    async with running_app(tiny_engine_factory, draft=None) as (_, c):

        async def bad(path: str, text: str, param: str | None, word: str) -> None:
            for body in (text, text.replace("{", '{"stream": true, ', 1) if text.startswith("{") else text):
                check_error(await c.post(path, content=body, headers=json_), 400, param, None, word)

        async def in_flight() -> list[str]:
            async with c.stream("POST", CHAT, json=chat_body(max_tokens=24, temperature=0, stream=True)) as r:
                assert r.status_code == 200
                return sse_data((await r.aread()).decode())

        stream, *_ = await asyncio.gather(in_flight(), *(bad(*case) for case in RAW_CASES))
        assert stream[-1] == "[DONE]" and json.loads(stream[-2])["choices"][0]["finish_reason"] == "length"
        assert (await c.post(COMP, json=comp_body())).status_code == 200
        # just inside the limits (the body's own object is the first level): read and served
        deep_ok = raw_body(chat_body(), metadata="[" * 127 + "]" * 127)
        assert (await c.post(CHAT, content=deep_ok, headers=json_)).status_code == 200
        longest = raw_body({"model": MODEL, "messages": HI}, max_tokens="1" + "0" * 4299)  # read, and too many
        check_error(await c.post(CHAT, content=longest, headers=json_), 400, "messages", "context_length_exceeded")


@pytest.mark.slow
async def test_a_tool_call_the_model_garbles_stays_text(client):
    r"""guided_regex makes the reply a tool-call block whose name holds an escape JSON does not know
    (`\q`): not a call of an offered function, so it stays text. Its parse was a 500 (a broken stream)."""
    reply = r'<tool_call>{"name": "\q", "arguments": {}}</tool_call>'
    forced = r'<tool_call>\{"name": "\\q", "arguments": \{\}\}</tool_call>'  # that text as a regex
    body = chat_body(max_tokens=40, tools=F, guided_regex=forced)
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == reply and not message.get("tool_calls")
    r = await client.post(CHAT, json={**body, "stream": True})
    chunks = sse_json(r.text)
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == reply


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

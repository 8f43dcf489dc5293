"""Tool calling: the output parser (whole and in any split), tools through the chat template (native
and the fallback), and the API end to end with the openai SDK on a scripted model reply."""

from __future__ import annotations

import copy
import json
import random
import time

import openai
import pytest

from server.api.app import create_app
from server.api.chat_schemas import ChatMessage, ToolDefinition
from server.api.chat_template import render_messages, supports_tools
from server.api.errors import APIError
from server.api.tool_calls import ToolCallParser, parse_whole
from server.config import Settings
from tests.live_server import serve_app
from tests.scripted_engine import ScriptedEngine

NAMES = {"get_weather", "f"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# (model output, expected content, expected [(name, arguments)])
CASES = [
    ("Just text, with a < sign and <tool", "Just text, with a < sign and <tool", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": {"a": 1}}}'
        "\n</tool_call>",
        "Let me check.",
        [("get_weather", '{"city": "Paris", "x": {"a": 1}}')],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"arguments": {"y": 2}, "name": "f"}'
        "</tool_call>",
        None,
        [("f", '{"x": 1}'), ("f", '{"y": 2}')],
    ),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", '{"city": "Oslo"}')]),
    ('{"answer": 42}', '{"answer": 42}', []),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',  # not an offered function: text
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> ok',
        [],
    ),
    ('<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', None, [("f", '{"x": [1, 2]}')]),  # cut by a stop
    (  # cut by max_tokens inside the closing tag: what it wrote of the tag is not part of the arguments
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "f", '
        '"arguments": {"x": 2}}\n</tool_c',
        None,
        [("f", '{"x": 1}'), ("f", '{"x": 2}')],
    ),
    ("  \n", "  \n", []),
    (  # a repeat of an earlier call (arguments equal as JSON) is a loop, not a parallel call: the reply ends
        '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2}}</tool_call>\n<tool_call>{"name": "f", "arguments": '
        '{"x": 2}}</tool_call>\n<tool_call>{"name": "f", "arguments": {"y": 2, "x": 1}}</tool_call>\n<tool_call>'
        '{"name": "f", "arguments": {"x": 3}}</tool_call> and text',
        None,
        [("f", '{"x": 1, "y": 2}'), ("f", '{"x": 2}')],
    ),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"name": "f", "arguments": {}}]</tool_call>', None, [("f", "{}")]),
]
REPEAT_END = len(CASES[-2][0]) - len('\n<tool_call>{"name": "f", "arguments": {"x": 3}}</tool_call> and text')


@pytest.mark.parametrize("text,content,calls", CASES)
def test_parse_whole(text, content, calls):
    reply = parse_whole(text, NAMES)
    assert reply.content == content
    assert [(c.name, c.arguments) for c in reply.calls] == calls
    assert all(c.id.startswith("call_") for c in reply.calls) and len({c.id for c in reply.calls}) == len(calls)
    assert not reply.cut


def test_a_repeated_call_ends_the_reply_where_the_repeat_ends():
    reply = parse_whole(CASES[-2][0], NAMES)
    assert reply.end == REPEAT_END and CASES[-2][0][:REPEAT_END].endswith("</tool_call>")
    assert parse_whole(CASES[1][0], NAMES).end is None


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "f", "argu',
        "Sure.<tool_call>\n<tool_",
        '{"name": "get_weather", "parameters": {"city": "Os',  # bare
    ],
)
def test_a_call_cut_by_max_tokens_is_neither_a_call_nor_content(text):
    reply = parse_whole(text, NAMES, "length")
    assert reply.cut
    assert reply.content in (None, "", "Sure.") and all(json.loads(c.arguments) for c in reply.calls)
    assert [c.arguments for c in reply.calls] in ([], ['{"x": 1}'])
    streamed = ToolCallParser(NAMES)
    deltas = [d for i in range(0, len(text), 3) for d in streamed.feed(text[i : i + 3])] + streamed.finish("length")
    assert "".join(d.content or "" for d in deltas) == (reply.content or "")
    assert [d.arguments for d in deltas if d.index is not None] == [c.arguments for c in reply.calls]


def test_text_that_is_no_call_stays_text_when_max_tokens_cuts_it():
    reply = parse_whole('{"answer": 4', NAMES, "length")
    assert (reply.content, reply.calls, reply.cut) == ('{"answer": 4', [], False)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_any_split_gives_the_same_result_and_each_call_comes_whole(text, content, calls):
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        parser = ToolCallParser(NAMES)
        deltas = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas += parser.feed(text[a:b])
        deltas += parser.finish()
        got = "".join(d.content for d in deltas if d.content is not None)
        assert ((got.strip() or None) if parser.calls else got) == content
        call_deltas = [d for d in deltas if d.index is not None]
        assert [(d.name, d.arguments) for d in call_deltas] == calls  # one delta per call: id, name, arguments
        assert all(d.id is not None for d in call_deltas)


def test_a_call_is_sent_whole_once_its_block_ends():
    parser = ToolCallParser(NAMES)
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "get_weather", "arguments": ') == []
    assert parser.feed('{"city": "Par') == []
    rest = parser.feed('is"}}\n</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in rest] == [(0, "get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",  # past Python's recursion limit: RecursionError
        '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",  # bare
        r'<tool_call>{"name": "\q", "arguments": {}}</tool_call>',  # an escape JSON does not know: ValueError
        r'<tool_call>{"name": "f\u12", "arguments": {}}</tool_call>',
    ],
)
def test_output_the_parser_cannot_read_stays_text(text):
    """Model output (which a client can force with guided_regex) that is not a readable call of an
    offered function is text, whole and streamed; reading it raised (a 500, or a broken stream)."""
    reply = parse_whole(text, NAMES)
    assert (reply.content, reply.calls) == (text, [])
    parser = ToolCallParser(NAMES)
    deltas = [d for i in range(0, len(text), 7) for d in parser.feed(text[i : i + 7])] + parser.finish()
    assert "".join(d.content or "" for d in deltas) == text and not parser.calls


def msgs(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


HISTORY = (
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
)


def test_fallback_rendering_for_a_template_without_tools(tokenizer):
    assert not supports_tools(tokenizer)
    tools = [ToolDefinition.model_validate(WEATHER)]
    messages, specs = render_messages(tokenizer, msgs(*HISTORY), tools, parallel_tool_calls=True)
    assert specs is None
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"] and "at most one" not in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    single, _ = render_messages(tokenizer, msgs({"role": "system", "content": "Be brief."}), tools, False)
    assert single[0]["content"].endswith("Be brief.") and "at most one function" in single[0]["content"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in text and "18 C, sunny" in text


def test_native_rendering_for_a_template_with_tools(tokenizer):
    tok = copy.copy(tokenizer)  # the session's tokenizer keeps its own template
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }}){% endfor %}"
        "{% endfor %}"
    )
    assert supports_tools(tok)
    tools = [ToolDefinition.model_validate(WEATHER)]
    messages, specs = render_messages(tok, msgs(*HISTORY), tools, parallel_tool_calls=True)
    assert specs == [WEATHER]
    text = tok.apply_chat_template(messages, tools=specs, tokenize=False)
    assert text == "[tool get_weather]<user>Weather in Paris?<assistant>(call get_weather Paris)<tool>18 C, sunny"


@pytest.mark.parametrize(
    ("arguments", "word"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested more than 128"),
        ('{"x": ' + "[" * 128 + "]" * 128 + "}", "nested more than 128"),
        ('{"x": ' + "9" * 5000 + "}", "5000 digits"),
        ('{"city": "\\ud800"}', "surrogate"),  # rendered as text, half a character the tokenizer refuses
    ],
)
def test_arguments_the_server_cannot_read_are_a_400_naming_them(tokenizer, arguments, word):
    tok = copy.copy(tokenizer)
    tok.chat_template = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}"
    tok.chat_template += "{% endfor %}{{ m.content }}{% endfor %}{{ tools }}"
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    history = msgs(HISTORY[0], {"role": "assistant", "content": "ok"}, {**HISTORY[1], "tool_calls": [call] * 2})
    for template in (tok, tokenizer):  # native and fallback rendering
        with pytest.raises(APIError) as err:
            render_messages(template, history, [ToolDefinition.model_validate(WEATHER)], parallel_tool_calls=True)
        assert err.value.status == 400 and err.value.param == "messages[2].tool_calls[0].function.arguments"
        assert word in err.value.message


SCRIPT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = SCRIPT + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer, TWO_CALLS, per_step=2)
    app = create_app(Settings.load(), lambda _s: engine)
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60), engine


def ask(client, **extra):
    return client.chat.completions.create(
        model="scripted-model", messages=[{"role": "user", "content": "Weather?"}], **extra
    )


def test_sdk_tool_calls_not_streamed(scripted):
    client, engine = scripted
    resp = ask(client, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert "get_weather" in engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)  # the model saw it
    # the SDK's own message object goes back into the history (with a tool result) and is accepted
    history = [{"role": "user", "content": "Weather?"}, choice.message.model_dump(),
               *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls)]
    again = client.chat.completions.create(model="scripted-model", messages=history, tools=[WEATHER])
    assert again.choices[0].finish_reason == "tool_calls"


def test_sdk_tool_calls_streamed(scripted):
    client, _ = scripted
    chunks = list(ask(client, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking."
    calls: dict[int, dict] = {}
    pieces = 0
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
            pieces += 1
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(v["id"].startswith("call_") for v in calls.values())
    assert pieces == len(calls)  # each call whole, once its block has ended
    for c in chunks:  # one entry per call per chunk, as OpenAI sends them (some clients read only the first)
        indexes = [d.index for d in (c.choices[0].delta.tool_calls or [])] if c.choices else []
        assert len(indexes) == len(set(indexes)), indexes
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_finishes_with_stop_as_openai_answers(scripted, stream):
    """OpenAI ends a choice forced to call a named function with finish_reason "stop" (required and auto:
    "tool_calls"), streamed or not; vLLM answers the same. The calls are there either way."""
    client, _ = scripted
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, reason in ((named, "stop"), ("required", "tool_calls"), ("auto", "tool_calls")):
        if stream:
            chunks = list(ask(client, tools=[WEATHER], tool_choice=choice, stream=True))
            calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            resp = ask(client, tools=[WEATHER], tool_choice=choice)
            calls, finish = resp.choices[0].message.tool_calls, resp.choices[0].finish_reason
        assert calls and all(c.function.name == "get_weather" for c in calls), choice
        assert finish == reason, choice


def test_parallel_tool_calls_false_stops_after_the_first_call(scripted):
    client, engine = scripted
    resp = ask(client, tools=[WEATHER], parallel_tool_calls=False)
    assert "</tool_call>" in engine.requests[-1].sampling.stop
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert resp.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_tools_leave_the_text_alone(scripted):
    client, engine = scripted
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        resp = ask(client, **extra)
        assert resp.choices[0].message.content == TWO_CALLS and not resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "stop"
        assert "get_weather" not in engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)


def test_each_streamed_choice_has_its_own_calls(scripted):
    client, _ = scripted
    chunks = list(ask(client, tools=[WEATHER], stream=True, n=2, parallel_tool_calls=False))
    per_choice: dict[int, list] = {0: [], 1: []}
    finish = {}
    for c in chunks:
        for choice in c.choices:
            per_choice[choice.index] += choice.delta.tool_calls or []
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    for calls in per_choice.values():
        assert {d.index for d in calls} == {0}  # one call each (parallel_tool_calls false), indexed per choice
        assert json.loads("".join(d.function.arguments or "" for d in calls)) == {"city": "Paris"}
    assert finish == {0: "tool_calls", 1: "tool_calls"}


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LOOP = "Checking." + "\n".join([CALL] * 30)  # what greedy SmolLM2-135M does under tool_choice required


@pytest.fixture(scope="module")
def looping(tokenizer):
    engine = ScriptedEngine(tokenizer, LOOP, per_step=3, step_s=0.01)
    app = create_app(Settings.load(), lambda _s: engine)
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60), engine


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_that_repeats_its_call_ends_after_the_first(looping, tokenizer, stream):
    """The repeat is not a parallel call: one call, finish_reason tool_calls, and the engine stops generating
    the choice instead of running to max_tokens; usage counts the tokens up to the end of the repeat."""
    client, engine = looping
    before = len(engine.aborted)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    resp = ask(client, tools=[WEATHER], tool_choice="required", max_tokens=1000, stream=stream, **extra)
    if stream:
        chunks = list(resp)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert [(d.function.name, d.function.arguments) for d in calls] == [("get_weather", '{"city": "Paris"}')]
    else:
        calls = resp.choices[0].message.tool_calls
        content, finish, usage = resp.choices[0].message.content, [resp.choices[0].finish_reason], resp.usage
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert content == "Checking." and finish == ["tool_calls"]
    script = engine.script_ids
    two_calls = len(tokenizer.encode("Checking." + "\n".join([CALL] * 2), add_special_tokens=False))
    assert usage.completion_tokens == two_calls  # through the repeat, whatever the engine generated after it
    deadline = time.monotonic() + 10  # the worker drops the choice at its next step boundary
    while len(engine.aborted) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == before + 1 and engine.aborted[-1][1] < len(script)  # stopped, not run out


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["second call", "first call", "second tag"])
def test_a_call_cut_by_max_tokens_is_dropped(looping, tokenizer, stream, where):
    """max_tokens inside a later call: the cut call is dropped and the reply is the whole calls before it,
    finishing `tool_calls` (the calls closed the answer, as vLLM's call array closes); inside the only call:
    nothing, `length` (the SDK's parse() raises LengthFinishReasonError, as with OpenAI)."""
    client, _ = looping
    first = len(tokenizer.encode("Checking." + CALL, add_special_tokens=False))
    tag = len(tokenizer.encode("Checking." + CALL + "\n<tool", add_special_tokens=False))
    max_tokens = {"second call": first + 6, "first call": first - 12, "second tag": tag}[where]
    resp = ask(client, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens, stream=stream)
    if stream:
        chunks = list(resp)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        calls = resp.choices[0].message.tool_calls or []
        content, finish = resp.choices[0].message.content, [resp.choices[0].finish_reason]
    assert content == "Checking."
    if where == "first call":
        assert finish == ["length"] and not calls
    else:
        assert finish == ["tool_calls"]
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]  # the whole one only

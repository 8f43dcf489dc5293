"""The Responses API (`POST /v1/responses`) with the `openai` package's own helpers: `responses.create`
(plain and streamed), `responses.stream`, `responses.parse` with `text_format`, a function tool round
trip (output items sent back, and `previous_response_id`), stored responses; greedy text identical with
every speculation method; bad input a 4xx naming the field."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from server.api.app import create_app
from server.api.response_store import ResponseStore, StoredResponse
from server.config import Settings
from tests.api_helpers import MODEL
from tests.live_server import live_server, serve_app
from tests.scripted_engine import ScriptedEngine

SCRIPTED = "scripted-model"
GREETING = "Hello there! How can I help you today?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def scripted_server(tokenizer, script: str):
    engine = ScriptedEngine(tokenizer, script, per_step=3, step_s=0.002)
    app = create_app(Settings.load(), lambda _s: engine)
    return engine, serve_app(app)


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greeting(tokenizer):
    engine, server = scripted_server(tokenizer, GREETING)
    with server as url:
        yield client_for(url), engine, url


@pytest.fixture(scope="module")
def calling(tokenizer):
    engine, server = scripted_server(tokenizer, "Checking." + CALL + "\n" + CALL)  # repeats its call
    with server as url:
        yield client_for(url), engine


@pytest.fixture(scope="module")
def tiny(tiny_target, tiny_draft):
    with live_server(tiny_target, tiny_draft) as (url, _app):
        yield client_for(url), url


def test_create_plain_and_stored(greeting):
    client, engine, _ = greeting
    resp = client.responses.create(model=SCRIPTED, input="Hi!", instructions="Be kind.")
    assert resp.object == "response" and resp.status == "completed" and resp.output_text == GREETING
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    usage = resp.usage
    assert usage.output_tokens == len(engine.script_ids)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.model_extra["speculation"]["decode_steps"] > 0
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert "Be kind." in prompt and "Hi!" in prompt
    assert resp.instructions == "Be kind." and resp.store is True and resp.tool_choice == "auto"
    again = client.responses.retrieve(resp.id)
    assert again.output_text == GREETING and again.id == resp.id
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    unstored = client.responses.create(model=SCRIPTED, input="Hi!", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_with_the_sdks_helpers(greeting):
    client, _, url = greeting
    with client.responses.stream(model=SCRIPTED, input="Hi!") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == GREETING
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == GREETING and final.status == "completed" and final.usage.output_tokens > 0
    plain = list(client.responses.create(model=SCRIPTED, input="Hi!", stream=True))
    assert [e.type for e in plain] == kinds
    raw = httpx.post(f"{url}/v1/responses", json={"model": SCRIPTED, "input": "Hi!", "stream": True}, timeout=60)
    blocks = [b for b in raw.text.split("\n\n") if b.strip() and not b.startswith(":")]
    assert all(b.split("\n")[0] == f"event: {json.loads(b.split('data: ', 1)[1])['type']}" for b in blocks)
    assert "[DONE]" not in raw.text  # OpenAI's Responses streams end with response.completed


def test_max_output_tokens_makes_the_response_incomplete(greeting):
    client, _, _ = greeting
    resp = client.responses.create(model=SCRIPTED, input="Hi!", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 3
    events = list(client.responses.create(model=SCRIPTED, input="Hi!", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_previous_response_id_continues_the_conversation(greeting):
    client, engine, _ = greeting
    first = client.responses.create(model=SCRIPTED, input="My name is Ada.", instructions="Speak French.")
    second = client.responses.create(model=SCRIPTED, input="What is my name?", previous_response_id=first.id)
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert prompt.index("My name is Ada.") < prompt.index(GREETING) < prompt.index("What is my name?")
    assert "Speak French." not in prompt  # instructions are not carried over (OpenAI's rule)
    assert second.previous_response_id == first.id
    third = client.responses.create(model=SCRIPTED, input="And now?", previous_response_id=second.id)
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert prompt.count(GREETING) == 2 and "My name is Ada." in prompt and third.status == "completed"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=SCRIPTED, input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(calling, stream):
    """A call comes back as a function_call item (the repeat of it ends the answer, as on the chat route);
    sending the output items back with a function_call_output, or only the output with
    previous_response_id, shows the model the call and its result."""
    client, engine = calling
    if stream:
        with client.responses.stream(model=SCRIPTED, input="Weather in Paris?", tools=[WEATHER]) as s:
            events = list(s)
            resp = s.get_final_response()
        kinds = [e.type for e in events]
        assert kinds.count("response.function_call_arguments.done") == 1
        assert kinds.index("response.function_call_arguments.delta") > kinds.index("response.output_text.done")
    else:
        resp = client.responses.create(model=SCRIPTED, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required")
    assert resp.status == "completed" and [item.type for item in resp.output] == ["message", "function_call"]
    call = resp.output[1]
    assert resp.output_text == "Checking." and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
    history = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump() for i in resp.output], result]
    client.responses.create(model=SCRIPTED, input=history, tools=[WEATHER])
    sent_back = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert sent_back.count('"city": "Paris"') == 1 and "18 C and sunny" in sent_back
    client.responses.create(model=SCRIPTED, input=[result], previous_response_id=resp.id, tools=[WEATHER])
    assert engine.tokenizer.decode(engine.requests[-1].prompt_token_ids) == sent_back


class Answer(BaseModel):
    colour: Literal["red", "green", "blue"]
    sure: bool


@pytest.mark.slow
def test_text_format_follows_the_schema_through_the_chat_routes_grammar(tiny):
    client, _ = tiny
    parsed = client.responses.parse(model=MODEL, input="Pick a colour.", text_format=Answer, temperature=0,
                                     max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Answer), parsed.output_text
    schema = Answer.model_json_schema()
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}], temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema}},
    )
    assert chat.choices[0].message.content == parsed.output_text  # the same request, the same grammar
    loose = client.responses.create(model=MODEL, input="JSON please", temperature=0, max_output_tokens=40,
                                    text={"format": {"type": "json_object"}})
    assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "auto"])
def test_greedy_text_is_the_same_under_every_method(tiny, method):
    client, _ = tiny
    body = {"model": MODEL, "input": "Tell me a story about a cat.", "temperature": 0, "max_output_tokens": 24}
    plain = client.responses.create(**body, extra_body={"speculation": {"method": "none"}})
    spec = client.responses.create(**body, extra_body={"speculation": {"method": method, "num_tokens": 4}})
    assert spec.output_text == plain.output_text and spec.usage.output_tokens == plain.usage.output_tokens
    assert spec.usage.model_extra["speculation"]["method"] == method
    with client.responses.stream(**body, extra_body={"speculation": {"method": method}}) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert streamed == plain.output_text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0]"),
        ({"input": 5}, 400, "input"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, 400, None),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "input"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
         "text.format.schema"),
        ({"input": "x", "model": "gpt-4o"}, 404, "model"),
        ({"input": "x", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
        ({"input": "x", "speculation": {"method": "eagle"}}, 400, "speculation.method"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(tiny, body, status, param):
    _, url = tiny
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error")
    for chat_word in ("max_tokens", "max_completion_tokens", "messages", "response_format"):  # Responses wording
        assert chat_word not in error["message"], error
    streamed = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "stream": True, **body}, timeout=60)
    assert streamed.status_code == status  # refused before the stream starts


def test_input_items_lists_the_inputs_in_openais_shape_and_pages(greeting):
    """`GET /v1/responses/{id}/input_items` (the SDK's `responses.input_items.list`): the request's `input` items
    with ids (an item's own id kept), newest first by default, paged with `limit`, `after` and `before`."""
    client, _, url = greeting
    inputs = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}], "id": "msg_mine"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 18 C."}]},
        {"role": "user", "content": "Thanks"},
    ]
    resp = client.responses.create(model=SCRIPTED, input=inputs, max_output_tokens=8)
    listed = client.responses.input_items.list(resp.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "message", "function_call", "function_call_output",
                                                   "message", "message"]
    assert listed.data[1].id == "msg_mine" and listed.data[1].content[0].text == "Weather?"
    assert listed.data[2].name == "get_weather" and listed.data[3].output == "18 C"
    assert listed.data[4].content[0].type == "output_text" and listed.data[0].role == "system"
    assert len({item.id for item in listed.data}) == 6 and not listed.has_more
    newest = httpx.get(f"{url}/v1/responses/{resp.id}/input_items", params={"limit": 2}).json()
    assert [i["id"] for i in newest["data"]] == [listed.data[5].id, listed.data[4].id] and newest["has_more"]
    assert newest["first_id"] == listed.data[5].id and newest["last_id"] == listed.data[4].id
    rest = httpx.get(f"{url}/v1/responses/{resp.id}/input_items", params={"after": newest["last_id"]}).json()
    assert [i["id"] for i in rest["data"]] == [i.id for i in listed.data[3::-1]] and not rest["has_more"]
    before = httpx.get(f"{url}/v1/responses/{resp.id}/input_items",
                       params={"order": "asc", "before": "msg_mine"}).json()
    assert [i["id"] for i in before["data"]] == [listed.data[0].id]
    text = client.responses.create(model=SCRIPTED, input="Hi", max_output_tokens=4)
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hi"
    for params, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "nope"}, "after")):
        r = httpx.get(f"{url}/v1/responses/{resp.id}/input_items", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    missing = httpx.get(f"{url}/v1/responses/resp_missing/input_items")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


@pytest.mark.slow
def test_the_store_keeps_the_newest_within_its_bytes():
    store = ResponseStore(max_bytes=100)

    def entry(i: int, size: int) -> StoredResponse:
        return StoredResponse({"id": f"resp_{i}"}, [], size)

    assert store.put(entry(1, 40)) and store.put(entry(2, 40))
    assert store.get("resp_1") is not None  # now the most recently used
    assert store.put(entry(3, 40))
    assert store.get("resp_2") is None and store.get("resp_1") and store.get("resp_3") and store.bytes == 80
    assert not store.put(entry(4, 101)) and len(store) == 2
    assert store.delete("resp_1") and not store.delete("resp_1") and store.bytes == 40

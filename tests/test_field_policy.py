"""The field policy: fields that cannot change the output are accepted with any value; fields that
would change it are honoured, or refused unless neutral; `top_p: 0` is greedy; `seed < 0` is unseeded."""

from __future__ import annotations

import pytest

from server.api.prompts import generation_requests
from server.api.schemas import ChatCompletionRequest, CompletionRequest
from tests.api_helpers import MODEL, chat_body, running_app

CHAT = "/v1/chat/completions"
INERT = {
    "store": True,
    "metadata": {"conversation": "42"},
    "service_tier": "flex",
    "prompt_cache_key": "user-7",
    "prompt_cache_retention": "24h",
    "safety_identifier": "hash-1",
    "user": "alice",
}
NULL_ONLY = ["audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"]


@pytest.fixture
async def client(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, c):
        yield c


async def test_inert_and_null_fields_are_accepted(client):
    nulls = dict.fromkeys(NULL_ONLY)
    body = chat_body(max_tokens=2, temperature=0, **INERT, **nulls, response_format={"type": "text"})
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    plain = await client.post(CHAT, json=chat_body(max_tokens=2, temperature=0))
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]  # they changed nothing
    streamed = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert (await client.post(CHAT, json=streamed)).status_code == 200


@pytest.mark.parametrize("field", NULL_ONLY)
async def test_output_changing_fields_without_an_implementation_are_named(client, field):
    r = await client.post(CHAT, json=chat_body(**{field: {"x": 1} if field != "reasoning_effort" else "low"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["code"] == "unsupported_field"


async def test_message_fields_an_sdk_round_trip_sends(client):
    history = [
        {"role": "developer", "content": "Be terse.", "name": "ops"},
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [], "audio": None,
         "function_call": None, "tool_calls": []},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "nothing found"},
        {"role": "function", "name": "lookup", "content": "legacy result"},
        {"role": "user", "content": [{"type": "text", "text": "ok?"}]},
    ]
    r = await client.post(CHAT, json={**chat_body(max_tokens=2), "messages": history})
    assert r.status_code == 200, r.text


async def test_keys_other_clients_add_inside_messages_are_ignored(client):
    """litellm adds `provider_specific_fields` to every assistant message (and tool call) it returns, and
    clients add `cache_control` to text parts: accepted and ignored, as vLLM does; the prompt is unchanged.
    Unknown top-level fields are still refused, and so are known message fields that would change the prompt."""
    tool_call = {"id": "c1", "type": "function", "index": 0, "provider_specific_fields": None,
                 "function": {"name": "lookup", "arguments": "{}", "provider_specific_fields": {"x": 1}}}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "tool_calls": [tool_call],
         "provider_specific_fields": {"refusal": None}, "reasoning_content": None, "thinking_blocks": None},
        {"role": "tool", "tool_call_id": "c1", "content": "nothing found", "metadata": {"ms": 3}},
    ]
    plain = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "nothing found"},
    ]
    r = await client.post(CHAT, json={**chat_body(max_tokens=3, temperature=0), "messages": history})
    assert r.status_code == 200, r.text
    same = await client.post(CHAT, json={**chat_body(max_tokens=3, temperature=0), "messages": plain})
    assert r.json()["usage"]["prompt_tokens"] == same.json()["usage"]["prompt_tokens"]
    assert r.json()["choices"][0]["message"] == same.json()["choices"][0]["message"]
    top = await client.post(CHAT, json=chat_body(provider_specific_fields={}))
    assert top.status_code == 400 and top.json()["error"]["param"] == "provider_specific_fields"
    refusal = [{"role": "assistant", "content": "x", "refusal": "I cannot."}, {"role": "user", "content": "ok"}]
    r = await client.post(CHAT, json={**chat_body(), "messages": refusal})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].refusal"


async def test_top_p_0_is_greedy(client):
    greedy = await client.post(CHAT, json=chat_body(max_tokens=6, temperature=0))
    top_p0 = await client.post(CHAT, json=chat_body(max_tokens=6, temperature=1.5, top_p=0))
    assert top_p0.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_negative_seed_means_unseeded(tokenizer):
    from server.api.prompts import ModelInfo
    from server.types import ServingLimits

    limits = ServingLimits(max_context=1024, vocab_size=len(tokenizer), methods=("none", "ngram", "auto"))
    info = ModelInfo(MODEL, tokenizer, limits, "none", 4, 16, 8)
    chat = ChatCompletionRequest.model_validate(chat_body(seed=-1, n=2))
    assert [r.sampling.seed for r in generation_requests(info, chat, "id", [[1, 2]], 4, None, "messages")] == [
        None, None]
    comp = CompletionRequest.model_validate({"model": MODEL, "prompt": "x", "seed": 5, "n": 2})
    assert [r.sampling.seed for r in generation_requests(info, comp, "id", [[1]], 4, None, "prompt")] == [5, 6]


def test_a_request_without_k_gets_autos_ceiling_or_the_fixed_methods_k(tokenizer):
    """`auto` picks K per step up to its own ceiling (`auto_max_speculative_tokens`); a fixed method drafts
    `num_speculative_tokens` every step; a request's own `num_tokens` overrides either."""
    from server.api.prompts import ModelInfo
    from server.types import ServingLimits

    limits = ServingLimits(max_context=1024, vocab_size=len(tokenizer), methods=("none", "ngram", "auto"))
    info = ModelInfo(MODEL, tokenizer, limits, "auto", 4, 16, 12)

    def k(**speculation) -> int:
        body = ChatCompletionRequest.model_validate(chat_body(**({"speculation": speculation} if speculation else {})))
        (req,) = generation_requests(info, body, "id", [[1, 2]], 4, None, "messages")
        return 0 if req.speculation.method == "none" else req.speculation.num_tokens

    assert k() == 12 and k(method="auto") == 12  # the server's default method is auto here
    assert k(method="ngram") == 4 and k(method="none") == 0
    assert k(method="auto", num_tokens=3) == 3 and k(method="ngram", num_tokens=6) == 6

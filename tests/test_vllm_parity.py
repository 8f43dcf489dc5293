"""What tools written for vLLM read: `/version`, `/tokenize` and `/detokenize` in vLLM's shapes, the model
card's `max_model_len` (and `root`, `parent`, `permission`), HEAD probes, and per-request speculation as
vLLM's `metrics.speculative_decoding` (what AIPerf reports acceptance from)."""

from __future__ import annotations

import pytest

from server import __version__
from tests.api_helpers import MODEL, chat_body, running_app, sse_json

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
async def client(tiny_engine_factory):
    async with running_app(tiny_engine_factory, api_key="k") as (_, c):
        c.headers["Authorization"] = "Bearer k"
        yield c


async def test_version_and_model_card(client):
    assert (await client.get("/version")).json() == {"version": __version__}
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["max_model_len"] == 1024 and card["root"] == MODEL and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    for path in ("/health", "/metrics"):
        head = await client.head(path)
        assert head.status_code == 200 and head.content == b""


async def test_tokenize_counts_what_the_generation_routes_count(client, tokenizer):
    prompt = await client.post("/tokenize", json={"prompt": "The sky is blue", "return_token_strs": True})
    body = prompt.json()
    assert prompt.status_code == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    done = await client.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is blue", "max_tokens": 1})
    assert done.json()["usage"]["prompt_tokens"] == body["count"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    chat = await client.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": [WEATHER]})
    answered = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1, messages=messages,
                                                                        tools=[WEATHER]))
    assert chat.json()["count"] == answered.json()["usage"]["prompt_tokens"]
    assert chat.json()["token_strs"] is None
    bare = await client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < (await client.post("/tokenize", json={"messages": messages})).json()["count"]
    back = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith("The sky is blue")


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
async def test_bad_tokenizer_requests_are_4xx_in_openais_shape(client, path, body, status, param):
    r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param or r.json()["error"]["param"].startswith(f"{param}.")


async def test_the_tokenizer_routes_take_the_key(client):
    r = await client.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert (await client.get("/version", headers={"Authorization": ""})).status_code == 200


def check_vllm_shape(metrics: dict, usage: dict) -> None:
    """The invariants AIPerf's vLLM adapter checks before it reports a request's acceptance."""
    spec = metrics["speculative_decoding"]
    histogram = spec["acceptance_histogram"]
    assert len(histogram) == spec["num_spec_tokens"] + 1 and all(type(n) is int and n >= 0 for n in histogram)
    assert sum(histogram) == spec["num_spec_steps"] == usage["speculation"]["decode_steps"]
    assert sum(j * n for j, n in enumerate(histogram)) == spec["num_accepted_draft_tokens"]
    assert spec["num_accepted_draft_tokens"] == usage["speculation"]["accepted_tokens"] <= spec["num_draft_tokens"]
    steps = spec["num_spec_steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(usage["speculation"]["acceptance_rate"])


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_per_request_speculation_in_vllms_shape(client, route):
    base = chat_body(max_tokens=12, temperature=0) if "chat" in route else {
        "model": MODEL, "prompt": "The sky is", "max_tokens": 12, "temperature": 0}
    for method in ("draft", "ngram", "none"):
        body = {**base, "speculation": {"method": method, "num_tokens": 3}}
        answer = (await client.post(route, json=body)).json()
        check_vllm_shape(answer["metrics"], answer["usage"])
        assert answer["metrics"]["speculative_decoding"]["num_spec_tokens"] == (0 if method == "none" else 3)
        stream = await client.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = sse_json(stream.text)
        assert [c for c in chunks if "metrics" in c] == [chunks[-1]] and chunks[-1]["choices"] == []
        check_vllm_shape(chunks[-1]["metrics"], chunks[-1]["usage"])
    several = (await client.post(route, json={**base, "n": 2})).json()
    assert "metrics" not in several  # per request of one sequence, as vLLM reports it

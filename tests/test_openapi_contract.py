"""The OpenAPI document is honest: every status a route answers is documented with the OpenAI error
schema, the 200 bodies have their real schemas, and schemathesis finds no 5xx and no answer that
breaks the document, against a live server on the tiny engine (bounded: a fixed number of examples
per operation, max_tokens and n capped)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.api.app import create_app
from server.api.openapi import OPERATIONS
from server.config import Settings
from tests.live_server import live_server

MODEL = "tiny-target"
EXAMPLES = 12  # per operation and generation mode: a fixed, small number keeps the run to seconds
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ERROR_REF = "#/components/schemas/ErrorResponse"
CHUNK_REF = "#/components/schemas/ChatCompletionChunk"
# Requests every run sends besides the generated ones: streams (each SSE event checked against its schema),
# logprobs and per-token origins, so those answers' schemas are exercised whatever hypothesis draws.
EXPLICIT: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "n": 2,
         "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True, "include_speculation": True}},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
         "speculation": {"method": "draft", "num_tokens": 2, "include_tokens": True}},
    ],
    "/v1/completions": [
        {"prompt": ["Hi", [1, 2, 3]], "max_tokens": 3, "stream": True, "logprobs": 2,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_speculation": True}},
        {"prompt": "Hi", "max_tokens": 3, "logprobs": 1, "n": 2, "speculation": {"include_tokens": True}},
    ],
    "/v1/responses": [
        {"input": "Hi", "max_output_tokens": 3, "stream": True, "instructions": "Be brief."},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], "max_output_tokens": 3,
         "text": {"format": {"type": "json_object"}}, "speculation": {"method": "draft", "num_tokens": 2}},
    ],
    "/tokenize": [
        {"prompt": "Hi", "return_token_strs": True},
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
    ],
}


def _doc(**overrides: Any) -> dict[str, Any]:
    return create_app(Settings.load(**overrides)).openapi()


def _statuses(doc: dict[str, Any], path: str, method: str) -> set[str]:
    return set(doc["paths"][path][method]["responses"])


def test_generation_routes_document_every_status_they_answer_and_never_422():
    doc = _doc(api_key="k")
    for path, ok in (("/v1/chat/completions", "ChatCompletion"), ("/v1/completions", "Completion")):
        responses = doc["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503"}
        for status, response in responses.items():
            if status != "200":
                assert response["content"]["application/json"]["schema"]["$ref"] == ERROR_REF
        content = responses["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith(f"/{ok}")
        assert "text/event-stream" in content
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body.endswith("Request")
    event = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = event["schema"]["else"]["properties"]["data"]
    assert data["contentMediaType"] == "application/json"
    assert {s["$ref"] for s in data["contentSchema"]["anyOf"]} == {CHUNK_REF, ERROR_REF}
    assert _statuses(doc, "/v1/models", "get") == {"200", "401", "503"}
    assert _statuses(doc, "/v1/models/{model_id}", "get") == {"200", "401", "404", "503"}
    text = str(doc)
    assert "422" not in _statuses(doc, "/v1/models/{model_id}", "get") and "HTTPValidationError" not in text
    metrics = doc["paths"]["/metrics"]["get"]["responses"]
    assert set(metrics["200"]["content"]) == {"text/plain"} and set(metrics) == {"200", "503"}
    models = doc["components"]["schemas"]["ModelList"]
    assert models["properties"]["data"]["items"]["$ref"].endswith("/Model")


def test_every_route_in_the_document_is_described_by_the_table():
    doc = _doc()
    assert {(path, method) for path, methods in doc["paths"].items() for method in methods} == set(OPERATIONS)


def test_401_is_documented_only_where_a_key_is_required():
    open_doc = _doc()
    assert "401" not in _statuses(open_doc, "/v1/chat/completions", "post")
    assert "securitySchemes" not in open_doc["components"]
    protected = _doc(api_key="k", protect_metrics=True)
    assert "401" in _statuses(protected, "/metrics", "get")
    assert protected["paths"]["/metrics"]["get"]["security"] == [{"bearer": []}]


def _capped(case: Any) -> None:
    """Keep generated requests cheap (a few tokens, at most 2 choices) and aimed at the served model, so
    they reach the engine rather than a 404. Positive cases' messages also get what the schema cannot
    say (text content; tool roles' ids), or nearly none would get past validation to the engine."""
    body = case.body
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 3:
            body[key] = 3
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
    if positive and isinstance(body.get("messages"), list):
        body["messages"] = [_plain_message(m) for m in body["messages"]]


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    role = message["role"] if message["role"] in ("system", "developer", "user", "assistant") else "user"
    content = message.get("content")
    return {"role": role, "content": content if isinstance(content, str) else "Hello"}


def _fuzz(operation: Any, url: str, statuses: set[int]) -> None:
    """EXAMPLES positive and negative cases of one operation, plus its EXPLICIT ones, against `url`,
    each answer checked."""
    strategy = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )

    def check(case: Any) -> None:
        _capped(case)
        response = case.call(base_url=url, timeout=60)
        statuses.add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    test = given(case=strategy)(check)
    for body in EXPLICIT.get(operation.path, []):
        test = example(case=operation.Case(body={"model": MODEL, **body}, media_type="application/json"))(test)
    settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )(test)()


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_violation(tiny_target, tiny_draft):
    started = time.monotonic()
    with live_server(tiny_target, tiny_draft, max_batch_size=4, max_waiting=8) as (url, _app):
        schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json").json())
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/metrics"}
        statuses: dict[str, set[int]] = {}
        for operation in operations:
            _fuzz(operation, url, statuses.setdefault(operation.label, set()))
    print(f"schemathesis: {time.monotonic() - started:.1f} s; statuses {statuses}")
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /tokenize"):
        assert {200, 400} <= statuses[route]  # both the engine and the validation paths were exercised


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc"])
async def test_protect_metrics_puts_metrics_and_docs_behind_the_key(path, tiny_engine_factory):
    from tests.api_helpers import running_app

    async with running_app(tiny_engine_factory, api_key="sekrit", protect_metrics=True) as (_, client):
        r = await client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get(path, headers={"Authorization": "Bearer sekrit"})).status_code == 200
    async with running_app(tiny_engine_factory, api_key="sekrit") as (_, client):
        assert (await client.get(path)).status_code == 200  # default: Prometheus scrapes without a key


def test_protect_metrics_without_a_key_is_a_configuration_error():
    with pytest.raises(ValueError, match="protect_metrics needs an api_key"):
        Settings.load(protect_metrics=True)

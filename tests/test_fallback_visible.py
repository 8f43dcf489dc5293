"""A method that fails safe says so (tiny models, the real app in-process): the request's
`usage.speculation.fallbacks` names the proposer it lost and why, `/health` lists the part under `degraded`, and
`specula_spec_decode_fallbacks_total` counts the fallback; a request whose method ran has `fallbacks: []`.

The draft proposer raises at every draft here (the shape of the bf16 self-draft bug: a method that failed at each
step and, turned off by the fail-safe, answered as plain decoding with nothing in the response to say so).
"""

from __future__ import annotations

import pytest

from server.failsafe import SWITCH_OFF_AFTER
from server.speculation.draft_model import DraftModelProposer
from tests.api_helpers import chat_body, running_app, sse_json
from tests.metrics_helpers import sum_samples

CHAT = "/v1/chat/completions"
COPY = "a b c a b c a b c a b c"


class Injected(RuntimeError):
    pass


@pytest.fixture
async def client(tiny_engine_factory, monkeypatch):
    def broken(self, seqs, ks):  # noqa: ANN001
        raise Injected("Expected attn_mask dtype to match query dtype (this text stays in the server's log)")

    monkeypatch.setattr(DraftModelProposer, "propose", broken)
    async with running_app(tiny_engine_factory) as (_, c):
        yield c


def body(method: str, **extra) -> dict:
    return chat_body(COPY, max_tokens=8, temperature=0, speculation={"method": method, "num_tokens": 4}, **extra)


def fallbacks(metrics: bytes, **labels: str) -> float:
    return sum_samples(metrics, "specula_spec_decode_fallbacks_total", **labels)


async def test_a_method_that_fails_safe_is_named_in_usage_health_and_metrics(client):
    before = (await client.get("/metrics")).content
    assert fallbacks(before, method="draft", proposer="draft", reason="error") == 0  # exported from the start
    r = (await client.post(CHAT, json=body("draft"))).json()
    spec = r["usage"]["speculation"]
    assert spec["method"] == "draft" and spec["draft_tokens"] == 0
    assert spec["fallbacks"] == [{"proposer": "draft", "reason": "error", "error": "Injected"}]
    assert "attn_mask" not in str(r)  # the exception's message is for the log, not the client
    health = (await client.get("/health")).json()
    assert health["status"] == "ok"
    assert health["degraded"]["proposer:draft"] == {"failures": 1, "off": False, "error": "Injected"}
    metrics = (await client.get("/metrics")).content
    assert fallbacks(metrics, method="draft", proposer="draft", reason="error") == 1
    ok = (await client.post(CHAT, json=body("ngram"))).json()["usage"]["speculation"]
    assert ok["fallbacks"] == [] and ok["draft_tokens"] > 0  # a method that ran says it lost nothing


@pytest.mark.slow
async def test_a_switched_off_proposer_is_named_for_every_request_that_would_use_it(client):
    for _ in range(SWITCH_OFF_AFTER):  # each request's first draft fails once: then it is off until restart
        await client.post(CHAT, json=body("draft"))
    assert (await client.get("/health")).json()["degraded"]["proposer:draft"]["off"] is True
    streamed = (await client.post(CHAT, json=body("auto", stream=True, stream_options={"include_usage": True})))
    usage = [c for c in sse_json(streamed.text) if c.get("usage")][-1]["usage"]
    assert {"proposer": "draft", "reason": "switched_off", "error": "Injected"} in usage["speculation"]["fallbacks"]
    fixed = (await client.post(CHAT, json=body("draft"))).json()["usage"]["speculation"]
    assert fixed["fallbacks"] == [{"proposer": "draft", "reason": "switched_off", "error": "Injected"}]
    metrics = (await client.get("/metrics")).content
    assert fallbacks(metrics, method="draft", proposer="draft", reason="error") == SWITCH_OFF_AFTER
    assert fallbacks(metrics, method="draft", proposer="draft", reason="switched_off") == 1
    assert fallbacks(metrics, method="auto", proposer="draft", reason="switched_off") == 1

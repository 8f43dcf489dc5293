"""In-process API tests (httpx against the ASGI app, tiny models): routes, shapes, SSE framing."""

from __future__ import annotations

import asyncio
import json
import threading

from server.api.app import create_app
from server.api.state import PUBLIC_ERRORS
from server.config import Settings
from tests.api_helpers import MODEL, chat_body, running_app, sse_data, sse_json

DEFAULTS = Settings.load()
SPEC_KEYS = {"method", "draft_tokens", "accepted_tokens", "acceptance_rate", "decode_steps", "by_proposer",
             "fallbacks"}


async def test_health_is_503_while_loading_then_200(tiny_engine_factory):
    release = threading.Event()

    def slow_factory(_settings):
        release.wait(30)
        return tiny_engine_factory()

    app = create_app(Settings.load(), slow_factory)
    async with app.router.lifespan_context(app):
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.get("/health")
            assert (r.status_code, r.json()["status"]) == (503, "loading")
            r = await client.post("/v1/chat/completions", json=chat_body())
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
            release.set()
            await app.state.specula.wait_ready(60)
            assert (await client.get("/health")).status_code == 200


async def test_health_reports_a_failed_load_without_its_details_which_are_logged(caplog):
    """/health and 503s need no key: they say the load failed, never the exception (paths, internals)."""

    def broken(_settings):
        raise FileNotFoundError("/srv/secret/models/llama: no such model")

    caplog.set_level("ERROR", logger="server.api.state")
    app = create_app(Settings.load(), broken)
    async with app.router.lifespan_context(app):
        assert await app.state.specula.wait_ready(10) == "failed"
        import httpx

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "failed", "error": PUBLIC_ERRORS["failed"]}
            late = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert late.status_code == 503 and late.json()["error"]["message"] == PUBLIC_ERRORS["failed"]
            for answer in (r, late):
                assert "secret" not in answer.text and "FileNotFoundError" not in answer.text
    assert "/srv/secret/models/llama: no such model" in caplog.text  # the operator's log says why


async def test_models_docs_and_metrics(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert {"id", "object", "created", "owned_by"} <= models["data"][0].keys()
        assert models["data"][0]["weights"] == "fp32"  # the weights format served (the tiny target: dense fp32)
        assert models["data"][0]["activations"] == "float32"
        assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        r = await client.get("/v1/models/gpt-4")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "/v1/chat/completions" in (await client.get("/openapi.json")).json()["paths"]
        assert (await client.get("/docs")).status_code == 200
        await client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "specula_spec_decode_steps_total" in r.text


async def test_chat_completion_shape(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=6, temperature=0))
        assert r.status_code == 200
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        assert isinstance(body["created"], int) and body["model"] == MODEL
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["logprobs"] is None
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["completion_tokens"] <= 6 and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert set(usage["speculation"]) == SPEC_KEYS and usage["speculation"]["method"] == DEFAULTS.speculation


async def test_content_parts_and_system_messages_use_the_chat_template(tiny_engine_factory, tokenizer):
    async with running_app(tiny_engine_factory) as (_, client):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Again"},
        ]
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Hi there"} for m in messages]
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_stream_and_non_stream_give_the_same_greedy_text(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        req = chat_body("Tell me a story", max_tokens=12, temperature=0)
        whole = (await client.post("/v1/chat/completions", json=req)).json()
        r = await client.post("/v1/chat/completions", json={**req, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_json(r.text)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["delta"] == {}
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]

        comp = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
        whole = (await client.post("/v1/completions", json=comp)).json()
        chunks = sse_json((await client.post("/v1/completions", json={**comp, "stream": True})).text)
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_stream_usage_chunk_comes_last_before_done(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        req = chat_body(max_tokens=5, n=2, stream=True, stream_options={"include_usage": True})
        r = await client.post("/v1/chat/completions", json=req)
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        chunks = sse_json(r.text)
        *body, final = chunks
        assert all(c["usage"] is None for c in body)
        assert final["choices"] == [] and set(final["usage"]["speculation"]) == SPEC_KEYS
        roles = [c["choices"][0]["index"] for c in body if "role" in c["choices"][0]["delta"]]
        assert sorted(roles) == [0, 1]
        finishes = [c["choices"][0] for c in body if c["choices"][0]["finish_reason"]]
        assert sorted(f["index"] for f in finishes) == [0, 1]
        tokens = final["usage"]["completion_tokens"]
        assert tokens <= 10 and final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + tokens

        comp = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
        chunks = sse_json(
            (await client.post("/v1/completions", json={**comp, "stream_options": {"include_usage": True}})).text
        )
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 3


async def test_n_choices_with_seed_are_reproducible_and_usage_sums(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        # a fixed method: `auto` picks K from measured step times, so its random draws vary run to run
        spec = {"method": "ngram", "num_tokens": 4}
        req = chat_body("Pick a word", max_tokens=6, n=3, seed=7, temperature=1.0, speculation=spec)
        a = (await client.post("/v1/chat/completions", json=req)).json()
        b = (await client.post("/v1/chat/completions", json=req)).json()
        assert [c["index"] for c in a["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
        spec = a["usage"]["speculation"]
        assert spec["decode_steps"] >= a["usage"]["completion_tokens"] / (1 + 4) > 0
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]


async def test_completion_prompt_forms(tiny_engine_factory, tokenizer):
    async with running_app(tiny_engine_factory) as (_, client):
        ids = tokenizer("The quick brown fox")["input_ids"]
        base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
        by_text = (await client.post("/v1/completions", json={**base, "prompt": "The quick brown fox"})).json()
        by_ids = (await client.post("/v1/completions", json={**base, "prompt": ids})).json()
        assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
        assert by_text["usage"]["prompt_tokens"] == len(ids)
        many = (
            await client.post("/v1/completions", json={**base, "prompt": ["a", "The quick brown fox"], "n": 2})
        ).json()
        assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]  # prompt-major
        assert many["choices"][2]["text"] == by_text["choices"][0]["text"]
        lists = (await client.post("/v1/completions", json={**base, "prompt": [ids, ids[:2]]})).json()
        assert lists["choices"][0]["text"] == by_text["choices"][0]["text"]
        assert lists["usage"]["prompt_tokens"] == len(ids) + 2


async def test_stop_string_is_honoured(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        base = {"model": MODEL, "prompt": "Count with me", "max_tokens": 12, "temperature": 0}
        full = (await client.post("/v1/completions", json=base)).json()["choices"][0]["text"]
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        assert stop.strip()
        cut = (await client.post("/v1/completions", json={**base, "stop": [stop]})).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["text"] == full[: full.index(stop)]
        chunks = sse_json((await client.post("/v1/completions", json={**base, "stop": stop, "stream": True})).text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]


async def test_logprobs_shapes(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        chat = (
            await client.post("/v1/chat/completions", json=chat_body(max_tokens=4, logprobs=True, top_logprobs=3))
        ).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == chat["usage"]["completion_tokens"]
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 3
            assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]
        comp = (
            # greedy: a sampled token could be half of a multi-byte character, whose own decoded
            # string then differs from its share of the text (as in OpenAI's API)
            await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 2, "temperature": 0},
            )
        ).json()
        lp = comp["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert "".join(lp["tokens"]) == comp["choices"][0]["text"]
        assert lp["text_offset"][0] == 0 and all(len(t) <= 2 for t in lp["top_logprobs"])
        greedy = chat_body(max_tokens=4, logprobs=True, temperature=0)
        whole = (await client.post("/v1/chat/completions", json=greedy)).json()["choices"][0]["logprobs"]["content"]
        chunks = sse_json((await client.post("/v1/chat/completions", json={**greedy, "stream": True})).text)
        streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        assert [e["token"] for e in streamed] == [e["token"] for e in whole]


async def test_speculation_extension_field(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        outs = {}
        for method in ("none", "ngram", "draft", "auto"):
            req = chat_body(
                "Repeat: a b c a b c a b c",
                max_tokens=10,
                temperature=0,
                speculation={"method": method, "num_tokens": 3},
            )
            body = (await client.post("/v1/chat/completions", json=req)).json()
            spec = body["usage"]["speculation"]
            assert spec["method"] == method
            outs[method] = body["choices"][0]["message"]["content"]
            if method == "none":
                assert spec["draft_tokens"] == 0 and spec["by_proposer"] == {}
            if method == "draft":
                assert spec["draft_tokens"] > 0
                assert spec["by_proposer"] == {
                    "draft": {"draft_tokens": spec["draft_tokens"], "accepted_tokens": spec["accepted_tokens"]}
                }
            assert sum(p["draft_tokens"] for p in spec["by_proposer"].values()) == spec["draft_tokens"]
        assert outs["none"] == outs["ngram"] == outs["draft"] == outs["auto"]  # greedy speculation is lossless


async def test_api_key_and_cors(tiny_engine_factory):
    async with running_app(tiny_engine_factory, api_key="sekrit", cors_origins=["http://ui.example"]) as (
        _,
        client,
    ):
        assert (await client.get("/health")).status_code == 200  # health needs no key
        r = await client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
        pre = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"


async def test_queue_full_is_429(tiny_engine_factory):
    async with running_app(tiny_engine_factory, max_batch_size=1, max_waiting=0) as (app, client):
        first = asyncio.create_task(
            client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 60, "temperature": 0})
        )
        sched = app.state.specula.scheduler
        while sched.num_running == 0:
            await asyncio.sleep(0.005)
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "b", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert (await first).status_code == 200


async def test_one_log_line_per_request_with_its_ttft(tiny_engine_factory, caplog):
    caplog.set_level("INFO", logger="specula.request")
    async with running_app(tiny_engine_factory) as (_, client):
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4, stream=stream, user="u1"))
            assert r.status_code == 200
    records = [json.loads(rec.getMessage().removeprefix("request ")) for rec in caplog.records
               if rec.name == "specula.request"]
    assert len(records) == 2
    for rec in records:
        assert rec["user"] == "u1" and rec["completion_tokens"] <= 4
        assert isinstance(rec["ttft_s"], float) and 0 <= rec["ttft_s"] <= rec["total_s"]

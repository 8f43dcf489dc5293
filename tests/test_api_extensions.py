"""vLLM's request extensions through the API (tiny models): ignore_eos, min_tokens, stop_token_ids,
continuous usage, include_stop_str_in_output, special tokens, tokens as ids; sampler fields."""

from __future__ import annotations

import pytest

from tests.api_helpers import chat_body, running_app, sse_json

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EOS = 2  # the tokenizer's EOS (<|im_end|>); tiny random models practically never pick it unbiased
IM_START = 1  # another special token (<|im_start|>)


def comp_body(prompt: str = "Hello there", max_tokens: int = 6, **extra):
    return {"model": "tiny-target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.fixture
async def client(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, c):
        yield c


async def test_ignore_eos_generates_past_eos(client):
    forced = {"logit_bias": {str(EOS): 100}}
    r = (await client.post(COMP, json=comp_body(**forced))).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    r = (await client.post(COMP, json=comp_body(ignore_eos=True, **forced))).json()
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    r = (await client.post(COMP, json=comp_body(ignore_eos=False, **forced))).json()
    assert r["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
async def test_min_tokens_holds_eos_back(client, method):
    body = comp_body(max_tokens=10, min_tokens=4, logit_bias={str(EOS): 100}, speculation={"method": method})
    r = (await client.post(COMP, json=body)).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "stop"


async def test_min_tokens_above_max_tokens_is_a_400(client):
    r = await client.post(COMP, json=comp_body(max_tokens=3, min_tokens=4))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


async def test_stop_token_ids_end_the_choice(client):
    plain = (await client.post(COMP, json=comp_body())).json()["choices"][0]["text"]
    r = (await client.post(COMP, json=comp_body(logit_bias={"300": 100}, stop_token_ids=[300]))).json()
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == ""
    kept = comp_body(logit_bias={"300": 100}, stop_token_ids=[300], include_stop_str_in_output=True)
    r = (await client.post(COMP, json=kept)).json()
    assert r["choices"][0]["text"] != "" and r["choices"][0]["text"] != plain
    bad = await client.post(COMP, json=comp_body(stop_token_ids=[10**7]))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


async def test_include_stop_str_in_output(client):
    full = (await client.post(COMP, json=comp_body(max_tokens=12, ignore_eos=True))).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and full.find(stop) > 0
    cut = full[: full.find(stop)]
    for stream in (False, True):
        body = comp_body(max_tokens=12, ignore_eos=True, stop=[stop], stream=stream)
        for include, expected in ((False, cut), (True, cut + stop)):
            r = await client.post(COMP, json={**body, "include_stop_str_in_output": include})
            if stream:
                text = "".join(c["choices"][0]["text"] for c in sse_json(r.text) if c["choices"])
            else:
                text = r.json()["choices"][0]["text"]
            assert text == expected


async def test_special_tokens_skipped_or_kept_with_or_without_spaces(client):
    body = comp_body(max_tokens=3, ignore_eos=True, logit_bias={str(IM_START): 100})
    assert (await client.post(COMP, json=body)).json()["choices"][0]["text"] == ""
    kept = {**body, "skip_special_tokens": False}
    text = (await client.post(COMP, json=kept)).json()["choices"][0]["text"]
    assert text.split() == ["<|im_start|>"] * 3 and text.count(" ") >= 2  # spaces between them by default
    kept["spaces_between_special_tokens"] = False
    assert (await client.post(COMP, json=kept)).json()["choices"][0]["text"] == "<|im_start|>" * 3


async def test_return_tokens_as_token_ids(client):
    r = (await client.post(COMP, json=comp_body(logprobs=1, return_tokens_as_token_ids=True))).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)
    body = chat_body(max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    content = (await client.post(CHAT, json=body)).json()["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in content)
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])


@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_continuous_usage_stats_on_every_chunk(client, path):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = chat_body(max_tokens=6, ignore_eos=True) if path == CHAT else comp_body(ignore_eos=True)
    chunks = sse_json((await client.post(path, json={**body, "stream": True, "stream_options": opts})).text)
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
    assert chunks[-1]["choices"] == []  # the final usage chunk (include_usage)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    only = {"continuous_usage_stats": True}
    chunks = sse_json((await client.post(path, json={**body, "stream": True, "stream_options": only})).text)
    assert all(c["usage"] is not None for c in chunks) and all(c["choices"] for c in chunks)  # no final chunk


async def test_sampler_fields(client):
    body = comp_body(logit_bias={"300": 100}, logprobs=0, return_tokens_as_token_ids=True)
    r = (await client.post(COMP, json=body)).json()
    assert r["choices"][0]["logprobs"]["tokens"] == ["token_id:300"] * 6
    for field, value in (("min_p", 0.5), ("repetition_penalty", 1.3), ("top_k", 5)):
        r = await client.post(COMP, json=comp_body(temperature=1.0, seed=3, **{field: value}))
        assert r.status_code == 200, r.text
    for field, value, word in (
        ("logit_bias", {"x": 1}, "token id"),
        ("logit_bias", {"300": 101}, "100"),
        ("logit_bias", {str(10**7): 1}, "vocabulary"),
        ("min_p", 1.5, "less than"),
        ("repetition_penalty", 0, "greater than"),
    ):
        r = await client.post(COMP, json=comp_body(**{field: value}))
        assert r.status_code == 400, (field, value)
        assert r.json()["error"]["param"].startswith(field) and word in r.json()["error"]["message"]


async def test_cache_salt_scopes_drafts_from_earlier_answers(client):
    """vLLM's cache_salt: `suffix` drafts a repeated prompt's whole answer from an earlier request with the
    same salt, and nothing of it for another salt (so tenants cannot time each other's answers)."""
    def body(salt):
        extra = {"cache_salt": salt} if salt else {}
        return comp_body(prompt="A salted prompt", max_tokens=16, ignore_eos=True, speculation={"method": "suffix"},
                         **extra)

    first = (await client.post(COMP, json=body("tenant-1"))).json()
    again = (await client.post(COMP, json=body("tenant-1"))).json()
    other = (await client.post(COMP, json=body("tenant-2"))).json()
    unsalted = (await client.post(COMP, json=body(None))).json()
    texts = {r["choices"][0]["text"] for r in (first, other, unsalted)}  # same verify widths as `first`
    assert len(texts) == 1  # greedy: the salt never changes the text, only what is drafted
    drafted = {name: r["usage"]["speculation"] for name, r in
               (("first", first), ("again", again), ("other", other), ("unsalted", unsalted))}
    again = drafted["again"]  # tenant-1's answer, drafted from its pool (wider passes: floats may differ
    assert again["accepted_tokens"] >= 12  # in the last bit, so "all 16" is not promised)
    assert again["decode_steps"] < drafted["first"]["decode_steps"]
    assert drafted["first"]["accepted_tokens"] < again["accepted_tokens"]
    for name in ("other", "unsalted"):  # no earlier answer in their pools: only what the request's own text offers
        assert drafted[name]["accepted_tokens"] == drafted["first"]["accepted_tokens"], name


async def test_cache_salt_must_be_a_nonempty_string(client):
    for bad in ("", 7, "x" * 257):
        r = await client.post(COMP, json=comp_body(cache_salt=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", bad

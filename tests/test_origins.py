"""Per-token origins: the engine's `RequestOutput.sources` and the opt-in `speculation` on API choices."""

from __future__ import annotations

from collections import Counter

import pytest

from server.api.origins import OriginTracker
from server.config import Settings
from server.engine.engine import Engine
from server.types import RequestOutput, RequestStats, TokenSource
from tests.api_helpers import MODEL, chat_body, running_app, sse_json
from tests.engine_helpers import request

COPY = "Repeat this exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"
CYCLING = "tiny-cycling"
ORIGINS = {"accepted", "recovered", "bonus", "plain"}


def _check_step_shapes(sources: list[TokenSource], k: int, proposer: str) -> None:
    """Tokens of one step: some accepted then exactly one recovered/bonus (or one plain token)."""
    by_step: dict[int, list[TokenSource]] = {}
    for s in sources:
        by_step.setdefault(s.step, []).append(s)
    assert sorted(by_step) == list(range(len(by_step)))  # 0-based, no gaps
    for step in by_step.values():
        kinds = [s.origin for s in step]
        if "plain" in kinds:
            assert kinds == ["plain"] and step[0].proposer is None
            continue
        *accepted, last = kinds
        assert set(accepted) <= {"accepted"} and len(accepted) <= k
        # the last step may be cut at max_tokens or a stop; every full step ends in recovered or bonus
        assert last in ("recovered", "bonus", "accepted")
        assert last != "bonus" or len(accepted) == k
        assert {s.proposer for s in step} == {proposer}


def _run_engine(engine, req) -> list[RequestOutput]:
    engine.add_requests([req])
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step().outputs if o.request_id == req.request_id)
    return outs


@pytest.fixture
def cycling_factory(cycling_target):
    """`factory(**settings_overrides) -> Engine` on the model that repeats a sentence (no draft)."""
    return lambda **overrides: Engine(cycling_target, None, Settings.load(**overrides))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_sources_match_tokens_and_stats(tiny_engine_factory, cycling_factory, prompt_ids, method):
    # n-gram drafts land on the model that repeats itself; the draft model on the tiny pair
    engine = cycling_factory() if method == "ngram" else tiny_engine_factory()
    req = request("r", prompt_ids[1], method, 3, max_tokens=40)
    outs = _run_engine(engine, req)
    sources = [s for o in outs for s in o.sources]
    for o in outs:
        assert len(o.sources) == len(o.token_ids)
    stats = outs[-1].stats
    count = Counter(s.origin for s in sources)
    assert sum(count.values()) == stats.completion_tokens == 40
    assert count["accepted"] == stats.accepted_tokens
    assert count["recovered"] == stats.recovered_tokens and count["bonus"] == stats.bonus_tokens
    assert count["plain"] == stats.decode_steps - stats.recovered_tokens - stats.bonus_tokens  # steps without drafts
    assert max(s.step for s in sources) + 1 == stats.decode_steps
    _check_step_shapes(sources, 3, method)
    assert count["accepted"] > 0


def test_engine_plain_tokens_without_speculation(tiny_engine_factory, prompt_ids):
    engine = tiny_engine_factory()
    outs = _run_engine(engine, request("p", prompt_ids[1], "none", max_tokens=6))
    sources = [s for o in outs for s in o.sources]
    assert sources == [TokenSource("plain", None, i) for i in range(6)]


def test_tracker_cuts_text_from_the_content_at_token_boundaries(tokenizer):
    """Text arrives in increments that do not follow tokens (held back, then released); the entries
    still split it at token boundaries and join to exactly the content."""
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(" héllo wörld, naïve café")
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    full = pieces[-1]
    tracker = OriginTracker(tokenizer, prompt)
    stats = RequestStats(method="ngram")
    half = len(ids) // 2
    released = full[: len(full) // 3]  # less than the first half's text: the rest is held back
    first = RequestOutput("x", ids[:half], released, None, False, None, stats,
                          [TokenSource("accepted", "ngram", 0)] * half)
    rest = len(ids) - half
    last = RequestOutput("x", ids[half:], full[len(released):], None, True, "length", stats,
                         [TokenSource("plain", None, 1)] * rest)
    a, b = tracker.feed(first), tracker.feed(last)
    entries = a["tokens"] + b["tokens"]
    assert len(entries) == len(ids)
    assert "".join(e["text"] for e in entries) == full
    # every entry is exactly its token's text (boundaries from decoding, text from the content)
    assert [e["text"] for e in entries] == [p[len(q):] for p, q in zip(pieces, ["", *pieces[:-1]], strict=True)]
    assert [e["origin"] for e in entries] == ["accepted"] * half + ["plain"] * rest
    assert "".join(e["text"] for e in a["tokens"]) == released[: len("".join(e["text"] for e in a["tokens"]))]


def test_tracker_gives_a_stop_cut_to_the_last_tokens(tokenizer):
    ids = tokenizer.encode(" one two three")
    tracker = OriginTracker(tokenizer, [1])
    out = RequestOutput("x", ids, " one tw", None, True, "stop", RequestStats(method="none"),
                        [TokenSource("plain", None, i) for i in range(len(ids))])
    entries = tracker.feed(out)["tokens"]
    assert len(entries) == len(ids) and "".join(e["text"] for e in entries) == " one tw"


async def test_stream_chunks_carry_origins_only_when_asked(cycling_factory):
    spec = {"method": "ngram", "num_tokens": 4}
    async with running_app(cycling_factory) as (_, client):
        body = chat_body(COPY, max_tokens=48, temperature=0, stream=True, speculation=spec, model=CYCLING)
        plain = sse_json((await client.post("/v1/chat/completions", json=body)).text)
        assert all("speculation" not in c for chunk in plain for c in chunk["choices"])

        body["stream_options"] = {"include_speculation": True, "include_usage": True}
        chunks = sse_json((await client.post("/v1/chat/completions", json=body)).text)
        content, entries, last_spec = "", [], None
        for chunk in chunks:
            for c in chunk["choices"]:
                content += c["delta"].get("content") or ""
                if "speculation" in c:
                    entries += c["speculation"]["tokens"]
                    last_spec = c["speculation"]
                    # no stop strings: each chunk's entries join to exactly its content
                    assert "".join(e["text"] for e in c["speculation"]["tokens"]) == c["delta"]["content"]
        usage = chunks[-1]["usage"]
        plain_text = "".join(c["delta"].get("content") or "" for ch in plain for c in ch["choices"])
        assert content == plain_text  # greedy: asking for origins changes nothing else
        assert "".join(e["text"] for e in entries) == content
        assert len(entries) == usage["completion_tokens"]
        assert {e["origin"] for e in entries} <= ORIGINS
        assert sum(e["origin"] == "accepted" for e in entries) == usage["speculation"]["accepted_tokens"] > 0
        assert {e["proposer"] for e in entries if e["origin"] != "plain"} == {"ngram"}
        assert last_spec["draft_tokens"] == usage["speculation"]["draft_tokens"]
        assert last_spec["decode_steps"] == usage["speculation"]["decode_steps"] == entries[-1]["step"] + 1


@pytest.mark.slow
async def test_non_streaming_choices_carry_origins_when_asked(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        spec = {"method": "draft", "num_tokens": 3}
        r = await client.post("/v1/chat/completions", json=chat_body(COPY, max_tokens=24, temperature=0,
                                                                     speculation=spec))
        assert "speculation" not in r.json()["choices"][0]
        spec["include_tokens"] = True
        body = (await client.post("/v1/chat/completions", json=chat_body(COPY, max_tokens=24, temperature=0,
                                                                          speculation=spec))).json()
        choice = body["choices"][0]
        tokens = choice["speculation"]["tokens"]
        assert "".join(t["text"] for t in tokens) == choice["message"]["content"]
        assert len(tokens) == body["usage"]["completion_tokens"]
        assert choice["speculation"]["accepted_tokens"] == body["usage"]["speculation"]["accepted_tokens"]

        comp = {"model": MODEL, "prompt": COPY, "max_tokens": 12, "temperature": 0, "n": 2,
                "speculation": {"method": "ngram", "include_tokens": True}}
        body = (await client.post("/v1/completions", json=comp)).json()
        for c in body["choices"]:
            assert "".join(t["text"] for t in c["speculation"]["tokens"]) == c["text"]
            assert len(c["speculation"]["tokens"]) == 12


async def test_completion_stream_origins_and_refusals(tiny_engine_factory):
    async with running_app(tiny_engine_factory) as (_, client):
        comp = {"model": MODEL, "prompt": COPY, "max_tokens": 10, "temperature": 0, "stream": True,
                "stream_options": {"include_speculation": True}, "speculation": {"method": "ngram"}}
        chunks = sse_json((await client.post("/v1/completions", json=comp)).text)
        text = "".join(c["text"] for ch in chunks for c in ch["choices"])
        tokens = [t for ch in chunks for c in ch["choices"] for t in c.get("speculation", {}).get("tokens", [])]
        assert "".join(t["text"] for t in tokens) == text and len(tokens) == 10

        # stream_options without stream, and a non-boolean flag, are refused with a 400
        bad = chat_body(stream_options={"include_speculation": True})
        r = await client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await client.post("/v1/chat/completions", json=chat_body(speculation={"include_tokens": "maybe"}))
        assert r.status_code == 400


async def test_model_card_names_methods_and_defaults(tiny_engine_factory):
    settings = {"speculation": "ngram", "num_speculative_tokens": 5, "auto_max_speculative_tokens": 12}
    async with running_app(tiny_engine_factory, **settings) as (_, client):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["speculation"] == {
            "methods": ["none", "ngram", "suffix", "draft", "auto"], "default_method": "ngram", "default_num_tokens": 5,
            "auto_max_num_tokens": 12,
        }
    async with running_app(tiny_engine_factory, draft=None) as (_, client):
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["speculation"]["methods"] == ["none", "ngram", "suffix", "auto"]


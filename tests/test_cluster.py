"""`python -m server cluster` end to end: two tiny-model replicas on a local Ray instance this module starts and
stops, against one server on the same checkpoint. Marked `ray` (`pytest -m ray` runs only these; `make test`
and CI run them with the rest). The replica-killing test runs last: it disturbs the cluster."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.config import Settings
from tests.cluster_helpers import API_KEY, AUTH, running_cluster, save_tiny, wait_for_replicas
from tests.live_server import serve_app
from tests.models import as_loaded, tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # slow: left out of make test-fast

CONVERSATIONS = [
    "You are a careful travel agent. Answer in one line.",
    "You are a terse code reviewer who only lists problems.",
    "You are a historian of the Roman republic; cite years.",
]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> Any:
    """The tiny target with a long context: streams that last (8,000 tokens) hold their replica's slots."""
    model = as_loaded(tiny_llama(len(tokenizer), seed=0, max_positions=8192), tokenizer, "tiny")
    return save_tiny(model, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory) -> Iterator[str]:
    with running_cluster(model_dir, tmp_path_factory.mktemp("cluster"), "--speculation", "ngram", "--max-batch-size",
                         "2", env={"SPECULA_MAX_WAITING": "1"}) as url:  # no flag for max_waiting: the environment
        yield url


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory) -> Iterator[str]:
    """One server on the same checkpoint and settings, loaded through the same path."""
    settings = Settings.load(target=str(model_dir), served_model_name="tiny", speculation="ngram", api_key=API_KEY,
                             calibrate=False, max_batch_size=2, max_waiting=1,
                             cache_dir=tmp_path_factory.mktemp("single-cache"))
    with serve_app(create_app(settings)) as url:
        yield url


def post(url: str, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def chat(system: str, *turns: str) -> list[dict]:
    return [{"role": "system", "content": system}, *({"role": "user", "content": t} for t in turns)]


def sse(lines: list[str]) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_two_replicas_answer_the_greedy_text_of_one_server(cluster, single):
    bodies = [
        ("/v1/chat/completions", {"messages": chat(CONVERSATIONS[0], "Two days in Lisbon?"), "max_tokens": 12}),
        ("/v1/chat/completions", {"messages": chat(CONVERSATIONS[1], "def f(x): return x+1"), "max_tokens": 12}),
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12}),
        ("/v1/completions", {"prompt": "Speculative decoding checks", "max_tokens": 12, "cache_salt": "a"}),
    ]
    for path, body in bodies:
        body = {"model": "tiny", "temperature": 0, **body}
        ours, theirs = post(cluster, path, body), post(single, path, body)
        assert ours.status_code == theirs.status_code == 200, ours.text
        a, b = ours.json(), theirs.json()
        assert [c.get("message", c).get("content", c.get("text")) for c in a["choices"]] == \
            [c.get("message", c).get("content", c.get("text")) for c in b["choices"]]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
        assert a["usage"]["speculation"]["method"] == "ngram"
        assert ours.headers["x-specula-replica"]


def test_streams_errors_auth_and_the_playground_pass_through(cluster, single):
    body = {"model": "tiny", "messages": chat(CONVERSATIONS[2], "Who was Cato?"), "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 10 and usage["speculation"]["method"] == "ngram"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e["choices"])
    whole = post(single, "/v1/chat/completions", {**body, "stream": False, "stream_options": None}).json()
    assert streamed == whole["choices"][0]["message"]["content"]

    for path, bad, headers in [
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, AUTH),  # 400
        ("/v1/completions", {"model": "tiny", "prompt": "x"}, None),  # 401: no key
        ("/v1/chat/completions", {"model": "nope", "messages": chat("s", "x")}, AUTH),  # 404: no such model
        ("/v1/nothing-here", {}, AUTH),  # 404: no such route
    ]:
        ours, theirs = post(cluster, path, bad, headers), post(single, path, bad, headers)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())
        assert 400 <= ours.status_code < 500 and set(ours.json()["error"]) >= {"message", "type", "param", "code"}

    models = httpx.get(f"{cluster}/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    page = httpx.get(f"{cluster}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    metrics = httpx.get(f"{cluster}/metrics", timeout=30).text
    replicas = {r["replica"] for r in httpx.get(f"{cluster}/health", timeout=30).json()["replicas"]}
    for name in replicas:
        assert f'vllm:num_requests_waiting{{engine="0",model_name="tiny",replica="{name}"}}' in metrics


def _running(url: str) -> int:
    replicas = httpx.get(f"{url}/health", timeout=30).json()["replicas"]
    return sum(r["running"] + r["waiting"] for r in replicas)


def test_a_client_that_disconnects_frees_its_slot(cluster):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _running(cluster) == 1
    deadline = time.monotonic() + 20
    while _running(cluster):
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.2)


def test_a_full_cluster_answers_429(cluster):
    """2 replicas x (2 batch slots + 1 waiting) ongoing and 1 more queued at the ingress: 7 long streams are
    taken (4 streaming, 3 waiting for a slot), the others get the single server's 429 (OpenAI's shape) while
    those are held, and the waiting ones run once slots free. Which of the last six wait is Ray's to decide
    (a burst is counted as queued until each is routed): the test counts, it does not assume an order."""
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    statuses: dict[int, int] = {}
    errors: list[dict] = []
    release = threading.Event()

    def one(i: int) -> None:
        with httpx.stream("POST", f"{cluster}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            statuses[i] = r.status_code
            if r.status_code != 200:
                errors.append(json.loads(r.read()))
            else:
                release.wait(120)

    def until(done, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, f"{what}: {statuses}"
            time.sleep(0.1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    try:
        for i in range(4):  # the replicas' batch slots, one stream at a time (however slow the host)
            threads[i].start()
            until(lambda i=i: statuses.get(i) == 200, 60, f"stream {i} was not taken")
        for t in threads[4:]:
            t.start()
            time.sleep(0.5)
        until(lambda: sum(s == 429 for s in statuses.values()) == 3, 60, "no 429s while the cluster was full")
        time.sleep(1)
        assert len(statuses) == 7, statuses  # the 3 waiting ones have no answer yet
    finally:
        release.set()
        for t in threads:
            if t.is_alive():
                t.join(120)
    assert sorted(statuses.values()) == [200] * 7 + [429] * 3, statuses  # the waiting ones ran once slots freed
    assert all(e["error"]["type"] == "rate_limit_error" and e["error"]["code"] for e in errors)


def test_turns_of_one_conversation_go_to_one_replica(cluster):
    served: dict[int, set[str]] = {}
    cached: list[int] = []
    for i, system in enumerate(CONVERSATIONS):
        messages = chat(system, f"Question {i}: where do we start?")
        for turn in range(3):
            r = post(cluster, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 6,
                                                       "temperature": 0})
            assert r.status_code == 200, r.text
            served.setdefault(i, set()).add(r.headers["x-specula-replica"])
            if turn:
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert all(n > 0 for n in cached), cached  # each later turn found its earlier turns in that replica's cache


def test_stored_responses_are_continued_and_read_where_they_are_stored(cluster):
    """A Responses API response lives on the replica that made it: `previous_response_id` and GET go there."""
    for i in range(4):
        first = post(cluster, "/v1/responses", {"model": "tiny", "input": f"Topic {i}: lighthouses.",
                                                "max_output_tokens": 5})
        assert first.status_code == 200, first.text
        rid, home = first.json()["id"], first.headers["x-specula-replica"]
        later = post(cluster, "/v1/responses", {"model": "tiny", "input": "And then?", "previous_response_id": rid,
                                                "max_output_tokens": 5})
        assert later.status_code == 200, later.text
        assert later.headers["x-specula-replica"] == home
        got = httpx.get(f"{cluster}/v1/responses/{rid}", headers=AUTH, timeout=30)
        assert got.status_code == 200 and got.json()["id"] == rid and got.headers["x-specula-replica"] == home


def test_killing_a_replica_fails_only_its_requests_and_ray_replaces_it(cluster):
    before = {r["replica"]: r["pid"] for r in wait_for_replicas(cluster, 2, 60)}
    results: dict[int, tuple[str, list[Any]]] = {}
    replica_of: dict[int, str] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": f"Stream {i}: " + "tell a long story " * (i + 1), "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster}/v1/completions", json=body, headers=AUTH, timeout=90) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            first = next(lines)
            replica_of[i] = r.headers["x-specula-replica"]
            started.wait(30)
            results[i] = (r.headers["x-specula-replica"], sse([first, *lines]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # routed one by one: a burst would meet the ingress's 1-request queue
    started.wait(30)
    time.sleep(0.3)
    victim = replica_of[0]  # the streams on it must fail, the others finish
    os.kill(before[victim], signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert len(results) == 4
    for replica, events in results.values():
        assert events[-1] == "[DONE]"
        if replica == victim:
            assert events[-2]["error"]["code"] == "replica_unavailable", events[-2]
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
    r = post(cluster, "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-specula-replica"] != victim
    after = {r["replica"] for r in wait_for_replicas(cluster, 2, 120)}
    assert victim not in after and len(after) == 2  # Ray started a replica in its place

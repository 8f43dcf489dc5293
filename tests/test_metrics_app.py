"""The real app on loopback: /metrics after requests, and a real Prometheus scraping it.

Counters' growth must equal the sum of the responses' `usage.speculation`; the PromQL acceptance
rate must equal the one computed from the responses. Runs on the tiny random models (real engine)
and on the scheduler tests' `FakeEngine` (wiring only, no drafts).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.config import Settings
from tests.live_server import serve_app
from tests.metrics_helpers import REQUIRED_FAMILIES, family_names, sum_samples
from tests.prometheus_server import PROMETHEUS, Prometheus, run_prometheus

pytestmark = pytest.mark.slow  # left out of make test-fast (seconds each)


PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "one two three four five six seven eight nine ten one two three",
    "Fix the typos: teh cat sat on teh mat. The cat sat on the",
]


@dataclass
class LiveServer:
    url: str
    model: str
    prom: Prometheus | None  # started before any request, so its first samples are all zero
    usages: list[dict[str, Any]] = field(default_factory=list)  # every response's usage so far

    def metrics(self) -> bytes:
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        return r.content


@pytest.fixture(scope="module", params=["tiny", "fake"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The app served by uvicorn on a free loopback port once /health is 200, and Prometheus scraping it."""
    factory = engine_factory(request.param, request)
    settings = Settings.load(speculation="ngram", num_speculative_tokens=4, max_batch_size=4)
    with serve_app(create_app(settings, factory)) as url:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        if PROMETHEUS is None:
            yield LiveServer(url, model, None)
        else:
            with run_prometheus(url.removeprefix("http://"), tmp_path_factory.mktemp("prom")) as prom:
                prom.wait_for(
                    "a zero scrape", lambda: prom.scalar("sum(specula_spec_decode_steps_total)") == 0
                )
                yield LiveServer(url, model, prom)


def engine_factory(kind: str, request: pytest.FixtureRequest) -> Callable[[Settings], Any]:
    if kind == "fake":
        from tests.fake_engine import FakeEngine

        tokenizer = request.getfixturevalue("tokenizer")
        return lambda settings: FakeEngine(tokenizer)
    engine_mod = pytest.importorskip("server.engine.engine", reason="the engine has not landed yet")
    target, draft = request.getfixturevalue("tiny_target"), request.getfixturevalue("tiny_draft")
    return lambda settings: engine_mod.Engine(target, draft, settings)


def run_requests(live: LiveServer, methods: tuple[str, ...]) -> list[dict[str, Any]]:
    """A few completions per method (greedy and sampled, one streamed); returns their usage objects."""
    usages = []
    with httpx.Client(base_url=live.url, timeout=120) as client:
        for i, (method, prompt) in enumerate((m, p) for m in methods for p in PROMPTS[:3]):
            temperature = 0.0 if i % 2 else 0.8
            body = {"model": live.model, "prompt": prompt, "max_tokens": 12, "temperature": temperature,
                    "seed": i, "speculation": {"method": method, "num_tokens": 3 + i % 3}}  # fmt: skip
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        # Streamed, with usage in the last chunk.
        body = {"model": live.model, "prompt": PROMPTS[3], "max_tokens": 10, "stream": True,
                "stream_options": {"include_usage": True}, "speculation": {"method": methods[0]}}  # fmt: skip
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(lines[-1][len("data: ") :])["usage"])
    live.usages.extend(usages)
    return usages


def methods_for(live: LiveServer) -> tuple[str, ...]:
    return ("ngram", "draft", "none") if live.model != "fake-model" else ("none",)


def test_metrics_after_requests_match_usage(live: LiveServer) -> None:
    before = live.metrics()
    methods = methods_for(live)
    usages = run_requests(live, methods)
    bad = httpx.post(f"{live.url}/v1/completions", json={"model": live.model, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400
    after = live.metrics()

    assert set(REQUIRED_FAMILIES) <= family_names(after)
    for method in methods:
        mine = [u for u in usages if u["speculation"]["method"] == method]
        assert mine, method
        for metric, key in (
            ("specula_spec_decode_draft_tokens_total", "draft_tokens"),
            ("specula_spec_decode_accepted_tokens_total", "accepted_tokens"),
            ("specula_spec_decode_steps_total", "decode_steps"),
        ):
            delta = sum_samples(after, metric, method=method) - sum_samples(before, metric, method=method)
            assert delta == sum(u["speculation"][key] for u in mine), (metric, method)

    def delta(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    assert delta("specula_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    if live.model != "fake-model":  # FakeEngine leaves RequestStats.prompt_tokens at 0
        assert delta("specula_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("specula_requests_total") == len(usages)
    assert delta("specula_e2e_request_latency_seconds_count") == len(usages)
    assert delta("specula_time_to_first_token_seconds_count") == len(usages)
    # ITL: one observation per token after the first chunk; a first chunk carries at most K + 1 = 6
    # tokens (a request joins with a verify pass), and those count toward TTFT only.
    itl = delta("specula_inter_token_latency_seconds_count")
    after_first = sum(u["completion_tokens"] - 1 for u in usages)
    assert after_first - 5 * len(usages) <= itl <= after_first
    assert delta("specula_request_errors_total", status="400") == 1
    # The worker publishes load after delivering outputs: give it a moment.
    deadline = time.monotonic() + 10
    while sum_samples(live.metrics(), "specula_requests_running") != 0:
        assert time.monotonic() < deadline, "requests_running never went back to 0"
        time.sleep(0.05)


@pytest.mark.skipif(PROMETHEUS is None, reason="`prometheus` binary not installed (.ci/run installs it)")
def test_prometheus_acceptance_rate_equals_responses(live: LiveServer) -> None:
    prom = live.prom
    assert prom is not None
    methods = methods_for(live)
    run_requests(live, methods)
    # Every series started at 0 in Prometheus, so rate() over a window holding all samples is the
    # total growth times one extrapolation factor shared by all series (same scrape timestamps).
    want_steps = sum(u["speculation"]["decode_steps"] for u in live.usages)
    prom.wait_for(
        "the requests' samples", lambda: prom.scalar("sum(specula_spec_decode_steps_total)") == want_steps
    )
    for method in methods:
        mine = [u["speculation"] for u in live.usages if u["speculation"]["method"] == method]
        drafted = sum(s["draft_tokens"] for s in mine)
        if not drafted:
            assert method == "none" or live.model == "fake-model"
            continue
        sel = f'model="{live.model}", method="{method}"'
        assert prom.scalar(f"sum(specula_spec_decode_draft_tokens_total{{{sel}}})") == drafted
        rate = prom.scalar(
            f"sum(rate(specula_spec_decode_accepted_tokens_total{{{sel}}}[1h]))"
            f" / sum(rate(specula_spec_decode_draft_tokens_total{{{sel}}}[1h]))"
        )
        accepted = sum(s["accepted_tokens"] for s in mine)
        assert rate == pytest.approx(accepted / drafted, abs=1e-9), (method, mine)

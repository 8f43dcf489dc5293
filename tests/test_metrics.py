"""Metrics fed with synthetic engine steps: counters equal the requests' usage, per position, per token."""

from __future__ import annotations

import logging

import pytest

from server.metrics import Metrics
from server.request_log import format_request_line, log_request, request_record
from server.types import RequestStats, SeqStepStats, StepResult
from tests.metrics_helpers import (
    REQUIRED_FAMILIES,
    family_names,
    finished,
    new_metrics,
    samples,
    sum_samples,
    synthetic_steps,
)


def test_all_required_names_present_before_any_request() -> None:
    body, content_type = new_metrics().render()
    assert content_type.startswith("text/plain")
    assert set(REQUIRED_FAMILIES) <= family_names(body)


def test_counter_deltas_equal_sum_of_request_usage() -> None:
    m = new_metrics()
    before = m.render()[0]
    steps, stats = synthetic_steps(12, seed=1)
    for s in steps:
        m.observe_step(s)
    for st in stats.values():
        m.observe_request(finished(st, "length", queue_s=0.01, e2e_s=1.0))
    after = m.render()[0]

    for method in ("ngram", "draft", "none"):
        mine = [st for st in stats.values() if st.method == method]
        for metric, field in (
            ("specula_spec_decode_draft_tokens_total", "draft_tokens"),
            ("specula_spec_decode_accepted_tokens_total", "accepted_tokens"),
            ("specula_spec_decode_steps_total", "decode_steps"),
        ):
            delta = sum_samples(after, metric, method=method) - sum_samples(before, metric, method=method)
            assert delta == sum(getattr(st, field) for st in mine), (metric, method)
        # Per position: position j counts exactly the requests' accepted_per_position[j].
        k_max = max((len(st.accepted_per_position) for st in mine), default=0)
        for j in range(k_max):
            expected = sum(st.accepted_per_position[j] for st in mine if j < len(st.accepted_per_position))
            got = sum_samples(
                after,
                "specula_spec_decode_accepted_tokens_per_position_total",
                method=method,
                position=str(j),
            )
            assert got == expected
        # Acceptance length: one observation per verify pass, summing to accepted + steps.
        assert sum_samples(after, "specula_spec_decode_acceptance_length_count", method=method) == sum(
            st.decode_steps for st in mine
        )
        assert sum_samples(after, "specula_spec_decode_acceptance_length_sum", method=method) == sum(
            st.accepted_tokens + st.decode_steps for st in mine
        )

    total = list(stats.values())
    assert sum_samples(after, "specula_generation_tokens_total") == sum(st.completion_tokens for st in total)
    assert sum_samples(after, "specula_prompt_tokens_total") == sum(st.prompt_tokens for st in total)
    assert sum_samples(after, "specula_requests_total", finish_reason="length") == len(total)
    assert sum_samples(after, "specula_e2e_request_latency_seconds_count") == len(total)
    assert sum_samples(after, "specula_request_queue_time_seconds_count") == len(total)


def test_per_position_counts_prefix_of_accepted() -> None:
    m = new_metrics()
    m.observe_step(
        StepResult(
            outputs=[],
            seq_stats=[
                SeqStepStats("a", "draft", "draft", 4, 2, 3, bonus=False),
                SeqStepStats("b", "draft", "draft", 4, 4, 5, bonus=True),
                SeqStepStats("c", "draft", "draft", 4, 0, 1, bonus=False),
            ],
        )
    )
    body = m.render()[0]
    per_pos = [
        sum_samples(body, "specula_spec_decode_accepted_tokens_per_position_total", position=str(j))
        for j in range(4)
    ]
    assert per_pos == [2, 2, 1, 1]
    assert sum_samples(body, "specula_spec_decode_steps_total", method="draft") == 3
    # Acceptance length buckets: 1, 3 and 5 tokens emitted.
    s = samples(body)
    bucket = {
        le: s[
            (
                "specula_spec_decode_acceptance_length_bucket",
                (("le", le), ("method", "draft"), ("model", "tiny"), ("proposer", "draft")),
            )
        ]
        for le in ("1.0", "3.0", "5.0")
    }
    assert bucket == {"1.0": 1, "3.0": 2, "5.0": 3}


def test_inter_token_latency_is_per_token() -> None:
    m = new_metrics()
    m.observe_first_token(0.2)
    m.observe_tokens(4, 0.2)  # one step emitted 4 tokens after 0.2 s: four observations of 0.05 s
    m.observe_tokens(1, 0.08)
    m.observe_tokens(0, 1.0)  # nothing arrived: no observation
    body = m.render()[0]
    assert sum_samples(body, "specula_inter_token_latency_seconds_count") == 5
    assert sum_samples(body, "specula_inter_token_latency_seconds_sum") == pytest.approx(0.28)
    s = samples(body)
    assert s[("specula_inter_token_latency_seconds_bucket", (("le", "0.06"), ("model", "tiny")))] == 4
    assert sum_samples(body, "specula_time_to_first_token_seconds_count") == 1


def test_errors_load_and_info() -> None:
    m = Metrics(model="tiny", target="t", draft=None, method="none", k=4, methods=("none", "ngram", "auto"))
    m.observe_error(400)
    m.observe_error(400)
    m.observe_error(503)
    m.set_load(running=3, waiting=2, kv_cache_usage=0.25)
    body = m.render()[0]
    assert sum_samples(body, "specula_request_errors_total", status="400") == 2
    assert sum_samples(body, "specula_request_errors_total", status="503") == 1
    assert sum_samples(body, "specula_requests_running") == 3
    assert sum_samples(body, "specula_requests_waiting") == 2
    assert sum_samples(body, "specula_kv_cache_usage_ratio") == 0.25
    info = samples(body)
    key = (
        "specula_speculation_info",
        (("draft", ""), ("k", "4"), ("method", "none"), ("model", "tiny"), ("target", "t")),
    )
    assert info[key] == 1


def test_two_instances_do_not_share_state() -> None:
    a, b = new_metrics(), new_metrics()
    a.observe_error(500)
    assert sum_samples(b.render()[0], "specula_request_errors_total") == 0


def test_request_log_line(caplog: pytest.LogCaptureFixture) -> None:
    st = RequestStats(
        method="ngram",
        prompt_tokens=7,
        completion_tokens=9,
        draft_tokens=8,
        accepted_tokens=6,
        decode_steps=3,
    )
    line = format_request_line(request_record("cmpl-1", "tiny", st, "stop", 0.1234, 1.5))
    assert "\n" not in line and line.startswith("request {")
    for part in (
        '"id": "cmpl-1"',
        '"method": "ngram"',
        '"prompt_tokens": 7',
        '"completion_tokens": 9',
        '"acceptance_rate": 0.75',
        '"ttft_s": 0.123',
        '"total_s": 1.5',
        '"finish_reason": "stop"',
    ):
        assert part in line
    with caplog.at_level(logging.INFO, logger="specula.request"):
        log_request("cmpl-1", "tiny", st, "stop", 0.1234, 1.5)
    assert [r.getMessage() for r in caplog.records] == [line]
    assert '"user"' not in line
    with_user = format_request_line(request_record("cmpl-2", "tiny", st, "length", None, 2.0, user='a"b\nc'))
    assert "\n" not in with_user and with_user.endswith('"user": "a\\"b\\nc"}')

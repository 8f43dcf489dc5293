"""The series under vLLM's names (the gateway gauges, the speculation counters, every series vLLM's Grafana
dashboard queries, with vLLM's bounds), the `replica` label, and one exposition merged from several servers'
(the cluster's /metrics)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics, merge_expositions
from tests.metrics_helpers import family_names, new_metrics, samples, sum_samples, synthetic_steps

VLLM_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def test_vllm_families_exist_from_the_start_with_vllm_labels() -> None:
    body = new_metrics().render()[0]
    assert set(VLLM_FAMILIES) <= family_names(body)
    # vLLM's exposition: counters end in _total, the labels are model_name and engine.
    assert samples(body)[("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "tiny")))] == 0
    assert ("vllm:spec_decode_num_drafts_total", (("engine", "0"), ("model_name", "tiny"))) in samples(body)


def test_vllm_counters_agree_with_the_specula_ones() -> None:
    m = new_metrics()
    steps, stats = synthetic_steps(12, seed=3)
    for s in steps:
        m.observe_step(s)
    body = m.render()[0]
    assert sum_samples(body, "vllm:spec_decode_num_draft_tokens_total") == sum(s.draft_tokens for s in stats.values())
    assert sum_samples(body, "vllm:spec_decode_num_accepted_tokens_total") == sum(
        s.accepted_tokens for s in stats.values()
    )
    # A draft is a verify pass that checked at least one draft token (vLLM's observe_draft).
    drafted = sum(1 for step in steps for s in step.seq_stats if s.draft_tokens > 0)
    assert 0 < drafted < sum(s.decode_steps for s in stats.values())  # plain steps are not drafts
    assert sum_samples(body, "vllm:spec_decode_num_drafts_total") == drafted
    for j in range(5):
        assert sum_samples(body, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) == (
            sum_samples(body, "specula_spec_decode_accepted_tokens_per_position_total", position=str(j))
        )


def test_vllm_gauges_follow_set_load() -> None:
    m = new_metrics()
    m.set_load(3, 5, 0.25)
    got = samples(m.render()[0])
    labels = (("engine", "0"), ("model_name", "tiny"))
    assert got[("vllm:num_requests_running", labels)] == 3
    assert got[("vllm:num_requests_waiting", labels)] == 5
    assert got[("vllm:kv_cache_usage_perc", labels)] == 0.25


def replica_metrics(name: str) -> Metrics:
    return Metrics(model="tiny", target="t", draft=None, method="ngram", k=4, methods=("none", "ngram"), replica=name)


def test_a_replica_name_labels_every_series() -> None:
    m = replica_metrics("r1")
    m.watch_memory(lambda: {"weights": 10})
    body = m.render()[0]
    names = set()
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            assert s.labels.get("replica") == "r1", s
            names.add(s.name)
    assert {"process_resident_memory_bytes", "specula_memory_bytes", "vllm:num_requests_running"} <= names
    assert all("replica" not in dict(labels) for _, labels in samples(new_metrics().render()[0]))


def test_merged_exposition_keeps_each_replica_and_each_family_once() -> None:
    a, b = replica_metrics("a"), replica_metrics("b")
    steps, _ = synthetic_steps(4, seed=5, methods=("ngram",))
    for s in steps:
        a.observe_step(s)
    a.set_load(2, 1, 0.5)
    b.set_load(1, 0, 0.1)
    body, content_type = merge_expositions([a.render()[0], b.render()[0].decode(), b"not an exposition {"])
    assert content_type.startswith("text/plain")
    text = body.decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert sum_samples(body, "vllm:num_requests_running", replica="a") == 2
    assert sum_samples(body, "vllm:num_requests_running", replica="b") == 1
    assert sum_samples(body, "vllm:spec_decode_num_draft_tokens_total", replica="a") == sum_samples(
        a.render()[0], "vllm:spec_decode_num_draft_tokens_total"
    )
    assert sum_samples(body, "vllm:spec_decode_num_draft_tokens_total", replica="b") == 0
    # Histograms survive the round trip whole.
    assert sum_samples(body, "specula_spec_decode_acceptance_length_count", replica="a") == len(
        [s for step in steps for s in step.seq_stats]
    )


# ---- vLLM's dashboard: every series it queries, under vLLM's types, bounds and labels -----------------------
def test_vllm_histograms_have_vllms_bounds_and_the_pairs_agree() -> None:
    """Bounds as vllm/v1/metrics/loggers.py sets them; each vllm: figure equals its specula_ twin (the same
    calls feed both), and the phases come from the sequence's own timestamps."""
    from server.types import RequestStats
    from server.vllm_metrics import VLLM_ITL_BUCKETS, VLLM_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS, buckets_1_2_5
    from tests.metrics_helpers import finished

    m = Metrics(model="tiny", target="t", draft=None, method="ngram", k=4, methods=("none", "ngram"),
                max_model_len=2048)
    done = [finished(RequestStats("ngram", prompt_tokens=7, completion_tokens=5), "stop", 0.5, 3.0, ttft_s=1.0),
            finished(RequestStats("ngram", prompt_tokens=3, completion_tokens=1), "length", 0.1, 0.4, ttft_s=0.4,
                     request_max_generated=5),
            finished(RequestStats("ngram", prompt_tokens=2), "abort", 0.2, 0.2)]
    for d in done:
        m.observe_request(d)
    m.observe_first_token(1.0)
    m.observe_tokens(4, 0.2)  # one output of 4 tokens: one vLLM observation, four of ours
    body = m.render()[0]
    bounds = {}
    for fam in text_string_to_metric_families(body.decode()):
        les = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
        bounds[fam.name] = tuple(les)
    assert bounds["vllm:time_to_first_token_seconds"] == VLLM_TTFT_BUCKETS[:22] and VLLM_TTFT_BUCKETS[-1] == 2560
    assert bounds["vllm:inter_token_latency_seconds"] == VLLM_ITL_BUCKETS == bounds[
        "vllm:request_time_per_output_token_seconds"] == bounds["vllm:time_per_output_token_seconds"]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert bounds[f"vllm:{name}"] == VLLM_LATENCY_BUCKETS, name
    assert bounds["vllm:request_prompt_tokens"] == buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500,
                                                                         1000, 2000)
    assert sum_samples(body, "vllm:prompt_tokens_total") == sum_samples(body, "specula_prompt_tokens_total") == 12
    for reason in ("stop", "length", "abort"):
        assert sum_samples(body, "vllm:request_success_total", finished_reason=reason) == 1
        assert sum_samples(body, "specula_requests_total", finish_reason=reason) == 1
    assert sum_samples(body, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.6)
    assert sum_samples(body, "vllm:request_queue_time_seconds_sum") == pytest.approx(
        sum_samples(body, "specula_request_queue_time_seconds_sum")) == pytest.approx(0.8)
    # prefill = first token - scheduled; decode = last token - first token; none for an abort while waiting
    assert sum_samples(body, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.5 + 0.3)
    assert sum_samples(body, "vllm:request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert sum_samples(body, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(2.0 / 4)
    assert sum_samples(body, "vllm:request_generation_tokens_sum") == 6
    assert sum_samples(body, "vllm:request_max_num_generation_tokens_count") == 1
    assert sum_samples(body, "vllm:inter_token_latency_seconds_count") == 1
    assert sum_samples(body, "specula_inter_token_latency_seconds_count") == 4
    assert sum_samples(body, "vllm:time_to_first_token_seconds_count") == 1


async def test_every_series_vllms_dashboard_queries_exists_after_traffic(tiny_engine_factory) -> None:
    """vLLM's dashboard (deploy/grafana/dashboards/vllm.json, its panels' PromQL) over /metrics after traffic,
    parsed with prometheus_client's parser: every metric each expression selects has a series with the served
    model's `model_name` (the dashboard's variable), finish reasons included."""
    from tests.api_helpers import MODEL, chat_body, running_app
    from tests.dashboard_queries import VLLM_DASHBOARD, dashboard_queries, load_dashboard, metric_names

    dashboard = load_dashboard(VLLM_DASHBOARD)
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 40
    async with running_app(tiny_engine_factory) as (_, client):
        for body in (chat_body(max_tokens=12, temperature=0, speculation={"method": "ngram"}),
                     chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True}),
                     {"model": MODEL, "prompt": "one two three one two three", "max_tokens": 10, "n": 2,
                      "speculation": {"method": "ngram", "num_tokens": 4}}):
            assert (await client.post("/v1/chat/completions" if "messages" in body else "/v1/completions",
                                      json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    series: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            series.setdefault(s.name, []).append(s.labels)
    assert any(labels.get("model_name") == MODEL for labels_list in series.values() for labels in labels_list)
    used = set()
    for expr in queries:
        for name in metric_names(expr):
            used.add(name)
            mine = [labels for labels in series.get(name, []) if labels.get("model_name") == MODEL]
            assert mine, f"{expr!r}: no {name} series for model_name={MODEL}"
    reasons = {labels["finished_reason"] for labels in series["vllm:request_success_total"]}
    assert {"stop", "length", "abort"} <= reasons
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_generation_tokens_count", "vllm:inter_token_latency_seconds_count"):
        assert sum_samples(text.encode(), name) >= 3, name  # the traffic was observed, not just declared
    assert sum_samples(text.encode(), "vllm:spec_decode_num_drafts_total") > 0
    assert {"vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:kv_cache_usage_perc"} <= used

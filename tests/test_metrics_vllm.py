"""The gateway gauges and the speculation counters under vLLM's names, the `replica` label, and one exposition
merged from several servers' (the cluster's /metrics)."""

from __future__ import annotations

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

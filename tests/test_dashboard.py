"""The Grafana dashboard loads, shows what operators need, and queries only metrics the server exports."""

from __future__ import annotations

from tests.dashboard_queries import all_panels, dashboard_queries, load_dashboard, metric_names
from tests.metrics_helpers import finished, new_metrics, samples, synthetic_steps


def exported_sample_names() -> set[str]:
    m = new_metrics()
    steps, stats = synthetic_steps(3)
    for s in steps:
        m.observe_step(s)
    for st in stats.values():
        m.observe_request(finished(st, "stop", 0.01, 0.5))
    m.observe_first_token(0.1)
    m.observe_tokens(2, 0.1)
    m.observe_error(400)
    return {name for name, _ in samples(m.render()[0])}


def test_metric_name_extraction() -> None:
    expr = 'sum by (method, position) (rate(a_total{model=~"$m", x="y{z}"}[$__rate_interval])) / on (method) '
    expr += "group_left sum by (method) (rate(b_total[5m])) + histogram_quantile(0.5, c_bucket)"
    assert metric_names(expr) == {"a_total", "b_total", "c_bucket"}
    assert metric_names("label_values(specula_speculation_info, model)") == {"specula_speculation_info"}


def test_dashboard_loads_with_panels_and_queries() -> None:
    dash = load_dashboard()
    assert dash["uid"] and dash["title"]
    titles = " | ".join(p["title"].lower() for p in all_panels(dash))
    for needed in (
        "acceptance rate by method",
        "acceptance rate by proposer",
        "mean accepted length",
        "draft position",
        "tokens/s",
        "time to first token p50/p95",
        "inter-token latency p50/p95",
        "running / waiting",
        "kv cache",
    ):
        assert needed in titles, needed
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in all_panels(dash):
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}"


def test_every_query_names_only_exported_metrics() -> None:
    exported = exported_sample_names()
    queries = dashboard_queries(load_dashboard())
    assert len(queries) >= 15
    used: set[str] = set()
    for expr in queries:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} uses unexported {names - exported}"
        used |= names
    # The headline counters are all on the dashboard.
    for name in (
        "specula_spec_decode_draft_tokens_total",
        "specula_spec_decode_accepted_tokens_total",
        "specula_spec_decode_steps_total",
        "specula_spec_decode_accepted_tokens_per_position_total",
        "specula_generation_tokens_total",
        "specula_kv_cache_usage_ratio",
    ):
        assert name in used, name


def test_replica_panels_show_acceptance_and_load_per_replica() -> None:
    """A cluster's replicas (the `replica` label) side by side: acceptance and load, with a replica picker."""
    dash = load_dashboard()
    assert "replica" in [v["name"] for v in dash["templating"]["list"]]
    panels = {p["title"].lower(): p for p in all_panels(dash)}
    for title in ("acceptance rate by replica", "load by replica: running / waiting"):
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert all("by (replica)" in e and 'replica=~"$replica"' in e for e in exprs), exprs

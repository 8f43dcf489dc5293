"""A real Prometheus scrapes `Metrics.render()` on loopback; its PromQL equals what the data says.

Needs the `prometheus` binary (Debian package `prometheus`, which `.ci/run` installs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from server.metrics import Metrics
from tests.dashboard_queries import DASHBOARD, VLLM_DASHBOARD, dashboard_queries, for_prometheus, load_dashboard
from tests.metrics_helpers import new_metrics, synthetic_steps
from tests.prometheus_server import PROMETHEUS, Prometheus, run_prometheus

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="`prometheus` binary not installed (apt-get install prometheus; .ci/run does)"
)


def serve_metrics(metrics: Metrics) -> ThreadingHTTPServer:
    """A loopback HTTP server answering GET /metrics with `metrics.render()`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body, content_type = metrics.render()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Metrics, Prometheus]]:
    metrics = new_metrics()
    server = serve_metrics(metrics)
    try:
        with run_prometheus(f"127.0.0.1:{server.server_port}", tmp_path_factory.mktemp("prom")) as prom:
            yield metrics, prom
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_promql_acceptance_rate_equals_fed_data(scraped: tuple[Metrics, Prometheus]) -> None:
    metrics, prom = scraped
    draft = 'sum(specula_spec_decode_draft_tokens_total{method="ngram"})'
    # First a scrape of the all-zero counters, so rate() over the window sees the whole growth.
    prom.wait_for("a zero sample", lambda: prom.scalar(draft) == 0.0)
    steps, stats = synthetic_steps(10, seed=3)
    for s in steps:
        metrics.observe_step(s)
    mine = [st for st in stats.values() if st.method == "ngram"]
    total_draft = sum(st.draft_tokens for st in mine)
    prom.wait_for("the fed data", lambda: prom.scalar(draft) == total_draft)

    sel = 'model="tiny", method="ngram"'
    rate = prom.scalar(
        f"sum(rate(specula_spec_decode_accepted_tokens_total{{{sel}}}[5m]))"
        f" / sum(rate(specula_spec_decode_draft_tokens_total{{{sel}}}[5m]))"
    )
    expected = sum(st.accepted_tokens for st in mine) / total_draft
    assert rate == pytest.approx(expected, rel=1e-9)

    length = prom.scalar(
        f"1 + sum(rate(specula_spec_decode_accepted_tokens_total{{{sel}}}[5m]))"
        f" / sum(rate(specula_spec_decode_steps_total{{{sel}}}[5m]))"
    )
    assert length == pytest.approx(
        1 + sum(st.accepted_tokens for st in mine) / sum(st.decode_steps for st in mine)
    )


@pytest.mark.parametrize("dashboard", [DASHBOARD, VLLM_DASHBOARD], ids=["specula", "vllm"])
def test_every_dashboard_query_evaluates(scraped: tuple[Metrics, Prometheus], dashboard: Path) -> None:
    _, prom = scraped
    prom.wait_for("any sample", lambda: prom.scalar("count(specula_requests_running)") == 1.0)
    for expr in dashboard_queries(load_dashboard(dashboard)):
        if expr.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        prom.query(for_prometheus(expr))  # raises on a PromQL error


def test_scrape_is_healthy(scraped: tuple[Metrics, Prometheus]) -> None:
    _, prom = scraped
    prom.wait_for("target up", lambda: prom.scalar('up{job="specula"}') == 1.0)
    assert Path(prom.log).exists()

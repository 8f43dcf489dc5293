"""Prometheus collectors for one server, fed from the engine's per-step stats.

This module and vllm_metrics.py (the series under vLLM's names) are the only ones that import
`prometheus_client`. One `Metrics` object owns its own
`CollectorRegistry` (no module globals), so tests and several servers in one process don't collide.

Who calls what (all methods are thread-safe; the worker thread and the event loop may both call):

* `observe_step(result)`        once per engine step, with its `StepResult` (worker thread).
* `observe_first_token(ttft_s)` when a request's first token reaches its output queue.
* `observe_tokens(n, gap_s)`    when n more tokens of a request arrive gap_s after its previous ones.
* `observe_request(done)`       once when a sequence finishes (any finish reason): a `FinishedSequence`.
* `observe_error(status)`       once per HTTP error response (4xx/5xx).
* `set_load(...)`               whenever queue lengths or KV usage change (e.g. after each step).
* `watch_memory(source, peak)`  once: `source()` gives the memory parts in bytes, read at every scrape;
                                `peak()` the parts when their sum was largest.
* `render()`                    for GET /metrics.

`merge_expositions(bodies)` joins several servers' `render()` outputs into one exposition (the cluster's
/metrics: each replica's series keep their `replica` label, server/cluster/ingress.py).

Contract: the speculation counters grow by exactly the sums of the per-sequence `SeqStepStats`, which
add up to each request's `RequestStats` (`usage.speculation`): draft_tokens, accepted_tokens and
decode_steps (one step per verify pass a sequence took part in).

Under vLLM's names too (docs/metrics.md "Under vLLM's names"): every series vLLM's Grafana dashboard queries
(the three gauges an inference gateway's endpoint picker reads, token counters, the latency and length
histograms, `vllm:request_success_total{finished_reason}`) and the speculation counters vLLM's dashboards and
AIPerf read (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`), with vLLM's types, bucket bounds and labels (`model_name`, `engine`), fed
from the same calls (the same timestamps and counts) as the `specula_` series, so each pair agrees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import get_args

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from server.types import FallbackReason, FinishedSequence, FinishReason, StepResult
from server.vllm_metrics import VllmSeries

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
FALLBACK_REASONS: tuple[str, ...] = get_args(FallbackReason)

log = logging.getLogger(__name__)

# Tokens emitted per verify pass is an integer in [1, K + 1], K <= 32.
ACCEPTANCE_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
# Prompt tokens one step computes: 0 (decoding only) up to max_num_batched_tokens (CPU 256, GPU 2048 by default).
PREFILL_BUCKETS = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
class Metrics:
    """All Prometheus collectors of one server.

    `model` is the served model name (the `model` label everywhere); `target`, `draft`, `method` and
    `k` are the server's configuration, exported once as `specula_speculation_info`. `methods` are the
    speculation methods the server runs ("none", its proposers, "auto"); the speculation series are
    labelled with the request's `method` and the `proposer` that drafted in each step ("none" for a
    plain step), so `method="auto"` can be split by what `auto` chose. `replica` (the `replica_name`
    setting; a cluster names each replica) labels every series, `process_*` included, when given.
    """

    def __init__(
        self,
        model: str,
        target: str,
        draft: str | None,
        method: str,
        k: int,
        methods: tuple[str, ...],
        replica: str | None = None,
        max_model_len: int = 8192,
    ) -> None:
        """`max_model_len`: the context length (the top bucket of vLLM's token-count histograms)."""
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._exposed = _Labelled(r, {"replica": replica}) if replica else r
        spec = ["model", "method", "proposer"]
        self.draft_tokens = Counter(
            "specula_spec_decode_draft_tokens", "Draft tokens proposed.", spec, registry=r
        )
        self.accepted_tokens = Counter(
            "specula_spec_decode_accepted_tokens", "Draft tokens the target accepted.", spec, registry=r
        )
        self.steps = Counter(
            "specula_spec_decode_steps",
            "Verify passes, counted once per sequence per step.",
            spec,
            registry=r,
        )
        self.accepted_per_position = Counter(
            "specula_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted at each 0-based draft position.",
            [*spec, "position"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specula_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "specula_generation_tokens",
            "Tokens generated (counted per step as emitted).",
            ["model"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "specula_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (every prompt token computed or reused).",
            ["model"],
            registry=r,
        )
        self.degraded = Counter(
            "specula_engine_degraded",
            "Failures of the engine's optional parts (thread governor, calibration, cost model, acceptance "
            "estimates, planner, a proposer, prefix cache, grammar fast path): each cost speed, not an answer.",
            ["model", "part"],
            registry=r,
        )
        self.fallbacks = Counter(
            "specula_spec_decode_fallbacks",
            "Requests whose speculation lost a proposer because it failed (the fail-safe turned it off for them; "
            "usage.speculation.fallbacks): once per request choice and proposer. reason: error (it raised while "
            "working for the request) or switched_off (it had failed too often and is off until restart).",
            ["model", "method", "proposer", "reason"],
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "specula_prefix_cache_hits",
            "Prompt tokens whose keys and values came from the prefix cache instead of a prefill.",
            ["model"],
            registry=r,
        )
        for counter in (self.prefix_cache_queries, self.prefix_cache_hits):
            counter.labels(model)  # exported from the start (0), so a hit rate is defined before the first hit
        self.requests = Counter(
            "specula_requests", "Finished requests by finish reason.", ["model", "finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "specula_request_errors", "HTTP error responses by status code.", ["status"], registry=r
        )
        self.acceptance_length = Histogram(
            "specula_spec_decode_acceptance_length",
            "Tokens emitted per verify pass (accepted + 1).",
            spec,
            buckets=ACCEPTANCE_LENGTH_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "specula_time_to_first_token_seconds",
            "Arrival to first token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specula_inter_token_latency_seconds",
            "Time between consecutive tokens, one observation per token.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specula_e2e_request_latency_seconds",
            "Arrival to finish.",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specula_request_queue_time_seconds",
            "Arrival to first scheduled.",
            ["model"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.step_prefill = Histogram(
            "specula_step_prefill_tokens",
            "Prompt tokens computed per engine step (chunks of prompts, within max_num_batched_tokens).",
            ["model"],
            buckets=PREFILL_BUCKETS,
            registry=r,
        )
        self.prompt_waiting = Gauge(
            "specula_prompt_tokens_waiting",
            "Prompt tokens of the running requests not computed yet (nor read from the prefix cache).",
            ["model"],
            registry=r,
        )
        self.prompt_waiting.labels(model).set(0)
        self.running = Gauge(
            "specula_requests_running", "Sequences in the running batch.", ["model"], registry=r
        )
        self.waiting = Gauge(
            "specula_requests_waiting", "Sequences waiting for admission.", ["model"], registry=r
        )
        self.kv_usage = Gauge(
            "specula_kv_cache_usage_ratio",
            "Fraction of KV cache capacity in use (0..1).",
            ["model"],
            registry=r,
        )
        self.vllm = VllmSeries(r, model, max_model_len, k)
        Info("specula_speculation", "Server speculation configuration.", registry=r).info(
            {"model": model, "target": target, "draft": draft or "", "method": method, "k": str(k)}
        )
        # Create the series up front so dashboards show 0 (not "no data") before the first request.
        proposers = [m for m in methods if m not in ("none", "auto")]
        for m in methods:
            used = ["none", *proposers] if m == "auto" else ["none", *([m] if m in proposers else [])]
            for proposer in used:
                for c in (self.draft_tokens, self.accepted_tokens, self.steps):
                    c.labels(model, m, proposer)
        for m in methods:  # a method's fallbacks read 0, not "no data", until one happens
            for proposer in proposers if m == "auto" else [m] if m in proposers else []:
                for reason in FALLBACK_REASONS:
                    self.fallbacks.labels(model, m, proposer, reason)
        for reason in FINISH_REASONS:
            self.requests.labels(model, reason)
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(model)
        self.set_load(0, 0, 0.0)

    def observe_step(self, result: StepResult) -> None:
        """Count one engine step: per-sequence speculation figures and the tokens it emitted.

        Each `SeqStepStats` is one verify pass of one sequence: +1 step, its draft/accepted tokens,
        accepted positions 0..accepted-1, and one acceptance-length observation of `emitted_tokens`.
        Generation tokens are the token ids of the step's outputs (after stop truncation); prompt tokens
        computed by the step or read from the prefix cache count as prefix-cache queries, the latter as hits;
        the prompt tokens computed are observed per step, and those still waiting set their gauge; each
        proposer a request lost to its failure this step counts one fallback.
        """
        for s in result.seq_stats:
            labels = (self.model, s.method, s.proposer)
            self.steps.labels(*labels).inc()
            self.draft_tokens.labels(*labels).inc(s.draft_tokens)
            self.accepted_tokens.labels(*labels).inc(s.accepted_tokens)
            for pos in range(s.accepted_tokens):
                self.accepted_per_position.labels(*labels, str(pos)).inc()
            self.acceptance_length.labels(*labels).observe(s.emitted_tokens)
            self.vllm.observe_draft(s.draft_tokens, s.accepted_tokens)
        if result.prefill_tokens or result.cached_tokens:
            self.prefix_cache_queries.labels(self.model).inc(result.prefill_tokens + result.cached_tokens)
            self.prefix_cache_hits.labels(self.model).inc(result.cached_tokens)
            self.vllm.observe_prefix_cache(result.prefill_tokens + result.cached_tokens, result.cached_tokens)
        self.step_prefill.labels(self.model).observe(result.prefill_tokens)
        self.prompt_waiting.labels(self.model).set(result.prompt_tokens_waiting)
        for part in result.degraded:
            self.degraded.labels(self.model, part).inc()
        for method, fallback in result.fallbacks:
            self.fallbacks.labels(self.model, method, fallback.proposer, fallback.reason).inc()
        generated = sum(len(o.token_ids) for o in result.outputs)
        if generated:
            self.generation_tokens.labels(self.model).inc(generated)
            self.vllm.generation_tokens.inc(generated)

    def observe_first_token(self, ttft_s: float) -> None:
        """A request's first token arrived `ttft_s` seconds after the request did."""
        self.ttft.labels(self.model).observe(ttft_s)
        self.vllm.ttft.observe(ttft_s)

    def observe_tokens(self, n_tokens: int, gap_s: float) -> None:
        """`n_tokens` more tokens of one request arrived `gap_s` seconds after its previous tokens.

        Inter-token latency is per token, not per step: this records `n_tokens` observations of
        `gap_s / n_tokens`. Don't call it for a request's first output: that is TTFT, and any other
        tokens arriving together with the first one count toward TTFT only. vLLM's inter-token latency is
        one observation of `gap_s` per output, whatever it holds (its dashboard's reading under speculation).
        """
        if n_tokens <= 0:
            return
        self.vllm.inter_token.observe(gap_s)
        self.vllm.time_per_output_token.observe(gap_s)
        child = self.itl.labels(self.model)
        per_token = gap_s / n_tokens
        for _ in range(n_tokens):
            child.observe(per_token)

    def observe_request(self, done: FinishedSequence) -> None:
        """One sequence finished: its prompt tokens, finish reason, queue time (arrival to first scheduled) and
        end-to-end latency (arrival to finish); vLLM's series also its phases, lengths and max_tokens.
        Speculation counters are not touched here: they were counted step by step in `observe_step`."""
        self.prompt_tokens.labels(self.model).inc(done.stats.prompt_tokens)
        self.requests.labels(self.model, done.finish_reason).inc()
        self.queue_time.labels(self.model).observe(done.queue_s)
        self.e2e.labels(self.model).observe(done.e2e_s)
        self.vllm.observe_request(done)

    def observe_error(self, status: int) -> None:
        """One HTTP error response with this status code."""
        self.request_errors.labels(str(status)).inc()

    def set_load(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """Current running and waiting sequence counts and KV cache usage in [0, 1]."""
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)
        self.kv_usage.labels(self.model).set(kv_cache_usage)
        self.vllm.set_load(running, waiting, kv_cache_usage)

    def watch_memory(self, source: Callable[[], Mapping[str, int]],
                     peak: Callable[[], Mapping[str, int]] | None = None) -> None:
        """Export `source()` (part -> bytes: the engine's `memory.usage`, server/engine/memory.py) as
        `specula_memory_bytes{model, part}`, read at every scrape, beside the process's own
        `process_resident_memory_bytes`, and `peak()` (the parts when their sum was largest: `memory.peak`,
        read after `source`) as `specula_memory_peak_bytes{model, part}`. Once per `Metrics`."""
        self.registry.register(_MemoryCollector(self.model, source))
        if peak is not None:
            self.registry.register(_MemoryCollector(self.model, peak, _MemoryCollector.PEAK))
        ProcessCollector(registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its Content-Type, for GET /metrics."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST


def merge_expositions(bodies: Iterable[bytes | str]) -> tuple[bytes, str]:
    """Several servers' expositions as one (and its Content-Type): each family once, with every server's
    samples. The servers' series must differ by a label (`replica`), as a cluster's replicas' do; a body that
    does not parse is skipped with a warning (one replica's scrape must not fail the cluster's)."""
    families: dict[str, Metric] = {}
    for body in bodies:
        text = body.decode() if isinstance(body, bytes) else body
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            log.warning("an exposition that does not parse was left out of the merge", exc_info=True)
            continue
        for fam in parsed:
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(fam.samples)
    return generate_latest(_Families(list(families.values()))), CONTENT_TYPE_LATEST


class _Labelled:
    """A registry's families with `labels` added to every sample (prometheus_client has no constant labels
    per registry)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.registry, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in fam.samples]
            yield out


class _Families:
    """Ready families, in the shape `generate_latest` collects from."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class _MemoryCollector:
    """`specula_memory_bytes{model, part}` from a callable read at scrape time (a failing read exports
    nothing rather than failing the scrape)."""

    NAME = "specula_memory_bytes"
    HELP = "Bytes of each part of the server's memory, measured from its objects (docs/api.md#memory)."
    PEAK = ("specula_memory_peak_bytes",
            "Bytes of each part of the server's memory when their sum was largest (docs/api.md#memory).")

    def __init__(self, model: str, source: Callable[[], Mapping[str, int]],
                 family: tuple[str, str] = (NAME, HELP)) -> None:
        self.model, self.source = model, source
        self.name, self.help = family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.name, self.help, labels=["model", "part"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.help, labels=["model", "part"])
        try:
            parts = dict(self.source())
        except Exception:  # noqa: BLE001 - a gauge must never break /metrics
            log.warning("memory gauges unavailable", exc_info=True)
            parts = {}
        for part, value in parts.items():
            family.add_metric([self.model, part], float(value))
        yield family

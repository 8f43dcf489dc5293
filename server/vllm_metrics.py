"""The series vLLM exports, under vLLM's names, types, labels and bounds (docs/metrics.md, "Under vLLM's names"),
owned by a server's `Metrics` (metrics.py), which feeds them from the same calls as its `specula_` series."""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.types import FinishedSequence, FinishReason

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)

# vLLM's labels on its series: the served model and the engine's index (one engine per server here: "0").
VLLM_LABELS = ("model_name", "engine")
# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same here.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)



def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's bounds for token counts of a request).

    >>> buckets_1_2_5(100)
    (1, 2, 5, 10, 20, 50, 100)
    """
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VllmSeries:
    """The series vLLM exports, under vLLM's names, types, labels and bounds (see the module doc).

    `vllm:spec_decode_num_drafts` counts verify passes that checked at least one draft token (vLLM's
    `observe_draft`: one per request per step that drafted), so mean accepted length = 1 + accepted / drafts
    and the acceptance at position j = accepted_per_pos{position=j} / drafts, as vLLM's dashboards compute them.
    Per-request figures are per sequence (a choice), as vLLM counts each of a request's n sequences;
    `vllm:request_max_num_generation_tokens` once per API request, over its sequences.
    """

    def __init__(self, r: CollectorRegistry, model: str, max_model_len: int, k: int) -> None:
        """`k`: the server's draft tokens per step; positions 0..k-1 are exported from the start (as vLLM does)."""
        values = (model, "0")
        self.values = values

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, VLLM_LABELS, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, VLLM_LABELS, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(*values)

        def by(name: str, doc: str, label: str, keys: list[str]) -> Counter:
            """A counter with one more label, each of `keys` exported (at 0) from the start."""
            family = Counter(name, doc, [*VLLM_LABELS, label], registry=r)
            for key in keys:
                family.labels(*values, key)
            return family

        lengths = buckets_1_2_5(max_model_len)
        self.running = gauge("vllm:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting for admission.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.drafts = counter("vllm:spec_decode_num_drafts", "Verify passes that checked draft tokens.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = by("vllm:spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted tokens per draft position.", "position", [str(pos) for pos in range(k)])
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated (per step, as emitted).")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens read from the prefix cache.")
        self.request_success = by("vllm:request_success", "Finished requests by finish reason.", "finished_reason",
                                  list(FINISH_REASONS))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", VLLM_TTFT_BUCKETS)
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive outputs of a request.", VLLM_ITL_BUCKETS
        )
        self.time_per_output_token = histogram(  # vLLM's older name for the same observations
            "vllm:time_per_output_token_seconds",
            "Time between consecutive outputs of a request (vllm:inter_token_latency_seconds).",
            VLLM_ITL_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (e2e latency - time to first token) / (generated tokens - 1).",
            VLLM_ITL_BUCKETS,
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", VLLM_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", VLLM_LATENCY_BUCKETS)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "First scheduled to last token.", VLLM_LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", VLLM_LATENCY_BUCKETS
        )
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last token.", VLLM_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", lengths
        )
        self.request_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Per API request: the most tokens one of its sequences generated.",
            lengths,
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens of each request.", lengths
        )

    def observe_draft(self, draft_tokens: int, accepted_tokens: int) -> None:
        if draft_tokens <= 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(draft_tokens)
        self.accepted_tokens.inc(accepted_tokens)
        for pos in range(accepted_tokens):
            self.accepted_per_pos.labels(*self.values, str(pos)).inc()

    def observe_prefix_cache(self, queries: int, hits: int) -> None:
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)

    def observe_request(self, done: FinishedSequence) -> None:
        self.prompt_tokens.inc(done.stats.prompt_tokens)
        self.request_success.labels(*self.values, done.finish_reason).inc()
        self.e2e.observe(done.e2e_s)
        self.queue.observe(done.queue_s)
        self.inference.observe(done.inference_s)
        self.prefill.observe(done.prefill_s)
        self.decode.observe(done.decode_s)
        self.request_time_per_output_token.observe(done.time_per_output_token_s)
        self.request_prompt_tokens.observe(done.stats.prompt_tokens)
        self.request_generation_tokens.observe(done.stats.completion_tokens)
        self.request_max_tokens.observe(done.max_tokens)
        if done.request_max_generated is not None:
            self.request_max_generation.observe(done.request_max_generated)

    def set_load(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_cache_usage)

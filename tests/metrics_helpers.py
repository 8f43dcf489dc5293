"""Shared helpers for the metrics tests: synthetic engine steps and exposition parsing."""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics
from server.types import FinishedSequence, RequestOutput, RequestStats, SeqStepStats, StepResult

# Every family name the issue requires (counters without their `_total` suffix, as the parser reports).
REQUIRED_FAMILIES = (
    "specula_spec_decode_draft_tokens",
    "specula_spec_decode_accepted_tokens",
    "specula_spec_decode_steps",
    "specula_spec_decode_accepted_tokens_per_position",
    "specula_prompt_tokens",
    "specula_generation_tokens",
    "specula_requests",
    "specula_request_errors",
    "specula_spec_decode_acceptance_length",
    "specula_time_to_first_token_seconds",
    "specula_inter_token_latency_seconds",
    "specula_e2e_request_latency_seconds",
    "specula_request_queue_time_seconds",
    "specula_requests_running",
    "specula_requests_waiting",
    "specula_kv_cache_usage_ratio",
    "specula_speculation_info",
)


def finished(stats: RequestStats, reason: str, queue_s: float, e2e_s: float, ttft_s: float | None = None,
             max_tokens: int = 16, request_max_generated: int | None = None) -> FinishedSequence:
    """A `FinishedSequence` that arrived at 100.0, was scheduled `queue_s` later, wrote its first token `ttft_s`
    after arrival (default: halfway between scheduled and finished) and its last one at the end, `e2e_s`."""
    first = 100.0 + (ttft_s if ttft_s is not None else (queue_s + e2e_s) / 2)
    return FinishedSequence(stats, reason, max_tokens, 100.0, 100.0 + queue_s, first, 100.0 + e2e_s, 100.0 + e2e_s,
                            request_max_generated)


def new_metrics() -> Metrics:
    return Metrics(
        model="tiny", target="tiny-target", draft="tiny-draft", method="ngram", k=4,
        methods=("none", "ngram", "draft", "auto"),
    )


def synthetic_steps(
    n_requests: int, seed: int = 0, methods: tuple[str, ...] = ("ngram", "draft", "none")
) -> tuple[list[StepResult], dict[str, RequestStats]]:
    """Random steps for `n_requests` sequences decoding side by side, and each request's totals."""
    rng = random.Random(seed)
    stats = {
        f"r{i}": RequestStats(method=methods[i % len(methods)], prompt_tokens=rng.randint(1, 50))
        for i in range(n_requests)
    }
    remaining = {rid: rng.randint(1, 8) for rid in stats}
    steps: list[StepResult] = []
    while remaining:
        seq, outs = [], []
        for rid in list(remaining):
            st = stats[rid]
            k = 0 if st.method == "none" else rng.randint(0, 5)
            acc = rng.randint(0, k)
            proposer = st.method if k else "none"
            seq.append(SeqStepStats(rid, st.method, proposer, k, acc, acc + 1, bonus=acc == k and k > 0))
            st.draft_tokens += k
            st.accepted_tokens += acc
            st.decode_steps += 1
            st.completion_tokens += acc + 1
            if len(st.accepted_per_position) < k:
                st.accepted_per_position += [0] * (k - len(st.accepted_per_position))
            for j in range(acc):
                st.accepted_per_position[j] += 1
            remaining[rid] -= 1
            done = remaining[rid] == 0
            outs.append(
                RequestOutput(rid, list(range(acc + 1)), "x", None, done, "length" if done else None, st)
            )
            if done:
                del remaining[rid]
        steps.append(StepResult(outputs=outs, seq_stats=seq))
    return steps, stats


def samples(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse an exposition into {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def family_names(body: bytes) -> set[str]:
    return {fam.name for fam in text_string_to_metric_families(body.decode())}


def sum_samples(body: bytes, name: str, **labels: str) -> float:
    """Sum of every sample called `name` whose labels include `labels`."""
    return sum(
        v
        for (n, lab), v in samples(body).items()
        if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
    )

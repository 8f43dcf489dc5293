"""One structured (JSON) log line per finished request.

Call `log_request(...)` once when a request finishes; it logs at INFO on the `specula.request`
logger a single line such as
`request {"id": "cmpl-1", "model": "smollm2", "method": "ngram", "prompt_tokens": 12, ...}`.
"""

from __future__ import annotations

import json
import logging

from server.types import RequestStats

LOGGER = logging.getLogger("specula.request")
MAX_FIELD_CHARS = 200  # a string field longer than this is cut (clients choose `user`; a 1 MB one made a 1 MB line)


def capped(value: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`value`, or its first `limit` characters and a marker saying how many were cut.

    >>> capped("x" * 205)[-24:]
    'xxxxxxx...[5 more chars]'
    """
    return value if len(value) <= limit else f"{value[:limit]}...[{len(value) - limit} more chars]"


def request_record(
    request_id: str,
    model: str,
    stats: RequestStats,
    finish_reason: str | None,
    ttft_s: float | None,
    e2e_s: float,
    user: str | None = None,
) -> dict[str, object]:
    """The fields of a finished request's log line (times in seconds, rounded to the millisecond).

    `user` (the OpenAI `user` field) is included only when the client sent one. Every string field is
    `capped` (at `MAX_FIELD_CHARS`), so no client can make a line longer than a few kilobytes.
    """
    record: dict[str, object] = {
        "id": request_id,
        "model": model,
        "method": stats.method,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "decode_steps": stats.decode_steps,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "ttft_s": None if ttft_s is None else round(ttft_s, 3),
        "total_s": round(e2e_s, 3),
        "finish_reason": finish_reason,
    }
    if user is not None:
        record["user"] = user
    if stats.fallbacks:  # proposers the fail-safe turned off for it (usage.speculation.fallbacks)
        record["fallbacks"] = [f"{f.proposer}:{f.reason}" for f in stats.fallbacks]
    return {k: capped(v) if isinstance(v, str) else v for k, v in record.items()}


def format_request_line(record: dict[str, object]) -> str:
    """`request <json>`: one line, no newlines inside (JSON escapes them), keys in a fixed order."""
    return "request " + json.dumps(record)


def log_request(
    request_id: str,
    model: str,
    stats: RequestStats,
    finish_reason: str | None,
    ttft_s: float | None,
    e2e_s: float,
    user: str | None = None,
    logger: logging.Logger = LOGGER,
) -> None:
    """Log the finished request's line at INFO."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(format_request_line(request_record(request_id, model, stats, finish_reason, ttft_s, e2e_s, user)))

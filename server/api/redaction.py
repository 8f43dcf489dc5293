"""Secrets out of every log line: credentials a client put in a URL's query (`?api_key=...`, `token`, `key`,
`access_token`, `password`, `secret`, `auth`...) or a bearer token in text are replaced by `<redacted>` before a
line is written, in uvicorn's access and error logs and in the server's own (the request log included).

`install()` puts `SecretsFilter` on the handlers of the root, `uvicorn`, `uvicorn.error` and `uvicorn.access`
loggers (a handler's filter sees every record it writes, propagated ones included) and on those loggers themselves;
uvicorn_config calls it once uvicorn has configured its logging."""

from __future__ import annotations

import logging
import re

MASK = "<redacted>"
_QUERY = re.compile(r"((?:^|[?&;])(?:[\w.-]*(?:api[_-]?key|token|secret|password|passwd|auth|signature|key)"
                    r"[\w.-]*)=)[^&;\s\"']*", re.IGNORECASE)
_BEARER = re.compile(r"(\bBearer\s+)[^\s\"',;]+", re.IGNORECASE)
_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access")


def redact(text: str) -> str:
    """`text` with query-string credentials and bearer tokens masked.

    >>> redact('GET /v1/models?api_key=sk-123&x=1 HTTP/1.1')
    'GET /v1/models?api_key=<redacted>&x=1 HTTP/1.1'
    >>> redact("Authorization: Bearer abc.def")
    'Authorization: Bearer <redacted>'
    """
    return _BEARER.sub(rf"\1{MASK}", _QUERY.sub(rf"\1{MASK}", text))


class SecretsFilter(logging.Filter):
    """Masks secrets in a record's message and its string arguments (uvicorn's access formatter reads its
    arguments by position, so they stay a tuple of the same shape)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def install() -> None:
    """`SecretsFilter` on the server's loggers and their handlers (idempotent)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, SecretsFilter) for f in target.filters):
                target.addFilter(SecretsFilter())

"""Secrets stay out of the logs: a key a client puts in a URL's query, or a bearer token, never reaches a log line
(uvicorn's access log, its error log, the server's own)."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
import uvicorn

from server.api.app import create_app
from server.api.connections import uvicorn_config
from server.api.redaction import MASK, redact
from server.config import Settings
from tests.fake_engine import FakeEngine


@pytest.mark.parametrize("line, secret", [
    ('127.0.0.1:5 - "GET /v1/models?api_key=sk-abc123 HTTP/1.1" 200', "sk-abc123"),
    ("GET /x?foo=1&access_token=tok-9&bar=2", "tok-9"),
    ("GET /x?KEY=k1;password=hunter2", "hunter2"),
    ("Authorization: Bearer eyJhbGciOi.payload.sig", "eyJhbGciOi"),
])
def test_credentials_are_masked(line, secret):
    out = redact(line)
    assert secret not in out and MASK in out


def test_the_servers_own_lines_are_masked_too():
    """The filter sits on the root logger's handlers: the server's own lines (the request log) pass through it."""
    from server.api import redaction

    record = logging.LogRecord("server.request_log", logging.INFO, __file__, 1, "request %s done", ("?token=t0p",),
                               None)
    redaction.SecretsFilter().filter(record)
    assert record.getMessage() == f"request ?token={MASK} done"


def test_other_query_values_are_left_alone():
    assert redact("GET /v1/responses/r1/input_items?limit=5&order=asc") == \
        "GET /v1/responses/r1/input_items?limit=5&order=asc"


@pytest.mark.slow
def test_a_live_servers_logs_never_hold_a_key(tokenizer, capsys):
    """A real uvicorn server with its access log on: requests with a key in the query (good and bad) and a bearer
    token; every line it wrote is searched."""
    app = create_app(Settings.load(api_key="the-real-key"), lambda _: FakeEngine(tokenizer))
    config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="info", access_log=True)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        while httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.05)
        httpx.get(f"{url}/v1/models?api_key=the-real-key")
        httpx.get(f"{url}/v1/models?api_key=a-wrong-key&x=1")
        httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer the-real-key"})
        httpx.get(f"{url}/health?token=sensitive-token")
    finally:
        server.should_exit = True
        thread.join(30)
    written = capsys.readouterr()
    logs = written.out + written.err
    assert "/v1/models?api_key=" in logs and "/health?token=" in logs  # the access log was written
    for secret in ("the-real-key", "a-wrong-key", "sensitive-token"):
        assert secret not in logs, secret

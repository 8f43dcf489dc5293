"""`python -m server serve` in a subprocess: /health 503 then 200; SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # left out of make test-fast (seconds each)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_health_then_sigterm_drains_running_stream(tiny_target, tmp_path: Path):
    model_dir = tmp_path / "tiny"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--target",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--speculation",
        "ngram",
    ]
    env = {**os.environ, "SPECULA_SHUTDOWN_GRACE_S": "60", "SPECULA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        seen: set[int] = set()
        deadline = time.monotonic() + 120
        while 200 not in seen:
            assert proc.poll() is None and time.monotonic() < deadline, "server died or never became healthy"
            try:
                seen.add(httpx.get(f"{url}/health", timeout=2).status_code)
            except httpx.TransportError:
                time.sleep(0.1)
        assert seen <= {200, 503}

        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish
                events.append(line[6:])
        rc = proc.wait(timeout=30)
        out = proc.communicate()[0]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]).get("choices", [{}])[0].get("finish_reason") == "length", out[-3000:]
        assert rc == 0, out[-3000:]
        assert "draining" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

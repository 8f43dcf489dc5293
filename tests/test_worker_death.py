"""The engine worker dies mid-step (an exception that escapes the engine's row isolation): requests in
flight get errors in OpenAI's shape (an error event on streams, a 500 JSON otherwise), /health turns
503, and `python -m server serve` exits with status 1 for its supervisor to restart it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.api.state import PUBLIC_ERRORS
from server.engine.engine import Engine
from server.model.runner import ModelRunner
from tests.live_server import live_server
from tests.test_api_serve import free_port


class WorkerKilled(BaseException):
    """Not an Exception: nothing on the way may swallow it (as a KeyboardInterrupt or a C-level abort)."""


def stream_events(url: str, body: dict, started: threading.Event) -> list[str]:
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


@pytest.mark.slow
def test_a_dead_worker_fails_what_is_in_flight_and_health_turns_503(tiny_target, tiny_draft, monkeypatch):
    kill = threading.Event()
    with live_server(tiny_target, tiny_draft, served_model_name="tiny", speculation="ngram") as (url, app):
        state = app.state.specula
        engine: Engine = state.engine
        real = ModelRunner.forward

        def forward(self, *args, **kwargs):
            if self is engine.runner and kill.is_set():
                raise WorkerKilled("killed mid-step")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", forward)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        started = threading.Event()
        got: dict[str, object] = {}
        post = lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # noqa: E731
        threads = [
            threading.Thread(target=lambda: got.update(stream=stream_events(url, body, started))),
            threading.Thread(target=lambda: got.update(plain=post())),
        ]
        for t in threads:
            t.start()
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while state.scheduler.num_running < 2:  # both in the batch
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kill.set()
        for t in threads:
            t.join(60)

        events = got["stream"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "WorkerKilled" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])
        plain = got["plain"]
        assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"

        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "broken"
        assert health.json()["error"] == PUBLIC_ERRORS["broken"]  # no exception text to clients without a key
        late = httpx.post(f"{url}/v1/completions", json=body, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "broken"
        assert "WorkerKilled" not in health.text + late.text


HARNESS = """
import os, sys
from server.model.runner import ModelRunner

class WorkerKilled(BaseException):
    pass

real = ModelRunner.forward

def forward(self, *args, **kwargs):
    if kwargs.get("logits", True) and os.path.exists(os.environ["KILL_FILE"]):
        raise WorkerKilled("killed mid-step")
    return real(self, *args, **kwargs)

ModelRunner.forward = forward
from server.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_serve_exits_non_zero_when_the_worker_dies(tiny_target, tmp_path: Path):
    """The real process: the stream in flight gets its error event, then the server exits with status 1."""
    model_dir = tmp_path / "tiny"
    tiny_target.model.save_pretrained(model_dir)
    tiny_target.tokenizer.save_pretrained(model_dir)
    kill_file = tmp_path / "kill"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", HARNESS, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--target", str(model_dir), "--served-model-name", "tiny", "--speculation", "ngram"]
    env = {**os.environ, "KILL_FILE": str(kill_file), "SPECULA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server died or never became healthy"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        kill_file.touch()
                    events.append(line[6:])
        rc = proc.wait(timeout=60)
        out = proc.communicate()[0]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error", out[-3000:]
        assert rc == 1, out[-3000:]
        assert "engine worker died" in out
    finally:
        if proc.poll() is None:
            proc.kill()

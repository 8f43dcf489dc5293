"""The API edge under hostile input: model-sized work never blocks the event loop, bodies over the limit
are a 413 before they are read, a request larger than the server admits is a 400 (not a 429), and
client-chosen strings cannot blow up the log line."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from server.__main__ import main
from server.api.app import create_app
from server.config import Settings
from server.request_log import MAX_FIELD_CHARS
from server.scheduler import NeverFits, RequestRejected, Scheduler
from server.types import GenerationRequest, SamplingParams
from tests.api_helpers import MODEL, chat_body
from tests.fake_engine import FakeEngine
from tests.live_server import live_server

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


class BlockingTokenizer:
    """The real tokenizer, except that encoding and chat templates wait (up to 20 s) for `release`. If
    they ran on the event loop, the loop would sit in that wait and `timed_out` would end up True."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timed_out = False

    def _block(self) -> None:
        self.entered.set()
        if not self.release.wait(20):
            self.timed_out = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._block()
        return self._tok(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._block()
        return self._tok.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


async def _client(app: Any) -> httpx.AsyncClient:
    await app.state.specula.wait_ready(30)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat_body(max_tokens=2, model="fake-model")),
        (COMP, {"model": "fake-model", "prompt": "x", "max_tokens": 2}),
    ],
)
async def test_tokenizing_and_templates_run_off_the_event_loop(tokenizer, path, body):
    """While one request is stuck inside the tokenizer (or chat template), /health still answers."""
    blocking = BlockingTokenizer(tokenizer)
    app = create_app(Settings.load(), lambda _: FakeEngine(blocking))
    async with app.router.lifespan_context(app):
        async with await _client(app) as client:
            pending = asyncio.create_task(client.post(path, json=body))
            assert await asyncio.to_thread(blocking.entered.wait, 10)
            health = await asyncio.wait_for(client.get("/health"), 5)
            assert health.status_code == 200
            blocking.release.set()
            assert (await pending).status_code == 200
    assert not blocking.timed_out


def _poll_health_during(url: str, work: Callable[[], httpx.Response]) -> tuple[httpx.Response, list[float]]:
    """Run `work` in a thread; meanwhile GET /health again and again. Returns its answer and the
    /health latencies (seconds) measured while it ran."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as health:
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    thread.join()
    return result[0], latencies


@pytest.fixture(scope="module")
def live_url(tiny_target: Any) -> Iterator[str]:
    with live_server(tiny_target, None, speculation="none") as (url, _app):
        yield url


def test_health_answers_while_a_large_prompt_is_tokenized(live_url):
    """A 2 MB prompt (about half a million tokens, far past the context) is tokenized off the loop and
    refused with a 400; /health answers within a generous bound meanwhile (figures printed with -s)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 46_000  # ~2 MB

    def big() -> httpx.Response:
        return httpx.post(f"{live_url}{COMP}", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=120)

    started = time.perf_counter()
    r, latencies = _poll_health_during(live_url, big)
    print(
        f"\n2 MB prompt answered in {time.perf_counter() - started:.2f} s; /health x{len(latencies)}: "
        f"max {max(latencies) * 1000:.0f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms"
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < 1.0


def test_bad_input_keeps_the_connection_alive(live_url):
    """Bad input is a 400 on the client's keep-alive connection, which then serves its next request: a
    500 (what a RecursionError or an int() ValueError in parsing became) made uvicorn close it."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    bodies = [
        json.dumps(ok)[:-1] + ', "metadata": ' + "[" * 5000 + "]" * 5000 + "}",
        json.dumps(ok).replace('"max_tokens": 2', '"max_tokens": ' + "9" * 5000),
        json.dumps({**ok, "logit_bias": {"²": 1}}),
        json.dumps({**ok, "guided_json": "[" * 5000 + "]" * 5000}),
        json.dumps(chat_body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}])),
    ]
    conn = http.client.HTTPConnection(*live_url.removeprefix("http://").split(":"), timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        for body in bodies:
            path = CHAT if '"messages"' in body else COMP
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 400 and json.loads(r.read())["error"]["type"] == "invalid_request_error"
        conn.request("POST", COMP, json.dumps(ok), {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        assert conn.sock is sock  # one connection throughout: never closed, never reopened
    finally:
        conn.close()


async def test_a_content_length_int_cannot_read_is_too_large_not_a_500(tokenizer):
    """The body limit reads Content-Length: one of 5,000 digits is past int()'s limit (a ValueError, a
    500); it is over any limit. A non-ASCII digit int() refuses ("²", which str.isdigit takes) is not a
    length at all: the body is counted as it streams in."""
    app = create_app(Settings.load(max_request_body_bytes=2000), lambda _: FakeEngine(tokenizer))
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 1})
    async with app.router.lifespan_context(app):
        async with await _client(app) as client:
            for declared, status in ((b"9" * 5000, 413), (b"\xb2", 200), (b"0" * 30 + b"12", 200)):
                headers = {"content-type": "application/json", "content-length": declared}
                r = await client.post(COMP, content=body, headers=headers)
                assert r.status_code == status, r.text


@pytest.mark.parametrize("chunked", [False, True])
def test_a_20_mb_body_is_refused_with_413_and_health_keeps_answering(live_url, chunked):
    """The default limit (8 MiB) refuses a 20 MB body: at once from its Content-Length, or as the
    streamed bytes pass the limit when it has none (chunked)."""
    body = json.dumps({"model": MODEL, "prompt": "word " * 4_000_000, "max_tokens": 1}).encode()  # ~20 MB

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    def big() -> httpx.Response:
        content = chunks() if chunked else body
        headers = {"content-type": "application/json"}
        return httpx.post(f"{live_url}{COMP}", content=content, headers=headers, timeout=60)

    r, latencies = _poll_health_during(live_url, big)
    how = "chunked" if chunked else "Content-Length"
    print(f"\n20 MB body ({how}): 413; /health x{len(latencies)}, max {max(latencies) * 1000:.0f} ms")
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "max_request_body_bytes" in err["message"]
    assert max(latencies) < 1.0
    assert httpx.get(f"{live_url}/health").status_code == 200


async def test_the_body_limit_is_configurable_and_counted(tokenizer):
    app = create_app(Settings.load(max_request_body_bytes=2000), lambda _: FakeEngine(tokenizer))
    async with app.router.lifespan_context(app):
        async with await _client(app) as client:
            small = {"model": "fake-model", "prompt": "hi", "max_tokens": 1}
            assert (await client.post(COMP, json=small)).status_code == 200
            big = {**small, "prompt": "x" * 3000}
            r = await client.post(COMP, json=big)
            assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}

            async def streamed() -> Any:
                data = json.dumps(big).encode()
                for i in range(0, len(data), 500):
                    yield data[i : i + 500]

            r = await client.post(COMP, content=streamed(), headers={"content-type": "application/json"})
            assert "content-length" not in r.request.headers
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            metrics = (await client.get("/metrics")).text
            assert 'specula_request_errors_total{status="413"} 2.0' in metrics


def test_max_request_body_bytes_flag_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULA_MAX_REQUEST_BODY_BYTES", "1234")
    assert Settings.load().max_request_body_bytes == 1234
    config = tmp_path / "c.yaml"
    config.write_text("max_request_body_bytes: 99\n")
    monkeypatch.delenv("SPECULA_MAX_REQUEST_BODY_BYTES")
    assert Settings.load(config).max_request_body_bytes == 99
    assert _served_settings(monkeypatch, ["--max-request-body-bytes", "77"]).max_request_body_bytes == 77


# ---- a request that can never fit is a 400, not a 429 -----------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMP, {"prompt": ["a"] * 6, "max_tokens": 1}, "prompt"),
        (COMP, {"prompt": ["a", "b"], "n": 3, "max_tokens": 1}, "n"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "n": 6, "max_tokens": 1}, "n"),
    ],
)
async def test_more_sequences_than_an_idle_server_admits_is_a_400_naming_the_field(tokenizer, path, body, param):
    """max_batch_size 2 + max_waiting 3 = 5 sequences at most: 6 can never be admitted, so retrying
    (what a 429 says) cannot help. 5 are served."""
    app = create_app(Settings.load(max_batch_size=2, max_waiting=3), lambda _: FakeEngine(tokenizer))
    async with app.router.lifespan_context(app):
        async with await _client(app) as client:
            r = await client.post(path, json={"model": "fake-model", **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "too_many_sequences" and "at most 5" in err["message"]
            fits = {**body, "n": 1} if param == "n" else {**body, "prompt": ["a"] * 5}
            ok = await client.post(path, json={"model": "fake-model", **fits})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == len(fits.get("prompt", "x"))


async def test_the_scheduler_refuses_what_never_fits_as_a_rejection_not_queue_full(tokenizer):
    scheduler = Scheduler(FakeEngine(tokenizer), max_batch_size=2, max_waiting=1)
    reqs = [GenerationRequest(f"r{i}", (1, 2), SamplingParams(max_tokens=1)) for i in range(4)]
    with pytest.raises(NeverFits, match="at most 3") as info:
        scheduler.submit(reqs)
    assert isinstance(info.value, RequestRejected)


# ---- log fields and the API key ---------------------------------------------------------------


async def test_client_strings_in_the_request_log_are_capped(tokenizer, caplog):
    caplog.set_level("INFO", logger="specula.request")
    app = create_app(Settings.load(), lambda _: FakeEngine(tokenizer))
    async with app.router.lifespan_context(app):
        async with await _client(app) as client:
            user = "u" * 1_000_000
            r = await client.post(COMP, json={"model": "fake-model", "prompt": "hi", "max_tokens": 1, "user": user})
            assert r.status_code == 200
    [line] = [r.getMessage() for r in caplog.records if r.name == "specula.request"]
    record = json.loads(line.removeprefix("request "))
    assert record["user"] == "u" * MAX_FIELD_CHARS + f"...[{1_000_000 - MAX_FIELD_CHARS} more chars]"
    assert len(line) < 1000


def _served_settings(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> Settings:
    """The settings `python -m server serve FLAGS` would run with (the server itself not started)."""
    seen: list[Settings] = []
    monkeypatch.setattr("server.api.serve.serve", lambda settings: seen.append(settings) or 0)  # exit status 0
    assert main(["serve", *flags]) == 0
    logging.getLogger().handlers.clear()  # main() configured logging
    return seen[0]


def test_api_key_file_and_environment(monkeypatch, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sekrit\n")
    settings = _served_settings(monkeypatch, ["--api-key-file", str(key_file)])
    assert settings.api_key == "sekrit" and "sekrit" not in repr(settings)
    monkeypatch.setenv("SPECULA_API_KEY", "from-env")
    assert _served_settings(monkeypatch, []).api_key == "from-env"
    assert _served_settings(monkeypatch, ["--api-key-file", str(key_file)]).api_key == "sekrit"  # flags win
    for bad in (["--api-key-file", str(tmp_path / "missing")], ["--api-key", "a", "--api-key-file", str(key_file)]):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", *bad])
        assert exit_.value.code == 2
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        main(["serve", "--api-key-file", str(tmp_path / "empty")])

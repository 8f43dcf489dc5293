"""The HTTP edge: what one connection may cost before the app sees its request.

uvicorn's httptools protocol (the fast parser `uvicorn[standard]` brings, and the one uvicorn picks) bounds
neither the size nor the time of reading a request: a 16 MB header line or 100k header fields were
parsed whole (the parser joins a header's pieces by copying, so one slow 64 MiB header held the event
loop for seconds), and a client sending its head or body at a byte a second held its connection
forever. (uvicorn's h11 protocol caps an unfinished head at `h11_max_incomplete_event_size`, 16 KiB,
but neither the number of fields nor any deadline, and it parses in Python.) `GuardedHttpProtocol` is
the httptools protocol with, per connection (the settings in `server/config.py`):

* **Head size.** A request line and header fields over `max_header_bytes`, or more than
  `max_header_count` fields, are a 431 once they pass it: an unfinished head is counted as its bytes
  arrive, so at most one socket read past the limit is ever buffered.
* **Head deadline.** A head must be complete within `header_timeout_s` of the connection opening, or
  of its first byte on a kept-alive connection (between requests uvicorn's keep-alive timeout, 5 s,
  applies): else 408, or a silent close when nothing arrived at all.
* **Body deadline.** A body must be complete within `body_timeout_s` of its head: else 408 (the app,
  waiting on the body, sees the client disconnected). It bounds reading the request only: an answer,
  an SSE stream of minutes included, is written for as long as it takes.
* **Open connections.** Past `max_connections`, a new connection is answered 503 and closed. Health probes
  keep an answer: `probe_connections` more slots (`ProbeReserve`) admit a connection past the limit on
  probation, its head read within `PROBE_HEAD_TIMEOUT_S`, and it is served only when that head is `GET` or
  `HEAD` of a probe path (`PROBE_PATHS`: `/health`, what every shipped probe asks), then closed; any other
  request there gets the same 503, so the reserve serves ordinary traffic nothing. One peer address holds at
  most `PROBE_SLOTS_PER_PEER` of those slots (a client holding every ordinary slot cannot take the reserve
  too, nor can a proxy's overflow), and a slot is given back the moment its connection is refused. Past the
  reserve (or the peer's share of it) a connection is answered 503 at once, nothing it sends parsed.
  Why a reserve and not a health port: the kubelet opens a new connection for every probe (its prober
  disables keep-alive), so a probe always needs a free slot, and the reserve gives it one on the port every
  manifest, the Dockerfile's HEALTHCHECK and a proxy's health check already use.

Each refusal is an answer in OpenAI's error shape with `Connection: close`, counted like the app's
errors (`on_refused`), logged at INFO; then the connection stops reading into the parser, shuts its
sending side and drops what still arrives for up to `LINGER_S` before it closes, so the client reads
the answer instead of a reset. Malformed requests (uvicorn's plain-text 400) get the same treatment.

`uvicorn_config(app, **options)` is the `uvicorn.Config` that serves `app` with this protocol
(`serve.py`, and the tests' live servers). The protocol leans on uvicorn's internals (the parser
callbacks, `cycle`, `pipeline`, `flow`); tests/test_http_edge.py drives every limit over real sockets,
so a uvicorn release that changes them fails there.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import urllib.parse
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import httptools
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from server.api import redaction
from server.api.errors import APIError
from server.config import Settings

log = logging.getLogger(__name__)

# After a refusal, how long the connection keeps draining what the client still sends before it closes:
# closing with unread bytes makes the kernel send a reset, which can destroy the answer before it is read.
LINGER_S = 2.0
# What a connection past max_connections may ask (in the reserve): the path every shipped probe uses
# (deploy/k8s's startup, readiness and liveness probes, the Dockerfile's HEALTHCHECK), by GET or HEAD.
PROBE_PATHS = frozenset({"/health"})
PROBE_METHODS = frozenset({b"GET", b"HEAD"})
# A probe sends its head as it connects; a reserved slot waits this long for it (not header_timeout_s: a silent
# connection must not hold a slot of the reserve for long).
PROBE_HEAD_TIMEOUT_S = 1.0
# Reserved slots one peer address may hold at once: the kubelet's readiness and liveness probes of a pod can
# overlap (its startup probe runs alone, before them); Docker's HEALTHCHECK runs one at a time.
PROBE_SLOTS_PER_PEER = 2


class ProbeReserve:
    """The connection slots past `max_connections` that only health probes may use: at most `slots` connections
    at once, at most `per_peer` of them from one peer address. One per server (`uvicorn_config`), shared by its
    connections; connections in it are not among the server's `connections` (max_connections counts the others).
    Runs on the event loop only.

    >>> reserve = ProbeReserve(3, per_peer=2)
    >>> [reserve.take("10.0.0.1") for _ in range(3)], reserve.take("10.0.0.2"), reserve.take("10.0.0.3")
    ([True, True, False], True, False)
    >>> reserve.give_back("10.0.0.1"); reserve.take("10.0.0.3")
    True
    """

    def __init__(self, slots: int, per_peer: int = PROBE_SLOTS_PER_PEER) -> None:
        self.slots, self.per_peer = slots, per_peer
        self._held: dict[str, int] = {}  # peer address -> slots it holds (absent: none)

    @property
    def held(self) -> int:
        """Slots in use."""
        return sum(self._held.values())

    def take(self, peer: str) -> bool:
        """A slot for a connection from `peer`; False when the reserve or the peer's share of it is full."""
        mine = self._held.get(peer, 0)
        if mine >= self.per_peer or self.held >= self.slots:
            return False
        self._held[peer] = mine + 1
        return True

    def give_back(self, peer: str) -> None:
        """Free one slot `take(peer)` gave."""
        left = self._held[peer] - 1
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head past its limits."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with caps on the head, deadlines on reading the request, and a cap
    on open connections (see the module docstring). Built per connection by `uvicorn_config`'s factory."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        settings: Settings,
        reserve: ProbeReserve,
        on_refused: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = settings
        self._reserve = reserve
        self._on_refused = on_refused
        self._reserved: str | None = None  # the peer whose reserved slot this connection holds (None: none)
        self._head_deadline: asyncio.TimerHandle | None = None  # while a head is awaited
        self._body_deadline: asyncio.TimerHandle | None = None  # while a body is read
        self._in_head = True  # the bytes arriving belong to a request head
        self._head_bytes = 0  # bytes received since this head began (what an unfinished head holds)
        self._head_size = 0  # the parsed head's target and fields, in bytes
        self._header_count = 0
        self._refusal: tuple[int, str, str] | None = None  # (status, message, code) a callback stopped on
        self._lingering = False  # answered a refusal: drop what arrives until closed
        self._turned_away = False  # over max_connections: never part of the server's connections

    # ---- connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        head_timeout = self._limits.header_timeout_s
        if len(self.connections) >= self._limits.max_connections:
            peer = _peer_address(transport)
            if not self._reserve.take(peer):
                self.transport = transport
                self._turned_away = True
                self._refuse(503, self._too_many(), "too_many_connections", answer=True)
                return
            super().connection_made(transport)
            self.connections.discard(self)  # in the reserve, not among the connections max_connections counts
            self._reserved = peer
            head_timeout = min(head_timeout, PROBE_HEAD_TIMEOUT_S)
        else:
            super().connection_made(transport)
        self._head_deadline = self.loop.call_later(head_timeout, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_deadline, self._body_deadline):
            if timer is not None:
                timer.cancel()
        self._head_deadline = self._body_deadline = None
        self._leave_reserve()
        if not self._turned_away:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, with our refusals (a callback raising _HeadRefused stops the parser) and our answer to a
        # malformed request in place of its plain-text 400.
        if self._lingering:
            return
        if self._in_head:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket routes: uvicorn_config sets ws="none"
        except httptools.HttpParserError as exc:
            refusal = self._refusal or (400, f"invalid HTTP request: {exc}", "invalid_http_request")
            self._refuse_head(*refusal)
            return
        if self._in_head and self._head_bytes > self._limits.max_header_bytes:
            self._refuse_head(431, self._head_too_large(), "request_header_fields_too_large")

    # ---- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = self._header_count = 0
        if self._head_deadline is None:  # a kept-alive connection's next request
            self._head_deadline = self.loop.call_later(self._limits.header_timeout_s, self._head_too_slow)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._limits.max_header_count:
            limit = self._limits.max_header_count
            message = f"the request has more header fields than this server accepts ({limit}: max_header_count)"
            self._refusal = (431, message, "request_header_fields_too_large")
            raise _HeadRefused
        self._count_head(len(name) + len(value) + 4)  # "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._reserved is not None and not self._is_probe():
            self._refusal = (503, self._too_many(), "too_many_connections")
            raise _HeadRefused
        self._in_head = False
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().on_headers_complete()
        if self._reserved is not None and self.cycle is not None:
            self.cycle.keep_alive = False  # one probe per reserved slot: the answer closes the connection
        # Cancelled at once by on_message_complete when the request has no body.
        self._body_deadline = self.loop.call_later(self._limits.body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
        self._in_head, self._head_bytes = True, 0

    # ---- limits -------------------------------------------------------------------------------

    def _too_many(self) -> str:
        limit = self._limits.max_connections
        return (f"the server has as many open connections as it accepts ({limit}: max_connections; past it only "
                f"GET /health is answered); retry shortly")

    def _is_probe(self) -> bool:
        """Whether the head just parsed asks what a connection in the reserve may ask (PROBE_PATHS)."""
        path = httptools.parse_url(self.url).path.decode("latin-1")
        return self.parser.get_method() in PROBE_METHODS and urllib.parse.unquote(path) in PROBE_PATHS

    def _leave_reserve(self) -> None:
        if self._reserved is not None:
            self._reserve.give_back(self._reserved)
            self._reserved = None

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > self._limits.max_header_bytes:
            self._refusal = (431, self._head_too_large(), "request_header_fields_too_large")
            raise _HeadRefused

    def _head_too_large(self) -> str:
        limit = self._limits.max_header_bytes
        return f"the request line and headers are larger than this server accepts ({limit} bytes: max_header_bytes)"

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self._head_bytes == 0:  # an idle connection that never asked: close without an answer
            self._refuse_head(408, "", "", quiet=True)
            return
        timeout = self._limits.header_timeout_s
        message = f"the request line and headers did not arrive within {timeout:g} s (header_timeout_s)"
        self._refuse_head(408, message, "request_timeout")

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        cycle = self.cycle
        # The request whose body is late is the one running (nothing pipelined behind an earlier answer)
        # and has not answered: it can be told why. Its app sees the client gone and its sends go nowhere.
        answer = cycle is not None and not self.pipeline and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        timeout = self._limits.body_timeout_s
        message = f"the request body did not arrive within {timeout:g} s of its headers (body_timeout_s)"
        self._refuse(408, message, "request_timeout", answer=answer)

    def _refuse_head(self, status: int, message: str, code: str, quiet: bool = False) -> None:
        """Refuse the head being read. It can be answered unless an earlier request on this connection
        (pipelined) is still answering; that answer is cut instead."""
        cycle = self.cycle
        idle = cycle is None or cycle.response_complete
        if not idle:
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(status, message, code, answer=idle and not quiet)

    def _refuse(self, status: int, message: str, code: str, *, answer: bool) -> None:
        """Answer `status` (when `answer`), then stop parsing and linger until the connection closes."""
        if self._lingering or self.transport.is_closing():
            return
        self._lingering = True
        self._in_head = False
        self._leave_reserve()  # refused: only draining now, its slot is free for a probe
        for timer in (self._head_deadline, self._body_deadline):
            if timer is not None:
                timer.cancel()
        self._head_deadline = self._body_deadline = None
        if self.flow is not None:
            self.flow.resume_reading()  # reading may be paused on a buffered body: drain it too
        if message:
            log.info("%s: %d %s", _peer(self.transport), status, message)
        if answer:
            if self._on_refused is not None:
                self._on_refused(status)
            self.transport.write(self._answer(status, message, code))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _answer(self, status: int, message: str, code: str) -> bytes:
        body = json.dumps(APIError(status, message, code=code).body()).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
        lines += [name + b": " + value for name, value in headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _peer(transport: asyncio.Transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "client"


def _peer_address(transport: asyncio.Transport) -> str:
    """The peer's address without its port (what `ProbeReserve` shares slots by); "local" for a Unix socket."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "local"


def uvicorn_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` (made by `create_app`) with `GuardedHttpProtocol` (its connections share one
    `ProbeReserve` of `probe_connections` slots) and no WebSocket upgrades (no route takes one); `options` are
    uvicorn's (host, port, log_level, ...)."""
    state = app.state.specula
    reserve = ProbeReserve(state.settings.probe_connections)
    protocol = functools.partial(GuardedHttpProtocol, settings=state.settings, reserve=reserve,
                                 on_refused=state.observe_error)
    config = uvicorn.Config(app, http=protocol, ws="none", **options)  # type: ignore[arg-type]
    redaction.install()  # after uvicorn configured its loggers: their handlers mask credentials in URLs
    return config

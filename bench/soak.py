"""`make soak`: mixed traffic against a fresh server for a bounded time, then idle; what it served.

With `--hogs N`, N CPU-bound processes run for the whole soak, started before the server (which then loads and
calibrates on a busy host, as users' servers do) and stopped however the soak ends. Right after the server
answers `/health`, it gets its first request alone, then `FRESH_CLIENTS` concurrent clients each send
`FRESH_CHATS` short chats (what a fresh server on a busy host once failed: its first requests). Then each of
`--clients` concurrent clients loops until the deadline, picking one kind of request at a time (seeded): chat
and text completions (some with prompts of 300-1500 words), streams read to the end, streams aborted after two
chunks, n = 2 seeded sampling, oversized inputs (a prompt beyond the context; a multi-megabyte body) and bad
fields (out-of-range numbers, unknown models, a lone UTF-16 surrogate...), and copy-heavy chats asking for each
speculation method the server lists in `/v1/models` (greedy). After the traffic, each method is asked once more
per copy prompt, one request at a time, beside `none`. It reports requests served,
statuses per kind, p50/p95 latency of the completed ones, the server's RSS every second (after warm-up, peak,
and after `--idle-s` seconds without traffic) and the memory parts its /metrics exports
(`specula_memory_bytes{part}`, docs/api.md#memory), whose largest sum the peak RSS is held to
(`--max-rss-ratio`, default 1.15): the largest of the sampled sums and the server's own record
(`specula_memory_peak_bytes{part}`, also taken when the KV cache grows, its old storage beside the new, which
a one-second sample misses). The peak is the kernel's high-water mark of the server's RSS since it became
healthy (VmHWM, reset then), so no spike between two samples escapes. It fails (exit 1) on any 5xx, any lost
request (no status, a stream without `[DONE]`, a timeout), a fresh-start request that is not a 200, a server
that does not come up or does not drain, a peak RSS over the ratio, or a method that did not run: one asked for
that never drafted or never had a draft accepted, one the fail-safe turned off for a request
(`usage.speculation.fallbacks`), or a copy chat whose greedy text is not `none`'s for the same prompt (under the
traffic's batches as in the sequential check). Server settings come from the
environment (`SPECULA_KV_CACHE_MEMORY=512MiB`) or the arguments after `--` (flags of `python -m server
serve`).

The report goes to `--out` (default bench/results/latest/soak/soak.json) and the run to the ledger
(bench/ledger.py) as suite `soak` (`--no-record`: neither the ledger nor latest/, as CI's soak runs).

    python -m bench.soak --seconds 600                    # the built-in model, 10 minutes
    python -m bench.soak --seconds 120 --hogs 2           # CI's (make soak-ci): 2 minutes on a busy host
    python -m bench.soak -- --target DIR --served-model-name tiny   # any model directory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import ledger
from bench.server_proc import live_server

SUITE = "soak"
FRESH_CLIENTS = 8  # concurrent short chat clients right after the server's first request
FRESH_CHATS = 2  # chats each of them sends
MAX_RSS_RATIO = 1.15  # the peak RSS may exceed the largest sum of the memory parts /metrics exports by this
WORDS = "the quick brown fox jumps over the lazy dog while specula drafts and verifies tokens".split()

# kind -> share of the traffic
MIX = {
    "chat": 0.1,
    "copy": 0.1,  # a copy-heavy greedy chat asking for one of the server's methods (`check_methods`)
    "long_prompt": 0.05,
    "completion": 0.15,
    "stream": 0.15,
    "stream_abort": 0.1,
    "n2_seeded": 0.05,
    "oversized_prompt": 0.05,
    "oversized_body": 0.05,
    "bad_field": 0.2,
}
BAD_FIELDS: list[dict[str, Any]] = [
    {"temperature": -1},
    {"temperature": 1e-300},  # valid: greedy in the limit
    {"top_p": 2},
    {"top_k": 2**63},
    {"seed": 2**64},
    {"n": 0},
    {"max_tokens": -5},
    {"model": "no-such-model"},
    {"logprobs": True, "top_logprobs": 100},
    {"speculation": {"method": "nope"}},
    {"messages": []},
    {"messages": [{"role": "user", "content": "half an emoji \ud83d here"}]},
    {"stop": ["x"] * 100},
    {"max_tokens": "10"},  # loose types: strict fields refuse them
    {"temperature": True},
    {"stream": "yes"},
    {"use_beam_search": True},  # a vLLM field not served: refused, naming it
]
# copy-heavy prompts: the answer repeats the prompt's text, so every proposer has something to draft
COPY_PROMPTS = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. Speculative decoding lets a small "
    "draft propose tokens that a large target model checks in one pass.",
    "Fix the typos and repeat the rest as it is: Teh cat sat on teh mat. The dog sat on the mat. Teh bird sat "
    "on the mat.",
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears.",
]
COPY_TOKENS = 48  # max_tokens of a copy chat (the same for every method: their greedy texts are compared)


@dataclass(frozen=True)
class Target:
    """What the traffic is sized to: the served model's name, its context in tokens, the big body's size, and the
    speculation methods it lists (`/v1/models`; the copy chats ask for each)."""

    model: str
    context: int
    body_mb: float
    methods: tuple[str, ...] = ("none",)


@dataclass(frozen=True)
class Copied:
    """What a copy chat's answer said of its speculation (its `usage.speculation`) and its text."""

    method: str
    prompt: int  # index into COPY_PROMPTS
    text: str
    draft_tokens: int
    accepted_tokens: int
    fallbacks: tuple[str, ...]  # "proposer:reason" of each proposer the fail-safe turned off for it


@dataclass
class Outcome:
    kind: str
    # HTTP status; "aborted" (by us, on purpose), "stream_error" (an error event mid-stream) or "lost"
    # (no answer, a stream cut without [DONE], a timeout)
    status: int | str
    latency_s: float
    copied: Copied | None = None  # a copy chat answered in full


@dataclass
class Report:
    seconds: float
    clients: int
    requests: int
    served: int  # 2xx answered in full
    statuses: dict[str, dict[str, int]]  # kind -> status -> count
    latency_p50_s: float | None
    latency_p95_s: float | None
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, RSS MiB)
    rss_after_warmup_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_idle_mb: float = 0.0
    hogs: int = 0  # CPU-bound processes that ran beside the server
    # /metrics' memory parts (specula_memory_bytes{part}, MiB) when their sum was largest, and that sum
    memory_parts_mb: dict[str, float] = field(default_factory=dict)
    memory_sum_mb: float = 0.0
    rss_ratio: float | None = None  # rss_peak_mb / memory_sum_mb (None: the server exports no parts)
    memory_parts_series: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (s, part -> MiB)
    drained: bool = False  # running and waiting gauges back to 0 after the traffic
    # per method asked for by copy chats: requests, draft_tokens, accepted_tokens, fallbacks, texts unlike none's
    methods: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    """Resident set size of a process (Linux /proc), in MiB; `VmHWM`: its high-water mark."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss(pid: int) -> bool:
    """Reset a process's RSS high-water mark (VmHWM) to its RSS now (Linux: /proc/PID/clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


MEMORY_LINE = re.compile(r'^(?P<name>specula_memory(?:_peak)?_bytes)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def memory_parts(metrics_text: str, peak: bool = False) -> dict[str, float]:
    """`specula_memory_bytes{part=...}` from a /metrics body (`peak`: `specula_memory_peak_bytes`, the parts
    when their sum was largest), in MiB per part ({} when it has none)."""
    name = "specula_memory_peak_bytes" if peak else "specula_memory_bytes"
    parts = {}
    for line in metrics_text.splitlines():
        m = MEMORY_LINE.match(line)
        if m and m["name"] == name:
            part = re.search(r'part="([^"]*)"', m["labels"])
            if part:
                parts[part[1]] = float(m["value"]) / 2**20
    return parts


class RssSampler(threading.Thread):
    """The server's RSS every `every_s` seconds and, from its /metrics, its memory parts: the parts when
    their sum was largest."""

    def __init__(self, pid: int, url: str | None = None, every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.url, self.every_s, self.started = pid, url, every_s, time.monotonic()
        self.series: list[tuple[float, float]] = []
        self.parts_series: list[tuple[float, dict[str, float]]] = []
        self.largest_parts: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.series.append((round(time.monotonic() - self.started, 1), round(rss_mb(self.pid), 1)))
            except OSError:
                return
            if self.url is not None:
                try:
                    text = httpx.get(f"{self.url}/metrics", timeout=10).text
                except httpx.HTTPError:
                    text = ""
                parts = memory_parts(text)
                if parts:
                    self.parts_series.append((self.series[-1][0], {k: round(v, 1) for k, v in parts.items()}))
                # the server's own record of the largest sum: it also looks right after the KV cache grows,
                # where the sum peaks between two samples
                for seen in (parts, memory_parts(text, peak=True)):
                    if sum(seen.values()) > sum(self.largest_parts.values()):
                        self.largest_parts = seen
            self.stop.wait(self.every_s)


HOG = "import os, sys\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n    for _ in range(10**6): pass\n"


@contextmanager
def cpu_hogs(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` processes that keep a CPU core busy until the block ends, however it ends (each also stops by
    itself within a few milliseconds once its parent is gone: no orphans when the soak is killed)."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build(kind: str, rng: random.Random, target: Target) -> tuple[str, dict[str, Any] | bytes]:
    """(path, JSON body or raw bytes) for one request of `kind`."""
    model = target.model
    chat = {"model": model, "messages": [{"role": "user", "content": prompt(rng, rng.randint(3, 40))}],
            "max_tokens": rng.randint(4, 48)}
    if kind == "chat":
        return "/v1/chat/completions", {**chat, "temperature": rng.choice([0, 0.7])}
    if kind == "long_prompt":  # 300-1500 words (about as many tokens), within half the context
        words = rng.randint(min(300, target.context // 4), min(1500, target.context // 2))
        return "/v1/completions", {"model": model, "prompt": prompt(rng, words), "max_tokens": rng.randint(8, 64),
                                   "temperature": 0}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": prompt(rng, rng.randint(3, 60)),
                                   "max_tokens": rng.randint(4, 48), "temperature": 0}
    if kind in ("stream", "stream_abort"):
        return "/v1/chat/completions", {**chat, "stream": True, "max_tokens": rng.randint(16, 64)}
    if kind == "n2_seeded":
        return "/v1/chat/completions", {**chat, "n": 2, "temperature": 0.9, "seed": rng.randint(0, 1000)}
    if kind == "oversized_prompt":  # more tokens than the context: 400
        return "/v1/completions", {"model": model, "prompt": prompt(rng, 2 * target.context), "max_tokens": 4}
    if kind == "oversized_body":  # a multi-megabyte body: 400 (too long) or 413 (over the body limit)
        big = "a " * int(target.body_mb * 2**19)
        return "/v1/completions", json.dumps({"model": model, "prompt": big, "max_tokens": 4}).encode()
    if kind == "copy":
        return "/v1/chat/completions", copy_body(model, rng.randrange(len(COPY_PROMPTS)), rng.choice(target.methods))
    bad = dict(rng.choice(BAD_FIELDS))
    body = {**chat, **bad}
    return "/v1/chat/completions", json.dumps(body).encode()  # json.dumps keeps a lone surrogate as \\ud83d


def copy_body(model: str, prompt_index: int, method: str) -> dict[str, Any]:
    """A copy chat: prompt `prompt_index` of COPY_PROMPTS, greedy, asking for `method` (K 4 for a fixed method)."""
    speculation: dict[str, Any] = {"method": method} | ({"num_tokens": 4} if method not in ("none", "auto") else {})
    return {"model": model, "messages": [{"role": "user", "content": COPY_PROMPTS[prompt_index]}],
            "max_tokens": COPY_TOKENS, "temperature": 0, "speculation": speculation}


def copied(body: dict[str, Any], answer: dict[str, Any]) -> Copied:
    """A copy chat's `Copied` from its request body and its (whole, 200) answer."""
    spec = answer.get("usage", {}).get("speculation", {})
    prompt = COPY_PROMPTS.index(body["messages"][0]["content"])
    return Copied(body["speculation"]["method"], prompt, answer["choices"][0]["message"]["content"] or "",
                  int(spec.get("draft_tokens", 0)), int(spec.get("accepted_tokens", 0)),
                  tuple(f"{f['proposer']}:{f['reason']}" for f in spec.get("fallbacks", [])))


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, target: Target) -> Outcome:
    path, body = build(kind, rng, target)
    started = time.monotonic()
    kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        if kind.startswith("stream"):
            async with client.stream("POST", path, **kwargs) as r:
                if r.status_code != 200:
                    await r.aread()
                    return Outcome(kind, r.status_code, time.monotonic() - started)
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith('data: {"error"'):
                        return Outcome(kind, "stream_error", time.monotonic() - started)
                    chunks += 1
                    if kind == "stream_abort" and chunks == 2:
                        return Outcome(kind, "aborted", time.monotonic() - started)
                return Outcome(kind, 200 if done else "lost", time.monotonic() - started)
        r = await client.post(path, **kwargs)
        if r.status_code == 200 and not r.json().get("choices"):
            return Outcome(kind, "lost", time.monotonic() - started)
        answer = copied(body, r.json()) if kind == "copy" and r.status_code == 200 else None  # type: ignore[arg-type]
        return Outcome(kind, r.status_code, time.monotonic() - started, answer)
    except httpx.HTTPError:
        return Outcome(kind, "lost", time.monotonic() - started)


async def method_check(url: str, target: Target) -> list[Outcome]:
    """Each copy prompt with `none`, then with every other method the server lists, one request at a time: what
    `check_methods` compares the traffic's copy chats with (`none`'s texts), and each method asked for at least
    once per prompt."""
    outcomes = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for i in range(len(COPY_PROMPTS)):
            for method in ("none", *(m for m in target.methods if m != "none")):
                body = copy_body(target.model, i, method)
                started = time.monotonic()
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                    answer = copied(body, r.json()) if r.status_code == 200 else None
                    outcomes.append(Outcome("method_check", r.status_code if answer else "lost",
                                            time.monotonic() - started, answer))
                except (httpx.HTTPError, KeyError, IndexError, ValueError):
                    outcomes.append(Outcome("method_check", "lost", time.monotonic() - started))
    return outcomes


def check_methods(outcomes: list[Outcome]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Per method asked for by copy chats (the traffic's and the sequential check's): requests, draft and
    accepted tokens, fallbacks and texts unlike `none`'s for the same prompt; and the problems: a method other
    than `none` that never drafted or never had a draft accepted, one the fail-safe turned off for a request, a
    greedy text that differs from `none`'s (the sequential check's answer to the same prompt)."""
    answers = [o.copied for o in outcomes if o.copied is not None]
    plain = {a.prompt: a.text for o, a in ((o, o.copied) for o in outcomes)
             if a is not None and o.kind == "method_check" and a.method == "none"}
    tally: dict[str, dict[str, int]] = {}
    for a in answers:
        t = tally.setdefault(a.method, dict.fromkeys(("requests", "draft_tokens", "accepted_tokens", "fallbacks",
                                                      "unlike_none"), 0))
        t["requests"] += 1
        t["draft_tokens"] += a.draft_tokens
        t["accepted_tokens"] += a.accepted_tokens
        t["fallbacks"] += len(a.fallbacks)
        t["unlike_none"] += a.prompt in plain and a.text != plain[a.prompt]
    problems = []
    for method, t in sorted(tally.items()):
        if method != "none" and not t["draft_tokens"]:
            problems.append(f"method {method} never drafted in {t['requests']} copy chats")
        elif method != "none" and not t["accepted_tokens"]:
            problems.append(f"method {method} drafted {t['draft_tokens']} tokens in {t['requests']} copy chats and "
                            "none was accepted")
        if t["fallbacks"]:
            lost = sorted({f for a in answers if a.method == method for f in a.fallbacks})
            problems.append(f"method {method} fell back {t['fallbacks']} times (usage.speculation.fallbacks: "
                            f"{', '.join(lost)})")
        if t["unlike_none"]:
            problems.append(f"method {method}: {t['unlike_none']} of {t['requests']} greedy copy chats differ from "
                            "none's text for the same prompt")
    return tally, problems


async def traffic(url: str, target: Target, clients: int, seconds: float, seed: int) -> list[Outcome]:
    deadline = time.monotonic() + seconds
    kinds, weights = list(MIX), list(MIX.values())
    outcomes: list[Outcome] = []

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                outcomes.append(await one(client, rng.choices(kinds, weights)[0], rng, target))

    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return outcomes


async def fresh_start(url: str, target: Target, seed: int) -> list[Outcome]:
    """A fresh server's first request, alone, then `FRESH_CLIENTS` concurrent clients sending
    `FRESH_CHATS` short chats each: every one must be a 200."""
    rng = random.Random(seed)

    async def chat(client: httpx.AsyncClient, kind: str) -> Outcome:
        body = {"model": target.model, "messages": [{"role": "user", "content": prompt(rng, rng.randint(3, 20))}],
                "max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.7])}
        started = time.monotonic()
        try:
            r = await client.post("/v1/chat/completions", json=body)
            ok = r.status_code != 200 or r.json().get("choices")
            return Outcome(kind, r.status_code if ok else "lost", time.monotonic() - started)
        except httpx.HTTPError:
            return Outcome(kind, "lost", time.monotonic() - started)

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        outcomes = [await chat(client, "first_request")]

        async def client_loop() -> list[Outcome]:
            return [await chat(client, "fresh_burst") for _ in range(FRESH_CHATS)]

        for got in await asyncio.gather(*(client_loop() for _ in range(FRESH_CLIENTS))):
            outcomes += got
    return outcomes


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        for name in ("specula_requests_running", "specula_requests_waiting"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found


def summarize(outcomes: list[Outcome], seconds: float, clients: int) -> Report:
    statuses: dict[str, Counter[str]] = {}
    for o in outcomes:
        statuses.setdefault(o.kind, Counter())[str(o.status)] += 1
    done = sorted(o.latency_s for o in outcomes if o.status == 200)
    p50 = statistics.median(done) if done else None
    p95 = done[min(len(done) - 1, int(0.95 * len(done)))] if done else None
    problems = [f"{k}: {n} x {s}" for k, c in statuses.items() for s, n in c.items()
                if s in ("lost", "stream_error") or (s.isdigit() and int(s) >= 500)
                or (k in ("first_request", "fresh_burst") and s != "200")]
    return Report(seconds, clients, len(outcomes), len(done), {k: dict(c) for k, c in statuses.items()}, p50, p95,
                  problems=problems)


def soak(
    server_args: list[str], *, seconds: float, clients: int, idle_s: float, warmup_s: float, seed: int,
    log_path: Path, context: int = 2048, body_mb: float = 3.0, threads: int | None = None, hogs: int = 0,
    max_rss_ratio: float | None = MAX_RSS_RATIO, start_timeout_s: float = 600.0,
    progress: Callable[[str], None] = print,
) -> Report:
    """Start `hogs` CPU hogs, then a server with `server_args`; its first requests, warm-up, the traffic,
    idle; the report. A server that does not come up raises RuntimeError."""
    procs: list[Any] = []
    with cpu_hogs(hogs), live_server(server_args, threads, log_path, timeout_s=start_timeout_s, procs=procs) as url:
        pid = procs[0].pid
        exact_peak = reset_peak_rss(pid)
        sampler = RssSampler(pid, url)
        sampler.start()
        listed = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        methods = tuple(listed.get("speculation", {}).get("methods", ("none",)))
        target = Target(listed["id"], context, body_mb, methods)
        progress(f"fresh start: 1 request, then {FRESH_CLIENTS} clients x {FRESH_CHATS} short chats"
                 + (f" ({hogs} CPU hogs running)" if hogs else ""))
        first = asyncio.run(fresh_start(url, target, seed + 2))
        warm = 0.0
        outcomes = first
        if procs[0].poll() is None:  # the rest only for a server still running
            progress(f"warm-up {warmup_s:.0f} s")
            asyncio.run(traffic(url, target, clients, warmup_s, seed + 1))
            warm = rss_mb(pid)
            progress(f"traffic {seconds:.0f} s, {clients} clients")
            outcomes = first + asyncio.run(traffic(url, target, clients, seconds, seed))
            progress(f"every method on {len(COPY_PROMPTS)} copy prompts, one request at a time")
            outcomes += asyncio.run(method_check(url, target))
        report = summarize(outcomes, seconds, clients)
        report.methods, problems = check_methods(outcomes)
        report.problems += problems
        if procs[0].poll() is None:
            progress(f"idle {idle_s:.0f} s")
            time.sleep(idle_s)
        high_water = rss_mb(pid, "VmHWM") if exact_peak and procs[0].poll() is None else 0.0
        sampler.stop.set()
        sampler.join()
        if procs[0].poll() is not None:
            report.problems.append(f"the server exited (status {procs[0].returncode}) during the soak")
        else:
            report.rss_idle_mb = rss_mb(pid)
            try:
                load = gauges(url)
                health = httpx.get(f"{url}/health", timeout=10).status_code
            except httpx.HTTPError as exc:
                load, health = {}, f"unreachable ({exc})"
            report.drained = load.get("specula_requests_running") == 0 and load.get("specula_requests_waiting") == 0
            if not report.drained:
                report.problems.append(f"not drained after the traffic: {load}")
            if health != 200:
                report.problems.append(f"/health is {health} after the traffic, not 200")
    report.hogs = hogs
    report.rss_mb = sampler.series
    report.rss_after_warmup_mb = round(warm, 1)
    report.rss_peak_mb = round(max(high_water, *(r for _, r in sampler.series), 0.0), 1)
    report.rss_idle_mb = round(report.rss_idle_mb, 1)
    report.memory_parts_mb = {k: round(v, 1) for k, v in sampler.largest_parts.items()}
    report.memory_parts_series = sampler.parts_series
    report.memory_sum_mb = round(sum(sampler.largest_parts.values()), 1)
    if report.memory_sum_mb:
        report.rss_ratio = round(report.rss_peak_mb / report.memory_sum_mb, 3)
        if max_rss_ratio is not None and report.rss_ratio > max_rss_ratio:
            report.problems.append(f"peak RSS {report.rss_peak_mb:.0f} MiB is {report.rss_ratio:.2f}x the memory "
                                   f"parts' sum {report.memory_sum_mb:.0f} MiB (over {max_rss_ratio:.2f}x)")
    elif max_rss_ratio is not None:
        report.problems.append("the server's /metrics exports no specula_memory_bytes: no memory plan to check")
    return report


def format_report(r: Report) -> str:
    ms = lambda s: f"{1000 * s:.0f} ms" if s is not None else "-"  # noqa: E731
    lines = [
        f"soak: {r.requests} requests in {r.seconds:.0f} s from {r.clients} clients; {r.served} served (2xx, whole)",
        f"latency of served requests: p50 {ms(r.latency_p50_s)}, p95 {ms(r.latency_p95_s)}",
        "statuses by kind:",
        *[f"  {kind:<17} {dict(sorted(c.items()))}" for kind, c in sorted(r.statuses.items())],
        f"RSS: {r.rss_after_warmup_mb:.0f} MiB after warm-up, peak {r.rss_peak_mb:.0f} MiB, "
        f"{r.rss_idle_mb:.0f} MiB after idle ({r.rss_idle_mb / max(r.rss_after_warmup_mb, 1e-9):.2f}x warm-up)",
        "memory parts at their largest sum (MiB, /metrics): "
        + (", ".join(f"{k} {v:.0f}" for k, v in r.memory_parts_mb.items()) or "none exported")
        + (f"; sum {r.memory_sum_mb:.0f}, peak RSS / sum {r.rss_ratio:.2f}" if r.rss_ratio is not None else ""),
        *([f"CPU hogs beside the server: {r.hogs}"] if r.hogs else []),
        "copy chats per method (requests, draft / accepted tokens, fallbacks, unlike none): "
        + ("; ".join(f"{m} {t['requests']}, {t['draft_tokens']} / {t['accepted_tokens']}, {t['fallbacks']}, "
                     f"{t['unlike_none']}" for m, t in sorted(r.methods.items())) or "none"),
        f"drained: {r.drained}; problems: {r.problems or 'none'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300, help="traffic duration (default 300)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=30, help="idle time after the traffic before the last RSS")
    p.add_argument("--warmup-s", type=float, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    p.add_argument("--context", type=int, default=2048, help="the server's context (sizes the oversized prompts)")
    p.add_argument("--body-mb", type=float, default=3.0, help="size of the oversized bodies")
    p.add_argument("--hogs", type=int, default=0,
                   help="CPU-bound processes running for the whole soak, started before the server")
    p.add_argument("--max-rss-ratio", type=float, default=MAX_RSS_RATIO,
                   help="fail when the peak RSS exceeds the memory parts' sum by more (0: do not check)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="how long the server may take to be healthy")
    p.add_argument("--out", type=Path, default=None, help="the report (default bench/results/latest/soak/soak.json)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    p.add_argument("server_args", nargs="*", help="passed to `python -m server serve` (after --)")
    args = p.parse_args(argv)
    args.out = args.out or ledger.results_dir() / ledger.LATEST_DIR / SUITE / "soak.json"
    # SIGTERM (a CI runner's timeout) unwinds like Ctrl-C: the server and the hogs are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log_path = args.out.with_suffix(".log")
    try:
        report = soak(args.server_args, seconds=args.seconds, clients=args.clients, idle_s=args.idle_s,
                      warmup_s=args.warmup_s, seed=args.seed, log_path=log_path, context=args.context,
                      body_mb=args.body_mb, threads=args.threads, hogs=args.hogs,
                      max_rss_ratio=args.max_rss_ratio or None, start_timeout_s=args.start_timeout_s)
    except RuntimeError as exc:  # the server did not come up
        print(f"soak FAILED: {exc}", file=sys.stderr)
        print_log_tail(log_path)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(format_report(report))
    if not args.no_record:
        ledger.record(SUITE, [], files=[args.out, *([log_path] if report.problems else [])],
                      figures=ledger_figures(report, args))
    if report.problems:
        print(f"soak FAILED: {'; '.join(report.problems)} (server log: {log_path})", file=sys.stderr)
        print_log_tail(log_path)
        return 1
    return 0


def ledger_figures(report: Report, args: argparse.Namespace) -> dict[str, Any]:
    """What the ledger keeps of a soak: its shape, what was served, latency, RSS against the memory parts."""
    def rounded(v: float | None, digits: int = 2) -> float | None:
        return None if v is None else round(v, digits)

    return {"seconds": report.seconds, "clients": report.clients, "hogs": args.hogs, "requests": report.requests,
            "served": report.served, "p50_s": rounded(report.latency_p50_s), "p95_s": rounded(report.latency_p95_s),
            "rss_peak_mib": report.rss_peak_mb, "memory_parts_mib": report.memory_sum_mb,
            "rss_over_parts": report.rss_ratio, "problems": len(report.problems)}


def print_log_tail(path: Path, lines: int = 40) -> None:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    print(f"--- last {len(tail)} lines of {path} ---", *tail, sep="\n", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

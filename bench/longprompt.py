"""Long prompts against streaming chats: do short streams stall while a long prompt is computed?

    python -m bench.longprompt [--budget 64] [--seconds 60] [--every 20] [--long-tokens 8000]

One server (the default model and settings; `--budget` sets `max_num_batched_tokens`, the step's token
budget: server/speculation/budget.py). Three phases, one after another, each prompt sent once (every
request has its own `cache_salt`, so neither the prefix cache nor `suffix` sees a prompt twice):

1. `alone`: two long prompts (different documents) one after the other with nothing else running, `max_tokens`
   1: the prefill alone is the mean of their times to first token.
2. `unloaded`: `--clients` clients stream short greedy chats in closed loops for `--seconds`.
3. `loaded`: the same clients again, and a long prompt (about `--long-tokens` tokens, different text each
   time) arrives every `--every` seconds from the phase's second second.

Reported, for the short streams: tokens/s (completion tokens over the phase's seconds) and p50/p95 of the
gaps between a stream's chunks (inter-token latency as a client sees it: a chunk may carry several
accepted tokens) and of their times to first token (a new chat that waits behind a long prompt stalls
before its first gap); for the long prompts: their times to first token against the prefill alone.
Run it with `--budget 8192` for what computing each prompt whole (no chunking) gives. The figures go to
`--out` (default bench/results/latest/longprompt/longprompt.json, with the server's log beside it) and the
run to the ledger (bench/ledger.py) as suite `longprompt` (`--no-record`: neither).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import httpx

from bench import ledger
from bench.fresh import OPEN
from bench.server_proc import live_server

SUITE = "longprompt"

CHATS = [  # the held-out open questions (bench/fresh.py), and four more
    *OPEN,
    "How does a bicycle stay upright when it moves?",
    "Describe a calm morning at the beach in a few sentences.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery and explain why.",
]
WORDS = ("river stone garden window market lantern copper meadow harbor pencil orbit violin canyon ledger "
         "thunder pepper glacier saddle cinder orchard beacon marble tunnel falcon quarry velvet anchor").split()


@dataclass
class Stream:
    """One streamed request: when it was sent, when each content chunk arrived, its completion tokens."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> Stream:
    """Send one chat completion with `stream: true` and time its chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = Stream(time.perf_counter())
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out.tokens = event["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                out.chunks.append(time.perf_counter())
    return out


def long_text(seed: int, words: int) -> str:
    """A different long document for each seed (random words, numbered sentences)."""
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(f"Note {len(sentences) + 1}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return " ".join(sentences)


async def long_body(client: httpx.AsyncClient, url: str, model: str, seed: int, tokens: int) -> dict:
    """A chat asking to summarise a document, sized to about `tokens` prompt tokens with /tokenize."""
    words = tokens * 3 // 4
    for _ in range(4):
        messages = [{"role": "user", "content": "Summarise this log in one sentence.\n\n" + long_text(seed, words)}]
        count = (await client.post(f"{url}/tokenize", json={"model": model, "messages": messages})).json()["count"]
        if abs(count - tokens) <= tokens // 50:
            break
        words = words * tokens // count
    return {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "cache_salt": f"long-{seed}"}


async def chats(client: httpx.AsyncClient, url: str, model: str, clients: int, seconds: float, max_tokens: int,
                salt: str) -> list[Stream]:
    """`clients` closed loops of short greedy chats until `seconds` have passed (the last ones finish)."""
    done: list[Stream] = []
    end = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def loop(c: int) -> None:
        while time.perf_counter() < end:
            n = next(counter)
            body = {"model": model, "messages": [{"role": "user", "content": CHATS[n % len(CHATS)]}],
                    "max_tokens": max_tokens, "temperature": 0, "cache_salt": f"{salt}-{n}"}
            done.append(await stream(client, url, body))

    await asyncio.gather(*(loop(c) for c in range(clients)))
    return done


def summary(streams: list[Stream], started: float, ended: float) -> dict:
    """Tokens/s of the short streams in [started, ended], their chunk gaps' p50/p95 and their times to first
    token's p50/p95 (seconds: a stream that waits to start is a stall the gaps do not show)."""
    gaps = sorted(g for s in streams for g in s.gaps)
    q = statistics.quantiles(gaps, n=20) if len(gaps) >= 20 else [float("nan")] * 19
    ttfts = sorted(s.ttft for s in streams if s.chunks)
    t = statistics.quantiles(ttfts, n=20) if len(ttfts) >= 2 else [float("nan")] * 19
    return {"requests": len(streams), "tokens": sum(s.tokens for s in streams),
            "tokens_per_s": sum(s.tokens for s in streams) / (ended - started),
            "itl_p50_s": statistics.median(gaps) if gaps else float("nan"), "itl_p95_s": q[18],
            "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"), "ttft_p95_s": t[18]}


async def measure(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await stream(client, url, {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                   "max_tokens": 4, "temperature": 0})  # warm up
        alone_body = await long_body(client, url, model, 0, args.long_tokens)
        prompt_tokens = (await client.post(f"{url}/tokenize", json={"model": model, "messages":
                                                                    alone_body["messages"]})).json()["count"]
        alones = [await stream(client, url, {**body, "max_tokens": 1})  # two documents: the mean of two runs
                  for body in (alone_body, await long_body(client, url, model, 10**6, args.long_tokens))]
        alone_s = statistics.mean(a.ttft for a in alones)
        print(f"long prompt of {prompt_tokens} tokens alone: first token after "
              f"{', '.join(f'{a.ttft:.2f}' for a in alones)} s", flush=True)

        started = time.perf_counter()
        unloaded = await chats(client, url, model, args.clients, args.seconds, args.max_tokens, "unloaded")
        base = summary(unloaded, started, time.perf_counter())
        print(f"unloaded: {json.dumps(base)}", flush=True)

        bodies = [await long_body(client, url, model, seed, args.long_tokens)
                  for seed in range(1, int(args.seconds // args.every) + 2)]
        started = time.perf_counter()

        async def longs() -> list[Stream]:
            out = []
            tasks = []
            for i, body in enumerate(bodies):
                at = started + 1.0 + i * args.every
                if at > started + args.seconds:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(stream(client, url, body)))
            for t in tasks:
                out.append(await t)
            return out

        loaded, long_streams = await asyncio.gather(
            chats(client, url, model, args.clients, args.seconds, args.max_tokens, "loaded"), longs())
        load = summary(loaded, started, time.perf_counter())
        print(f"loaded: {json.dumps(load)}", flush=True)
    ttfts = [s.ttft for s in long_streams]
    return {
        "budget": args.budget, "clients": args.clients, "seconds": args.seconds, "every": args.every,
        "long_prompt_tokens": prompt_tokens, "prefill_alone_s": alone_s, "long_ttft_s": ttfts,
        "unloaded": base, "loaded": load,
        "tokens_per_s_ratio": load["tokens_per_s"] / base["tokens_per_s"],
        "itl_p95_ratio": load["itl_p95_s"] / base["itl_p95_s"],
        "ttft_over_alone": max(ttfts) / alone_s if ttfts else float("nan"),
        "short_streams": {"unloaded": [asdict(s) for s in unloaded], "loaded": [asdict(s) for s in loaded]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the server's)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the unloaded and loaded phases")
    p.add_argument("--every", type=float, default=20.0, help="a long prompt every this many seconds")
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="of each short chat")
    p.add_argument("--out", type=Path, default=None, help="the figures and every stream's timings, as JSON "
                   "(default bench/results/latest/longprompt/longprompt.json)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args()
    args.out = args.out or ledger.results_dir() / ledger.LATEST_DIR / SUITE / "longprompt.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {"SPECULA_MAX_NUM_BATCHED_TOKENS": str(args.budget)} if args.budget else {}
    log = args.out.with_suffix(".log")
    with mock.patch.dict("os.environ", env), live_server([], None, log, timeout_s=600) as url:
        result = asyncio.run(measure(url, args))
    print(f"short streams keep {result['tokens_per_s_ratio']:.0%} of their tokens/s; p95 gap x "
          f"{result['itl_p95_ratio']:.2f} the unloaded one, their first token's p95 "
          f"{result['loaded']['ttft_p95_s']:.2f} s "
          f"({result['unloaded']['ttft_p95_s']:.2f} s unloaded); long prompts' first token after "
          f"{', '.join(f'{t:.1f}' for t in result['long_ttft_s'])} s (alone {result['prefill_alone_s']:.1f} s: "
          f"x {result['ttft_over_alone']:.2f} at worst)")
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_record:
        ledger.record(SUITE, ledger_cells(result), files=[args.out, log],
                      figures={"budget": result["budget"], "long_prompt_tokens": result["long_prompt_tokens"]})


def ledger_cells(result: dict) -> list[ledger.Cell]:
    """The short streams' tokens/s with long prompts arriving over without (ratio), with the p95 gap's ratio,
    and the long prompts' worst time to first token over the prefill alone, as values."""
    values = {k: result[k] for k in ("tokens_per_s_ratio", "itl_p95_ratio", "ttft_over_alone", "prefill_alone_s",
                                     "long_ttft_s")}
    values |= {f"{phase}_{k}": result[phase][k] for phase in ("unloaded", "loaded")
               for k in ("tokens_per_s", "itl_p50_s", "itl_p95_s", "ttft_p95_s")}
    return [ledger.Cell(f"long_prompt_{result['long_prompt_tokens']}", f"budget_{result['budget'] or 'default'}",
                        ratio=result["tokens_per_s_ratio"], baseline="no_long_prompts", clients=result["clients"],
                        values=values)]


if __name__ == "__main__":
    main()

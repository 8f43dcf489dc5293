"""HTTP side of the benchmark: run one round of concurrent chat completions against a live server.

A round is N clients in closed loops (asyncio + httpx, one connection each): each client sends its
next request when its last answer arrives, taking the round's requests in order, as a load tool's
concurrent mode or a chat UI's users do; its wall time runs from the first send to the last
response. With one request per client a round is a synchronised wave (every request sent at once,
the round as long as its slowest answer). Non-streaming, so each response carries `usage.speculation`;
requests also ask for per-token origins (`speculation.include_tokens`), from which the bench counts
each proposer's passes and first-position acceptance (`bench.cells.response_figures`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.cells import ProposerFigures, response_figures
from bench.workloads import Prompt


@dataclass(frozen=True)
class RoundResult:
    """What one round of concurrent requests produced (sums over its requests)."""

    requests: int
    completion_tokens: int
    wall_s: float
    draft_tokens: int
    accepted_tokens: int
    decode_steps: int
    reported_methods: tuple[str, ...]  # usage.speculation.method of each response
    proposers: dict[str, ProposerFigures]  # summed over the responses (empty: the server sent no origins)


class SpeculationUnsupported(Exception):
    """The server answered 400 to a speculation method (e.g. `auto` before it exists)."""


def request_body(
    model: str, prompt: Prompt, method: str, k: int | None, max_tokens: int, temperature: float, seed: int | None,
    origins: bool = True, cache_salt: str | None = None,
) -> dict[str, Any]:
    """A chat completion for `prompt` with `speculation: {method, num_tokens}` (K only for proposers)
    and, when `origins`, `include_tokens` (per-token origins, same for every method). `cache_salt`: the
    pool of earlier answers `suffix` may draft from (run.py gives each method its own, never holding the
    same prompt twice)."""
    speculation: dict[str, Any] = {"method": method}
    if origins:
        speculation["include_tokens"] = True
    if k is not None and method not in ("none", "auto"):
        speculation["num_tokens"] = k
    body: dict[str, Any] = {
        "model": model,
        "messages": list(prompt.messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "speculation": speculation,
    }
    if seed is not None:
        body["seed"] = seed
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url, json=body)
    if response.status_code == 400:
        raise SpeculationUnsupported(response.text)
    response.raise_for_status()
    return response.json()


async def run_round(
    client: httpx.AsyncClient, base_url: str, bodies: list[dict[str, Any]], clients: int | None = None
) -> RoundResult:
    """`clients` closed loops (default: one per body, all sent at once) through `bodies` in order:
    each client sends the next unsent body when its answer to the last one arrives."""
    url = f"{base_url}/v1/chat/completions"
    replies: list[dict[str, Any]] = [{} for _ in bodies]
    queue = iter(enumerate(bodies))

    async def loop() -> None:
        for i, body in queue:  # the iterator is shared: each body goes to the first free client
            replies[i] = await _one(client, url, body)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(min(clients or len(bodies), len(bodies)))))
    wall = time.perf_counter() - started
    spec = [r["usage"].get("speculation") or {} for r in replies]
    proposers: dict[str, ProposerFigures] = {}
    for reply, s in zip(replies, spec, strict=True):
        for name, figs in response_figures(s, reply.get("choices", [])).items():
            proposers.setdefault(name, ProposerFigures()).add(figs)
    return RoundResult(
        requests=len(replies),
        completion_tokens=sum(r["usage"]["completion_tokens"] for r in replies),
        wall_s=wall,
        draft_tokens=sum(s.get("draft_tokens", 0) for s in spec),
        accepted_tokens=sum(s.get("accepted_tokens", 0) for s in spec),
        decode_steps=sum(s.get("decode_steps", 0) for s in spec),
        reported_methods=tuple(str(s.get("method", "?")) for s in spec),
        proposers=proposers,
    )


async def model_id(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def supports_method(client: httpx.AsyncClient, base_url: str, model: str, prompt: Prompt, method: str) -> bool:
    """Probe with one short request: a 400 means the server does not accept this method."""
    try:
        await run_round(client, base_url, [request_body(model, prompt, method, None, 4, 0.0, None, origins=False)])
    except SpeculationUnsupported:
        return False
    return True

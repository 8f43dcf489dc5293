"""`python -m bench.cluster`: two replicas behind the cache-aware router, against Ray Serve's default routing
and against one server, on the same multi-turn traffic.

Each arm is a fresh process tree on the default model: `python -m server serve` (one server), then
`python -m server cluster --replicas 2` with `--request-router cache_aware` and with `power_of_two` (Ray's
default). The traffic: `--clients` closed loops (8), half holding multi-turn conversations (each its own system
prompt; every turn resends the history and adds a question), half agent loops (one shared system prompt with
tool descriptions; every step adds a tool result). Per arm: the prefix-cache hit rate (`cached_tokens` /
prompt tokens), tokens per target pass (completion tokens / `usage.speculation.decode_steps`), output tokens per
second, and how requests spread over replicas. The report goes to `--out` (default
bench/results/latest/cluster/cluster.json) and the run to the ledger (bench/ledger.py) as suite `cluster`: a cell
per arm, its prefix-cache hit rate over one server's (`--no-record`: neither).

On a machine with 2 cores the replicas share the cores the one server has to itself: the throughput column
compares nothing there; the hit rate and tokens per pass are what the router changes, and they carry over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench import ledger
from bench.server_proc import REPO, free_port, live_server, running

SUITE = "cluster"
AGENT_SYSTEM = (
    "You are an agent that solves tasks step by step with tools. Tools: search(query) returns web results; "
    "read(url) returns a page's text; calc(expression) evaluates arithmetic; note(text) saves a note. Reply with "
    "one tool call per step as `tool(argument)` and a one-line reason, or `done(answer)` when finished. Keep the "
    "reasoning short and never invent tool results."
)
AGENT_TASKS = ["the population of Lisbon divided by that of Porto", "the boiling point of water at 2,000 m",
               "the year the Eiffel Tower opened plus 150", "the distance from Paris to Rome in miles"]
CHAT_SYSTEMS = [
    "You are a patient tutor of European history. Answer in two sentences.",
    "You are a cooking assistant who suggests vegetarian recipes briefly.",
    "You are a travel planner for train journeys; be concise and concrete.",
    "You are a reviewer of Python code who points out one problem at a time.",
]
CHAT_OPENERS = ["Why did the Hanseatic League decline?", "Something quick with chickpeas?",
                "Lisbon to Madrid by train?", "def mean(xs): return sum(xs) / len(xs)"]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "And what else should I know?", "Summarize that in one line."]


def session(i: int) -> tuple[str, list[dict[str, str]]]:
    """Client i's kind and opening messages: even clients chat, odd ones run an agent loop."""
    if i % 2 == 0:
        k = (i // 2) % len(CHAT_SYSTEMS)
        return "chat", [{"role": "system", "content": CHAT_SYSTEMS[k]}, {"role": "user", "content": CHAT_OPENERS[k]}]
    task = AGENT_TASKS[(i // 2) % len(AGENT_TASKS)]
    return "agent", [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"Task: {task}"}]


async def client_loop(client: httpx.AsyncClient, url: str, model: str, i: int, turns: int, max_tokens: int,
                      salt: str, records: list[dict[str, Any]]) -> None:
    kind, messages = session(i)
    for turn in range(turns):
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "cache_salt": salt}
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        doc = r.json()
        usage = doc["usage"]
        records.append({"client": i, "kind": kind, "turn": turn, "replica": r.headers.get("x-specula-replica", "-"),
                        "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"],
                        "completion": usage["completion_tokens"], "passes": usage["speculation"]["decode_steps"]})
        reply = doc["choices"][0]["message"]["content"] or ""
        follow = (f"Tool result {turn}: ok, value {17 * (turn + 1) + i}." if kind == "agent"
                  else FOLLOW_UPS[turn % len(FOLLOW_UPS)])
        messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": follow}]


async def traffic(url: str, clients: int, turns: int, max_tokens: int, salt: str) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await client.post(f"{url}/v1/chat/completions", json={  # warm-up, another salt: no cache shared
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "cache_salt": "warm"})
        start = time.perf_counter()
        loops = [client_loop(client, url, model, i, turns, max_tokens, salt, records) for i in range(clients)]
        await asyncio.gather(*loops)
        seconds = time.perf_counter() - start
    prompt, cached = sum(r["prompt"] for r in records), sum(r["cached"] for r in records)
    later = [r for r in records if r["turn"] > 0]
    return {
        "requests": len(records),
        "seconds": round(seconds, 1),
        "hit_rate": round(cached / prompt, 3),
        "hit_rate_later_turns": round(sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)), 3),
        "tokens_per_pass": round(sum(r["completion"] for r in records) / max(1, sum(r["passes"] for r in records)), 3),
        "tokens_per_s": round(sum(r["completion"] for r in records) / seconds, 2),
        "per_replica": dict(Counter(r["replica"] for r in records)),
        "sessions_on_one_replica": sum(len({r["replica"] for r in records if r["client"] == c}) == 1
                                       for c in range(clients)),
    }


def run_cluster_arm(router: str, args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "cluster", "--host", "127.0.0.1", "--port", str(port), "--replicas", "2",
           "--replica-num-cpus", str(args.replica_cpus), "--request-router", router, *args.server_args]

    def both_ready(r: httpx.Response) -> bool:
        return sum(x.get("status") == "ready" for x in r.json().get("replicas", [])) == 2

    # Ray's processes in a session of their own: killed together if the cluster does not stop
    with running(cmd, "cluster", port, log_path, 600, ready=both_ready, stop_s=120, cwd=REPO,
                 start_new_session=True) as url:
        return asyncio.run(traffic(url, args.clients, args.turns, args.max_tokens, f"cluster-{router}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation / steps per agent loop")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--arms", default="one,cache_aware,power_of_two")
    p.add_argument("--out", type=Path, default=None,
                   help="the report (default bench/results/latest/cluster/cluster.json)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    p.add_argument("server_args", nargs="*", help="flags passed to serve and cluster (after --)")
    args = p.parse_args(argv)
    args.out = args.out or ledger.results_dir() / ledger.LATEST_DIR / SUITE / "cluster.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="specula-cluster-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": "python -m bench.cluster " + " ".join(argv or sys.argv[1:]),
                               "cpus": os.cpu_count(), "clients": args.clients, "arms": {}}
    for arm in args.arms.split(","):
        print(f"arm {arm} ...", flush=True)
        if arm == "one":
            with live_server(args.server_args, None, logs / "one.log", timeout_s=600) as url:
                results["arms"][arm] = asyncio.run(traffic(url, args.clients, args.turns, args.max_tokens, "one"))
        else:
            results["arms"][arm] = run_cluster_arm(arm, args, logs / f"{arm}.log")
        print(json.dumps(results["arms"][arm]), flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(results))
    print(f"server logs: {logs}")
    if not args.no_record:
        ledger.record(SUITE, ledger_cells(results), files=[args.out], figures={"cpus": results["cpus"]})
    return 0


def ledger_cells(results: dict[str, Any]) -> list[ledger.Cell]:
    """One cell per arm: its prefix-cache hit rate over one server's (the `one` arm, when it ran), with the
    arm's figures as values."""
    arms = results["arms"]
    base = arms.get("one", {}).get("hit_rate")
    return [ledger.Cell("multi_turn_agents", arm, ratio=(a["hit_rate"] / base) if base and arm != "one" else None,
                        baseline="one", clients=results.get("clients", 8),
                        values={k: a[k] for k in ("hit_rate", "hit_rate_later_turns", "tokens_per_pass", "tokens_per_s",
                                                  "sessions_on_one_replica") if k in a})
            for arm, a in arms.items()]


def format_table(results: dict[str, Any]) -> str:
    rows = ["| arm | prefix-cache hit rate (later turns) | tokens per target pass | tokens/s | requests per replica |",
            "|---|---|---|---|---|"]
    for arm, r in results["arms"].items():
        rows.append(f"| {arm} | {r['hit_rate']:.3f} ({r['hit_rate_later_turns']:.3f}) | {r['tokens_per_pass']:.2f} "
                    f"| {r['tokens_per_s']:.1f} | {sorted(r['per_replica'].values(), reverse=True)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())

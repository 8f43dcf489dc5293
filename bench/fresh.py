"""Fresh servers on prompts no workload file contains: the default against `none`, request by request.

    python -m bench.fresh [--kinds copy,open,agent] [--max-tokens 128]

What a new user sees: two servers started side by side (the default, and `--speculation none`), each
with an empty cache directory, so the default calibrates at start and its first request is the first
it ever serves. Every prompt goes to both, in alternating order, one at a time, greedy; the ratio of
tokens/s is printed per prompt and pooled per kind (tokens over time). Kinds: `copy` (ten copy-heavy
edits), `open` (six open questions), `agent` (twelve requests to one tool-calling system prompt with
two few-shot turns; pooled from the third on, as the issue asks). These prompts are a held-out set: no
workload, test or default was tuned on them; keep it that way. Every measurement goes to `--out` (default
bench/results/latest/fresh/results.json) and the run to the ledger (bench/ledger.py) as suite `fresh`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import httpx

from bench import ledger
from bench.server_proc import live_server

SUITE = "fresh"
Measured = dict[str, dict[str, tuple[int, float]]]  # arm -> "kind-i" -> (completion tokens, seconds)

COPY = [
    "Fix the spelling and grammar in this paragraph and return only the corrected text:\n\nThe comittee have "
    "decided that the anual meeting will be held on thursday instead of friday, because many member's could not "
    "attend. Everyone are asked to bring there own laptop and to register before the deadline, wich is next monday.",
    "Rename the variable `tmp` to `total_price` everywhere in this Python function and return the whole function:"
    "\n\ndef price(items, tax):\n    tmp = 0\n    for item in items:\n        tmp += item.cost * item.quantity\n"
    "    tmp = tmp * (1 + tax)\n    if tmp > 1000:\n        tmp = tmp * 0.95\n    return round(tmp, 2)",
    "Convert this JavaScript function to Python, keeping the same names:\n\nfunction countWords(text) {\n"
    "  const counts = {};\n  for (const word of text.toLowerCase().split(' ')) {\n    if (word.length === 0) "
    "continue;\n    counts[word] = (counts[word] || 0) + 1;\n  }\n  return counts;\n}",
    "Add type hints to this Python code and return the full code:\n\ndef merge(a, b):\n    result = dict(a)\n"
    "    for key, value in b.items():\n        if key in result and isinstance(result[key], list):\n"
    "            result[key] = result[key] + value\n        else:\n            result[key] = value\n    return result",
    "Change every occurrence of the port 8080 to 9090 in this config and return the whole file:\n\nserver:\n"
    "  host: 0.0.0.0\n  port: 8080\nhealthcheck:\n  url: http://localhost:8080/health\n  interval: 30s\nproxy:\n"
    "  upstream: http://backend:8080\n  timeout: 10s",
    "Sort these lines alphabetically and return them, one per line:\nzebra crossing\napple pie\nmountain bike\n"
    "banana bread\ncoffee table\nlemon tart\nguitar string\nhoney jar",
    "Translate the comments in this code from French to English, leaving the code unchanged:\n\n# calcule la "
    "moyenne d'une liste\ndef moyenne(valeurs):\n    # retourne zero si la liste est vide\n    if not valeurs:\n"
    "        return 0\n    # somme divisee par le nombre d'elements\n    return sum(valeurs) / len(valeurs)",
    'In this JSON, set "enabled" to false for the user named Carol and return the whole JSON:\n\n{"users": '
    '[{"name": "Alice", "enabled": true, "role": "admin"}, {"name": "Bob", "enabled": true, "role": "viewer"}, '
    '{"name": "Carol", "enabled": true, "role": "editor"}, {"name": "Dave", "enabled": true, "role": "viewer"}]}',
    "Fix the typos in this email and return it:\n\nHi Mark,\n\nThank you for you quick reply. I have atached the "
    "updated schedul for next week. Please let me now if the tuesday slot still works for your team, otherwise we "
    "can move the meeting to wensday afternoon.\n\nBest regards,\nSara",
    "Rewrite this SQL query in uppercase keywords, keeping everything else identical:\n\nselect customers.name, "
    "count(orders.id) as order_count from customers left join orders on orders.customer_id = customers.id where "
    "customers.country = 'France' group by customers.name order by order_count desc limit 10;",
]
OPEN = [
    "What are three good habits for staying focused while working from home?",
    "Explain in simple terms why the sky looks blue during the day.",
    "Write a short poem about a lighthouse in winter.",
    "What should I consider when choosing a first programming language?",
    "Give me a few ideas for a vegetarian dinner that is quick to cook.",
    "Why do cats purr?",
]
AGENT_SYSTEM = (
    "You are a kitchen assistant that controls smart appliances. Answer every request with exactly one tool call "
    'as JSON on one line: {"tool": NAME, "args": {...}}. Tools: oven_set(temp_c, mode), timer_start(minutes, '
    "label), fridge_temp(temp_c), kettle_boil(), dishwasher_start(program), light_set(room, level)."
)
AGENT_SHOTS = [
    {"role": "user", "content": "Switch the hallway light to 50 percent."},
    {"role": "assistant", "content": '{"tool": "light_set", "args": {"room": "hallway", "level": 50}}'},
    {"role": "user", "content": "Start a 20 minute timer for the bread."},
    {"role": "assistant", "content": '{"tool": "timer_start", "args": {"minutes": 20, "label": "bread"}}'},
]
AGENT = [
    "Preheat the oven to 200 degrees with fan mode.",
    "Start a timer for 12 minutes for the pasta.",
    "Set the fridge to 4 degrees.",
    "Boil the kettle please.",
    "Run the dishwasher on the eco program.",
    "Dim the kitchen lights to 30 percent.",
    "Start a 45 minute timer called roast.",
    "Set the oven to 180 in grill mode.",
    "Turn the dining room light to full.",
    "Set the fridge temperature to 3 degrees.",
    "Start a timer for 5 minutes labelled eggs.",
    "Put the oven on 220 degrees conventional mode.",
]
ARMS = {"none": ["--speculation", "none"], "default": []}


def _jobs(kinds: list[str]) -> list[tuple[str, int, list[dict[str, str]]]]:
    jobs = {
        "copy": [[{"role": "user", "content": p}] for p in COPY],
        "open": [[{"role": "user", "content": p}] for p in OPEN],
        "agent": [[{"role": "system", "content": AGENT_SYSTEM}, *AGENT_SHOTS, {"role": "user", "content": p}]
                  for p in AGENT],
    }
    return [(kind, i, messages) for kind in kinds for i, messages in enumerate(jobs[kind])]


def _ask(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds) of one greedy chat completion."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"], time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="copy,open,agent")
    p.add_argument("--max-tokens", type=int, default=128, help="copy and open; agent requests get half")
    p.add_argument("--out", default=None,
                   help="write every measurement here as JSON (default bench/results/latest/fresh/results.json)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    results: dict[str, dict[tuple[str, int], tuple[int, float]]] = {arm: {} for arm in ARMS}
    with ExitStack() as stack:
        cache = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls, models = {}, {}
        for arm, server_args in ARMS.items():
            with mock.patch.dict("os.environ", {"SPECULA_CACHE_DIR": str(cache / arm)}):
                urls[arm] = stack.enter_context(live_server(server_args, None, cache / f"{arm}.log"))
            models[arm] = httpx.get(f"{urls[arm]}/v1/models").json()["data"][0]["id"]
        for n, (kind, i, messages) in enumerate(_jobs(kinds)):
            max_tokens = args.max_tokens if kind != "agent" else args.max_tokens // 2
            for arm in list(ARMS) if n % 2 == 0 else list(ARMS)[::-1]:
                results[arm][kind, i] = _ask(urls[arm], models[arm], messages, max_tokens)
            (tn, sn), (td, sd) = results["none"][kind, i], results["default"][kind, i]
            print(f"{kind} {i}: none {tn / sn:.1f} tok/s, default {td / sd:.1f} tok/s, x {(td / sd) / (tn / sn):.2f}",
                  flush=True)
    flat = {arm: {f"{k[0]}-{k[1]}": v for k, v in r.items()} for arm, r in results.items()}
    cells = ledger_cells(flat, kinds)
    for cell in cells:
        scope = " (from the third request)" if cell.workload == "agent" else ""
        spread = cell.spread
        print(f"{cell.workload}{scope}: default x none pooled {cell.ratio:.2f}, median {cell.values['median']:.2f}"
              + (f", per prompt {spread.low:.2f}-{spread.high:.2f}" if spread else ""))
    out = Path(args.out) if args.out else ledger.results_dir() / ledger.LATEST_DIR / SUITE / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(flat, indent=1))
    if not args.no_record:
        ledger.record(SUITE, cells, files=[out], figures={"max_tokens": args.max_tokens})


def ledger_cells(measured: Measured, kinds: list[str] | None = None) -> list[ledger.Cell]:
    """Per kind, the default server's tokens/s over `none`'s, pooled (all tokens over all time; agent from
    its third request), with the spread and median of the per-prompt ratios."""
    def key_kind(key: str) -> str:
        return key.rsplit("-", 1)[0]

    kinds = kinds or list(dict.fromkeys(key_kind(k) for k in measured["none"]))
    cells = []
    for kind in kinds:
        keys = sorted((k for k in measured["none"] if key_kind(k) == kind), key=lambda k: int(k.rsplit("-", 1)[1]))
        keys = keys[2:] if kind == "agent" else keys
        if not keys:
            continue

        def speed(arm: str, keys: list[str]) -> float:
            return sum(measured[arm][k][0] for k in keys) / sum(measured[arm][k][1] for k in keys)

        ratios = [speed("default", [k]) / speed("none", [k]) for k in keys]
        cells.append(ledger.Cell(
            kind, "default", speed("default", keys) / speed("none", keys), spread=ledger.Spread.of(ratios),
            values={"median": round(statistics.median(ratios), 3), "prompts": len(keys),
                    "none_tokens_per_s": round(speed("none", keys), 2),
                    "default_tokens_per_s": round(speed("default", keys), 2)},
            headline=True))
    return cells


if __name__ == "__main__":
    main()

"""Structured output under speculation: constrained JSON with each method against plain decoding.

    python -m bench.structured [--methods none,ngram,suffix,eagle,auto] [--max-tokens 160] [--rounds 2]

In-process engine on the default model (greedy). Each case is a chat prompt plus a JSON schema, as
the API builds it (server/api/structured.py). Methods run interleaved, case by case, `--rounds`
times; the report gives, per method, the median over rounds of total time, the ratio to `none`
from the same run, target passes, tokens drafted by the grammar, and whether every output equals
`none`'s and validates against its schema. `suffix`'s global index is emptied before every run, so
no method is drafted an answer another method just wrote. The run goes to the ledger (bench/ledger.py)
as suite `structured`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from bench import ledger
from server.api.schemas import ChatCompletionRequest
from server.api.structured import request_grammar
from server.config import Settings
from server.engine.engine import Engine, build_engine
from server.speculation.plan import FORCED
from server.speculation.suffix import GLOBAL_TOKENS, SharedIndex, SuffixProposer
from server.types import GenerationRequest, SamplingParams, SpeculationParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "born": {"type": "integer", "minimum": 0, "maximum": 2100},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "occupation", "born", "languages"],
    "additionalProperties": False,
}
RECIPE = {
    "type": "object",
    "properties": {
        "dish": {"type": "string", "maxLength": 40},
        "servings": {"type": "integer", "minimum": 1, "maximum": 20},
        "ingredients": {
            "type": "array",
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"item": {"type": "string", "maxLength": 30}, "grams": {"type": "integer",
                                                                                    "maximum": 5000}},
                "required": ["item", "grams"],
                "additionalProperties": False,
            },
        },
        "vegetarian": {"type": "boolean"},
    },
    "required": ["dish", "servings", "ingredients", "vegetarian"],
    "additionalProperties": False,
}
EVENTS = {
    "type": "object",
    "properties": {
        "events": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 40},
                    "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                    "all_day": {"type": "boolean"},
                },
                "required": ["title", "day", "all_day"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["events"],
    "additionalProperties": False,
}
CASES = [
    ("Describe Ada Lovelace as JSON.", PERSON),
    ("Give me a simple pancake recipe as JSON.", RECIPE),
    ("Extract the events: team sync on Monday morning, dentist Wednesday, a hike all Saturday.", EVENTS),
    ("Who was Alan Turing? Answer in JSON.", PERSON),
    ("A tomato soup recipe for four, as JSON.", RECIPE),
]


def grammar_for(schema: dict) -> str:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    })
    grammar = request_grammar(body)
    assert grammar is not None
    return grammar


def forget_earlier_answers(engine: Engine) -> None:
    """Empty `suffix`'s global index: every method here answers the same prompt, and a method run after
    another would otherwise be drafted the whole answer from its predecessor's output."""
    suffix = engine.proposer("suffix") if "suffix" in engine.limits.methods else None
    if isinstance(suffix, SuffixProposer):
        suffix.shared = SharedIndex(GLOBAL_TOKENS)


def run_case(engine: Engine, prompt: list[int], grammar: str, method: str, max_tokens: int) -> dict:
    forget_earlier_answers(engine)
    req = GenerationRequest(f"{method}-{time.perf_counter_ns()}", tuple(prompt),
                            SamplingParams(max_tokens=max_tokens, temperature=0.0), SpeculationParams(method, 8),
                            grammar)
    started = time.perf_counter()
    engine.add_requests([req])
    text, stats = "", None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            text += out.text
            stats = out.stats
    assert stats is not None
    forced = stats.by_proposer.get(FORCED)
    return {"seconds": time.perf_counter() - started, "text": text, "steps": stats.decode_steps,
            "tokens": stats.completion_tokens, "forced": forced.accepted_tokens if forced else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,ngram,suffix,eagle,auto")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    settings = Settings.load(device="cpu")
    totals: dict[str, list[float]] = {m: [] for m in methods}
    info: dict[str, dict] = {m: {"steps": 0, "tokens": 0, "forced": 0, "same": True, "valid": 0} for m in methods}
    for round_ in range(args.rounds):
        engine = build_engine(settings)
        tok = engine.tokenizer
        round_time = dict.fromkeys(methods, 0.0)
        for content, schema in CASES:
            prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
            grammar = grammar_for(schema)
            results = {m: run_case(engine, prompt, grammar, m, args.max_tokens) for m in methods}
            for m, r in results.items():
                round_time[m] += r["seconds"]
                if round_ == 0:
                    info[m]["steps"] += r["steps"]
                    info[m]["tokens"] += r["tokens"]
                    info[m]["forced"] += r["forced"]
                    info[m]["same"] &= r["text"] == results[methods[0]]["text"]
                    try:
                        jsonschema.validate(json.loads(r["text"]), schema)
                        info[m]["valid"] += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
        for m in methods:
            totals[m].append(round_time[m])
    base = statistics.median(totals[methods[0]])
    print(f"{len(CASES)} cases, greedy, max_tokens {args.max_tokens}, median of {args.rounds} rounds "
          f"(ratios against {methods[0]} from this run)")
    print(f"{'method':8} {'seconds':>8} {'speedup':>8} {'passes':>7} {'tokens':>7} {'grammar':>8} "
          f"{'same':>5} {'valid':>6}")
    for m in methods:
        t, i = statistics.median(totals[m]), info[m]
        print(f"{m:8} {t:8.2f} {base / t:7.2f}x {i['steps']:7d} {i['tokens']:7d} {i['forced']:8d} "
              f"{str(i['same']):>5} {i['valid']:>3}/{len(CASES)}")
    if not args.no_record:
        ledger.record("structured", [
            ledger.Cell("json_schema", m, base / statistics.median(totals[m]), baseline=methods[0],
                        spread=ledger.Spread.of([b / t for b, t in zip(totals[methods[0]], totals[m], strict=True)]),
                        values={"seconds": round(statistics.median(totals[m]), 2), "passes": info[m]["steps"],
                                "tokens": info[m]["tokens"], "grammar_drafted": info[m]["forced"],
                                "same_as_baseline": info[m]["same"], "valid": info[m]["valid"]})
            for m in methods[1:]], figures={"cases": len(CASES), "max_tokens": args.max_tokens, "rounds": args.rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What serving costs: `none` over HTTP against the same engine in-process and transformers `generate()`.

    python -m bench.overhead [--rounds 4] [--max-tokens 128]

One run, interleaved per prompt and round (the machine's drift hits all three alike): a streamed chat
completion from a fresh `python -m server serve --speculation none` (greedy, `ignore_eos`), the engine
in this process (`Engine.step()` until done), and `model.generate()` on the same weights and prompt ids.
Prints ms/token (median over prompts x rounds) and the ratios; exits 0 whatever they are. The run goes
to the ledger (bench/ledger.py) as suite `overhead` (ratios are speeds: above 1 is faster than the baseline).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from bench import ledger
from bench.peer import Peer, chat_ids
from bench.server_proc import live_server
from server.config import Settings
from server.engine.engine import build_engine
from server.types import GenerationRequest, SamplingParams, SpeculationParams

PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how vaccines train the immune system.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--log", default="bench/results/tmp/overhead-server.log")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args(argv)
    n = args.max_tokens
    engine = build_engine(Settings.load(device="cpu", speculation="none"), keep_dense=True,  # the peer runs it too
                          modules="transformers")
    tok = engine.tokenizer

    def in_process(ids: list[int]) -> float:
        started = time.perf_counter()
        engine.add_requests([GenerationRequest(
            f"r{time.perf_counter_ns()}", tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            SpeculationParams("none", 1),
        )])
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - started

    peer = Peer(engine.target, None)

    def transformers(ids: list[int]) -> float:
        return peer.generate("hf-none", ids, n, ignore_eos=True).wall_s

    times: dict[str, list[float]] = {"http": [], "in-process": [], "transformers": []}
    with live_server(["--speculation", "none"], None, Path(args.log)) as url:
        def http(messages: list[dict[str, str]]) -> float:
            body = {"messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
                    "model": engine.model_name}
            started = time.perf_counter()
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    pass
            return time.perf_counter() - started

        for _ in range(args.rounds):
            for prompt in PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                ids = chat_ids(tok, messages)
                times["http"].append(http(messages))
                times["in-process"].append(in_process(ids))
                times["transformers"].append(transformers(ids))
    med = {k: statistics.median(v) for k, v in times.items()}
    print("ms/token (median):", ", ".join(f"{k} {v / n * 1e3:.1f}" for k, v in med.items()))
    print(f"http / in-process speed {med['in-process'] / med['http']:.3f}   "
          f"in-process / transformers {med['transformers'] / med['in-process']:.3f}   "
          f"http / transformers {med['transformers'] / med['http']:.3f}")
    if not args.no_record:
        ms = {k: round(v / n * 1e3, 2) for k, v in med.items()}
        ledger.record("overhead", [
            ledger.Cell("chat", "http", med["in-process"] / med["http"], baseline="in-process",
                        values={"ms_per_token": ms["http"]}),
            ledger.Cell("chat", "in-process", med["transformers"] / med["in-process"], baseline="transformers",
                        values={"ms_per_token": ms["in-process"]}),
            ledger.Cell("chat", "http", med["transformers"] / med["http"], baseline="transformers",
                        values={"ms_per_token": ms["http"], "transformers_ms_per_token": ms["transformers"]}),
        ], figures={"rounds": args.rounds, "max_tokens": n})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Microseconds per lookup of the model-free proposers (`ngram`, `suffix`) at realistic text lengths.

    python -m bench.lookup_cost [--lengths 256,1024,4096] [--k 8]

The text is the bench's own prompts, tokenized and repeated up to each length (so matches exist, as
in a copy-heavy answer); `suffix` also holds a full global index of earlier outputs. Each figure is
the median of many `propose` calls for one sequence; compare it with a target step (the bench's
costs table) to get the `draft_token_cost` a proposer declares. The run goes to the ledger
(bench/ledger.py) as suite `lookup_cost` (microseconds per call; no ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np

from bench import ledger
from bench.workloads import load_workloads
from server.model.loading import load_default_tokenizer
from server.speculation.ngram import NgramProposer
from server.speculation.suffix import GLOBAL_TOKENS, SuffixProposer


@dataclass
class _Seq:
    request_id: str
    tokens: list[int]
    cache_salt: str | None = None


def corpus(tokenizer) -> list[int]:
    text = "\n\n".join(m["content"] for w in load_workloads() for p in w.prompts for m in p.messages)
    return tokenizer.encode(text)


def per_call_us(proposer, seq: _Seq, k: int, calls: int = 200, forget: bool = False) -> float:
    """Median microseconds of one `propose` for `seq`; `forget`: the suffix proposer's global pools
    forget their remembered walks before each call (a node not looked up since the index changed)."""
    times = []
    for _ in range(calls):
        if forget:
            for pool in proposer.shared.partitions.values():
                pool.walks.clear()
        started = time.perf_counter()
        proposer.propose([seq], [k])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args(argv)
    tokens = corpus(load_default_tokenizer())
    print(f"{'tokens':>7} {'ngram us':>9} {'suffix us':>10} {'remembered':>10}  (suffix: global index of "
          f"{GLOBAL_TOKENS} tokens; remembered: its walk from the matched node known from an earlier lookup)")
    cells = []
    for n in (int(x) for x in args.lengths.split(",")):
        text = (tokens * (n // len(tokens) + 2))[len(tokens) // 3 :][:n]  # starts mid-corpus, repeats later
        seq = _Seq("r", text)
        suffix = SuffixProposer()
        rng = np.random.default_rng(0)
        while suffix.shared.tokens < GLOBAL_TOKENS - 512:  # a full global index: earlier outputs
            start = int(rng.integers(0, len(tokens) - 512))
            suffix.shared.add(np.asarray(tokens[start : start + 512], dtype=np.int64))
        suffix.join([seq], None)
        ngram = per_call_us(NgramProposer(), seq, args.k)
        cold, warm = per_call_us(suffix, seq, args.k, forget=True), per_call_us(suffix, seq, args.k)
        print(f"{n:>7} {ngram:>9.1f} {cold:>10.1f} {warm:>10.1f}")
        cells += [ledger.Cell(f"{n} tokens", "ngram", values={"us_per_call": round(ngram, 1)}),
                  ledger.Cell(f"{n} tokens", "suffix", values={"us_per_call": round(cold, 1),
                                                              "us_per_call_remembered": round(warm, 1)})]
    if not args.no_record:
        ledger.record("lookup_cost", cells, figures={"k": args.k, "global_tokens": GLOBAL_TOKENS})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

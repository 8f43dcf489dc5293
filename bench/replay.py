"""Replay recorded greedy answers through model-free proposers: tokens per step and acceptance, no model.

    python -m bench.replay collect --out answers.json [--workloads copy_edit,agent] [--max-tokens 128]
    python -m bench.replay replay answers.json [--methods ngram,suffix] [--k 8]

Greedy verification accepts a draft exactly while it agrees with the target's own greedy answer, so
once the answers are recorded (`collect`: the default target, greedy, through the engine), a lookahead
proposer's drafts can be scored against them without running the model: each request in recorded
order joins the proposer, drafts up to K tokens at every step, keeps the agreeing prefix plus one token,
and leaves (so a proposer's state across requests, like `suffix`'s global index, is exercised as a
server would). Reported per workload: tokens per step (the speedup at zero verify cost), acceptance,
draft tokens, per `agent` round, and first-draft acceptance per confidence level (the proposers'
`confidence_priors` come from it). `replay` appends its figures to the ledger (bench/ledger.py) as suite
`replay` (tokens per step and acceptance per workload; no ratios).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench import ledger
from bench.workloads import WORKLOADS, load_workloads


@dataclass
class _Seq:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    cache_salt: str | None = None


def collect(out: Path, workloads: list[str], max_tokens: int, batch: int = 5) -> None:
    """Record the default target's greedy answer to every prompt of `workloads` (batched; n-gram drafts
    make it faster and do not change greedy text)."""
    from bench.peer import chat_ids
    from server.config import Settings
    from server.engine.engine import build_engine
    from server.types import GenerationRequest, SamplingParams, SpeculationParams

    engine = build_engine(Settings.load(draft=None, draft_head=None))
    answers: dict[str, dict[str, list[int]]] = {}
    for w in load_workloads(workloads):
        reqs = [
            GenerationRequest(f"{w.name}/{p.id}", tuple(chat_ids(engine.tokenizer, list(p.messages))),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0), SpeculationParams("ngram", 8))
            for p in w.prompts
        ]
        for start in range(0, len(reqs), batch):
            part = reqs[start : start + batch]
            got: dict[str, list[int]] = {r.request_id: [] for r in part}
            engine.add_requests(part)
            while engine.has_unfinished():
                for o in engine.step().outputs:
                    got[o.request_id] += o.token_ids
            for r in part:
                answers[r.request_id] = {"prompt": list(r.prompt_token_ids), "output": got[r.request_id]}
        print(f"{w.name}: {len(reqs)} answers", flush=True)
    out.write_text(json.dumps(answers))


def replay(answers: dict[str, dict[str, list[int]]], method: str, k: int) -> dict[str, object]:
    """Score `method`'s drafts against the recorded answers (see the module docstring)."""
    from server.config import Settings
    from server.speculation.proposer import BuildContext
    from server.speculation.registry import BUILTIN

    entry = next(e for e in BUILTIN.entries if e.name == method)
    proposer = entry.build(BuildContext(None, None, Settings.load(), 0))  # type: ignore[arg-type]
    if proposer is None or not proposer.traits.lookahead:
        raise SystemExit(f"{method}: only model-free (lookahead) proposers can be replayed")
    per_workload: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # tokens, steps, drafted, accepted
    levels: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # level -> [steps drafted, first accepted]
    rounds: dict[str, list[float]] = defaultdict(list)
    for rid, answer in answers.items():
        workload = rid.split("/")[0]
        prompt, output = answer["prompt"], answer["output"]
        text = prompt + output
        seq = _Seq(rid, list(prompt))
        proposer.join([seq], None)
        t, steps = len(prompt), 0
        while t < len(text):
            seq.tokens = text[:t]
            found = proposer.propose([seq], [min(k, len(text) - t - 1)])
            drafts = found.drafts[0]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == text[t + accepted]:
                accepted += 1
            if drafts:
                level = (found.confidence or [0])[0]
                levels[level][0] += 1
                levels[level][1] += accepted > 0
            proposer.commit(seq, drafts, text[t : t + accepted + 1], None)
            t, steps = t + accepted + 1, steps + 1
            per_workload[workload][2] += len(drafts)
            per_workload[workload][3] += accepted
        proposer.leave({rid})
        per_workload[workload][0] += len(output)
        per_workload[workload][1] += steps
        rounds[workload].append(len(output) / steps)
    return {"workloads": dict(per_workload), "levels": dict(levels), "rounds": dict(rounds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--workloads", default=",".join(WORKLOADS))
    c.add_argument("--max-tokens", type=int, default=128)
    r = sub.add_parser("replay")
    r.add_argument("answers", type=Path)
    r.add_argument("--methods", default="ngram,suffix")
    r.add_argument("--k", type=int, default=8)
    r.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args(argv)
    if args.command == "collect":
        collect(args.out, args.workloads.split(","), args.max_tokens)
        return 0
    answers = json.loads(args.answers.read_text())
    cells = []
    for method in args.methods.split(","):
        result = replay(answers, method, args.k)
        cells += [ledger.Cell(w, method, values={"tokens_per_step": round(tokens / steps, 3),
                                                 "acceptance": round(accepted / max(drafted, 1), 3),
                                                 "draft_tokens": drafted})
                  for w, (tokens, steps, drafted, accepted) in result["workloads"].items()]
        print(f"{method} (K={args.k})")
        for w, (tokens, steps, drafted, accepted) in result["workloads"].items():
            print(f"  {w:10s} tokens/step {tokens / steps:5.2f}  acceptance {accepted / max(drafted, 1):.2f}"
                  f"  draft tokens {drafted}")
        if "agent" in result["rounds"]:
            print("  agent rounds (tokens/step)", " ".join(f"{x:.2f}" for x in result["rounds"]["agent"]))
        print("  first-draft acceptance per level",
              {lv: f"{a / n:.2f} ({n})" for lv, (n, a) in sorted(result["levels"].items())})
    if not args.no_record:
        ledger.record("replay", cells, figures={"k": args.k, "answers": args.answers.name})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

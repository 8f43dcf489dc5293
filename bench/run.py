"""`python -m bench.run`: Specula's side-by-side speculation benchmark, end to end over HTTP.

One run: load the default model in-process (to measure the draft/target cost ratio c and to run
the transformers peer), start `python -m server serve` on loopback, then for every workload,
temperature and client count run the methods interleaved, round by round (A B C D, then D C B A, ...),
so machine drift hits every method alike. A round at N clients is N closed loops over N x
`--per-client` requests (bench/client.py). Writes results.md, results.json and speedup.png to `--out`
(default bench/results/latest/grid/) and appends the run to the ledger (bench/ledger.py) as suite `grid`.
See docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench import ledger
from bench.cells import PROPOSERS, SPEC_METHODS, Cell, CellKey, cost_map, summarize
from bench.client import model_id, request_body, run_round, supports_method
from bench.peer import PEER_METHODS
from bench.report import write_all
from bench.workloads import WORKLOADS, Workload, load_workloads
from server.types import DEFAULT_NUM_TOKENS

SUITE = "grid"
HEADLINE_WORKLOADS = ("copy_edit", "chat")  # README's table shows `auto` on these (the copy-heavy and the open case)
# K per proposer when --k does not say: the server's default (8), except the draft head, whose drafts
# decay with depth (issue 10 measures it at K = 4).
DEFAULT_K = {name: 4 if name == "eagle" else DEFAULT_NUM_TOKENS for name in PROPOSERS}
COST_BATCHES = (1, 2, 4, 8)  # batch sizes the costs table always has (plus every --clients value)


def _csv(kind: type, choices: tuple | None = None):
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v.strip()]
        if choices is not None:
            bad = [v for v in values if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(map(str, choices))}")
        return values
    return parse


def _parse_k(text: str) -> dict[str, int]:
    """K per proposer (every name in the server's registry): `6` -> 6 for all of them;
    `ngram=8,eagle=4` -> those two, the rest at `DEFAULT_K`; `8,eagle=4` -> 8 for all but eagle."""
    ks = dict(DEFAULT_K)
    for part in text.split(","):
        name, _, value = part.strip().rpartition("=")
        if name and name not in ks:
            raise argparse.ArgumentTypeError(f"K applies to the proposers {', '.join(ks)}, not {name!r}")
        if not value.isdigit() or not 1 <= int(value) <= 32:
            raise argparse.ArgumentTypeError(f"K must be an integer in [1, 32], got {value!r}")
        for method in [name] if name else list(ks):
            ks[method] = int(value)
    return ks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~3 min): copy_edit and chat, greedy, 1 and 4 clients, 32 tokens, 1 request/cell")
    p.add_argument("--methods", type=_csv(str, SPEC_METHODS), default=None,
                   help=f"comma list of {','.join(SPEC_METHODS)} (the server's registry; default: all, less those "
                        "the server refuses, e.g. eagle without a draft head)")
    p.add_argument("--clients", type=_csv(int), default=None, help="concurrency levels (default 1,4,8)")
    p.add_argument("--workloads", type=_csv(str, WORKLOADS), default=None, help=f"default: {','.join(WORKLOADS)}")
    p.add_argument("--temperatures", type=_csv(float), default=None, help="default 0,0.8 (0 = greedy)")
    p.add_argument("--peer", type=_csv(str, PEER_METHODS), default=None,
                   help=f"transformers variants at 1 client, greedy (default: {','.join(PEER_METHODS)}); '' for none")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 48; quick 32)")
    p.add_argument("--k", type=_parse_k, default=dict(DEFAULT_K),
                   help="draft tokens per step (K): one number for every proposer, or per method, e.g. "
                        f"ngram=8,draft=4,eagle=4 (default {','.join(f'{m}={k}' for m, k in DEFAULT_K.items())}; "
                        "auto gets no K and uses the server's auto_max_speculative_tokens as its maximum)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per cell at 1 client (default 8: every prompt; quick 1); N clients run "
                        "ceil(this / (N x --per-client)) rounds, and at least --min-rounds")
    p.add_argument("--per-client", type=int, default=None,
                   help="at N > 1 clients, requests each client sends in turn per round, each when its last "
                        "answer arrives (default 3; quick 1); 1 = synchronised waves, where a round lasts "
                        "as long as its slowest answer and every row that finishes sooner leaves the batch "
                        "smaller (the bench before 2026-12-01)")
    p.add_argument("--min-rounds", "--min-waves", dest="min_rounds", type=int, default=None,
                   help="rounds per cell at least (default 2; quick 1)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for the server and the peer (default 0 = torch's default, all cores)")
    p.add_argument("--seed", type=int, default=1234, help="base seed for temperature > 0 requests")
    p.add_argument("--server-url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--server-args", default="", help="extra arguments for `python -m server serve`")
    p.add_argument("--draft-head", default=None,
                   help="draft head directory for the server (`serve --draft-head`) and the costs table "
                        "(default: the server's setting, i.e. the shipped head when there is one)")
    p.add_argument("--no-costs", action="store_true", help="skip the in-process cost measurement (no theory)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output directory (default bench/results/latest/{SUITE}; the ledger copies the files there)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger (smoke runs)")
    args = p.parse_args(argv)
    quick = args.quick
    args.workloads = args.workloads or (["copy_edit", "chat"] if quick else list(WORKLOADS))
    args.clients = args.clients or ([1, 4] if quick else [1, 4, 8])
    args.temperatures = args.temperatures if args.temperatures is not None else ([0.0] if quick else [0.0, 0.8])
    args.peer = args.peer if args.peer is not None else (["hf-prompt-lookup"] if quick else list(PEER_METHODS))
    args.max_tokens = args.max_tokens or (32 if quick else 48)
    args.requests = args.requests or (1 if quick else 8)
    args.min_rounds = args.min_rounds or (1 if quick else 2)
    if args.per_client is None:
        args.per_client = 1 if quick else 3
    if args.per_client < 1:
        p.error("--per-client must be at least 1")
    args.out = args.out or ledger.results_dir() / ledger.LATEST_DIR / SUITE
    return args


def _fmt_c(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def ledger_cells(rows: list[dict[str, Any]]) -> list[ledger.Cell]:
    """Every cell of a run with a ratio to `none` as the ledger records it: the spread over its rounds,
    tokens/s, acceptance, tokens per pass; `auto` on HEADLINE_WORKLOADS is README's headline."""
    out = []
    for r in sorted(rows, key=lambda r: (r["workload"], r["temperature"], r["clients"], r["method"])):
        if r["method"] == "none" or r.get("ratio_to_none") is None:
            continue
        values = {"tokens_per_s": r["tokens_per_s"], "acceptance": r.get("acceptance_rate"),
                  "tokens_per_pass": r.get("mean_accepted_length")}
        out.append(ledger.Cell(
            r["workload"], r["method"], r["ratio_to_none"], clients=r["clients"], temperature=r["temperature"],
            spread=ledger.Spread.of(r.get("round_ratios") or []),
            values={k: round(v, 3) for k, v in values.items() if v is not None},
            headline=r["method"] == "auto" and r["workload"] in HEADLINE_WORKLOADS))
    return out


class Progress:
    def __init__(self, total_rounds: int) -> None:
        self.total, self.done, self.started = total_rounds, 0, time.perf_counter()

    def tick(self, label: str, tokens: int, wall: float) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done:4d}/{self.total}] {label:48s} {tokens:4d} tok {wall:6.1f} s {tokens / wall:6.1f} tok/s"
              f"   elapsed {elapsed / 60:4.1f} min, eta {eta / 60:4.1f} min", flush=True)


def round_size(clients: int, per_client: int) -> int:
    """Requests in one round at `clients` clients. One client sends one per round: its requests never
    overlap, so there is no tail to amortise, and the methods interleave request by request."""
    return clients * (per_client if clients > 1 else 1)


def schedule(workloads: list[Workload], temperatures: list[float], clients: list[int], methods: list[str],
             peer: list[str], requests: int, min_rounds: int = 1,
             per_client: int = 1) -> list[tuple[Workload, float, int, int, list[str]]]:
    """(workload, temperature, clients, round, method order) per round, in run order.

    Within a block the order alternates A B C D / D C B A between rounds (cancels linear drift); the
    starting method rotates between blocks, so no method always goes first.
    """
    plan = []
    block = 0
    for w in workloads:
        for t in temperatures:
            for n in clients:
                names = methods + (peer if n == 1 and t == 0.0 else [])
                rot = block % len(names)
                base = names[rot:] + names[:rot]
                for r in range(max(1, min_rounds, -(-requests // round_size(n, per_client)))):
                    plan.append((w, t, n, r, base if r % 2 == 0 else base[::-1]))
                block += 1
    return plan


async def run_grid(args: argparse.Namespace, url: str, workloads: list[Workload], methods: list[str],
                   peer_runner: Any, prompt_ids: dict[str, list[int]], cells: dict[CellKey, Cell]) -> None:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        model = await model_id(client, url)
        plan = schedule(workloads, args.temperatures, args.clients, methods, args.peer if peer_runner else [],
                        args.requests, args.min_rounds, args.per_client)
        progress = Progress(sum(len(order) for *_, order in plan))
        run_id = os.urandom(4).hex()  # a server given with --server-url may hold pools from earlier runs
        for w, t, n, r, order in plan:
            size = round_size(n, args.per_client)
            picks = [w.prompts[(r * size + i) % len(w.prompts)] for i in range(size)]
            # Earlier answers `suffix` may draft from: per cell and method, and never the same prompt twice
            # (a new pool each pass over the prompt list). A bench that repeats prompts would otherwise
            # let `suffix` replay the identical answers of other methods' requests, which unseen prompts
            # never offer; what differs between prompts of one pool (e.g. agent rounds) still counts.
            salts = [f"{run_id}/{w.name}/T{t:g}/c{n}/pass{(r * size + i) // len(w.prompts)}" for i in range(size)]
            for method in order:
                key = CellKey(w.name, method, n, t)
                cell = cells.setdefault(key, Cell(key, k=args.k.get(method)))
                label = f"{w.name} T={t:g} clients={n} round={r} {method}"
                if method.startswith("hf-"):  # in-process, one client (the server idles meanwhile)
                    (prompt,) = picks
                    run = peer_runner.generate(method, prompt_ids[prompt.id], args.max_tokens)
                    cell.add(1, run.completion_tokens, run.wall_s, round_index=r)
                    progress.tick(label, run.completion_tokens, run.wall_s)
                    continue
                seeds = [None if t == 0 else args.seed + 1000 * r + i for i in range(size)]
                bodies = [request_body(model, p, method, args.k.get(method), args.max_tokens, t, s,
                                       cache_salt=f"{salt}/{method}")
                          for p, s, salt in zip(picks, seeds, salts, strict=True)]
                done = await run_round(client, url, bodies, n)
                cell.add(done.requests, done.completion_tokens, done.wall_s, done.draft_tokens,
                         done.accepted_tokens, done.decode_steps, done.reported_methods, done.proposers, round_index=r)
                progress.tick(label, done.completion_tokens, done.wall_s)


async def warm_up(url: str, workloads: list[Workload], methods: list[str]) -> list[str]:
    """One short request per method (first calls allocate); drops methods the server refuses."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        model = await model_id(client, url)
        prompt = workloads[0].prompts[0]
        accepted = []
        for method in methods:
            if await supports_method(client, url, model, prompt, method):
                accepted.append(method)
        return accepted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from bench.costs import engine_attention, load_head, measure_costs
    from bench.peer import Peer, chat_ids
    from bench.server_proc import live_server
    from server.config import Settings
    from server.model.loading import load_draft_like, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = load_workloads(args.workloads)
    requested = args.methods or list(SPEC_METHODS)
    notes: list[str] = []

    # In-process: the same weights the server loads (the default model's default weights, the draft in bf16).
    settings = Settings.load()
    print("loading the default model in-process (cost ratio, peer) ...", flush=True)
    target = load_model(None, dtype="float32", device="cpu", cache_dir=settings.cache_dir, modules="transformers")
    draft = load_draft_like(target, "target", dtype="bfloat16", cache_dir=settings.cache_dir)
    prompt_ids = {p.id: chat_ids(target.tokenizer, list(p.messages)) for w in workloads for p in w.prompts}

    costs: list[dict[str, Any]] = []
    if not args.no_costs:
        print("measuring draft/target cost ratios ...", flush=True)
        head_setting = args.draft_head if args.draft_head is not None else settings.draft_head
        head, head_note = load_head(Settings.load(draft_head=head_setting).draft_head, settings.target, target)
        notes.append(f"costs table: the eagle row times {head_note}.")
        print(f"  eagle: {head_note}", flush=True)
        contexts = [prompt_ids[p.id] for w in workloads for p in w.prompts]
        with engine_attention(target.model, draft.model, head.decoder if head is not None else None):
            measured = measure_costs(target, draft, contexts, sorted(set(args.clients) | set(COST_BATCHES)),
                                     args.k["ngram"], head=head)
        costs = [c.to_json() for c in measured.values()]
        for c in costs:
            print(f"  batch {c['batch']}: target {c['target_step_ms']:.1f} ms, draft c={c['c_draft']:.3f}, "
                  f"eagle c={_fmt_c(c['c_eagle'])}, ngram c={c['c_ngram']:.4f}, "
                  f"verify K+1 = {c['verify_ratio']:.2f} steps", flush=True)
    peer = Peer(target, draft) if args.peer else None

    cells: dict[CellKey, Cell] = {}
    server_args = ["--max-batch-size", str(max(8, *args.clients)), *shlex.split(args.server_args)]
    if args.draft_head is not None:
        server_args += ["--draft-head", args.draft_head]
    log_path = args.out / "server.log"

    def with_server(url: str) -> None:
        methods = asyncio.run(warm_up(url, workloads, requested))
        for m in requested:
            if m not in methods:
                notes.append(f"method `{m}` was refused by the server (400), so it is not in this run.")
                print(f"NOTE: {notes[-1]}", flush=True)
        asyncio.run(run_grid(args, url, workloads, methods, peer, prompt_ids, cells))

    if args.server_url:
        with_server(args.server_url.rstrip("/"))
    else:
        print("starting the server ...", flush=True)
        with live_server(server_args, args.threads, log_path) as url:
            with_server(url)
        log_path.unlink(missing_ok=True)

    rows = summarize(list(cells.values()), cost_map(costs))
    meta = {
        "command": "python -m bench.run" + ("" if argv is None and len(sys.argv) < 2 else " " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": ledger.git_commit()[0],
        "machine": ledger.machine()[0],
        "model": target.name,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "threads": args.threads,
        "requests_per_cell": args.requests,
        "min_rounds": args.min_rounds,
        "per_client": args.per_client,
        "workloads": args.workloads,
        "clients": args.clients,
        "temperatures": args.temperatures,
        "methods": [m for m in requested if any(k.method == m for k in cells)],
        "peer": args.peer,
        "duration_s": time.perf_counter() - started,
        "notes": notes,
    }
    write_all(args.out, meta, rows, costs)
    print(f"wrote {args.out}/results.md, results.json, speedup.png in {meta['duration_s'] / 60:.1f} min", flush=True)
    if not args.no_record:
        ledger.record(SUITE, ledger_cells(rows), files=[args.out / n for n in ("results.md", "results.json",
                                                                              "speedup.png")],
                      command=meta["command"], figures={"minutes": round(meta["duration_s"] / 60, 1)})
        print(f"recorded in {ledger.results_dir() / ledger.LEDGER}", flush=True)
    print(json.dumps([t for t in json.loads((args.out / "results.json").read_text())["targets"]], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

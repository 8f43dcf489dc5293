"""How well estimators of a verify pass's time predict the next pass: the evidence for `auto`'s cost model.

`python -m bench.verify_costs record TRACE` runs `auto` in-process on the default model (chat and
copy_edit prompts, closed loops of 1, 4 and 8 rows, T = 0 and 0.8) and writes every verify timing the
cost model is given, calibration's included, as JSON. `python -m bench.verify_costs score TRACE` replays
them in order through each estimator: before each traffic timing it predicts that pass, then learns it.
It prints the median relative error per estimator, for plain passes (every row feeding one token) and for
wider ones (what `auto` weighs drafting with), and for the wider ones also the error of their ratio to
the batch size's recent plain passes (what decides whether a draft pays). docs/bench.md has the figures.

Estimators: `ratio` is server/speculation/cost.py's (the server's one); `line` a least-squares line over
each batch size's recent timings; `medians` each width's median timing per batch size, non-decreasing.
`score` appends its figures to the ledger (bench/ledger.py) as suite `verify_costs` (median relative errors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from bench import ledger
from server.speculation.cost import CostModel, non_decreasing

Timing = dict[str, object]  # {"rows", "tokens", "seconds", "prior", "phase"}


def record(out: Path, max_tokens: int = 64) -> None:
    from bench.workloads import load_workload
    from server.config import Settings
    from server.engine.engine import build_engine
    from server.types import GenerationRequest, SamplingParams, SpeculationParams

    trace: list[Timing] = []
    phase = ["calibration"]
    real = CostModel.observe_verify

    def observe(self: CostModel, rows: int, tokens: int, seconds: float, prior: bool = False) -> None:
        trace.append({"rows": rows, "tokens": tokens, "seconds": seconds, "prior": prior, "phase": phase[0]})
        real(self, rows, tokens, seconds, prior)

    CostModel.observe_verify = observe  # type: ignore[method-assign]
    engine = build_engine(Settings.load())
    tok, n = engine.tokenizer, 0
    for workload in ("chat", "copy_edit"):
        prompts = [tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for p in load_workload(workload).prompts]
        for temperature in (0.0, 0.8):
            for clients in (1, 4, 8):
                phase[0] = f"{workload}/T{temperature}/c{clients}"
                queue = [prompts[i % len(prompts)] for i in range(max(8, 2 * clients))]
                started = time.perf_counter()
                while queue or engine.has_unfinished():
                    while queue and len(engine.running) < clients:
                        n += 1
                        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                  seed=n if temperature else None)
                        engine.add_requests([GenerationRequest(f"r{n}", tuple(queue.pop(0)), sampling,
                                                               SpeculationParams("auto", 16), cache_salt=f"s{n}")])
                    engine.step()
                print(phase[0], f"{time.perf_counter() - started:.1f} s", len(trace), file=sys.stderr, flush=True)
    out.write_text(json.dumps(trace))


class Line:
    """A least-squares line over each batch size's last 128 timings (calibration's included)."""

    def __init__(self) -> None:
        self.points: dict[int, deque[tuple[int, float]]] = {}

    def learn(self, rows: int, tokens: int, seconds: float, prior: bool) -> None:
        self.points.setdefault(rows, deque(maxlen=128)).append((tokens, seconds))

    def predict(self, rows: int, tokens: int) -> float | None:
        pts = self.points.get(rows)
        if not pts:
            return None
        xs, ys = [float(t) for t, _ in pts], [s for _, s in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var, 0.0) if var else 0.0
        return my + slope * (tokens - mx)


class Medians:
    """Each width's median of its last 8 timings per batch size (calibration's while traffic has none),
    non-decreasing in the width, linear between widths and beyond them."""

    def __init__(self) -> None:
        self.times: dict[int, dict[int, deque[float]]] = {}
        self.prior: dict[int, dict[int, list[float]]] = {}

    def learn(self, rows: int, tokens: int, seconds: float, prior: bool) -> None:
        if prior:
            self.prior.setdefault(rows, {}).setdefault(tokens, []).append(seconds)
        else:
            self.times.setdefault(rows, {}).setdefault(tokens, deque(maxlen=8)).append(seconds)

    def predict(self, rows: int, tokens: int) -> float | None:
        known = {**self.prior.get(rows, {}), **self.times.get(rows, {})}
        if not known:
            return None
        widths = sorted(known)
        times = non_decreasing([statistics.median(known[w]) for w in widths], [len(known[w]) for w in widths])
        if len(widths) == 1:
            return times[0]
        i = min(max(next((i for i, w in enumerate(widths) if w >= tokens), len(widths) - 1), 1), len(widths) - 1)
        w0, w1, t0, t1 = widths[i - 1], widths[i], times[i - 1], times[i]
        return t0 + (t1 - t0) * (tokens - w0) / (w1 - w0)


class Ratio:
    """The server's estimator (server/speculation/cost.py)."""

    def __init__(self) -> None:
        self.cost = CostModel()

    def learn(self, rows: int, tokens: int, seconds: float, prior: bool) -> None:
        self.cost.observe_verify(rows, tokens, seconds, prior)

    def predict(self, rows: int, tokens: int) -> float | None:
        return self.cost.verify_time(rows, tokens)


ESTIMATORS: dict[str, Callable[[], object]] = {"ratio": Ratio, "line": Line, "medians": Medians}


def score(trace: list[Timing]) -> dict[str, dict[str, float]]:
    """Per estimator: median relative error of plain and of wider passes, and of the wider ones' ratio to
    the median of the batch size's last 8 plain passes; and how many passes each figure is over."""
    results = {}
    for name, make in ESTIMATORS.items():
        est = make()
        plain_err: list[float] = []
        wide_err: list[float] = []
        ratio_err: list[float] = []
        recent: dict[int, deque[float]] = {}
        for t in trace:
            rows, tokens, seconds, prior = int(t["rows"]), int(t["tokens"]), float(t["seconds"]), bool(t["prior"])
            if not prior:
                guess = est.predict(rows, tokens)  # type: ignore[attr-defined]
                plain_now = recent.get(rows)
                if guess is not None:
                    (plain_err if tokens <= rows else wide_err).append(abs(guess - seconds) / seconds)
                    guess_plain = est.predict(rows, rows)  # type: ignore[attr-defined]
                    if tokens > rows and plain_now and guess_plain:
                        actual = seconds / statistics.median(plain_now)
                        ratio_err.append(abs(guess / guess_plain - actual) / actual)
                if tokens <= rows:
                    recent.setdefault(rows, deque(maxlen=8)).append(seconds)
            est.learn(rows, tokens, seconds, prior)  # type: ignore[attr-defined]
        results[name] = {"plain": statistics.median(plain_err), "wider": statistics.median(wide_err),
                         "wider ratio": statistics.median(ratio_err), "plain passes": len(plain_err),
                         "wider passes": len(wide_err)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_costs", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["record", "score"])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--no-record", action="store_true", help="score only: do not append to the ledger")
    args = parser.parse_args(argv)
    if args.action == "record":
        record(args.trace)
        return 0
    scored = score(json.loads(args.trace.read_text()))
    for name, figures in scored.items():
        print(f"{name:8} plain {figures['plain']:.1%}  wider {figures['wider']:.1%}  wider's ratio to plain "
              f"{figures['wider ratio']:.1%}  ({figures['plain passes']} plain, {figures['wider passes']} wider)")
    if not args.no_record:
        ledger.record("verify_costs", ledger_cells(scored, args.trace.name), files=[args.trace])
    return 0


def ledger_cells(scored: dict[str, dict[str, float]], trace: str) -> list[ledger.Cell]:
    """One cell per estimator: its median relative errors (plain, wider, a wider pass's ratio to plain)."""
    return [ledger.Cell(trace, name, values={k.replace(" ", "_"): round(v, 4) if isinstance(v, float) else v
                                             for k, v in figures.items()}) for name, figures in scored.items()]


if __name__ == "__main__":
    raise SystemExit(main())

"""The cost of a verify pass by its width: what speculation buys with (docs/bench.md, "Pass cost").

    .venv/bin/python -m bench.pass_cost [--target FILE] [--context 300] [--repeats 9] [--threads 2] [--json]
                                        [--parts] [--products] [--no-record]

In-process, on the engine's `ModelRunner` over the served model (default: the built-in model as its file's blocks),
with `--context` tokens of context per row: one row feeding 1, 2, 3, 5, 9 and 17 tokens, four rows feeding 1, 5 and
9 tokens each. Every measurement restores the cache to the same context before the next (`BatchKV.checkpoint`),
the widths are timed in rotating order round after round (load from other processes hits every width alike), and
medians of `--repeats` rounds are reported, in ms and in plain steps (the one-token pass of the same rows).

`--json` prints `{"rows": {"1": {"1": ms, "2": ms, ...}, "4": {"1": ms, "5": ms, "9": ms}}}`. `--parts` adds where a
pass's time goes at widths 1, 5, 9 and 17: each distinct linear shape's product (its block kernel alone, all
layers), the LM head, the decoder stack's C call (its attention, norms and RoPE: the call less its products), and
Python and ctypes (the runner's pass less the C call and the head). `--products` adds the products' own curve: every
layer's products and the LM head on 1, 2, 4, 9, 17, 36 and 128 rows, in ms, in one-row products and in multiply-adds
a second. A pass can cost no fewer steps than its products' ratio at its width: where the 128-row rate is not far
above the 17-row one, the kernels are at the host's arithmetic and a wider pass is bought with arithmetic, not
with bytes. The run goes to the ledger as suite `pass_cost` (cells: one row's width w against its plain step, four
rows' likewise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench import ledger

ONE_ROW = (1, 2, 3, 5, 9, 17)
FOUR_ROWS = (1, 5, 9)
PART_WIDTHS = (1, 5, 9, 17)
PRODUCT_ROWS = (1, 2, 4, 9, 17, 36, 128)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _median_ms(runs: list[float]) -> float:
    return round(statistics.median(runs) * 1e3, 3)


def _passes(runner, rows: int, widths: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Median ms of a pass of `rows` rows feeding w tokens each, for every w, the cache back at the context after
    each pass."""
    ckpt = runner.kv.checkpoint()
    times: dict[int, list[float]] = {w: [] for w in widths}
    feeds = {w: [_tokens(w, 7 * r + w) for r in range(rows)] for w in widths}
    for w in widths:  # warm: each width's first pass (allocations, oneDNN's first call)
        runner.forward(feeds[w])
        runner.kv.restore(ckpt)
    for round_ in range(repeats):
        order = widths[round_ % len(widths):] + widths[: round_ % len(widths)]
        for w in order:
            start = time.perf_counter()
            runner.forward(feeds[w])
            times[w].append(time.perf_counter() - start)
            runner.kv.restore(ckpt)
    return {w: _median_ms(t) for w, t in times.items()}


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return _median_ms(runs)


def _products(call) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]]:
    """Each distinct linear shape's kernel of the lean forward `call`: name -> (kernel, K, layers holding it)."""
    products: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, int]] = {}
    for kernels, both in zip(call.linears, call.fused, strict=True):
        named = [(f"qkv {both.qkv.in_features}x{both.qkv.out}", both.qkv), (f"gate_up {both.gate_up.in_features}x"
                 f"{both.gate_up.out}", both.gate_up)] if both is not None else []
        named += [(f"o {kernels[3].in_features}x{kernels[3].out}", kernels[3]),
                  (f"down {kernels[6].in_features}x{kernels[6].out}", kernels[6])]
        for name, kernel in named:
            if kernel is None:
                continue
            _, k, count = products.get(name, (kernel, kernel.in_features, 0))
            products[name] = (kernel, k, count + 1)
    return products


def product_curve(runner, repeats: int) -> dict[str, dict[str, float]]:
    """Every layer's products and the LM head on each of `PRODUCT_ROWS` rows (module doc): ms, in one-row products,
    and multiply-adds a second (GMAC/s)."""
    call = runner.call
    products = _products(call)
    hidden = runner.model.config.hidden_size
    head = call.lm_head
    vocab = head(torch.randn(1, hidden)).shape[-1]
    macs_per_row = sum(k * kernel(torch.randn(1, k)).shape[-1] * count for kernel, k, count in products.values())
    macs_per_row += hidden * vocab
    out: dict[str, dict[str, float]] = {}
    for m in PRODUCT_ROWS:
        ms = 0.0
        for kernel, k, count in products.values():
            x = torch.randn(m, k)
            ms += _time(lambda x=x, kernel=kernel: kernel(x), repeats) * count
        h = torch.randn(m, hidden)
        ms += _time(lambda h=h: head(h), repeats)
        out[str(m)] = {"ms": round(ms, 3), "gmac_s": round(m * macs_per_row / ms / 1e6, 1)}
    for row in out.values():
        row["one_row_products"] = round(row["ms"] / out["1"]["ms"], 2)
    return out


def parts(runner, repeats: int) -> dict[str, dict[str, float]]:
    """Where a one-row pass's time goes at each of `PART_WIDTHS` (see the module doc)."""
    call = runner.call
    model = runner.model
    out: dict[str, dict[str, float]] = {}
    products = _products(call)
    decoder = getattr(call, "decoder", None)
    head = call.lm_head
    hidden = model.config.hidden_size
    ckpt = runner.kv.checkpoint()
    for w in PART_WIDTHS:
        row: dict[str, float] = {}
        total_products = 0.0
        for name, (kernel, k, count) in products.items():
            x = torch.randn(w, k)
            ms = _time(lambda x=x, kernel=kernel: kernel(x), repeats) * count
            row[f"{name} (x{count})"] = round(ms, 3)
            total_products += ms
        row["lm head"] = _time(lambda w=w: head(torch.randn(w, hidden)), repeats)
        feed = [_tokens(w, w)]

        def whole(feed=feed) -> None:
            runner.forward(feed)
            runner.kv.restore(ckpt)

        pass_ms = _time(whole, repeats)
        if decoder is not None:
            captured: dict[str, float] = {}
            original = decoder.lib.decoder_forward

            def timed(*args, captured=captured, original=original) -> None:
                start = time.perf_counter()
                original(*args)
                captured.setdefault("runs", []).append(time.perf_counter() - start)

            decoder.lib.decoder_forward = timed
            try:
                _time(whole, repeats)
            finally:
                decoder.lib.decoder_forward = original
            c_ms = _median_ms(captured["runs"])
            row["decoder call (C)"] = c_ms
            row["attention, norms, RoPE (C call less its products)"] = round(c_ms - total_products, 3)
            row["python and ctypes (pass less C call and head)"] = round(pass_ms - c_ms - row["lm head"], 3)
        row["pass"] = pass_ms
        out[str(w)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a GGUF file or checkpoint (default: the built-in model)")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print only the pass costs as JSON")
    parser.add_argument("--parts", action="store_true", help="also where a pass's time goes (module doc)")
    parser.add_argument("--products", action="store_true", help="also the products' own curve (module doc)")
    parser.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pathlib import Path

    from server.model.attention import use_gqa_attention
    from server.model.loading import load_model
    from server.model.runner import ModelRunner

    cache = Path.home() / ".cache" / "specula"
    loaded = load_model(args.target, cache_dir=cache, weights=args.weights)
    use_gqa_attention(loaded.model)
    results: dict[str, dict[str, float]] = {}
    for rows, widths in ((1, ONE_ROW), (4, FOUR_ROWS)):
        runner = ModelRunner(loaded.model, kv_slots=rows * (args.context + 64))
        runner.join([f"r{i}" for i in range(rows)], [_tokens(args.context, i) for i in range(rows)])
        results[str(rows)] = {str(w): ms for w, ms in _passes(runner, rows, widths, args.repeats).items()}
        if rows == 1 and args.parts:
            breakdown = parts(runner, args.repeats)
        if rows == 1 and args.products:
            curve = product_curve(runner, args.repeats)
    payload = {"rows": results}
    if args.json:
        print(json.dumps(payload))
    else:
        for rows, by_width in results.items():
            plain = by_width["1"]
            print(f"{rows} row(s), {args.context} tokens of context, ms (in plain steps):")
            print("  " + "  ".join(f"{w}: {ms:.2f} ({ms / plain:.2f}x)" for w, ms in by_width.items()))
        if args.parts:
            for w, row in breakdown.items():
                print(f"width {w}: " + "; ".join(f"{k} {v:.2f}" for k, v in row.items()))
        if args.products:
            print("the products alone (every layer's and the LM head), by rows: ms (in one-row products, GMAC/s):")
            print("  " + "  ".join(f"{m}: {r['ms']:.2f} ({r['one_row_products']:.2f}x, {r['gmac_s']:.0f})"
                                   for m, r in curve.items()))
    if not args.no_record:
        # ratio: the pass's time over the plain step's (lower is better here, unlike the tokens/s suites)
        cells = [ledger.Cell(workload=f"{rows} row(s)", method=f"width {w}", baseline="width 1", clients=int(rows),
                             ratio=round(ms / by_width["1"], 3), values={"ms": ms})
                 for rows, by_width in results.items() for w, ms in by_width.items()]
        ledger.record("pass_cost", cells, figures={**payload, **({"parts": breakdown} if args.parts else {}),
                                                      **({"products": curve} if args.products else {})},
                      note=f"{loaded.name} weights {loaded.weights}, context {args.context}, threads {args.threads}")


if __name__ == "__main__":
    main()

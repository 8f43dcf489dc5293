"""`make compat`: the clients people use, unmodified, against a live server.

Installs pinned client packages in throwaway environments (a venv for the Python clients, one for AIPerf,
a node folder for the Vercel AI SDK; all from the package registries, nothing else), starts a server
(`python -m server serve` on the default model, on a free port) unless `--url` names a running one, and
runs each check in `compat/`:

* openai: Responses `create` plain and streamed, `responses.stream`, a function tool round trip with
  `previous_response_id`, `responses.parse` with `text_format` (responses_check.py);
* LangChain: a `bind_tools(tool_choice="any")` agent loop and `create_agent(response_format=...)`
  (langchain_check.py);
* litellm: its tool round trip (its assistant message, `provider_specific_fields` and all, sent back) and
  `litellm.responses` (litellm_check.py);
* Vercel AI SDK: the default `@ai-sdk/openai` provider (the Responses API) plain and streamed, and
  `toolChoice: 'required'` on it and on the chat provider, each tool run once (vercel_check.mjs);
* AIPerf: a short streamed chat run that reports speculation acceptance (vLLM's
  `metrics.speculative_decoding`).

Prints one line per check and exits 1 if any failed. Needs python3 with venv, node and npm.

    .venv/bin/python compat/run.py                      # everything, fresh environments, own server
    .venv/bin/python compat/run.py --url http://127.0.0.1:8000 --keep /tmp/specula-compat --only langchain
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The versions checked (docs/api.md, "Works with"); newer ones are what a user gets, so bump and rerun.
PYTHON_CLIENTS = ["openai==3.63.0", "langchain==1.5.0", "langchain-openai==1.8.1", "langgraph==1.2.24",
                  "litellm==1.110.2"]
AIPERF = ["aiperf==0.13.0"]
NODE_CLIENTS = ["ai@6.0.333", "@ai-sdk/openai@3.0.141", "zod@4.6.7"]
CHECKS = ("openai", "langchain", "litellm", "vercel", "aiperf")


def run(cmd: list[str], timeout: float, cwd: Path | None = None) -> tuple[bool, str]:
    """(succeeded, its output) of a command."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return False, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return done.returncode == 0, done.stdout + done.stderr


def install(cmd: list[str], cwd: Path | None = None) -> None:
    ok, output = run(cmd, timeout=1800, cwd=cwd)
    if not ok:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-4000:]}")


def venv(path: Path, packages: list[str]) -> Path:
    """A venv at `path` with `packages` (pip, from the registry); its python."""
    python = path / "bin" / "python"
    if not python.exists():
        install([sys.executable, "-m", "venv", str(path)])
    install([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages])
    return python


def node_folder(path: Path) -> Path:
    """A folder with the Vercel AI SDK installed (npm, from the registry) and its check."""
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "package.json").exists():
        install(["npm", "init", "-y"], cwd=path)
    install(["npm", "install", "--no-audit", "--no-fund", *NODE_CLIENTS], cwd=path)
    shutil.copy(HERE / "vercel_check.mjs", path / "vercel_check.mjs")
    return path


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited (status {proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in 900 s; see {log}")


def aiperf_check(python: Path, url: str, model: str, tokenizer: Path, out: Path) -> tuple[bool, str]:
    """A short streamed chat run; passes when AIPerf reports acceptance figures."""
    aiperf = python.parent / "aiperf"
    ok, output = run([str(aiperf), "profile", "-m", model, "-u", url, "--endpoint-type", "chat", "--streaming",
                      "--request-count", "6", "--concurrency", "2", "--prompt-input-tokens-mean", "64",
                      "--prompt-output-tokens-mean", "32", "--tokenizer", str(tokenizer),
                      "--output-artifact-dir", str(out)], timeout=900)
    export = out / "profile_export_aiperf.json"
    if not ok or not export.exists():
        return False, output
    report = json.loads(export.read_text())
    length = report.get("spec_decode_acceptance_length", {}).get("avg")
    rate = report.get("spec_decode_draft_acceptance_rate", {}).get("avg")
    if length is None or rate is None:
        return False, "AIPerf reported no speculation figures\n" + output[-3000:]
    histogram = report.get("pooled_spec_decode_acceptance_histogram")
    return True, f"acceptance length {length:.2f}, draft acceptance {rate:.1f} %, accepted per step {histogram}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one on the default model)")
    parser.add_argument("--keep", type=Path, help="keep (and reuse) the client environments in this folder")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--tokenizer", type=Path, help="AIPerf's tokenizer (default: the default model's)")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    unknown = set(only) - set(CHECKS)
    if unknown:
        raise SystemExit(f"unknown checks: {', '.join(sorted(unknown))}")

    work = args.keep or Path(tempfile.mkdtemp(prefix="specula-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        print(f"installing clients under {work} ...", flush=True)
        python = venv(work / "clients", PYTHON_CLIENTS) if {"openai", "langchain", "litellm"} & set(only) else None
        aiperf_python = venv(work / "aiperf", AIPERF) if "aiperf" in only else None
        node = node_folder(work / "node") if "vercel" in only else None
        if args.url:
            url = args.url.rstrip("/")
        else:
            print("starting a server on the default model ...", flush=True)
            server, url = start_server(work / "server.log")
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        tokenizer = args.tokenizer
        if "aiperf" in only and tokenizer is None:
            from server.config import Settings
            from server.model.loading import load_default_tokenizer

            tokenizer = work / "tokenizer"
            load_default_tokenizer(Settings.load().cache_dir).save_pretrained(tokenizer)

        results: list[tuple[str, bool, float, str]] = []
        for name in only:
            started = time.monotonic()
            if name in ("openai", "langchain", "litellm"):
                script = {"openai": "responses_check.py", "langchain": "langchain_check.py",
                          "litellm": "litellm_check.py"}[name]
                ok, output = run([str(python), str(HERE / script), url, model], timeout=900)
            elif name == "vercel":
                ok, output = run(["node", "vercel_check.mjs", url, model], timeout=600, cwd=node)
            else:
                ok, output = aiperf_check(aiperf_python, url, model, tokenizer, work / "aiperf-out")
            results.append((name, ok, time.monotonic() - started, output))
            print(f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - started:.0f} s)", flush=True)
            lines = [line for line in output.splitlines() if "LiteLLM:WARNING" not in line]
            print("\n".join("    " + line for line in (lines if ok else lines[-40:])), flush=True)
        failed = [name for name, ok, _, _ in results if not ok]
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
        if failed:
            raise SystemExit(1)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

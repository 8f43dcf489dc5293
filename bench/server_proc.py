"""Start `python -m server serve` as a subprocess on a free loopback port and wait for /health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def thread_env(threads: int | None) -> dict[str, str]:
    """Environment that caps torch's intra-op threads (see docs/bench.md: oversubscription)."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


@contextmanager
def running(
    cmd: list[str],
    name: str,
    port: int,
    log_path: Path,
    timeout_s: float,
    *,
    ready: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    procs: list[subprocess.Popen] | None = None,
    stop_s: float = 30.0,
    **popen: Any,
) -> Iterator[str]:
    """Run `cmd` (a server listening on `port`, its output to `log_path`) and yield its base URL once
    `ready(GET /health)` holds; SIGTERM it (and wait `stop_s`, then kill it, its process group too when it
    has one of its own: `start_new_session=True` in `popen`) however the block ends. The process is
    appended to `procs` when given (its pid, its exit status)."""
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen)
        if procs is not None:
            procs.append(proc)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
                try:
                    if ready(httpx.get(f"{url}/health", timeout=5)):
                        break
                except (httpx.HTTPError, ValueError):  # not listening yet, or no JSON yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s; see {log_path}")
                time.sleep(0.25)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=stop_s)
                except subprocess.TimeoutExpired:
                    if popen.get("start_new_session"):
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                    proc.wait()


@contextmanager
def live_server(
    extra_args: list[str],
    threads: int | None,
    log_path: Path,
    timeout_s: float = 180.0,
    procs: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """`python -m server serve` with `extra_args`: yields its base URL once healthy; SIGTERMs it (and waits)
    afterwards. The process is appended to `procs` when given (its pid, its exit status)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with running(cmd, "server", port, log_path, timeout_s, procs=procs, cwd=REPO, env=thread_env(threads)) as url:
        yield url

"""Start `python -m server serve` as a subprocess on a free loopback port and wait for /health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
def live_server(
    extra_args: list[str],
    threads: int | None,
    log_path: Path,
    timeout_s: float = 180.0,
    procs: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """Yields the server's base URL once healthy; SIGTERMs it (and waits) afterwards. The process is
    appended to `procs` when given (its pid, its exit status)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=thread_env(threads), stdout=log, stderr=subprocess.STDOUT)
        if procs is not None:
            procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log_path}")
                time.sleep(0.25)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

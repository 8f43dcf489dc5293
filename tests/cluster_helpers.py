"""`python -m server cluster` on the tiny model, started and stopped by a test (a local Ray instance of its own)."""

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

from server.model.loading import LoadedModel

API_KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(target: LoadedModel, directory: Path) -> Path:
    """The tiny model as a checkpoint directory every replica loads through the real loading path."""
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)
    return directory


def ready_replicas(url: str) -> list[dict]:
    """The replicas /health lists as ready ([] while the cluster is down or loading)."""
    try:
        body = httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return []
    return [r for r in body.get("replicas", []) if r.get("status") == "ready"]


def wait_for_replicas(url: str, n: int, timeout_s: float, proc: subprocess.Popen | None = None) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(replicas := ready_replicas(url)) < n:
        assert proc is None or proc.poll() is None, f"the cluster exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{n} replicas not ready within {timeout_s:.0f} s"
        time.sleep(0.5)
    return replicas


@contextmanager
def running_cluster(model_dir: Path, tmp: Path, *flags: str, replicas: int = 2,
                    env: dict[str, str] | None = None) -> Iterator[str]:
    """Yields the base URL of `python -m server cluster` serving `model_dir` once `replicas` are ready; then
    SIGTERM (Serve and Ray shut down), SIGKILL to its process group if that takes over 60 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server", "cluster", "--host", "127.0.0.1", "--port", str(port),
           "--replicas", str(replicas), "--replica-num-cpus", "0.5", "--target", str(model_dir),
           "--served-model-name", "tiny", *flags]
    env = {**os.environ, "SPECULA_CACHE_DIR": str(tmp / "cache"), "SPECULA_CALIBRATE": "false",
           "SPECULA_API_KEY": API_KEY, "OMP_NUM_THREADS": "1", **(env or {})}
    log = (tmp / "cluster.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_replicas(url, replicas, 180, proc)
        yield url
    except BaseException:
        log.flush()
        print((tmp / "cluster.log").read_text()[-6000:])
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of Ray's processes is left
        except ProcessLookupError:
            pass
        proc.wait(10)
        log.close()

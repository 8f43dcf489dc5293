"""Run a real Prometheus (the Debian package's binary) against a loopback target, for tests."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A running Prometheus at `url` scraping one target every second."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now; the `result` list (raises on a PromQL error)."""
        qs = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        """The single value of an expression that yields one series, or None when it yields none."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def wait_for(self, what: str, ok: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                if ok():
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"waited {timeout_s}s for {what}; prometheus log: {self.log.read_text()[-2000:]}")


@contextmanager
def run_prometheus(target: str, workdir: Path, scrape_interval: str = "1s") -> Iterator[Prometheus]:
    """Start Prometheus scraping `target` (host:port, path /metrics); stop it on exit."""
    assert PROMETHEUS is not None
    config = workdir / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {scrape_interval}\n  scrape_timeout: {scrape_interval}\n"
        f"scrape_configs:\n  - job_name: specula\n    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        prom.wait_for(
            "prometheus ready", lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200
        )
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

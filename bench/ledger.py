"""The benchmark ledger: one JSON line per run, appended by every bench command.

`bench/results/ledger.jsonl` holds one line per run: when (`date`), what code (`commit`, and `dirty` when
tracked files had uncommitted changes), where (`machine`, `device`), the exact `command`, the `suite` (which
bench), and its figures as `cells` (one per workload, method, clients and temperature: the method's `ratio`
to its `baseline` from the same run, its `spread`, and raw `values`) and run-wide `figures`. The newest run
of each suite keeps its files in `bench/results/latest/<suite>/`; an older run's files are in git history
(its line's `files` names the path, and the commit that holds them once the line is committed).
`bench/results/LATEST.md` is rendered from the ledger (`python -m bench.report --readme`, which also
rewrites README.md's current-figures table), never by hand.

Recording a run from any bench command (a new suite needs nothing else):

    from bench import ledger

    cells = [ledger.Cell("long_prompt", "auto", ratio=1.31, clients=1, spread=ledger.Spread.of(round_ratios),
                         values={"tokens_per_s": 12.4}, headline=True)]
    ledger.record("long_prompt", cells, files=[out / "results.json"], figures={"prompt_tokens": 8000})

`headline=True` puts a cell in README's table (keep it to the few figures a newcomer needs). A command
offers `--no-record` for smoke runs; tests point `SPECULA_BENCH_RESULTS` at a temporary directory.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LEDGER = "ledger.jsonl"
LATEST_DIR = "latest"
LATEST_MD = "LATEST.md"


def results_dir() -> Path:
    """Where the ledger, `latest/` and LATEST.md live: `bench/results/`, or `$SPECULA_BENCH_RESULTS`."""
    return Path(os.environ.get("SPECULA_BENCH_RESULTS") or REPO / "bench" / "results")


@dataclass(frozen=True)
class Spread:
    """How far one run's repeats (rounds, prompts) of a ratio moved: lowest, highest, the standard error
    of their mean (stdev / sqrt(n)), and n. A ratio within two `se` of 1.00 is not told apart from it."""

    low: float
    high: float
    se: float | None
    n: int

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Spread | None:
        """The spread of `ratios`; None for fewer than two.

        >>> Spread.of([1.1, 0.9, 1.0])
        Spread(low=0.9, high=1.1, se=0.0577, n=3)
        """
        if len(ratios) < 2:
            return None
        se = statistics.stdev(ratios) / math.sqrt(len(ratios))
        return cls(round(min(ratios), 4), round(max(ratios), 4), round(se, 4), len(ratios))


@dataclass(frozen=True)
class Cell:
    """One figure of a run: `method` against `baseline` on `workload` at `clients` and `temperature`.

    `ratio` is the method's figure over the baseline's from the same run (tokens/s unless the suite says
    otherwise), None where a cell only has `values`."""

    workload: str
    method: str
    ratio: float | None = None
    baseline: str = "none"
    clients: int = 1
    temperature: float = 0.0
    spread: Spread | None = None
    values: dict[str, Any] = field(default_factory=dict)
    headline: bool = False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = None if self.ratio is None else round(self.ratio, 4)
        if not self.headline:
            del out["headline"]
        if self.spread is None:
            del out["spread"]
        return out


def git_commit(cwd: Path = REPO) -> tuple[str, bool]:
    """(short HEAD, whether tracked files under server/, bench/ or config/ differ from it); ("?", False)
    outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "server", "bench/*.py", "config"],
                               cwd=cwd, capture_output=True).returncode != 0
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return "?", False


def machine() -> tuple[str, str]:
    """(a one-line summary of this machine, the device a default server uses: "cpu" or "cuda").

    The summary names the CPU count, model and vector width (AVX-512 or AVX2: a CPU step on the block kernels is
    bound by bytes on the one and by arithmetic on the other, docs/bench.md), the load average (other work on a
    shared host moves every absolute figure) and, where torch sees one, the GPU."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    width = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    named = ", ".join(x for x in (model, width) if x)
    cpu = f" ({named})" if named else ""
    summary = f"{os.cpu_count()} CPUs{cpu}, {platform.machine()}, load average {os.getloadavg()[0]:.1f}"
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = "cuda"
            summary += f"; {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return summary, device


def command_line(argv: Sequence[str] | None = None) -> str:
    """`python -m bench.<module> ARGS` of this process (what to paste to run it again)."""
    argv = list(sys.argv if argv is None else argv)
    module = Path(argv[0]).stem if argv else "?"
    prefix = f"python -m bench.{module}" if module != "__main__" else "python -m bench"
    return " ".join([prefix, *(shlex.quote(a) for a in argv[1:])])


def record(suite: str, cells: Iterable[Cell], *, files: Iterable[Path] = (), figures: dict[str, Any] | None = None,
           note: str | None = None, command: str | None = None, results: Path | None = None) -> dict[str, Any]:
    """Append one run to the ledger, copy its `files` into `latest/<suite>/` (replacing the previous run's),
    and render LATEST.md again. Returns the ledger line as written.

    `command` defaults to this process's command line; `results` to `results_dir()`."""
    root = results or results_dir()
    commit, dirty = git_commit()
    summary, device = machine()
    latest = root / LATEST_DIR / suite
    files = [Path(f) for f in files]
    entry: dict[str, Any] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": commit,
        **({"dirty": True} if dirty else {}),
        "machine": summary,
        "device": device,
        "command": command or command_line(),
        "suite": suite,
        "cells": [c.to_json() for c in cells],
        **({"figures": figures} if figures else {}),
        **({"files": {"path": _shown(latest)}} if files else {}),
        **({"note": note} if note else {}),
    }
    if files:
        _replace_latest(latest, files)
    append(entry, root)
    write_latest(root)
    return entry


def append(entry: dict[str, Any], results: Path | None = None) -> None:
    """Append one line (a complete entry) to the ledger."""
    root = results or results_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LEDGER, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, separators=(", ", ": "), ensure_ascii=False) + "\n")


def read(results: Path | None = None) -> list[dict[str, Any]]:
    """Every ledger line, in the order they were appended."""
    path = (results or results_dir()) / LEDGER
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def latest(entries: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The newest run of each (suite, device), in order of first appearance. A line marked `baseline` (a run of
    older code, made to compare against) is never the newest."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for e in entries:
        if e.get("baseline"):
            continue
        key = (e["suite"], e.get("device", "cpu"))
        if key not in out or e["date"] >= out[key]["date"]:
            out[key] = e
    return out


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO)) + "/"
    except ValueError:
        return str(path) + "/"


def _replace_latest(latest: Path, files: list[Path]) -> None:
    """`latest/<suite>/` becomes exactly `files` (those already inside it stay as they are)."""
    latest.mkdir(parents=True, exist_ok=True)
    keep = {f.resolve() for f in files if f.resolve().parent == latest.resolve()}
    for old in latest.iterdir():
        if old.resolve() not in keep:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    for f in files:
        if f.resolve() not in keep and f.exists():
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, latest / f.name)


def write_latest(results: Path | None = None) -> str:
    """Render LATEST.md from the ledger (bench.report does the rendering) and write it; returns the text."""
    from bench.report import latest_markdown

    root = results or results_dir()
    text = latest_markdown(read(root))
    root.mkdir(parents=True, exist_ok=True)
    (root / LATEST_MD).write_text(text, encoding="utf-8")
    return text

"""Benchmark workloads: chat prompts shipped as JSON lines in bench/workloads/<name>.jsonl.

Each line is {"id": str, "task": str, "messages": [{"role", "content"}, ...]}. The workloads span
the range speculation cares about: copy-heavy editing and code transformation (the answer repeats
the prompt: n-gram lookup shines), extractive summarization (partly copied), open-ended chat
(nothing to copy: speculation must not lose), and repeated agent-style requests (the same system
prompt and few-shot turns, a tool call as JSON each round: earlier answers predict later ones).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"
WORKLOADS = ("copy_edit", "code", "summarize", "chat", "agent")  # table order
MIN_PROMPTS = 8


@dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[Prompt, ...]

    @property
    def copy_heavy(self) -> bool:
        return self.name in ("copy_edit", "code")


def load_workload(name: str, directory: Path = WORKLOAD_DIR) -> Workload:
    path = directory / f"{name}.jsonl"
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        messages = row["messages"]
        if not messages or any(set(m) != {"role", "content"} for m in messages):
            raise ValueError(f"{path}:{n}: messages must be a non-empty list of {{role, content}}")
        prompts.append(Prompt(id=row["id"], task=row["task"], messages=tuple(messages)))
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError(f"{path}: duplicate prompt ids")
    return Workload(name=name, prompts=tuple(prompts))


def load_workloads(names: list[str] | None = None, directory: Path = WORKLOAD_DIR) -> list[Workload]:
    """The named workloads (default: all, in table order)."""
    return [load_workload(name, directory) for name in (names or WORKLOADS)]

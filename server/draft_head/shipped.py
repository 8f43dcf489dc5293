"""Which draft head a server loads: the `draft_head` setting resolved to a directory, or none."""

from __future__ import annotations

from pathlib import Path

# The head trained for the built-in target (SmolLM2-135M-Instruct) and shipped with the package.
SHIPPED_HEAD = Path(__file__).resolve().parent / "weights" / "smollm2-135m-instruct"


def resolve_draft_head(draft_head: str | None, target: str | None) -> Path | None:
    """`draft_head` is a directory (model.safetensors + config.json), "auto" (the shipped head when the
    target is the built-in one and a head ships, else none) or None (no head)."""
    if draft_head is None:
        return None
    if draft_head == "auto":
        return SHIPPED_HEAD if target is None and (SHIPPED_HEAD / "config.json").is_file() else None
    return Path(draft_head)

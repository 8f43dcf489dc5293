"""EAGLE-style draft heads: the model (`model.py`), its training data (`data.py`), training (`train.py`,
`unroll.py`) and `python -m server distill` (`distill.py`, `cli.py`). Trained heads ship under `weights/`."""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BUILTIN_HEAD = WEIGHTS_DIR / "smollm2-135m-instruct"  # the head for the built-in default target


def resolve_head(draft_head: str | None, target: str | None) -> Path | None:
    """The directory a `draft_head` setting names: a path; "auto" = `BUILTIN_HEAD` when the target is the
    built-in one (`target` None) and a head ships there, else none; None = no head."""
    if draft_head == "auto":
        return BUILTIN_HEAD if target is None and (BUILTIN_HEAD / "config.json").is_file() else None
    return Path(draft_head).expanduser() if draft_head is not None else None

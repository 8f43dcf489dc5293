"""EAGLE-style draft heads: the model (`model.py`), its training data (`data.py`), training (`train.py`,
`unroll.py`) and `python -m server distill` (`distill.py`, `cli.py`). Trained heads ship under `weights/`."""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BUILTIN_HEAD = WEIGHTS_DIR / "smollm2-135m-instruct"  # the head for the built-in default target

"""Specula's end-to-end benchmark: `python -m bench.run` (see docs/bench.md)."""

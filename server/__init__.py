"""Specula: an OpenAI-compatible inference server whose worker runs speculative decoding."""

import os

# OpenMP threads that spin while waiting are fast on an idle machine and catastrophic beside any
# other busy process (measured here: a batch-8 decode step of SmolLM2 took 1.97 s instead of 0.16 s
# with a benchmark client running). Passive waiting must be chosen before torch loads OpenMP;
# an explicit OMP_WAIT_POLICY in the environment still wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

"""Specula: an OpenAI-compatible inference server whose worker runs speculative decoding."""

# OpenMP waiting is left at libgomp's default (workers spin a while between parallel regions): on an
# idle CPU a decode step is ~30% faster than with OMP_WAIT_POLICY=PASSIVE. Spinning turns ruinous when
# another process holds a core, so the engine picks its thread count from measured step times
# (server/engine/threads.py). An OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment still applies.

__version__ = "0.1.0"

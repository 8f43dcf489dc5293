"""Specula: an OpenAI-compatible inference server whose worker runs speculative decoding."""

import os

# OpenMP waiting is left at libgomp's default spin count (workers spin a while between parallel regions): on an
# idle CPU a decode step is ~30% faster than with OMP_WAIT_POLICY=PASSIVE. Spinning turns ruinous when another
# process holds a core, so the engine picks its thread count from measured step times (server/engine/threads.py).
# The count is set explicitly (GOMP_SPINCOUNT=300000, libgomp's documented default): left unset, libgomp cuts it to
# its "throttled" count whenever it counts more of its threads than CPUs (torch's pool beside the kernels' teams),
# and a worker that sleeps at once can take a scheduler tick to wake on a virtual machine: measured on a 2-vCPU VM,
# every parallel region of a small product took 16 ms instead of 0.05, and a 4-row pass of a Qwen2.5-0.5B-shaped
# model 1.5 s instead of 48 ms (docs/bench-journal.md). An OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment
# still applies. Set before torch loads libgomp (`python -m server` and every test import this package first).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")

__version__ = "0.1.0"

"""Memory for the KV cache budget: the budget in bytes on a device, and giving freed heap back.

`kv_cache_memory` (server/config.py) is bytes or a fraction of the free memory at start-up: on a GPU
what the driver reports free, on CPU the kernel's MemAvailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

import torch

from server.config import parse_memory

log = logging.getLogger(__name__)


def free_bytes(device: torch.device) -> int:
    """Memory free for new allocations now: the GPU's free memory, or MemAvailable on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("a fraction for kv_cache_memory needs /proc/meminfo on CPU; give bytes instead")


def budget_bytes(value: str, device: torch.device, name: str = "kv_cache_memory", reserved: int = 0) -> int:
    """A memory setting (`kv_cache_memory`, `prefix_cache_memory`) in bytes on `device` (a fraction is
    taken of what is free now, less `reserved` bytes promised to something that allocates later)."""
    amount = parse_memory(value, name)
    return int(amount * max(0, free_bytes(device) - reserved)) if isinstance(amount, float) else amount


class HeapTrimmer:
    """Gives the C heap's free pages back to the kernel (glibc `malloc_trim`), so a burst's temporary
    buffers (activations, logits, prefill caches) do not stay in the RSS once the server is idle.
    A no-op where the C library has no `malloc_trim` (musl, macOS)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim = getattr(libc, "malloc_trim", None) if libc is not None else None

    def __call__(self) -> None:
        if self._trim is not None:
            self._trim(0)

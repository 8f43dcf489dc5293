"""Memory: the KV cache budget in bytes on a device, giving freed heap back, dropping the file pages
of weights no longer read, and measuring what a server's memory is made of.

`kv_cache_memory` (server/config.py) is bytes or a fraction of the free memory at start-up: on a GPU
what the driver reports free, on CPU the kernel's MemAvailable.

The parts of a server's memory (docs/api.md "Memory"; exported as `specula_memory_bytes{part}`) are
measured from the objects themselves: `tensor_bytes` counts the storages behind tensors (each once),
`PeakTensorBytes` the most bytes a piece of code's tensors held at once (the working memory of a step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def _libc_function(name: str) -> Callable[..., int] | None:
    """A function of the C library, or None where there is none (musl without it, macOS)."""
    library = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(library), name, None) if library else None


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_heap_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (`mallopt(M_ARENA_MAX)`) for a server process, unless MALLOC_ARENA_MAX
    is set. glibc gives threads that allocate at once arenas of their own (up to 8 per core), each
    keeping its freed blocks: the tokenizing threads', the worker's and the event loop's heaps grow
    apart (9 arenas for 8 allocating threads; 2 with the cap). 3-minute soaks of the built-in model put
    the peak RSS at 1.07x and 1.12x the memory parts with 2 arenas, 1.10-1.13x without: within the runs'
    spread. Call it before threads start; returns whether it was applied."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_ARENA_MAX, arenas) == 1


KERNEL_CACHE_ENTRIES = 128  # oneDNN's primitive cache and ideep's, each (the libraries' default: 1,024)


def limit_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap the two caches of compiled matrix kernels oneDNN keeps on CPU (its primitive cache,
    `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, and ideep's, `LRU_CACHE_CAPACITY`), unless the environment sets
    them. Each keeps a kernel per matrix shape run, about a quarter MiB each whatever the model, and a
    server runs a new shape for every new token count (each prompt length, each verify width): at their
    default of 1,024 entries they grew the built-in model's RSS by ~470 MiB and a 30-second soak's by
    ~250 MiB, beyond the memory parts. At 128 the growth stays under ~60 MiB; least recently used
    shapes go first, so the decode widths a busy batch keeps running stay cached, and a shape compiled
    again costs ~0.6 ms. Both libraries read the variables when first used: call it before the first
    forward. Returns what it set."""
    applied = {}
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if name not in os.environ:
            os.environ[name] = applied[name] = str(entries)
    return applied


class HeapTrimmer:
    """Gives the C heap's free pages back to the kernel (glibc `malloc_trim`), so a burst's temporary
    buffers (activations, logits, prefill caches) do not stay in the RSS once the server is idle.
    A no-op where the C library has no `malloc_trim` (musl, macOS)."""

    def __init__(self) -> None:
        self._trim = _libc_function("malloc_trim")

    def __call__(self) -> None:
        if self._trim is not None:
            self._trim(0)


_MADV_DONTNEED = 4  # Linux


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's memory mapped from files (/proc/self/maps; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):  # a path: file-backed (not [heap], [anon...])
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def drop_file_pages(tensors: list[torch.Tensor]) -> int:
    """Tell the kernel that the pages of these CPU tensors that are mapped from a file (weights read
    zero-copy from a safetensors file) will not be read again, so they leave the RSS now rather than
    when memory runs short. Only whole pages inside a tensor and inside a file mapping: such a page
    read again later is read back from the file as the file has it (anonymous memory is left alone:
    there the same call would zero it), so give only tensors nothing reads any more. Returns the bytes
    the advice covered."""
    spans = _file_mappings()
    madvise = _libc_function("madvise") if spans else None
    if madvise is None:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    covered = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        for lo, hi in spans:
            a, b = max(start, lo), min(end, hi)
            a, b = -(-a // page) * page, b // page * page
            if b > a and madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED) == 0:
                covered += b - a
    return covered


def tensor_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views and shared weights are
    not counted again; `seen` carries what earlier calls counted). oneDNN's reordered weights (opaque
    tensors without a storage) count their elements."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            key, size = (str(t.device), storage.data_ptr()), storage.nbytes()
        else:  # an opaque oneDNN tensor
            key, size = (str(t.device), id(t)), t.numel() * t.element_size()
        if size and key not in seen:
            seen.add(key)
            total += size
    return total


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def settle(trim: Callable[[], None]) -> None:
    """Collect unreachable objects (reference cycles that hold tensors) and give the freed heap back."""
    gc.collect()
    trim()


class PeakTensorBytes(TorchDispatchMode):
    """Within `with PeakTensorBytes() as peak:`, the most bytes that tensors created inside held at once
    (`peak.peak`): every operation's new storages, counted until the last tensor over each is freed.
    Views count nothing; what an operation allocates and frees inside itself (a kernel's scratch) is
    not seen. Python runs at every operation: a measuring tool for a few passes, not for every step."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's `__torch_dispatch__` in dynamo's "disable" unless this says no; the wrapper imports
        # torch._dynamo (and with it sympy and torch.distributed: ~100 MiB resident) at its first call. Nothing
        # compiles under this mode (it measures a few eager passes at start-up), so there is nothing to disable.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [tensors alive over it, its bytes]

    def _freed(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None or (key in inputs and key not in self._refs):  # a view or an in-place result
                continue
            ref = self._refs.get(key)
            if ref is None:
                ref = self._refs[key] = [0, _nbytes(t)]
                self.live += ref[1]
            ref[0] += 1
            weakref.finalize(t, self._freed, key)
        self.peak = max(self.peak, self.live)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
    if t.layout != torch.strided:
        return id(t)
    pointer = t.untyped_storage().data_ptr()
    return pointer or None


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() if t.layout == torch.strided else t.numel() * t.element_size()

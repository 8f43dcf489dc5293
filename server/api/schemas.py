"""Request bodies of the OpenAI API, as pydantic models that refuse what they don't implement (their shared
field policy: body_policy.py; docs/api.md lists every field)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from server.api.body_policy import _Body
from server.api.chat_schemas import ChatMessage, NamedToolChoice, ToolDefinition
from server.request_log import capped
from server.speculation.registry import BUILTIN


class SpeculationOptions(_Body):
    """Extension: how this request is speculated. Unset fields take the server's defaults."""

    method: str | None = Field(
        default=None,
        description="none (plain decoding), a proposer (" + ", ".join(BUILTIN.proposers) + "), or auto (the "
        "engine picks the proposer and K each step from measured acceptance and cost); a method this server "
        "cannot run is a 400",
        json_schema_extra={"examples": list(BUILTIN.methods)},
    )
    num_tokens: int | None = Field(
        default=None, ge=1, le=32, description="draft tokens per step (K); the most auto may use"
    )
    include_tokens: bool | None = Field(
        default=None,
        description="add `speculation` to each choice: every token's origin (accepted/recovered/bonus/plain), "
        "proposer and step (in a stream, per chunk)",
    )


class StreamOptions(_Body):
    _inert: ClassVar[frozenset[str]] = frozenset({"include_obfuscation"})  # OpenAI's chunk padding: never sent

    include_usage: bool | None = Field(default=None, description="send a final chunk with `usage`")
    include_speculation: bool | None = Field(
        default=None, description="extension: each content chunk's choice carries its tokens' origins (`speculation`)"
    )
    continuous_usage_stats: bool | None = Field(
        default=None, description="extension (vLLM): every chunk carries `usage` so far"
    )


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`: the schema the reply must follow (enforced, strict or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """text (free), json_object (any JSON object) or json_schema: decoded under a grammar
    (server/api/structured.py), lossless under speculation."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_structural_tag(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "structural_tag":
            raise ValueError("type structural_tag (vLLM's) is not implemented: send json_schema, json_object or text")
        return data

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only for type json_schema, not {self.type}")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (its newer spelling of the `guided_*` fields): at most one constraint."""

    _inert: ClassVar[frozenset[str]] = frozenset({"disable_fallback", "disable_any_whitespace", "backend"})
    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {
        "whitespace_pattern": (),
        "disable_additional_properties": (False,),
        "structural_tag": (),
    }

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    regex: str | None = Field(default=None, min_length=1, description="a regular expression")
    choice: list[str] | None = Field(default=None, min_length=1, description="the reply is one of these")
    grammar: str | None = Field(default=None, min_length=1, description="a grammar (GBNF or Lark)")
    json_object: bool | None = Field(default=None, description="true: any JSON object")

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        named = (("json", self.json_), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
        given = [name for name, value in named if value is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both shape the output; send one")
        return self


class _GenerationBody(_Body):
    """Fields common to chat and text completions."""

    _inert: ClassVar[frozenset[str]] = frozenset({
        "length_penalty",  # shapes beam search only, which is not served (vLLM ignores it without beam search)
        "guided_decoding_backend",  # one backend here (llguidance); the constraint means the same in any
    })
    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {
        "use_beam_search": (False,),
        "prompt_logprobs": (),
        "allowed_token_ids": (),
        "bad_words": ([],),
        "logits_processors": ([],),
        "structural_tag": (),
        "guided_whitespace_pattern": (),
        "kv_transfer_params": (),
        "vllm_xargs": ({},),
        "best_of": (1,),
    }

    model: str = Field(description="the served model id (see GET /v1/models)")
    max_tokens: int | None = Field(default=None, ge=1, description="most tokens to generate per choice")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: float | None = Field(default=None, ge=0, le=1, description="nucleus; 0 = greedy")
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1, description="extension: 0 or -1 disables")
    min_p: float | None = Field(default=None, ge=0, le=1, description="extension: 0 disables")
    repetition_penalty: float | None = Field(default=None, gt=0, description="extension: 1 disables")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100]")
    seed: int | None = Field(  # bounded so seed + i fits the 64-bit generator for every choice
        default=None, ge=-(2**63), le=2**63 - 17,
        description="reproducible sampling; choice i uses seed + i; a negative seed means unseeded",
    )
    stop: str | list[str] | None = Field(default=None, description="up to 4 stop strings")
    n: int | None = Field(default=None, ge=1, le=16, description="choices to generate")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: str | None = Field(default=None, description="end-user id; recorded in the request log")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="extension (vLLM): prompts reuse the prefix cache, and speculation drafts from earlier "
        "requests' outputs, only of requests with the same salt, so tenants with different salts cannot learn "
        "from each other's prompts or answers (not even through timing); unsalted requests share one pool",
    )
    speculation: SpeculationOptions | None = Field(default=None, description="extension: per-request speculation")
    # vLLM's extensions (load tools and many clients send them).
    ignore_eos: bool | None = Field(default=None, description="extension: keep generating past EOS")
    min_tokens: int | None = Field(default=None, ge=0, description="extension: no EOS/stop token before this many")
    stop_token_ids: list[int] | None = Field(default=None, description="extension: token ids that end the choice")
    include_stop_str_in_output: bool | None = Field(default=None, description="extension: keep the stop text")
    skip_special_tokens: bool | None = Field(default=None, description="extension: default true")
    spaces_between_special_tokens: bool | None = Field(default=None, description="extension: default true")
    return_tokens_as_token_ids: bool | None = Field(
        default=None, description="extension: logprobs name tokens 'token_id:<id>'"
    )
    # Structured output (server/api/structured.py): at most one of these.
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema (enforced by constrained decoding)"
    )
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension (vLLM): a JSON schema")
    guided_regex: str | None = Field(default=None, min_length=1, description="extension (vLLM): a regex")
    guided_choice: list[str] | None = Field(
        default=None, min_length=1, description="extension (vLLM): the reply is one of these strings"
    )
    guided_grammar: str | None = Field(
        default=None, min_length=1, description="extension (vLLM): a context-free grammar (GBNF or Lark)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="extension (vLLM): json, regex, choice, grammar or json_object (one)"
    )
    # vLLM's request fields beyond sampling.
    priority: int | None = Field(
        default=None, ge=-(2**63), le=2**63 - 1,
        description="extension (vLLM): waiting requests are admitted lowest first (default 0); a running request "
        "is never preempted",
    )
    request_id: str | None = Field(
        default=None, min_length=1, max_length=256, pattern=r"^[!-~]+$",
        description="extension (vLLM): names the request: the response id (`chatcmpl-<id>`, `cmpl-<id>`) and its "
        "log line; printable ASCII without spaces",
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1,
        description="extension (vLLM): keep only the prompt's last N tokens (-1: the context length)",
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="extension (vLLM): add the tokenizer's special tokens (BOS) when tokenizing the prompt; default "
        "false on chat (the template writes its own), true on completions",
    )
    return_token_ids: bool | None = Field(
        default=None, description="extension (vLLM): the prompt's and each choice's token ids in the answer"
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit()):  # str.isdigit alone takes "²" and "١", int() not all
                raise ValueError(f"keys must be token ids (decimal digits), got {capped(key, 40)!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {capped(key, 40)} must be in [-100, 100], got {bias}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _no_empty_prompt(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("0 would leave no prompt: send N >= 1, or -1 for the context length")
        return v

    @model_validator(mode="after")
    def _one_output_format(self) -> _GenerationBody:
        fields = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
        given = [f for f in fields if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} both shape the output; send one")
        return self

    @model_validator(mode="after")
    def _check_stream_options(self) -> _GenerationBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


TEMPLATE_CALL_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    _inert: ClassVar[frozenset[str]] = _GenerationBody._inert | {
        "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
        "include_reasoning",  # no reasoning parser: there is no reasoning_content to include or leave out
    }
    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerationBody._neutral,
        "chat_template": (),
        "mm_processor_kwargs": ({},),
        "functions": ([],),
        "function_call": ("none", "auto"),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="same as max_tokens")
    logprobs: bool | None = Field(default=None, description="return the chosen tokens' logprobs")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="alternatives per position")
    tools: list[ToolDefinition] | None = Field(default=None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None,
        description="none, auto (default with tools), required (one or more calls), or a named function; "
        "required and named calls are enforced by constrained decoding",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call per reply")
    # vLLM's chat extensions: how the chat template renders the prompt, and echo.
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="extension (vLLM): keyword arguments the chat template reads (`{\"enable_thinking\": false}` "
        "for Qwen3's); keys the template does not use change nothing",
    )
    add_generation_prompt: bool | None = Field(
        default=None, description="extension (vLLM): end the prompt with the assistant prefix (default true)"
    )
    continue_final_message: bool | None = Field(
        default=None,
        description="extension (vLLM): the reply continues the final message (a prefill of the answer) instead of "
        "starting a new one; then add_generation_prompt defaults to false",
    )
    documents: list[dict[str, str]] | None = Field(
        default=None, description="extension (vLLM): documents passed to the chat template (templates with RAG)"
    )
    echo: bool | None = Field(
        default=None,
        description="extension (vLLM): the reply's content starts with the final message's when that is an "
        "assistant message (with continue_final_message: the whole answer)",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in v or {}:
            if key in TEMPLATE_CALL_PARAMETERS:
                raise ValueError(
                    f"{capped(key, 40)!r} is a parameter of the template call itself, set by the server"
                    + (" or the request's own field of that name" if key in cls.model_fields else "")
                )
        return v

    @model_validator(mode="after")
    def _generation_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the prompt ends with the assistant prefix: the field, else true unless continuing."""
        if self.add_generation_prompt is not None:
            return self.add_generation_prompt
        return not self.continue_final_message

    @field_validator("tool_choice")
    @classmethod
    def _named_choice(cls, v: Any) -> Any:
        if isinstance(v, NamedToolChoice) and not isinstance(v.function.get("name"), str):
            raise ValueError("a named tool_choice needs function.name")
        return v

    @model_validator(mode="after")
    def _choice_needs_tools(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice required or a named function needs tools")
        return self

    @property
    def active_tools(self) -> list[ToolDefinition]:
        """The tools shown to the model and parsed from its output (none with tool_choice 'none')."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self


_NONEMPTY_STR: dict[str, Any] = {"type": "string", "minLength": 1}
_INT: dict[str, Any] = {"type": "integer"}


def _list(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1}


class CompletionRequest(_GenerationBody):
    """POST /v1/completions. Each prompt (string or token ids) gets `n` choices."""

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {**_GenerationBody._neutral, "suffix": ("",),
                                                      "prompt_embeds": ()}

    prompt: Any = Field(
        description="a string, a list of strings, token ids, or a list of token id lists",
        json_schema_extra={"anyOf": [_NONEMPTY_STR, _list(_NONEMPTY_STR), _list(_INT), _list(_list(_INT))]},
    )
    logprobs: int | None = Field(default=None, ge=0, le=20, description="logprobs of the top N alternatives")
    echo: bool | None = Field(default=None, description="each choice's text starts with its prompt")

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs the prompt's logprobs, which this server does not compute")
        return self

    @field_validator("prompt")
    @classmethod
    def _normalise_prompt(cls, v: Any) -> list[str | list[int]]:
        """Always a non-empty list of prompts, each a non-empty string or a non-empty token id list."""

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            prompts: list[str | list[int]] = [v]
        elif is_ids(v) and v:
            prompts = [v]
        elif isinstance(v, list) and v and all(isinstance(p, str) or is_ids(p) for p in v):
            prompts = list(v)
        else:
            raise ValueError("must be a string, a list of strings, a list of token ids, or a list of those")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must not be empty")
        return prompts

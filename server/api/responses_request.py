"""`POST /v1/responses` request bodies (OpenAI's Responses API) and their chat-completion equivalent.

A Responses request is served as the chat completion it means (`chat_request`): `instructions` becomes a
system message, `input` (a string, or message, `function_call` and `function_call_output` items) the
messages after the stored conversation of `previous_response_id`, `max_output_tokens` `max_tokens`,
`text.format` `response_format`, function `tools` and `tool_choice` the chat ones. So the chat template,
the grammar path (structured output, forced tool calls), sampling, speculation and every check are the
chat route's own.

Field policy as on the other routes (schemas.py): honoured, inert (`service_tier`, `prompt_cache_key`,
`safety_identifier`, `stream_options`, ...), or refused with a 400 naming the field unless neutral
(`background: false`, `truncation: "disabled"`, `include: []`, `reasoning: null`, ...). Keys other
clients add inside input items and content parts are ignored, as inside chat messages.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from server.api.body_policy import _Body
from server.api.schemas import ChatCompletionRequest, SpeculationOptions


class ContentPart(_Body):
    """A text part of a message: `input_text` (user, system, developer), `output_text` (an earlier answer of
    the assistant, as `output` items send it back) or `refusal`. Images and files are not supported."""

    _ignore_unknown: ClassVar[bool] = True  # annotations, logprobs, cache_control, ...

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_text(self) -> ContentPart:
        if (self.refusal if self.type == "refusal" else self.text) is None:
            raise ValueError(f"a {self.type} part needs {'refusal' if self.type == 'refusal' else 'text'}")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _parts(value: Any) -> Any:
    """Text given as a string is one text part (so errors name the part at fault, not a union branch)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _joined(content: list[ContentPart]) -> str:
    return "".join(p.value for p in content)


def _or_string(schema: dict[str, Any]) -> None:
    """The JSON schema of a list field that also takes a string (`_parts`, `ResponsesRequest._one_message`)."""
    if "anyOf" in schema:
        schema["anyOf"].insert(0, {"type": "string"})
    else:
        schema["anyOf"] = [{"type": "string"}, {"type": "array", "items": schema.pop("items")}]
        schema.pop("type")


class InputItem(_Body):
    """One `input` item: a message (`{"role", "content"}`, `type: "message"` optional; an earlier output
    message sent back included), a `function_call` the model made earlier, or a `function_call_output`
    (a call's result). One model for the three, so a bad item's error names its own field."""

    _ignore_unknown: ClassVar[bool] = True  # status, phase, ...
    _needs: ClassVar[dict[str, tuple[str, ...]]] = {
        "message": ("role", "content"),
        "function_call": ("call_id", "name", "arguments"),
        "function_call_output": ("call_id", "output"),
    }

    type: Literal["message", "function_call", "function_call_output"] = Field(
        default="message", description="reasoning, image and hosted-tool items are not supported"
    )
    id: str | None = Field(default=None, description="the item's id (GET .../input_items lists it so)")
    role: Literal["user", "assistant", "system", "developer"] | None = Field(default=None, description="message")
    content: list[ContentPart] | None = Field(
        default=None, description="message: a string, or text parts", json_schema_extra=_or_string
    )
    call_id: str | None = Field(default=None, min_length=1, description="function_call, function_call_output")
    name: str | None = Field(default=None, min_length=1, description="function_call")
    arguments: str | None = Field(default=None, description="function_call: the arguments as JSON text")
    output: list[ContentPart] | None = Field(
        default=None, description="function_call_output: a string, or text parts", json_schema_extra=_or_string
    )

    _text = field_validator("content", "output", mode="before")(_parts)

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        missing = [f for f in self._needs[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self


class FunctionTool(_Body):
    """A function the model may call (the only tool type served: no hosted tools)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = Field(default=None, description="true: calls of it follow `parameters` exactly")


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`text.format`: free text, any JSON object, or JSON that follows `schema` (constrained decoding)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        if self.type != "json_schema" and self.schema_ is not None:
            raise ValueError(f"schema is only for type json_schema, not {self.type}")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat completion's `response_format`."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(_Body):
    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {"verbosity": ("medium",)}

    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    _inert: ClassVar[frozenset[str]] = frozenset(
        {"service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "stream_options"}
    )
    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {
        "background": (False,),
        "truncation": ("disabled",),
        "include": ([],),
        "reasoning": ({},),
        "top_logprobs": (0,),
        "max_tool_calls": (),
        "conversation": (),
        "prompt": (),
        "context_management": ([],),
    }

    model: str = Field(description="the served model id (see GET /v1/models)")
    input: list[InputItem] = Field(
        description="a user message, or message and function call items", json_schema_extra=_or_string
    )
    instructions: str | None = Field(default=None, description="a system message first (not carried over)")
    previous_response_id: str | None = Field(
        default=None, description="continue a stored response: its input and output come before this input"
    )
    store: bool | None = Field(default=None, description="false: not stored (no previous_response_id, no GET)")
    stream: bool | None = False
    max_output_tokens: int | None = Field(default=None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: float | None = Field(default=None, ge=0, le=1, description="nucleus; 0 = greedy")
    tools: list[FunctionTool] | None = Field(default=None, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        default=None, description="none, auto (default with tools), required, or a named function"
    )
    parallel_tool_calls: bool | None = Field(default=None, description="false: at most one call")
    text: TextConfig | None = Field(default=None, description="`format`: text, json_object or json_schema")
    metadata: dict[str, str] | None = Field(default=None, description="echoed on the response")
    user: str | None = Field(default=None, description="end-user id; recorded in the request log")
    # The chat routes' extensions that make sense here.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 17, description="extension: reproducible")
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1, description="extension: 0 or -1 disables")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description="extension (vLLM)")
    speculation: SpeculationOptions | None = Field(default=None, description="extension: per-request speculation")

    @field_validator("input", mode="before")
    @classmethod
    def _one_message(cls, value: Any) -> Any:
        """A string is one user message."""
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _choice_needs_tools(self) -> ResponsesRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice required or a named function needs tools")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages (without `instructions`): calls written into the assistant turn before
    them (one turn for an answer's text and its calls), results as `tool` messages."""
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if item.type == "message":
            messages.append({"role": item.role, "content": _joined(item.content or [])})
        elif item.type == "function_call":
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output or [])})
    return messages


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_item_objects(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as OpenAI's input item objects (what `GET /v1/responses/{id}/input_items` lists), in order: each
    with its own id, or a new one (`msg_...`, `fc_...`, `fco_...`)."""
    out: list[dict[str, Any]] = []
    for item in body.input:
        entry: dict[str, Any] = {"id": item.id or f"{_ITEM_PREFIX[item.type]}_{uuid.uuid4().hex}", "type": item.type}
        if item.type == "message":
            entry.update(role=item.role, status="completed", content=[_part_object(p) for p in item.content or []])
        elif item.type == "function_call":
            entry.update(status="completed", call_id=item.call_id, name=item.name, arguments=item.arguments)
        else:
            entry.update(status="completed", call_id=item.call_id, output=_joined(item.output or []))
        out.append(entry)
    return out


def _part_object(part: ContentPart) -> dict[str, Any]:
    if part.type == "refusal":
        return {"type": "refusal", "refusal": part.value}
    if part.type == "output_text":
        return {"type": "output_text", "text": part.value, "annotations": []}
    return {"type": "input_text", "text": part.value}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion `body` means, after `history` (the messages of `previous_response_id`'s
    conversation). Validated as a chat request, so it is checked exactly as one."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += history + input_messages(body)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "user": body.user,
        "seed": body.seed,
        "top_k": body.top_k,
        "cache_salt": body.cache_salt,
        "speculation": body.speculation.model_dump(exclude_none=True) if body.speculation else None,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in body.tools
        ]
    choice = body.tool_choice
    fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if isinstance(
        choice, NamedFunction) else choice
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = body.text.format.response_format()
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as a Response object repeats them."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    choice = body.tool_choice or "auto"
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": json.loads(fmt.model_dump_json(by_alias=True, exclude_none=True)) if fmt else {
            "type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "metadata": body.metadata or {},
    }

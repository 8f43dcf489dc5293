"""A chat request's messages and tools as pydantic models (schemas.py's `ChatCompletionRequest` holds them): message
content as text or parts, tool calls in history, function tools and a named tool choice."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from server.api.body_policy import _Body


def _text(v: str | list[dict[str, Any]] | None) -> str | None:
    """Message content as one string: a string, or the concatenated `{"type": "text"}` parts."""
    if v is None or isinstance(v, str):
        return v
    texts = []
    for i, part in enumerate(v):  # other keys of a text part (`cache_control`, ...) are ignored, as vLLM does
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i}: only {{'type': 'text', 'text': str}} parts are supported")
        texts.append(part["text"])
    return "".join(texts)


class FunctionCall(_Body):
    _ignore_unknown: ClassVar[bool] = True

    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class MessageToolCall(_Body):
    """An assistant's earlier tool call, sent back in the history."""

    _ignore_unknown: ClassVar[bool] = True

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One chat turn. `content`: a string or a list of `{"type": "text", "text": ...}` parts.

    Roles: system, developer (= system), user, assistant (content may be null when it has
    `tool_calls`), tool (`tool_call_id` names the call it answers), function (legacy: `name`).
    `name` is passed to the chat template (most templates ignore it). `refusal`, `audio`,
    `function_call` and `annotations` are accepted as null/empty, as `model_dump()` of an SDK
    message sends them; any other value of theirs is refused (they would change what the model sees).
    Other keys are ignored: clients add their own (litellm's `provider_specific_fields`)."""

    _ignore_unknown: ClassVar[bool] = True

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {
        "refusal": (),
        "audio": (),
        "function_call": (),
        "annotations": ([],),
    }

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]] | None) -> str | None:
        return _text(v)

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (null only for an assistant's tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs name")
        return self


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of the arguments")
    strict: bool | None = Field(
        default=None, description="true: calls of it (at the start of a reply) follow `parameters` exactly"
    )


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: dict[str, Any]


# Parameters of `apply_chat_template` itself: the server sets them (or the request's field of that name does),
# so `chat_template_kwargs` may not (vLLM drops or refuses them as well).

"""The Responses API's answers (`POST /v1/responses`, its SSE events, `DELETE`), as pydantic models for
the OpenAPI document only: `responses_output.py` builds the real objects; the schemathesis test keeps
the two equal (see response_schemas.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from server.api.response_schemas import SpeculationUsage, _Doc

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(description="always empty")
    logprobs: list[Any] = Field(description="always empty")


class OutputMessage(_Doc):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(_Doc):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    arguments: str = Field(description="the arguments as JSON text")
    call_id: str = Field(description="what a function_call_output item answers")
    name: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(_Doc):
    cached_tokens: int


class OutputTokensDetails(_Doc):
    reasoning_tokens: int


class ResponsesUsage(_Doc):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    speculation: SpeculationUsage


class IncompleteDetails(_Doc):
    reason: Literal["max_output_tokens"]


class Reasoning(_Doc):
    effort: None
    summary: None


class ResponseObject(_Doc):
    """A response of `POST /v1/responses` (and `GET /v1/responses/{id}`); the request's settings repeated."""

    id: str
    object: Literal["response"]
    created_at: int
    status: ItemStatus
    background: Literal[False]
    error: None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning
    service_tier: str
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponsesUsage | None = Field(description="null while in progress")
    user: str | None
    metadata: dict[str, str]


class ResponseLifecycleEvent(_Doc):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject
    sequence_number: int


class OutputItemEvent(_Doc):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem
    sequence_number: int


class ContentPartEvent(_Doc):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class TextDeltaEvent(_Doc):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]
    sequence_number: int


class TextDoneEvent(_Doc):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]
    sequence_number: int


class ArgumentsDeltaEvent(_Doc):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class ArgumentsDoneEvent(_Doc):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str
    sequence_number: int


class ErrorEvent(_Doc):
    """A failure after the stream started (the stream ends after it)."""

    type: Literal["error"]
    code: str
    message: str
    param: str | None
    sequence_number: int


class ResponseStreamEvent(_Doc):
    """One event of a Responses stream (`stream: true`): `event:` names its type, `data:` is the event."""

    event: (
        ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
        | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent
    )


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputTextPart(_Doc):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(default=None, description="output_text: always empty")


class InputRefusalPart(_Doc):
    type: Literal["refusal"]
    refusal: str


class InputMessageItem(_Doc):
    id: str = Field(description="the id the item was sent with, else one given when it was stored")
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    status: Literal["completed"]
    content: list[InputTextPart | InputRefusalPart]


class InputFunctionCallItem(_Doc):
    id: str
    type: Literal["function_call"]
    status: Literal["completed"]
    call_id: str
    name: str
    arguments: str


class InputFunctionCallOutputItem(_Doc):
    id: str
    type: Literal["function_call_output"]
    status: Literal["completed"]
    call_id: str
    output: str


class InputItemList(_Doc):
    """`GET /v1/responses/{id}/input_items`: a page of the response's `input` items."""

    object: Literal["list"]
    data: list[InputMessageItem | InputFunctionCallItem | InputFunctionCallOutputItem]
    first_id: str | None = Field(description="the page's first item (null when empty)")
    last_id: str | None = Field(description="the page's last item: `after` for the next page")
    has_more: bool


DOCUMENTED = (ResponseObject, ResponseStreamEvent, ResponseDeleted, InputItemList)

"""vLLM's tokenizer routes, with vLLM's request and response shapes: `POST /tokenize` and `POST /detokenize`.

Tools count tokens with them the way the server will (a chat's messages and tools through the chat
template, or a prompt as `/v1/completions` tokenizes it), and read the context length from the answer:

    POST /tokenize {"prompt": "Hello"}                        -> {"count": 2, "max_model_len": 8192,
                                                                   "tokens": [19556, 28], "token_strs": null}
    POST /tokenize {"messages": [...], "tools": [...]}        -> the ids a chat request of them starts from
    POST /detokenize {"tokens": [19556, 28]}                  -> {"prompt": "Hello"}

`model` is optional (when given it must be the served model). Messages render as on the chat route, with its
`chat_template_kwargs`, `continue_final_message` and `documents`; the chat template itself cannot be replaced
(`chat_template` is accepted only null). A text far beyond the context is refused from its first part
(`prompts.encode`), as on the generation routes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from server.api.body_policy import _Body
from server.api.chat_schemas import ChatMessage, ToolDefinition
from server.api.errors import bad_request
from server.api.prompts import ChatTemplateCall, ModelInfo, check_model, encode, render_chat
from server.api.schemas import TEMPLATE_CALL_PARAMETERS


class TokenizeRequest(_Body):
    """A prompt (as `/v1/completions` reads a string prompt) or chat messages (as `/v1/chat/completions`
    renders them), one of the two."""

    _neutral: ClassVar[dict[str, tuple[Any, ...]]] = {"chat_template": (), "mm_processor_kwargs": ({},)}

    model: str | None = Field(default=None, description="the served model id, if given")
    prompt: str | None = Field(default=None, description="text to tokenize as a completion prompt")
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, description="chat messages to render")
    tools: list[ToolDefinition] | None = Field(default=None, description="with messages: tools shown to the model")
    add_generation_prompt: bool | None = Field(
        default=None, description="with messages: end with the assistant prefix a reply starts from (default true)"
    )
    add_special_tokens: bool | None = Field(
        default=None, description="add the tokenizer's special tokens (BOS); default true for a prompt, false for "
        "messages (the template writes its own)"
    )
    return_token_strs: bool | None = Field(default=None, description="also return each token's string")
    continue_final_message: bool | None = Field(
        default=None, description="with messages: end inside the final message (then add_generation_prompt "
        "defaults to false)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="with messages: keyword arguments the chat template reads"
    )
    documents: list[dict[str, str]] | None = Field(default=None, description="with messages: documents (RAG)")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        chat_only = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents")
        if self.prompt is not None and any(getattr(self, f) is not None for f in chat_only):
            raise ValueError(f"{', '.join(chat_only)} go with messages, not prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        bad = [k for k in self.chat_template_kwargs or {} if k in TEMPLATE_CALL_PARAMETERS]
        if bad:
            raise ValueError(f"chat_template_kwargs: {bad[0]!r} is a parameter of the template call itself")
        return self

    def template(self) -> ChatTemplateCall:
        """How the chat template renders `messages` (the chat route's defaults)."""
        generation = self.add_generation_prompt
        return ChatTemplateCall(
            add_generation_prompt=not self.continue_final_message if generation is None else generation,
            continue_final_message=bool(self.continue_final_message),
            kwargs=dict(self.chat_template_kwargs or {}),
            documents=self.documents,
            add_special_tokens=bool(self.add_special_tokens),
        )


class DetokenizeRequest(_Body):
    model: str | None = Field(default=None, description="the served model id, if given")
    tokens: list[int] = Field(description="token ids to turn back into text")


def tokenize(info: ModelInfo, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's `TokenizeResponse`: `count`, `max_model_len`, `tokens`, `token_strs` (null unless asked)."""
    if body.model is not None:
        check_model(info, body.model)
    tok = info.tokenizer
    if body.messages is not None:
        ids = render_chat(info, body.messages, list(body.tools or []), True, body.template())
    else:
        ids = encode(info, body.prompt or "", "prompt", add_special_tokens=body.add_special_tokens is not False)
    return {
        "count": len(ids),
        "max_model_len": info.limits.max_context,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


def detokenize(info: ModelInfo, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's `DetokenizeResponse`: `{"prompt": text}` (special tokens written out)."""
    if body.model is not None:
        check_model(info, body.model)
    vocab = len(info.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": info.tokenizer.decode(body.tokens)}

"""OpenAI chat messages (and tools) -> the prompt text of the model's chat template.

Templates that know about tools (their source mentions `tools`: Qwen 2.5/3, Llama 3.1+, Hermes,
Mistral, ...) get them through transformers' `apply_chat_template(tools=...)`, with the history's
assistant `tool_calls` (arguments as objects, as those templates expect) and `tool` messages as they
are. A template without tool support (SmolLM2's, for one) gets the documented fallback:

* the tools are described in a system message (prepended to the first system message if there is
  one) that asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format
  `server/api/tool_calls.py` parses;
* an assistant turn's `tool_calls` are written into its content in that same format;
* a `tool`/`function` result becomes a user turn `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

from server.api import client_json
from server.api.body_policy import lone_surrogate_in_json
from server.api.chat_schemas import ChatMessage, ToolDefinition
from server.api.errors import bad_request
from server.api.tool_calls import CLOSE, OPEN

FALLBACK_INTRO = (
    "You can call functions to help you answer. They are described below as JSON schemas inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a block like this for each call, and nothing else in it:\n"
    f'{OPEN}\n{{{{"name": "<function name>", "arguments": {{{{<arguments as a JSON object>}}}}}}}}\n{CLOSE}\n'
    "The result of each call comes back in a <tool_response></tool_response> block."
)
SINGLE_CALL = "\nCall at most one function per reply."


def tool_call_format(tokenizer: Any) -> str:
    """How this model writes a tool call: "tagged" (`<tool_call>` blocks: Hermes, Qwen and our fallback)
    or "bare" (a JSON object: templates with tool support that never mention `<tool_call>`, Llama 3.x)."""
    return "bare" if supports_tools(tokenizer) and OPEN not in str(tokenizer.chat_template) else "tagged"


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or a dedicated tool_use one
        return "tool_use" in template or "tools" in str(template.get("default", ""))
    return isinstance(template, str) and "tools" in template


def _arguments(text: str, param: str) -> Any:
    """A call's arguments as an object when they are JSON (what tool-aware templates expect), else the
    text; a 400 naming `param` for JSON past what the server reads or holding half a character."""
    try:
        value = client_json.loads(text)
    except client_json.JSONLimitError as exc:
        raise bad_request(f"{param}: {exc.message}", param) from exc
    except ValueError:
        return text
    problem = lone_surrogate_in_json(value)
    if problem is not None:
        raise bad_request(f"{param}: {problem}", param)
    return value


def _calls(m: ChatMessage, i: int) -> list[tuple[Any, Any]]:
    """(the call, its arguments as `_arguments` reads them) for each of message `i`'s tool calls."""
    return [
        (c, _arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"))
        for j, c in enumerate(m.tool_calls or ())
    ]


def _native(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message as tool-aware templates (and plain ones) read it."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
    if m.role == "function":  # legacy function results are tool results
        out["role"] = "tool"
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
            for c, args in _calls(m, i)
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _fallback(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message for a template that knows nothing of tools: calls and results become text."""
    if m.role in ("tool", "function"):
        return {"role": "user", "content": f"<tool_response>\n{m.content or ''}\n</tool_response>"}
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        blocks = [
            f"{OPEN}\n{json.dumps({'name': c.function.name, 'arguments': args})}\n{CLOSE}" for c, args in _calls(m, i)
        ]
        out["content"] = "\n".join([out["content"], *blocks] if out["content"] else blocks)
    return out


def render_messages(
    tokenizer: Any, messages: list[ChatMessage], tools: list[ToolDefinition], parallel_tool_calls: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to pass to `apply_chat_template`; tools is None when the fallback inlined them."""
    tool_history = any(m.tool_calls or m.role in ("tool", "function") for m in messages)
    if supports_tools(tokenizer) or not (tools or tool_history):
        specs = [t.model_dump(exclude_none=True) for t in tools] or None
        return [_native(m, i) for i, m in enumerate(messages)], specs
    rendered = [_fallback(m, i) for i, m in enumerate(messages)]
    if tools:
        described = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
        intro = FALLBACK_INTRO.format(tools=described) + ("" if parallel_tool_calls else SINGLE_CALL)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{intro}\n\n{rendered[0]['content']}"}
        else:
            rendered.insert(0, {"role": "system", "content": intro})
    return rendered, None

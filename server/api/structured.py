"""What a request's output must look like -> the grammar the engine decodes it under (llguidance).

Sources, per request body:
* `response_format`: `json_object` (any JSON object) or `json_schema` (the schema; enforced whether
  or not `strict` is set), on chat and, as vLLM does, on text completions;
* vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (GBNF, as vLLM's xgrammar reads
  it, or Lark, as its llguidance backend does) and their newer spelling `structured_outputs` (`json`, `regex`,
  `choice`, `grammar`, `json_object`);
* tools (chat): `tool_choice` `required` or a named function makes the reply one or more tool calls
  (one with `parallel_tool_calls: false` or a named function) whose arguments match the function's
  schema; with `tool_choice` `auto`, functions marked `strict` or a `response_format` make the grammar
  "calls or a reply": a reply that opens like a call is calls whose arguments match (strict
  functions) or are any JSON object; any other reply is what the response format asks for, or free
  text (a call written after some text is still parsed, but not enforced: llguidance's lexer is
  greedy, so "text, then calls" cannot be one grammar without forbidding `<` in the text).

Tool calls are written in the model's own format (server/api/tool_calls.py parses both): tagged
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks (Hermes, Qwen, our fallback
prompt), or a bare `{"name": ..., "parameters": ...}` object (Llama 3.x templates).

JSON is generated compactly as Python's json.dumps writes it (`", "`, `": "`, no newlines): a small
model cannot then loop on whitespace, and the separators are forced tokens that the engine drafts for
free. A schema llguidance cannot compile is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import llguidance
import llguidance.gbnf_to_lark

from server.api import client_json
from server.api.body_policy import lone_surrogate_in_json
from server.api.chat_schemas import NamedToolChoice, ToolDefinition
from server.api.errors import bad_request
from server.api.schemas import ChatCompletionRequest, _GenerationBody
from server.api.tool_calls import CLOSE, OPEN

ToolFormat = Literal["tagged", "bare"]
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def request_grammar(body: _GenerationBody, tool_format: ToolFormat = "tagged") -> str | None:
    """The grammar `body`'s output must follow, or None for free text. Raises a 400 for a schema,
    regex or choice list that cannot be compiled, naming its field."""
    grammar, param = _grammar_text(body)
    calls = _tool_rule(body, tool_format) if isinstance(body, ChatCompletionRequest) else None
    if grammar is not None:  # a whole grammar of its own: it cannot be one rule beside the tool calls
        if calls is not None:
            raise bad_request(f"{param} and tools with tool_choice {_choice_name(body)} or strict functions both "
                              "shape the output; send one", param)
        try:
            lark = llguidance.gbnf_to_lark.any_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001 - the converter raises what its parser meets
            raise bad_request(f"{param}: not a GBNF or Lark grammar this server can read: {exc}", param) from exc
        return _from_lark(lark, param)
    content, param = _content_rule(body)
    if calls is None:
        if content is None:
            return None
        return _from_lark(f"start: {content}", param)
    rule, forced = calls
    if forced:
        return _from_lark(f"start: {rule}", "tool_choice")
    opener = "<" if tool_format == "tagged" else "{"
    reply = content or f"/([^{opener}][\\s\\S]*)?/"  # free text that does not open like a call
    return _from_lark(f"start: {rule} | {reply}", "tools")


def _grammar_text(body: _GenerationBody) -> tuple[str | None, str]:
    """(vLLM's grammar text, the field it came from), or (None, "")."""
    if body.guided_grammar is not None:
        return body.guided_grammar, "guided_grammar"
    so = body.structured_outputs
    if so is not None and so.grammar is not None:
        return so.grammar, "structured_outputs.grammar"
    return None, ""


def _choice_name(body: _GenerationBody) -> str:
    choice = body.tool_choice if isinstance(body, ChatCompletionRequest) else None
    return choice if isinstance(choice, str) else "naming a function" if choice is not None else "auto"


def _content_rule(body: _GenerationBody) -> tuple[str | None, str]:
    """(lark rule for the reply's content, the field it came from); None: free text."""
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, dict) else _parse_json(so.json_, "structured_outputs.json")
            return _json(schema, "structured_outputs.json"), "structured_outputs.json"
        if so.regex is not None:
            return f"/{_lark_regex(so.regex)}/", "structured_outputs.regex"
        if so.choice is not None:
            return " | ".join(json.dumps(c) for c in so.choice), "structured_outputs.choice"
        if so.json_object:
            return _json(ANY_OBJECT, "structured_outputs.json_object"), "structured_outputs.json_object"
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        return _json(ANY_OBJECT, "response_format"), "response_format"
    if fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        return _json(fmt.json_schema.schema_, "response_format.json_schema.schema"), "response_format"
    if body.guided_json is not None:
        given = body.guided_json
        schema = given if isinstance(given, dict) else _parse_json(given, "guided_json")
        return _json(schema, "guided_json"), "guided_json"
    if body.guided_regex is not None:
        return f"/{_lark_regex(body.guided_regex)}/", "guided_regex"
    if body.guided_choice is not None:
        return " | ".join(json.dumps(c) for c in body.guided_choice), "guided_choice"
    return None, ""


def _tool_rule(body: ChatCompletionRequest, tool_format: ToolFormat) -> tuple[str, bool] | None:
    """(lark rule for the reply's tool calls, whether calling is forced), or None when calls are free."""
    tools = body.active_tools
    if not tools:
        return None
    choice = body.tool_choice
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        tools = [t for t in tools if t.function.name == name]
        if not tools:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    strict = any(t.function.strict for t in tools)
    if not (forced or strict or body.response_format is not None):
        return None
    key = "arguments" if tool_format == "tagged" else "parameters"
    one_of = [_call_schema(t, key, enforce=forced or bool(t.function.strict)) for t in tools]
    call = _json(one_of[0] if len(one_of) == 1 else {"oneOf": one_of}, "tools")
    single = body.parallel_tool_calls is False or isinstance(choice, NamedToolChoice) or tool_format == "bare"
    if tool_format == "bare":
        return call, forced
    block = f'"{OPEN}\\n" {call} "\\n{CLOSE}"'
    return (block if single else f'{block} ("\\n" {block})*'), forced


def _call_schema(tool: ToolDefinition, key: str, enforce: bool) -> dict[str, Any]:
    """{"name": <this function>, key: its arguments} as a JSON schema; arguments follow the function's
    schema when `enforce`, else any JSON object."""
    arguments = (tool.function.parameters or ANY_OBJECT) if enforce else ANY_OBJECT
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json(schema: Any, param: str) -> str:
    """A lark rule for JSON that follows `schema`, in the compact style (checked alone, to name `param`)."""
    if not isinstance(schema, dict):
        raise bad_request("a JSON schema must be a JSON object", param)
    guidance = schema.get("x-guidance", {})
    if not isinstance(guidance, dict):
        raise bad_request(f"{param}: x-guidance must be an object of llguidance options", param)
    styled = {**schema, "x-guidance": {**guidance, **JSON_STYLE}}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(styled)
    except ValueError as exc:  # what llguidance cannot even read (validation below names the rest)
        raise bad_request(f"{param}: this server cannot decode under it: {exc}", param) from exc
    _validated(grammar, param)
    return "%json " + json.dumps(styled)


def _parse_json(text: str, param: str) -> Any:
    try:
        schema = client_json.loads(text)
    except client_json.JSONLimitError as exc:
        raise bad_request(f"{param}: {exc.message}", param) from exc
    except json.JSONDecodeError as exc:
        raise bad_request(f"{param} is not valid JSON: {exc}", param) from exc
    problem = lone_surrogate_in_json(schema)  # llguidance cannot take half a character
    if problem is not None:
        raise bad_request(f"{param}: {problem}", param)
    return schema


def _lark_regex(pattern: str) -> str:
    """`pattern` inside a lark /.../ literal (its slashes escaped)."""
    return pattern.replace("\\/", "/").replace("/", "\\/")


def _from_lark(lark: str, param: str) -> str:
    """llguidance's serialized grammar for a lark grammar, or a 400 naming `param`."""
    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), param)


def _validated(grammar: str, param: str) -> str:
    """`grammar` (llguidance's serialized form) if llguidance can build it, else a 400 naming `param`."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"{param}: this server cannot decode under it: {error}", param)
    return grammar

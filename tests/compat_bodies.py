"""Request bodies that popular clients send, written from their documented and observed shapes.

Each is what the client puts on the wire for the OpenAI-compatible "custom endpoint" case (the
served model id is passed in). SillyTavern's is taken from its source; the others are reconstructed
from documentation and observed traffic, not captured: Open WebUI 0.6-0.12 (native function calling
sends its built-in tools, ~30, with every chat; the tool set here is in its style), LibreChat (OpenAI client for custom
endpoints: `user`, penalties, title requests), SillyTavern (src/endpoints/backends/chat-completions.js,
"Custom (OpenAI-compatible)" source: top_k, logit_bias {}, seed, n, message `name`s), LangChain
(langchain-openai ChatOpenAI: bind_tools, AIMessage tool_calls and ToolMessage in the history).
"""

from __future__ import annotations

from typing import Any


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


_STR = {"type": "string"}
_INT = {"type": "integer"}

# About thirty tool definitions in Open WebUI's built-in style (web, knowledge, notes, memory, chats,
# images, code, time, ...): nested objects, enums, arrays, defaults, one with no arguments.
OPEN_WEBUI_TOOLS = [
    _tool("search_web", "Search the public web for up-to-date information.",
          {"query": {**_STR, "description": "search terms"}, "count": {**_INT, "default": 5}}, ["query"]),
    _tool("fetch_url", "Fetch a web page and return its text.", {"url": {**_STR, "format": "uri"}}, ["url"]),
    _tool("query_knowledge_bases", "Search the user's knowledge bases.",
          {"query": _STR, "knowledge_ids": {"type": "array", "items": _STR}}, ["query"]),
    _tool("view_knowledge_file", "Read a file from a knowledge base.", {"file_id": _STR}, ["file_id"]),
    _tool("list_knowledge_bases", "List the user's knowledge bases.", {}, []),
    _tool("search_notes", "Search the user's notes.", {"query": _STR, "limit": {**_INT, "minimum": 1}}, ["query"]),
    _tool("view_note", "Read one note.", {"note_id": _STR}, ["note_id"]),
    _tool("create_note", "Create a note.", {"title": _STR, "content": _STR}, ["title", "content"]),
    _tool("update_note", "Replace a note's content.", {"note_id": _STR, "content": _STR}, ["note_id", "content"]),
    _tool("search_memories", "Search what the assistant remembers about the user.", {"query": _STR}, ["query"]),
    _tool("add_memory", "Remember a fact about the user.", {"content": _STR}, ["content"]),
    _tool("delete_memory", "Forget a remembered fact.", {"memory_id": _STR}, ["memory_id"]),
    _tool("search_chats", "Search the user's past chats.", {"query": _STR, "days": _INT}, ["query"]),
    _tool("view_chat", "Read a past chat.", {"chat_id": _STR}, ["chat_id"]),
    _tool("generate_image", "Create an image from a prompt.",
          {"prompt": _STR, "size": {"type": "string", "enum": ["256x256", "512x512", "1024x1024"]}}, ["prompt"]),
    _tool("edit_image", "Edit an image.", {"image_id": _STR, "instructions": _STR}, ["image_id", "instructions"]),
    _tool("execute_code", "Run Python code in a sandbox and return its output.",
          {"code": _STR, "timeout": {"type": "number", "default": 30}}, ["code"]),
    _tool("get_current_timestamp", "The current date and time.", {}, []),
    _tool("calculate", "Evaluate an arithmetic expression.", {"expression": _STR}, ["expression"]),
    _tool("convert_units", "Convert a quantity between units.",
          {"value": {"type": "number"}, "from_unit": _STR, "to_unit": _STR}, ["value", "from_unit", "to_unit"]),
    _tool("get_weather", "Current weather for a location.",
          {"location": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"]),
    _tool("translate_text", "Translate text.", {"text": _STR, "target_language": _STR}, ["text", "target_language"]),
    _tool("summarize_url", "Summarise a web page.", {"url": _STR, "max_words": _INT}, ["url"]),
    _tool("list_files", "List files the user uploaded to this chat.", {}, []),
    _tool("read_file", "Read an uploaded file.", {"file_id": _STR, "offset": _INT, "length": _INT}, ["file_id"]),
    _tool("create_calendar_event", "Add an event to the user's calendar.",
          {"title": _STR, "start": {**_STR, "format": "date-time"}, "end": {**_STR, "format": "date-time"},
           "attendees": {"type": "array", "items": {"type": "object", "properties": {"email": _STR}}}},
          ["title", "start"]),
    _tool("list_calendar_events", "Events in a date range.", {"from": _STR, "to": _STR}, ["from", "to"]),
    _tool("send_email", "Send an email on the user's behalf.",
          {"to": {"type": "array", "items": _STR}, "subject": _STR, "body": _STR}, ["to", "subject", "body"]),
    _tool("create_task", "Create a to-do item.",
          {"title": _STR, "due": _STR, "priority": {"type": "string", "enum": ["low", "normal", "high"]}}, ["title"]),
    _tool("complete_task", "Mark a to-do item done.", {"task_id": _STR}, ["task_id"]),
    _tool("get_stock_quote", "Latest price of a stock.", {"symbol": _STR}, ["symbol"]),
]


def open_webui_chat(model: str) -> dict[str, Any]:
    """Open WebUI's default chat (native function calling): streamed, usage asked, all tools sent."""
    return {
        "stream": True,
        "model": model,
        "messages": [
            {"role": "system", "content": "User Context:\n1. The user prefers short answers.\n"},
            {"role": "user", "content": "What's the weather like in Paris today?"},
        ],
        "stream_options": {"include_usage": True},
        "tools": OPEN_WEBUI_TOOLS,
        "max_tokens": 8,
    }


def open_webui_tool_followup(model: str) -> dict[str, Any]:
    """The next request after a tool ran: the assistant's call and the tool result in the history."""
    body = open_webui_chat(model)
    body["messages"] += [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "{\"temp_c\": 18, \"sky\": \"sunny\"}"},
    ]
    return body


def open_webui_title(model: str) -> dict[str, Any]:
    """Open WebUI's background task (title generation): not streamed, a small max_tokens."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "### Task:\nGenerate a concise, 3-5 word title for the chat.\n"
                                                 "### Chat History:\n<chat_history>\nUSER: hi\n</chat_history>"}],
        "stream": False,
        "max_tokens": 8,
        "metadata": {"task": "title_generation", "chat_id": "c1"},
    }


def librechat_chat(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "temperature": 1,
        "top_p": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "stop": ["\nUser:"],
        "user": "6650f0c2e1b1a1b2c3d4e5f6",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [{"type": "text", "text": "Tell me a joke."}]},
        ],
    }


def librechat_title(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "temperature": 0.2,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "max_tokens": 8,
        "user": "6650f0c2e1b1a1b2c3d4e5f6",
        "messages": [{"role": "system", "content": "Write a concise title for this conversation."},
                     {"role": "user", "content": "Tell me a joke."}],
    }


def sillytavern_chat(model: str) -> dict[str, Any]:
    """SillyTavern, Custom (OpenAI-compatible) source, with a group chat's message names."""
    return {
        "messages": [
            {"role": "system", "content": "Write Seraphina's next reply in a fictional chat."},
            {"role": "system", "name": "example_user", "content": "Hello there."},
            {"role": "system", "name": "example_assistant", "content": "*Seraphina smiles* Welcome."},
            {"role": "user", "content": "Where am I?", "name": "Traveler"},
        ],
        "model": model,
        "temperature": 1,
        "max_tokens": 8,
        "stream": True,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "top_p": 1,
        "top_k": 0,
        "stop": ["\nTraveler:"],
        "logit_bias": {},
        "seed": -1,
        "n": 1,
        "logprobs": False,
    }


def sillytavern_samplers(model: str) -> dict[str, Any]:
    """SillyTavern with custom body parameters (min_p, repetition_penalty) and a logit bias."""
    body = sillytavern_chat(model)
    body.update(stream=False, min_p=0.05, repetition_penalty=1.1, top_k=40, logit_bias={"1000": -5}, seed=7)
    return body


def langchain_bind_tools(model: str) -> dict[str, Any]:
    """langchain-openai ChatOpenAI(...).bind_tools([get_weather]).invoke(...), second turn."""
    return {
        "messages": [
            {"content": "You are a weather bot.", "role": "system"},
            {"content": "What's the weather in Paris?", "role": "user"},
            {"content": "", "role": "assistant", "tool_calls": [
                {"type": "function", "id": "call_lc1",
                 "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
            {"content": "18 C and sunny", "role": "tool", "tool_call_id": "call_lc1"},
        ],
        "model": model,
        "stream": False,
        "n": 1,
        "temperature": 0.7,
        "max_completion_tokens": 8,
        "tools": [OPEN_WEBUI_TOOLS[20]],
    }


def langchain_stream(model: str) -> dict[str, Any]:
    """ChatOpenAI(stream_usage=True).stream(...)."""
    return {
        "messages": [{"content": "Count to three.", "role": "user"}],
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "max_completion_tokens": 8,
    }


BODIES = {
    "open_webui_chat_with_tools": open_webui_chat,
    "open_webui_tool_followup": open_webui_tool_followup,
    "open_webui_title": open_webui_title,
    "librechat_chat": librechat_chat,
    "librechat_title": librechat_title,
    "sillytavern_chat": sillytavern_chat,
    "sillytavern_samplers": sillytavern_samplers,
    "langchain_bind_tools": langchain_bind_tools,
    "langchain_stream": langchain_stream,
}

"""What the cache-aware router reads of a request: its prompt as text, its `cache_salt`, a replica it must go to.

The ingress reads each request's JSON body once (`request_routing`) and keeps only this. The text follows the
order the model reads the prompt in (the tools, then the messages' roles and contents; a completion's prompt;
a Responses request's instructions then input), so two requests share a text prefix exactly when their prompts
start the same way: a conversation's next turn extends its previous turn's text, agents that share a system
prompt and tools share its beginning. It is a routing hint, never the prompt itself: a body the replica will
refuse (not JSON, bad fields) still gets a key (empty, or whatever could be read), and the replica answers it.

>>> key, pinned = request_routing("POST", "/v1/chat/completions",
...     b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"}')
>>> key.text, key.salt, pinned
('\\x1euser\\x1fhi', 's', None)
"""

from __future__ import annotations

import json
from typing import Any

from server.cluster.forwarding import RoutingKey

# Separators no prompt text holds in practice: a message's role from its content, one message from the next.
_FIELD, _RECORD = "\x1f", "\x1e"
# The prefix the router compares is bounded: a longer prompt is routed by its first this many characters.
MAX_KEY_CHARS = 64 * 1024
_ROUTED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def request_routing(method: str, path: str, body: bytes) -> tuple[RoutingKey, str | None]:
    """The request's `RoutingKey` (empty for routes that generate nothing), and the stored response it needs
    (`previous_response_id`, or the one `GET`/`DELETE /v1/responses/{id}` names): only the replica that stored
    it can serve the request, and the ingress pins it there."""
    if path.startswith("/v1/responses/"):  # GET or DELETE a stored response: where it is stored
        return RoutingKey(), path.removeprefix("/v1/responses/") or None
    if method != "POST" or path not in _ROUTED or not body:
        return RoutingKey(), None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return RoutingKey(), None
    if not isinstance(doc, dict):
        return RoutingKey(), None
    salt = doc.get("cache_salt")
    salt = salt if isinstance(salt, str) else ""
    if path == "/v1/completions":
        text = _text(doc.get("prompt"))
    elif path == "/v1/chat/completions":
        text = _json(doc.get("tools")) + _messages(doc.get("messages"))
    else:
        text = _json(doc.get("tools")) + _text(doc.get("instructions")) + _messages(doc.get("input"))
    previous = doc.get("previous_response_id") if path == "/v1/responses" else None
    return RoutingKey(text[:MAX_KEY_CHARS], salt), previous if isinstance(previous, str) else None


def _messages(messages: Any) -> str:
    if isinstance(messages, str):
        return _RECORD + "user" + _FIELD + messages
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(_RECORD + _text(m.get("role")) + _FIELD + _text(m.get("content"))
                         + _json(m.get("tool_calls")) + _text(m.get("output")))
    return "".join(parts)


def _text(value: Any) -> str:
    """A prompt, a content (a string or a list of parts), or a list of prompts' first: as plain text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):  # token ids
            return " ".join(map(str, value))
        if value and isinstance(value[0], (str, list)) and all(isinstance(v, (str, list)) for v in value):
            return _text(value[0])  # a batch of prompts: routed by its first
        return "".join(_text(v.get("text")) if isinstance(v, dict) else _text(v) for v in value)
    return str(value)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":")) if value else ""

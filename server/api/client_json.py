"""JSON written by clients, read within limits: request bodies, and JSON text inside string fields
(`guided_json` given as a string, an assistant turn's `tool_calls[].function.arguments`).

Python's parser fails on some valid JSON with errors that are not `JSONDecodeError`: arrays and objects
nested about 1,000 deep raise `RecursionError`, and an integer literal of more than 4,300 digits
(`sys.get_int_max_str_digits()`) a plain `ValueError`. `loads` turns both into `JSONLimitError` (a
`ValueError`), naming where in the text the limit was hit, and refuses nesting deeper than `MAX_DEPTH`
well before the parser's own limit, so that what it returns is safe to walk recursively afterwards
(validation, chat templates, `json.dumps`). Malformed JSON is still `json.JSONDecodeError`. Python's parser
also reads `NaN`, `Infinity` and `-Infinity`, which are not JSON: `loads` refuses them (`JSONLimitError`
naming where), as a number too large for a float (`1e999`), so no field is ever given a number that is
not finite.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any

from server.request_log import capped

MAX_DEPTH = 128  # levels of arrays and objects, the text's own being the first (serde_json's default limit)

_WS = re.compile(r"[ \t\n\r]*")
_PathPart = str | int
_LEAVES = frozenset({str, int, float, bool, type(None)})  # what json.loads makes besides lists and dicts


class JSONLimitError(ValueError):
    """Valid JSON past what this server reads. `path`: where in the text (a member of the top-level
    object for nesting, the full path to a long integer), "" for the text as a whole."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.message = message
        self.path = path


def too_deep_message() -> str:
    return f"JSON nested more than {MAX_DEPTH} levels deep (arrays and objects): this server reads at most {MAX_DEPTH}"


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`, or `JSONLimitError` for nesting deeper than `MAX_DEPTH` or an integer too long
    to convert; `json.JSONDecodeError` (and `UnicodeDecodeError` for bytes) as `json.loads` raises them."""
    non_finite: list[str] = []  # why: NaN, Infinity, -Infinity (never in valid JSON), or 1e999 (read as inf)

    def constant(name: str) -> _NonFinite:
        non_finite.append(f"{name} is not a JSON number")
        return _NonFinite(name)

    def number(literal: str) -> float | _NonFinite:
        value = float(literal)
        if math.isfinite(value):
            return value
        non_finite.append(f"{capped(literal)} is beyond the largest number a double holds (about 1.8e308)")
        return _NonFinite(literal)

    try:
        value = json.loads(text, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise JSONLimitError(too_deep_message(), _deep_member(text)) from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:
        if "integer string conversion" not in str(exc):  # int()'s digit limit; anything else is unexpected
            raise
        raise _long_integer(text) from None
    _check_depth(text, value)
    if non_finite:
        found = _first(value, lambda v, _: isinstance(v, _NonFinite)) or ()
        raise JSONLimitError(f"{non_finite[0]}: numbers must be finite", path_str(found))
    return value


def path_str(parts: tuple[_PathPart, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (a key past 200 characters cut)."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{capped(part)}" if out else capped(part))
    return out


def _check_depth(text: str | bytes, value: Any) -> None:
    opening = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
    if text.count(opening[0]) + text.count(opening[1]) <= MAX_DEPTH:  # cannot nest deeper: no walk
        return
    deep = _first(value, lambda node, depth: depth > MAX_DEPTH and isinstance(node, list | dict))
    if deep is not None:  # named by the top-level object's member it is in
        raise JSONLimitError(too_deep_message(), path_str(deep[:1]) if isinstance(value, dict) else "")


class _NonFinite:
    """`NaN`, `Infinity` or `-Infinity` in a text `loads` reads (to find where it is)."""

    def __init__(self, name: str) -> None:
        self.name = name


class _LongInt:
    """An integer literal too long for `int()`, as `_long_integer`'s second parse reads it."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _int_or_long(literal: str) -> int | _LongInt:
    try:
        return int(literal)
    except ValueError:
        return _LongInt(len(literal.lstrip("-")))


def _long_integer(text: str | bytes) -> JSONLimitError:
    """The error for the first integer literal in `text` too long to convert (parsed again, such
    literals read as `_LongInt`s, to find it)."""
    try:
        value = json.loads(text, parse_int=_int_or_long)
    except RecursionError:
        return JSONLimitError(too_deep_message(), _deep_member(text))
    _check_depth(text, value)
    found = _first(value, lambda v, _: isinstance(v, _LongInt))
    literal = _walk_to(value, found) if found is not None else None
    digits = f"{literal.digits} digits" if isinstance(literal, _LongInt) else "too many digits"
    limit = sys.get_int_max_str_digits()
    return JSONLimitError(
        f"an integer of {digits}: this server reads integers of at most {limit} digits", path_str(found or ())
    )


def _walk_to(value: Any, parts: tuple[_PathPart, ...]) -> Any:
    for part in parts:
        value = value[part]
    return value


def _first(value: Any, hit: Callable[[Any, int], bool]) -> tuple[_PathPart, ...] | None:
    """The path of the first array, object, `_LongInt` or `_NonFinite` (depth first, in document order) for which
    `hit(it, depth)` holds; the text's own value has depth 1. Leaves of other types are never visited:
    the types of an array's or object's members are collected in C first (a prompt of a million token
    ids costs a few milliseconds)."""
    stack: list[tuple[Any, int, tuple[_PathPart, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if hit(node, depth):
            return path
        if isinstance(node, dict):
            items: Any = node.items()
            kinds = set(map(type, node.values()))
        elif isinstance(node, list):
            items = enumerate(node)
            kinds = set(map(type, node))
        else:
            continue
        if kinds <= _LEAVES:
            continue
        children = [(child, depth + 1, (*path, key)) for key, child in items if type(child) not in _LEAVES]
        stack.extend(reversed(children))
    return None


def _deep_member(text: str | bytes) -> str:
    """The key of the top-level object's member that is nested too deeply for the parser ("" when the
    text is not an object, or the member cannot be told). Each member is parsed on its own, in C."""
    if isinstance(text, bytes):
        try:
            text = text.decode(json.detect_encoding(text), "surrogatepass")
        except UnicodeDecodeError:
            return ""
    decoder = json.JSONDecoder(parse_int=_int_or_long)  # a long integer before it does not stop the search
    at = _WS.match(text, 0).end()
    if text[at : at + 1] != "{":
        return ""
    at = _WS.match(text, at + 1).end()
    while text[at : at + 1] == '"':
        try:
            key, at = json.decoder.scanstring(text, at + 1)
            at = _WS.match(text, at).end()
            if text[at : at + 1] != ":":
                return ""
            _, at = decoder.raw_decode(text, _WS.match(text, at + 1).end())
        except RecursionError:
            return key
        except ValueError:
            return ""
        at = _WS.match(text, at).end()
        if text[at : at + 1] != ",":
            return ""
        at = _WS.match(text, at + 1).end()
    return ""

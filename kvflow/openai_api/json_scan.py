"""Scanning JSON text that may be cut off: where a value ends, a member's raw text so far,
and the tool call an object holds. Pure Python; :mod:`kvflow.openai_api.tool_parsers` reads
calls out of generated text with it, whole or streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class PartialCall:
    """A call as far as the text goes: its name once complete, its argument text so far, and
    whether the call is complete."""

    name: str | None
    arguments: str
    complete: bool


def _scan(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """Each character of ``text`` from ``start`` that is outside a JSON string, with the
    nesting depth after it: ``(index, kind, depth)``. A string's quotes come as kind ``open``
    and ``close``; its inside, escapes included, is skipped."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                yield i, "close", depth
            continue
        if ch == '"':
            in_string = True
            yield i, "open", depth
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        yield i, ch, depth


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``start`` ends (exclusive), or None if ``text`` ends
    first. Strings and escapes are respected; only the nesting is tracked."""
    for i, kind, depth in _scan(text, start):
        if kind in ("close", "}", "]"):
            if depth == 0:
                return i + 1
        elif depth == 0 and kind in (",", " ", "\n", "\t", "\r"):
            return i if i > start else None
    return None


def object_call(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[PartialCall, int]:
    """The call in the JSON object starting at ``text[start] == '{'``: its name, its arguments'
    raw text so far, and where the object ends (``len(text)`` while it has not)."""
    end = _value_end(text, start)
    complete = end is not None
    body = text[start:end] if end is not None else text[start:]
    name: str | None = None
    arguments = ""
    if complete:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            name = obj["name"]
            key = next((k for k in args_keys if k in obj), None)
            arguments = _raw_member(body, key) if key is not None else "{}"
        else:
            complete = False
        return PartialCall(name, arguments, complete and name is not None), end  # type: ignore[return-value]
    name = _complete_string_member(body, "name")
    for key in args_keys:
        raw = _raw_member(body, key)
        if raw:
            arguments = raw
            break
    return PartialCall(name, arguments, False), len(text)


def _member_start(body: str, key: str) -> int | None:
    """Where the value of the top-level member ``key`` starts in the object ``body``."""
    n = len(body)
    for i, kind, depth in _scan(body):
        if kind != "open" or depth != 1 or not body.startswith(f'"{key}"', i):
            continue
        j = i + len(key) + 2
        while j < n and body[j] in " \n\t\r":
            j += 1
        if j < n and body[j] == ":":
            j += 1
            while j < n and body[j] in " \n\t\r":
                j += 1
            return j if j < n else None
    return None


def _raw_member(body: str, key: str | None) -> str:
    """The raw text of member ``key``'s value so far (all of it once it is complete)."""
    if key is None:
        return ""
    start = _member_start(body, key)
    if start is None:
        return ""
    end = _value_end(body, start)
    return body[start:end] if end is not None else body[start:]


def _complete_string_member(body: str, key: str) -> str | None:
    start = _member_start(body, key)
    if start is None or body[start] != '"':
        return None
    end = _value_end(body, start)
    if end is None:
        return None
    try:
        value = json.loads(body[start:end])
    except ValueError:
        return None
    return value if isinstance(value, str) else None

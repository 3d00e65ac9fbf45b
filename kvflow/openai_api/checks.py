"""What the frontend checks in an OpenAI body before it translates it: what the backend never
sees, or would see only in its own terms. The body's JSON (UTF-8, nesting bounded before it is
parsed), its fields (known, ignored or unsupported), the JSON type of each typed field (OpenAI's
API is typed; the backend converts numeric strings, for the clients of Triton's vLLM backend)
and the text packed for the backend (Unicode). Each error names the client's field.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from kvflow.openai_api.errors import bad_request
from kvflow.openai_api.fields import (
    CHAT_FIELDS,
    FIELD_TYPES,
    IGNORED_FIELDS,
    PACKED_FIELDS,
    UNSUPPORTED_FIELDS,
)
from kvflow.orchestrator.sampling.params import check_text, list_unknown, short_repr
from kvflow.triton_backend.params import JSON_STRING, MAX_SAMPLING_JSON_DEPTH, json_depth

log = logging.getLogger("kvflow.openai")

# The request body nests no deeper than the backend's sampling_parameters may: no body can
# exhaust the JSON parser, and no sampling field can nest past the backend's limit (each sits
# as deep in the body as in sampling_parameters, or deeper).
MAX_BODY_JSON_DEPTH = MAX_SAMPLING_JSON_DEPTH


def load_body(data: bytes) -> Any:
    """The request body's JSON, its nesting bounded before it is parsed (a 400 names the
    top-level field that nests too deep)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    depth = json_depth(text)
    if depth > MAX_BODY_JSON_DEPTH:
        field = _deepest_field(text, MAX_BODY_JSON_DEPTH)
        raise bad_request(f"the request body nests {depth} levels deep"
                          f"{f', in {field}' if field else ''}; the limit is "
                          f"{MAX_BODY_JSON_DEPTH}", field)
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer past Python's 4300 digits
        raise bad_request(f"the request body is not valid JSON: {e}") from None


_TOKENS = re.compile("(" + JSON_STRING + r")(\s*:)?|[\[\]{}]")


def _deepest_field(text: str, max_depth: int) -> str | None:
    """The key of JSON object ``text`` under which it first nests past ``max_depth``."""
    depth, key = 0, None
    for token in _TOKENS.finditer(text):
        if token.group(1):
            if depth == 1:  # a key, or the value of the last one
                key = token.group(1) if token.group(2) else None
            continue
        depth += 1 if token.group() in "[{" else -1
        if depth > max_depth:
            try:
                return json.loads(key) if key else None
            except ValueError:
                return None
    return None


def check_body(body: Any, known: tuple[str, ...], endpoint: str) -> None:
    """A 400 unless ``body`` is an object of ``endpoint``'s fields, each of its JSON type, its
    packed text Unicode."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, known, endpoint)
    _check_types(body)
    for name in PACKED_FIELDS:
        _check_unicode(body.get(name), name)


def _check_fields(body: dict[str, Any], known: tuple[str, ...], endpoint: str) -> None:
    for name, allowed in UNSUPPORTED_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} is not supported by kvflow's {endpoint} (got "
                              f"{short_repr(body[name])})", name)
    unknown = sorted((k for k in body if k not in known and k not in UNSUPPORTED_FIELDS
                      and k not in IGNORED_FIELDS), key=str)
    chat_only = [k for k in unknown if k in CHAT_FIELDS]
    if chat_only:
        raise bad_request(f"{chat_only[0]} is not supported by kvflow's {endpoint}: it is a "
                          "/v1/chat/completions field", chat_only[0])
    if unknown:
        raise bad_request(f"unknown field(s) {list_unknown(unknown)}; known: "
                          f"{', '.join(sorted(known))}", unknown[0])
    ignored = [k for k in IGNORED_FIELDS if k in body]
    if ignored:
        log.warning("%s: ignored field(s) %s (kvflow does not use them)", endpoint,
                    ", ".join(ignored))


def _check_types(body: dict[str, Any]) -> None:
    """Each typed field has its JSON type (a bool is not a number; a number is finite)."""
    for name, kind in FIELD_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        if kind == "a boolean":
            ok = isinstance(value, bool)
        elif kind == "an integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "a number":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if ok and not _finite(value):
                raise bad_request(f"{name} must be a finite number, got {short_repr(value)}",
                                  name)
        else:
            ok = isinstance(value, str if kind == "a string" else list)
        if not ok:
            raise bad_request(f"{name} must be {kind}, got {short_repr(value)}", name)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past the float range
        return False


def _check_unicode(value: Any, where: str) -> None:
    """A 400 naming the first string of ``value`` (a key or a value) that holds a lone
    surrogate (JSON's ``"\\udc00"`` decodes to one): it is not text, and UTF-8 cannot carry it.
    Recursion is bounded: the body nests at most MAX_BODY_JSON_DEPTH levels."""
    if isinstance(value, str):
        try:
            check_text(value, where)
        except ValueError as e:
            field = re.match(r"\w*", where)
            assert field is not None  # \w* matches every string, if only its empty prefix
            raise bad_request(str(e), field.group()) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, f"{where} (a key)")
            _check_unicode(item, f"{where}.{key if len(key) <= 40 else key[:40] + '...'}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | list | dict):  # not numbers (a prompt's token ids)
                _check_unicode(item, f"{where}[{i}]")


def int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """Integer field ``name`` (its type already checked by :func:`check_body`), ``default``
    when absent; a 400 outside ``[low, high]``."""
    value = body.get(name)
    if value is None:
        return default
    assert isinstance(value, int)  # its type was checked with the others (_check_types)
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)
    return value

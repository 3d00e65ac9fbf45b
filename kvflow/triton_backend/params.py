"""Triton request tensors -> a kvflow request, with errors that name the field and the limit.

The tensors are those of Triton's vLLM backend, so that its clients (and GenAI-Perf) work
unchanged: ``text_input`` (required), ``stream``, ``exclude_input_in_output``, ``max_tokens``,
``sampling_parameters`` (a JSON object), and scalar overrides ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``priority``; and kvflow's ``apply_chat_template`` (the text is
one user turn, rendered with the model's chat template) and ``cache_salt`` (requests with
different salts share no prefix-cache blocks). TensorRT-LLM-style benchmark clients also send
``min_length`` (taken as ``min_tokens``), ``end_id`` and ``accumulate_tokens`` (accepted and
ignored: kvflow ends on the model's own EOS ids and always streams deltas).

The prompt is one of ``text_input`` (text), ``input_ids`` (token ids) or ``messages`` (a JSON
list of chat messages, rendered with the model's chat template: what the OpenAI frontend sends
for ``/v1/chat/completions``), with the function tools offered in ``tools`` (a JSON list of
OpenAI tools, rendered as :mod:`kvflow.text.chat_tools` says). ``user`` (or ``tenant`` in
``sampling_parameters``) names the tenant the request is accounted to (the ``fair`` policy's
unit). ``timeout_ms`` in
``sampling_parameters`` is the request's deadline. ``lora_name`` (a request parameter, or a key
of ``sampling_parameters`` as Triton's vLLM backend takes it) selects a LoRA adapter the
server has loaded; the engine refuses a name it does not know.

Integer tensors are INT64, so that no value is wrapped before kvflow can check its range
(under ``kvflow serve``, INT32 tensors for them arrive widened to INT64: ``preload.c``).
Any other key (over HTTP ``generate``, Triton passes unknown JSON keys on as request
parameters) is refused with the list of known ones. Pure Python + NumPy: testable without
Triton.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.orchestrator.sampling.params import (
    GUIDED_FIELDS,
    SamplingParams,
    list_unknown,
    short_repr,
)
from kvflow.text.tokenizer import ChatPrompt, Prompt
from kvflow.triton_backend.protocol import ERROR_OUTPUT_PARAMETER, LORA_NAME_PARAMETER

# Triton's vLLM backend clients send every sampling parameter as a JSON string ("0.7"); these
# are the keys whose strings are converted, and to what.
_NUMERIC_KEYS: dict[str, type] = {
    "n": int, "max_tokens": int, "min_tokens": int, "top_k": int, "seed": int, "logprobs": int,
    "prompt_logprobs": int,
    "temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float, "timeout_ms": int,
}
# sampling_parameters keys that are the request's, not its sampling's.
REQUEST_KEYS = ("tenant", LORA_NAME_PARAMETER)
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "guided_json_object", "speculative")
MAX_PRIORITY = 1 << 30
# Inputs accepted from TensorRT-LLM-style clients and ignored on purpose (see module doc).
IGNORED_INPUTS = ("end_id", "accumulate_tokens")
# sampling_parameters: bounded before it is parsed, so no request can exhaust the parser.
MAX_SAMPLING_JSON_BYTES = 256 << 10
MAX_SAMPLING_JSON_DEPTH = 32
MAX_MESSAGES_JSON_BYTES = 4 << 20
MAX_MESSAGES_JSON_DEPTH = 8
MAX_USER_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_LORA_NAME_CHARS = 256
# Request parameters Triton itself sets on a request (KServe's reserved names).
TRITON_REQUEST_PARAMETERS = ("priority", "timeout", "sequence_id", "sequence_start",
                             "sequence_end", "headers", "triton_enable_empty_final_response")
REQUEST_PARAMETERS = (*TRITON_REQUEST_PARAMETERS, ERROR_OUTPUT_PARAMETER, LORA_NAME_PARAMETER)


PROMPT_INPUTS = ("text_input", "input_ids", "messages")
INPUT_NAMES = (*PROMPT_INPUTS, "tools", "chat_template_kwargs", "user", "stream",
               "exclude_input_in_output", "sampling_parameters", "max_tokens", "temperature",
               "top_p", "top_k", "seed", "stop", "priority", "apply_chat_template", "cache_salt",
               "min_length",
               *IGNORED_INPUTS)


class BadRequestError(ValueError):
    """The request is malformed; the message names the field and the limit."""


@dataclass(frozen=True)
class ParsedRequest:
    """One validated request. ``prompt`` is what the engine tokenizes; ``prompt_text`` is the
    text echoed before the output unless ``exclude_input_in_output`` ("" for token ids and
    messages)."""

    prompt: Prompt
    prompt_text: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int
    cache_salt: str | None = None
    tenant: str | None = None
    lora_name: str | None = None  # a LoRA adapter's name; None: the base model


def _scalar(name: str, array: np.ndarray) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise BadRequestError(f"{name} must hold exactly one value, got {flat.size}")
    return flat[0]


def _text(name: str, value: Any) -> str:
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequestError(f"{name} is not valid UTF-8 (byte {e.start})") from None
    if isinstance(value, str):
        return value
    raise BadRequestError(f"{name} must be a string (BYTES tensor), got {type(value).__name__}")


def _typed(name: str, value: Any, kind: type) -> Any:
    """Coerce a tensor element or JSON value to ``kind``, refusing lossy conversions."""
    if isinstance(value, bytes | np.bytes_ | str):
        text = _text(name, value).strip()
        try:
            return kind(text) if kind is not bool else _bool_text(name, text)
        except ValueError:
            raise BadRequestError(f"{name} must be {kind.__name__}, got "
                                  f"{short_repr(text)}") from None
    if kind is bool:
        if isinstance(value, bool | np.bool_):
            return bool(value)
        raise BadRequestError(f"{name} must be a bool, got {short_repr(value)}")
    if isinstance(value, bool | np.bool_):
        raise BadRequestError(f"{name} must be {kind.__name__}, got a bool")
    if kind is int:
        if isinstance(value, int | np.integer):
            return int(value)
        if isinstance(value, float | np.floating) and float(value).is_integer():
            return int(value)
        raise BadRequestError(f"{name} must be an integer, got {short_repr(value)}")
    if isinstance(value, int | float | np.integer | np.floating):
        return float(value)
    raise BadRequestError(f"{name} must be a number, got {short_repr(value)}")


def _bool_text(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise ValueError(name)


def json_depth(text: str) -> int:
    """How deeply ``[`` and ``{`` nest in JSON ``text``, strings left out; linear in the
    text's length, valid JSON or not."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRINGS.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


# A JSON string, or an unterminated one and the rest of the text. NOTE: a match never fails
# once begun, so the scan is linear on any text: a pattern that needs the closing quote is
# tried again from every escaped quote of an unterminated string (quadratic: minutes for the
# 256 KiB a request may send).
JSON_STRING = r'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)'
_JSON_STRINGS = re.compile(JSON_STRING)
_BRACKETS = re.compile(r"[\[\]{}]")


def unknown_keys_error(field: str, unknown: list[str], known: list[str]) -> BadRequestError:
    """The error for unknown keys: at most 8 of them, each cut short, then the known ones."""
    return BadRequestError(f"{field} has unknown key(s) {list_unknown(unknown)}; "
                           f"known: {', '.join(known)}")


def check_json_bounds(name: str, text: str, max_bytes: int, max_depth: int) -> None:
    """BadRequestError if JSON ``text`` of input ``name`` is longer than ``max_bytes``
    characters or nests deeper than ``max_depth`` (checked before it is parsed)."""
    if len(text) > max_bytes:
        raise BadRequestError(f"{name} is {len(text)} characters; the limit is {max_bytes}")
    depth = json_depth(text)
    if depth > max_depth:
        raise BadRequestError(f"{name} nests {depth} levels deep; the limit is {max_depth}")


def _bounded_json(name: str, text: str, max_bytes: int, max_depth: int) -> Any:
    """Parse JSON ``text`` of input ``name``, its size and nesting bounded before parsing."""
    check_json_bounds(name, text, max_bytes, max_depth)
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise BadRequestError(f"{name} is not valid JSON: {e.msg} at character {e.pos}") from None


def parse_sampling_json(text: str) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON object, numeric strings converted (vLLM clients)."""
    raw = _bounded_json("sampling_parameters", text, MAX_SAMPLING_JSON_BYTES,
                        MAX_SAMPLING_JSON_DEPTH)
    if not isinstance(raw, dict):
        raise BadRequestError("sampling_parameters must be a JSON object")
    known = (*SamplingParams.field_names(), *GUIDED_FIELDS, *REQUEST_KEYS)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise unknown_keys_error("sampling_parameters", unknown, sorted(known))
    out: dict[str, Any] = {}
    for key, value in raw.items():
        field = f"sampling_parameters.{key}"
        if key in _NUMERIC_KEYS and value is not None:
            out[key] = _typed(field, value, _NUMERIC_KEYS[key])
        elif key in _BOOL_KEYS:
            out[key] = _typed(field, value, bool)
        elif key == "stop" and isinstance(value, str):
            out[key] = [value]
        elif key == "guided_choice" and isinstance(value, str):
            # vLLM-backend clients send every parameter as a string: here a JSON list.
            out[key] = _bounded_json(field, value, MAX_SAMPLING_JSON_BYTES,
                                     MAX_SAMPLING_JSON_DEPTH)
        else:
            out[key] = value
    return out


def parse_request(inputs: Mapping[str, np.ndarray], max_model_len: int,
                  default_max_tokens: int = 16,
                  parameters: Mapping[str, Any] | None = None) -> ParsedRequest:
    """Validate and convert one request's input tensors (see module doc). ``parameters``: the
    request's parameters; over HTTP ``generate`` these are the JSON keys that match no input,
    so any but Triton's own is refused."""
    unknown = sorted(set(parameters or {}) - set(REQUEST_PARAMETERS))
    if unknown:
        raise unknown_keys_error("the request", unknown, sorted(INPUT_NAMES))

    def scalar_of(name: str, kind: type) -> Any:
        return _typed(name, _scalar(name, inputs[name]), kind) if name in inputs else None

    prompt, prompt_text = _prompt(inputs, scalar_of("apply_chat_template", bool) or False)
    stream = scalar_of("stream", bool) or False
    exclude = scalar_of("exclude_input_in_output", bool)
    fields: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        fields.update(parse_sampling_json(
            _text("sampling_parameters", _scalar("sampling_parameters",
                                                 inputs["sampling_parameters"]))))
    for name, kind in (("max_tokens", int), ("temperature", float), ("top_p", float),
                       ("top_k", int), ("seed", int)):
        value = scalar_of(name, kind)
        if value is not None:
            fields[name] = value
    if "stop" in inputs:
        fields["stop"] = [_text("stop", s) for s in np.asarray(inputs["stop"]).reshape(-1)]
    min_length = scalar_of("min_length", int)
    if min_length is not None:
        if "min_tokens" in fields and fields["min_tokens"] != min_length:
            raise BadRequestError("min_length and sampling_parameters.min_tokens disagree "
                                  f"({min_length} vs {fields['min_tokens']})")
        fields["min_tokens"] = min_length
    fields.setdefault("max_tokens", default_max_tokens)
    max_tokens = fields["max_tokens"]
    if (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
            and not 1 <= max_tokens < max_model_len):
        raise BadRequestError(
            f"max_tokens must be in [1, {max_model_len - 1}] (max_model_len "
            f"{max_model_len} minus at least one prompt token), got {max_tokens}")
    priority = scalar_of("priority", int) or 0
    if abs(priority) > MAX_PRIORITY:
        raise BadRequestError(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                              f"got {priority}")
    tenant = fields.pop("tenant", None)
    lora = fields.pop(LORA_NAME_PARAMETER, None)
    if tenant is not None and not isinstance(tenant, str):
        raise BadRequestError(f"sampling_parameters.tenant must be a string, got "
                              f"{short_repr(tenant)}")
    try:
        params = SamplingParams.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise BadRequestError(str(e)) from None
    salt = (_text("cache_salt", _scalar("cache_salt", inputs["cache_salt"]))
            if "cache_salt" in inputs else None)
    user = _text("user", _scalar("user", inputs["user"])) if "user" in inputs else None
    for name, value, limit in (("user", user, MAX_USER_CHARS),
                               ("sampling_parameters.tenant", tenant, MAX_USER_CHARS),
                               ("cache_salt", salt, MAX_CACHE_SALT_CHARS)):
        if value is not None and len(value) > limit:
            raise BadRequestError(f"{name} is {len(value)} characters; the limit is {limit}")
    if user and tenant and user != tenant:
        raise BadRequestError("user and sampling_parameters.tenant name different tenants "
                              f"({short_repr(user, 40)} vs {short_repr(tenant, 40)}); give one")
    user = user or tenant
    return ParsedRequest(prompt, prompt_text, params, bool(stream), bool(exclude), priority,
                         salt or None, user or None,
                         _lora_name((parameters or {}).get(LORA_NAME_PARAMETER), lora))


def _lora_name(parameter: Any, sampled: Any) -> str | None:
    """The adapter a request names: the request parameter ``lora_name`` or
    ``sampling_parameters.lora_name`` (both: the same name); None (or "") for the base."""
    for name, value in ((LORA_NAME_PARAMETER, parameter),
                        (f"sampling_parameters.{LORA_NAME_PARAMETER}", sampled)):
        if value is not None and not isinstance(value, str):
            raise BadRequestError(f"{name} must be a string, got {short_repr(value)}")
        if value is not None and len(value) > MAX_LORA_NAME_CHARS:
            raise BadRequestError(f"{name} is {len(value)} characters; the limit is "
                                  f"{MAX_LORA_NAME_CHARS}")
    if parameter and sampled and parameter != sampled:
        raise BadRequestError(f"lora_name and sampling_parameters.lora_name name different "
                              f"adapters ({short_repr(parameter, 40)} vs "
                              f"{short_repr(sampled, 40)}); give one")
    return parameter or sampled or None


def _prompt(inputs: Mapping[str, np.ndarray], apply_chat_template: bool) -> tuple[Prompt, str]:
    """The request's prompt (exactly one of PROMPT_INPUTS), and its text to echo."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if len(given) != 1:
        raise BadRequestError(f"exactly one of {', '.join(PROMPT_INPUTS)} is required, got "
                              f"{', '.join(given) if given else 'none'}")
    if given == ["input_ids"]:
        ids = np.asarray(inputs["input_ids"]).reshape(-1)
        if ids.size == 0:
            raise BadRequestError("input_ids must not be empty")
        if ids.dtype.kind not in "iu":
            raise BadRequestError(f"input_ids must be integers, got {ids.dtype}")
        return [int(t) for t in ids], ""
    tools = None
    if "tools" in inputs:
        if given != ["messages"]:
            raise BadRequestError("tools are offered in a chat: give them with messages")
        tools = _bounded_json("tools", _text("tools", _scalar("tools", inputs["tools"])),
                              MAX_MESSAGES_JSON_BYTES, MAX_SAMPLING_JSON_DEPTH)
    kwargs = None
    if "chat_template_kwargs" in inputs:
        if given != ["messages"]:
            raise BadRequestError("chat_template_kwargs apply to a chat: give them with messages")
        kwargs = _bounded_json("chat_template_kwargs",
                               _text("chat_template_kwargs", _scalar(
                                   "chat_template_kwargs", inputs["chat_template_kwargs"])),
                               MAX_MESSAGES_JSON_BYTES, MAX_SAMPLING_JSON_DEPTH)
    if given == ["messages"]:
        raw = _bounded_json("messages", _text("messages", _scalar("messages",
                                                                  inputs["messages"])),
                            MAX_MESSAGES_JSON_BYTES, MAX_MESSAGES_JSON_DEPTH)
        try:
            return ChatPrompt(raw, tools, kwargs), ""
        except ValueError as e:
            raise BadRequestError(str(e)) from None
    text = _text("text_input", _scalar("text_input", inputs["text_input"]))
    if not text:
        raise BadRequestError("text_input must not be empty")
    if apply_chat_template:  # the text is one user turn
        return ChatPrompt([{"role": "user", "content": text}]), text
    return text, text

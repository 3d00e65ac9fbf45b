"""Triton request tensors -> a kvflow request, with errors that name the field and the limit.

The tensors are those of Triton's vLLM backend, so that its clients (and GenAI-Perf) work
unchanged: ``text_input`` (required), ``stream``, ``exclude_input_in_output``, ``max_tokens``,
``sampling_parameters`` (a JSON object), and scalar overrides ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop``, ``priority``; and kvflow's ``apply_chat_template`` (the text is
one user turn, rendered with the model's chat template) and ``cache_salt`` (requests with
different salts share no prefix-cache blocks). Pure Python + NumPy: testable without Triton.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.orchestrator.sampling_params import SamplingParams

# Triton's vLLM backend clients send every sampling parameter as a JSON string ("0.7"); these
# are the keys whose strings are converted, and to what.
_NUMERIC_KEYS: dict[str, type] = {
    "n": int, "max_tokens": int, "min_tokens": int, "top_k": int, "seed": int, "logprobs": int,
    "temperature": float, "top_p": float, "min_p": float, "repetition_penalty": float,
    "presence_penalty": float, "frequency_penalty": float,
}
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens")
MAX_PRIORITY = 1 << 30


class BadRequestError(ValueError):
    """The request is malformed; the message names the field and the limit."""


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int
    apply_chat_template: bool = False
    cache_salt: str | None = None


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
            raise BadRequestError(f"{name} must be {kind.__name__}, got {text!r}") from None
    if kind is bool:
        if isinstance(value, bool | np.bool_):
            return bool(value)
        raise BadRequestError(f"{name} must be a bool, got {value!r}")
    if isinstance(value, bool | np.bool_):
        raise BadRequestError(f"{name} must be {kind.__name__}, got a bool")
    if kind is int:
        if isinstance(value, int | np.integer):
            return int(value)
        if isinstance(value, float | np.floating) and float(value).is_integer():
            return int(value)
        raise BadRequestError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int | float | np.integer | np.floating):
        return float(value)
    raise BadRequestError(f"{name} must be a number, got {value!r}")


def _bool_text(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise ValueError(name)


def parse_sampling_json(text: str) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON object, numeric strings converted (vLLM clients)."""
    try:
        raw = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise BadRequestError(
            f"sampling_parameters is not valid JSON: {e.msg} at character {e.pos}") from None
    if not isinstance(raw, dict):
        raise BadRequestError("sampling_parameters must be a JSON object")
    known = set(SamplingParams.field_names())
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequestError(f"sampling_parameters has unknown key(s) {unknown}; "
                              f"known: {sorted(known)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        field = f"sampling_parameters.{key}"
        if key in _NUMERIC_KEYS and value is not None:
            out[key] = _typed(field, value, _NUMERIC_KEYS[key])
        elif key in _BOOL_KEYS:
            out[key] = _typed(field, value, bool)
        elif key == "stop" and isinstance(value, str):
            out[key] = [value]
        else:
            out[key] = value
    return out


def parse_request(inputs: Mapping[str, np.ndarray], max_model_len: int,
                  default_max_tokens: int = 16) -> ParsedRequest:
    """Validate and convert one request's input tensors (see module doc)."""
    if "text_input" not in inputs:
        raise BadRequestError("text_input is required")
    prompt = _text("text_input", _scalar("text_input", inputs["text_input"]))
    if not prompt:
        raise BadRequestError("text_input must not be empty")

    def scalar_of(name: str, kind: type) -> Any:
        return _typed(name, _scalar(name, inputs[name]), kind) if name in inputs else None

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
    try:
        params = SamplingParams.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise BadRequestError(str(e)) from None
    chat = scalar_of("apply_chat_template", bool) or False
    salt = (_text("cache_salt", _scalar("cache_salt", inputs["cache_salt"]))
            if "cache_salt" in inputs else None)
    return ParsedRequest(prompt, params, bool(stream), bool(exclude), priority, chat,
                         salt or None)

"""OpenAI's HTTP API <-> kvflow's Triton requests: a translation, not a second validator.

A ``/v1/completions`` or ``/v1/chat/completions`` body becomes one Triton request per choice
(``n`` choices of each prompt). Sampling fields keep their names (kvflow speaks vLLM's
vocabulary, which is OpenAI's plus extras) and go to the backend in ``sampling_parameters``,
where :class:`~kvflow.orchestrator.sampling_params.SamplingParams` checks them, as it does for
every other front door. The backend's error names its field; :func:`error_from_backend` turns
it into OpenAI's error shape, the field named as the client sent it.

What this module checks itself is only what the backend never sees: the body's shape, the
model name, ``n``, ``stream_options`` and the OpenAI fields kvflow does not serve.
Pure Python + NumPy.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.orchestrator.outputs import ENGINE_ERROR_PREFIX, OVERLOADED_PREFIX
from kvflow.orchestrator.sampling_params import (
    GUIDED_FIELDS,
    SamplingParams,
    list_unknown,
    short_repr,
)

MAX_N = 64  # choices per prompt: the sequences of its one engine request
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
RETRY_AFTER_S = 1

# Body fields passed to the backend under the same name (SamplingParams validates them).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop", "stop_token_ids", "skip_special_tokens", "timeout_ms",
                   *GUIDED_FIELDS)
# Body fields sent as request tensors of their own.
TENSOR_FIELDS = ("user", "priority", "cache_salt")
COMMON_FIELDS = ("model", "max_tokens", "n", "stream", "stream_options", "logprobs",
                 "response_format", *SAMPLING_FIELDS, *TENSOR_FIELDS)
COMPLETION_FIELDS = ("prompt", "echo", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", *COMMON_FIELDS)
# OpenAI fields kvflow does not serve: accepted only when absent, null or their default.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"),
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# Completions default to 16 tokens (as OpenAI); chat to as many as the context holds.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 503: "server_error"}.get(status,
                                                                               "server_error")
        self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


@dataclass(frozen=True)
class ChoiceRequest:
    """One choice of one prompt; ``inputs``: the Triton input tensors of the prompt's engine
    request (the same for the prompt's ``n`` choices, whose sequences it holds)."""

    index: int
    prompt_index: int
    inputs: dict[str, np.ndarray]
    echo_text: str = ""


@dataclass
class CompletionRequest:
    """A parsed OpenAI request: its choices, and how to shape the answer."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    choices: list[ChoiceRequest]
    renamed: dict[str, str] = field(default_factory=dict)  # kvflow field -> the client's
    n: int = 1  # choices per prompt: the sequences of one engine request
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())


def _bytes_tensor(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _check_fields(body: dict[str, Any], known: tuple[str, ...], endpoint: str) -> None:
    for name, allowed in UNSUPPORTED_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} is not supported by kvflow's {endpoint} (got "
                              f"{short_repr(body[name])})", name)
    unknown = sorted((k for k in body if k not in known and k not in UNSUPPORTED_FIELDS),
                     key=str)
    if unknown:
        raise bad_request(f"unknown field(s) {list_unknown(unknown)}; known: "
                          f"{', '.join(sorted(known))}", unknown[0])


def _int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {short_repr(value)}", name)
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def parse_completion_request(body: Any, served_model: str, chat: bool) -> CompletionRequest:
    """Validate the shape of an OpenAI request body and build its engine requests.

    Raises:
        OpenAIError: 400 for a malformed body or an unsupported field, 404 for another model.
    """
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, endpoint)
    model = body.get("model")
    if model is not None and model != served_model:
        raise OpenAIError(404, f"The model `{short_repr(model, 60)[1:-1]}` does not exist; this "
                          f"server serves `{served_model}`", "model", code="model_not_found")
    n = _int_field(body, "n", 1, 1, MAX_N)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {short_repr(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS) or any(
                not isinstance(v, bool) for v in options.values()):
            raise bad_request("stream_options must be an object of booleans with keys "
                              f"{', '.join(STREAM_OPTIONS)}", "stream_options")
    options = options or {}

    sampling: dict[str, Any] = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    renamed: dict[str, str] = {}
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, renamed["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    sampling["max_tokens"] = max_tokens  # None: as many as the context holds
    logprobs = _logprobs(body, chat, renamed)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    sampling.update(_response_format(body.get("response_format"), sampling, renamed))

    extra: dict[str, np.ndarray] = {}
    for name in TENSOR_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "priority":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad_request(f"priority must be an integer, got {short_repr(value)}",
                                  "priority")
            extra[name] = np.array([value], dtype=np.int64)
        elif isinstance(value, str):
            extra[name] = _bytes_tensor(value)
        else:
            raise bad_request(f"{name} must be a string, got {short_repr(value)}", name)

    prompts = _chat_prompt(body) if chat else _completion_prompts(body)
    echo = bool(body.get("echo")) and not chat
    choices = []
    for p, (prompt_inputs, prompt_text) in enumerate(prompts):
        if echo and not prompt_text:
            raise bad_request("echo needs a text prompt (token-id prompts have no text to "
                              "echo)", "echo")
        # One engine request of n sequences per prompt (they share its KV blocks; sequence j
        # of a seeded request draws from seed + j); choice p * n + j is its sequence j.
        own = {**sampling, "n": n} if n > 1 else dict(sampling)
        inputs = {**prompt_inputs, **extra,
                  "stream": np.array([True]),
                  "exclude_input_in_output": np.array([True]),
                  "sampling_parameters": _bytes_tensor(json.dumps(own))}
        for j in range(n):
            choices.append(ChoiceRequest(p * n + j, p, inputs, prompt_text if echo else ""))
    return CompletionRequest(chat, served_model, stream, bool(options.get("include_usage")),
                             bool(options.get("continuous_usage_stats")), logprobs, choices,
                             renamed, n=n)


def _response_format(value: Any, sampling: dict[str, Any],
                     renamed: dict[str, str]) -> dict[str, Any]:
    """OpenAI's ``response_format`` as the engine's guided fields: ``json_schema`` (its
    ``json_schema.schema``) is ``guided_json``, ``json_object`` is ``guided_json_object``."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format must be an object whose type is text, json_object "
                          f"or json_schema, got {short_repr(value)}", "response_format")
    if kind == "text":
        return {}
    if any(sampling.get(k) is not None for k in GUIDED_FIELDS):
        raise bad_request("give response_format or a guided_* field, not both",
                          "response_format")
    if kind == "json_object":
        renamed["guided_json_object"] = "response_format"
        return {"guided_json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format.json_schema must be an object with a schema "
                          "object ({\"name\": ..., \"schema\": {...}})",
                          "response_format.json_schema")
    renamed["guided_json"] = "response_format"  # the backend's errors name the client's field
    return {"guided_json": spec["schema"]}


def _logprobs(body: dict[str, Any], chat: bool, renamed: dict[str, str]) -> int | None:
    """How many alternatives each token's logprobs list (the backend bounds it), or None."""
    if not chat:
        value = body.get("logprobs")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad_request(f"logprobs must be an integer, got {short_repr(value)}",
                              "logprobs")
        return value
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request(f"logprobs must be a boolean, got {short_repr(wanted)}", "logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if not wanted:
        return None
    if top is not None:
        renamed["logprobs"] = "top_logprobs"
        if isinstance(top, bool) or not isinstance(top, int):
            raise bad_request(f"top_logprobs must be an integer, got {short_repr(top)}",
                              "top_logprobs")
        return top
    return 0


def _completion_prompts(body: dict[str, Any]) -> list[tuple[dict[str, np.ndarray], str]]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists, and not empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"prompt holds {len(items)} prompts; the limit is {MAX_PROMPTS}",
                          "prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(({"text_input": _bytes_tensor(item)}, item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in item):
            if not all(-(2**63) <= t < 2**63 for t in item):
                raise bad_request(f"prompt[{i}] holds a token id beyond int64", "prompt")
            out.append(({"input_ids": np.array(item, dtype=np.int64)}, ""))
        else:
            raise bad_request(f"prompt[{i}] must be a string or a list of token ids, got "
                              f"{short_repr(item)}", "prompt")
    return out


def _chat_prompt(body: dict[str, Any]) -> list[tuple[dict[str, np.ndarray], str]]:
    """``messages`` goes to the backend as JSON; the engine's ChatPrompt checks each message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects",
                          "messages")
    return [({"messages": _bytes_tensor(json.dumps(messages))}, "")]


# --- the backend's answers ---------------------------------------------------------------------

_FIELD = re.compile(r"^(?:sampling_parameters\.)?([A-Za-z_]+)")
_PROMPT_WORDS = ("prompt", "text_input", "input_ids", "messages")


def error_from_backend(message: str, request: CompletionRequest | None = None) -> OpenAIError:
    """The OpenAI error for a backend error message: overload is 503 (retry), an engine
    failure 500, anything else the client's (400, ``param`` the field it names)."""
    if message.startswith(OVERLOADED_PREFIX):
        return OpenAIError(503, message, type_="server_error", code="server_overloaded")
    if message.startswith(ENGINE_ERROR_PREFIX):
        return OpenAIError(500, message, type_="server_error", code="engine_error")
    message = message.replace("sampling_parameters.", "")
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    renamed = request.renamed if request is not None else {}
    if param in renamed:
        message = renamed[param] + message[len(param):]
        param = renamed[param]
    if param in _PROMPT_WORDS:
        param = "messages" if request is not None and request.chat else "prompt"
    elif param not in SamplingParams.field_names() and param not in COMMON_FIELDS \
            and param not in CHAT_FIELDS:
        param = None
    return OpenAIError(400, message, param)

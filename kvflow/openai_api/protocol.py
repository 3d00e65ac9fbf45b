"""OpenAI's HTTP API <-> kvflow's Triton requests: a translation, not a second validator.

A ``/v1/completions`` or ``/v1/chat/completions`` body becomes one Triton request per choice
(``n`` choices of each prompt). Sampling fields keep their names (kvflow speaks vLLM's
vocabulary, which is OpenAI's plus extras) and go to the backend in ``sampling_parameters``,
where :class:`~kvflow.orchestrator.sampling.params.SamplingParams` checks them, as it does for
every other front door. The backend's error names its field; :func:`error_from_backend` turns
it into OpenAI's error shape, the field named as the client sent it.

What this module checks itself is what the backend never sees, or would see only in its own
terms: the body's shape and nesting, the JSON type of every field (OpenAI's API is typed; the
backend converts numeric strings, for the clients of Triton's vLLM backend), text that is not
Unicode, the model name, ``n``, ``priority``, ``stream_options``, the OpenAI fields kvflow
ignores or does not serve, and the backend's size and nesting limits on what is packed for it,
so that every error names the client's field. Pure Python + NumPy.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.orchestrator.outputs import ErrorCode
from kvflow.orchestrator.sampling.params import (
    GUIDED_FIELDS,
    SamplingParams,
    check_text,
    list_unknown,
    short_repr,
)
from kvflow.triton_backend.params import (
    JSON_STRING,
    MAX_MESSAGES_JSON_BYTES,
    MAX_MESSAGES_JSON_DEPTH,
    MAX_PRIORITY,
    MAX_SAMPLING_JSON_BYTES,
    MAX_SAMPLING_JSON_DEPTH,
    BadRequestError,
    check_json_bounds,
    json_depth,
)

log = logging.getLogger("kvflow.openai")

MAX_N = 64  # choices per prompt: the sequences of its one engine request
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
# Sequences (prompts x n) one request may create, and may have in flight at once: a batch
# runs at most this many sequences' worth of its prompts at a time (at least one prompt), so
# that a request sent after it waits behind one window of it, not behind all of it.
MAX_SEQUENCES = 1024
MAX_SEQUENCES_IN_FLIGHT = 64
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
# Fields packed for the backend: their text must be Unicode (UTF-8 cannot carry a lone
# surrogate).
PACKED_FIELDS = ("prompt", "messages", "response_format", *SAMPLING_FIELDS, *TENSOR_FIELDS)
# OpenAI fields that change nothing kvflow serves and that clients send anyway: accepted
# whatever their value, and ignored with a warning in the log (as vLLM does).
IGNORED_FIELDS = ("metadata", "store", "reasoning_effort", "prompt_cache_key",
                  "safety_identifier", "verbosity", "service_tier")
# OpenAI fields kvflow does not serve, which would change the output: accepted only when
# absent, null or a value that asks for nothing.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, False, True),
}
# The JSON type of each typed field; "10" is not an integer (OpenAI refuses it too).
FIELD_TYPES: dict[str, str] = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"), "a number"),
    **dict.fromkeys(("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens",
                     "timeout_ms", "priority", "top_logprobs"), "an integer"),
    **dict.fromkeys(("echo", "stream", "ignore_eos", "skip_special_tokens",
                     "guided_json_object"), "a boolean"),
    **dict.fromkeys(("model", "user", "cache_salt", "guided_regex", "guided_grammar"),
                    "a string"),
    "guided_choice": "a list", "stop_token_ids": "a list",
}
# The request body nests no deeper than the backend's sampling_parameters may: no body can
# exhaust the JSON parser, and no sampling field can nest past the backend's limit (each sits
# as deep in the body as in sampling_parameters, or deeper).
MAX_BODY_JSON_DEPTH = MAX_SAMPLING_JSON_DEPTH
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# Completions default to 16 tokens (as OpenAI); chat to as many as the context holds.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        # NOTE: the body must encode as UTF-8: a lone surrogate of the client's is escaped.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
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

    @property
    def prompts_in_flight(self) -> int:
        """How many of its prompts' engine requests may run at once (MAX_SEQUENCES_IN_FLIGHT
        sequences' worth, at least one)."""
        return max(1, MAX_SEQUENCES_IN_FLIGHT // self.n)


def _bytes_tensor(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


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


def _check_fields(body: dict[str, Any], known: tuple[str, ...], endpoint: str) -> None:
    for name, allowed in UNSUPPORTED_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} is not supported by kvflow's {endpoint} (got "
                              f"{short_repr(body[name])})", name)
    unknown = sorted((k for k in body if k not in known and k not in UNSUPPORTED_FIELDS
                      and k not in IGNORED_FIELDS), key=str)
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
            raise bad_request(str(e), re.match(r"\w*", where).group()) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, f"{where} (a key)")
            _check_unicode(item, f"{where}.{key if len(key) <= 40 else key[:40] + '...'}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | list | dict):  # not numbers (a prompt's token ids)
                _check_unicode(item, f"{where}[{i}]")


def _int_field(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    assert isinstance(value, int)  # its type was checked with the others (_check_types)
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
    _check_types(body)
    for name in PACKED_FIELDS:
        _check_unicode(body.get(name), name)
    model = body.get("model")
    if model is not None and model != served_model:
        raise OpenAIError(404, f"The model `{short_repr(model, 60)[1:-1]}` does not exist; this "
                          f"server serves `{served_model}`", "model", code="model_not_found")
    n = _int_field(body, "n", 1, 1, MAX_N)
    stream = body.get("stream") or False
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

    extra: dict[str, np.ndarray] = {
        name: _bytes_tensor(body[name]) for name in ("user", "cache_salt")
        if body.get(name) is not None}
    if body.get("priority") is not None:
        priority = _int_field(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
        extra["priority"] = np.array([priority], dtype=np.int64)
    # One engine request of n sequences per prompt (they share its KV blocks; sequence j of a
    # seeded request draws from seed + j).
    extra["sampling_parameters"] = _sampling_tensor({**sampling, "n": n} if n > 1 else sampling,
                                                    renamed)

    prompts = _chat_prompt(body) if chat else _completion_prompts(body)
    if len(prompts) * n > MAX_SEQUENCES:
        raise bad_request(f"prompt holds {len(prompts)} prompts and n is {n}: "
                          f"{len(prompts) * n} sequences; the limit is {MAX_SEQUENCES} "
                          "(prompts x n)", "n")
    echo = body.get("echo") is True and not chat
    choices = []
    for p, (prompt_inputs, prompt_text) in enumerate(prompts):
        if echo and not prompt_text:
            raise bad_request("echo needs a text prompt (token-id prompts have no text to "
                              "echo)", "echo")
        inputs = {**prompt_inputs, **extra,
                  "stream": np.array([True]),
                  "exclude_input_in_output": np.array([True])}
        for j in range(n):  # choice p * n + j is sequence j of prompt p's request
            choices.append(ChoiceRequest(p * n + j, p, inputs, prompt_text if echo else ""))
    return CompletionRequest(chat, served_model, stream, bool(options.get("include_usage")),
                             bool(options.get("continuous_usage_stats")), logprobs, choices,
                             renamed, n=n)


def _sampling_tensor(sampling: dict[str, Any], renamed: dict[str, str]) -> np.ndarray:
    """``sampling_parameters``, within the backend's limits on its JSON: past them, a 400 that
    names the client's field (of the fields together too big, the one that takes the most)."""
    text = json.dumps(sampling, ensure_ascii=False)
    # NOTE: never deeper than the backend allows: each field nests in sampling_parameters no
    # deeper than in the body, which load_body bounds to MAX_BODY_JSON_DEPTH.
    if len(text) > MAX_SAMPLING_JSON_BYTES:
        sizes = {renamed.get(k, k): json.dumps(v, ensure_ascii=False)
                 for k, v in sampling.items()}
        name = max(sizes, key=lambda k: len(sizes[k]))
        raise bad_request(f"{name} is {len(sizes[name])} characters as JSON, of the "
                          f"{len(text)} of all sampling fields together; the limit is "
                          f"{MAX_SAMPLING_JSON_BYTES}", name)
    return _bytes_tensor(text)


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
    """``messages`` goes to the backend as JSON, within its limits on that JSON; the engine's
    ChatPrompt checks each message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects",
                          "messages")
    text = json.dumps(messages, ensure_ascii=False)
    try:  # the backend's own bounds, named for the client here
        check_json_bounds("messages", text, MAX_MESSAGES_JSON_BYTES, MAX_MESSAGES_JSON_DEPTH)
    except BadRequestError as e:
        raise bad_request(str(e), "messages") from None
    return [({"messages": _bytes_tensor(text)}, "")]


# --- the backend's answers ---------------------------------------------------------------------

_FIELD = re.compile(r"^(?:sampling_parameters\.)?([A-Za-z_]+)")
_PROMPT_WORDS = ("prompt", "text_input", "input_ids", "messages")


def error_from_backend(message: str, request: CompletionRequest | None = None,
                       code: str | None = None) -> OpenAIError:
    """The OpenAI error for a backend error and its ``error_code``: overload is 503 (retry), an
    engine failure 500, anything else the client's (400, ``param`` the field its message
    names: the backend's messages begin with the field)."""
    if code == ErrorCode.OVERLOADED:
        return OpenAIError(503, message, type_="server_error", code="server_overloaded")
    if code == ErrorCode.ENGINE_ERROR:
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

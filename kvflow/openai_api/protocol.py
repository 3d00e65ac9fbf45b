"""OpenAI's HTTP API -> kvflow's Triton requests: a translation, not a second validator.

A ``/v1/completions`` or ``/v1/chat/completions`` body becomes one Triton request per choice
(``n`` choices of each prompt). Sampling fields keep their names (kvflow speaks vLLM's
vocabulary, which is OpenAI's plus extras) and go to the backend in ``sampling_parameters``,
where :class:`~kvflow.orchestrator.sampling.params.SamplingParams` checks them, as it does for
every other front door. The backend's error names its field; :func:`.errors.error_from_backend`
turns it into OpenAI's error shape, the field named as the client sent it.

What the frontend checks itself is what the backend never sees, or would see only in its own
terms: the body's shape and types (:mod:`.checks`), and here the model name, ``n``,
``priority``, ``stream_options``, and the backend's size and nesting limits on what is packed
for it, so that every error names the client's field. A chat's messages and tools are bounded
together before the tool plan compiles a schema; a token-id prompt's logprobs (``n`` x
``prompt_logprobs`` x its length) before it is sent (a text's once the backend has tokenized
it). Pure Python + NumPy.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.openai_api.checks import check_body, int_field
from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    SAMPLING_FIELDS,
    STREAM_OPTIONS,
)
from kvflow.openai_api.reasoning import ReasoningParser
from kvflow.openai_api.tool_parsers_families import SPECIAL_TOKEN_PARSERS
from kvflow.openai_api.tools import ToolPlan, plan_tools
from kvflow.orchestrator.input_processor import check_prompt_logprobs
from kvflow.orchestrator.sampling.params import GUIDED_FIELDS, MAX_LOGPROBS, short_repr
from kvflow.triton_backend.params import (
    MAX_MESSAGES_JSON_BYTES,
    MAX_MESSAGES_JSON_DEPTH,
    MAX_PRIORITY,
    MAX_SAMPLING_JSON_BYTES,
    MAX_SAMPLING_JSON_DEPTH,
    BadRequestError,
    check_json_bounds,
)

MAX_N = 64  # choices per prompt: the sequences of its one engine request
MAX_PROMPTS = 256  # prompts in one /v1/completions batch
# Sequences (prompts x n) one request may create, and may have in flight at once: a batch
# runs at most this many sequences' worth of its prompts at a time (at least one prompt), so
# that a request sent after it waits behind one window of it, not behind all of it.
MAX_SEQUENCES = 1024
MAX_SEQUENCES_IN_FLIGHT = 64
# Completions default to 16 tokens (as OpenAI); chat to as many as the context holds.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class ChoiceRequest:
    """One choice of one prompt; ``inputs``: the Triton input tensors of the prompt's engine
    request (the same for the prompt's ``n`` choices, whose sequences it holds). ``echo``: the
    prompt goes before the text; ``echo_text`` is a text prompt's own text ("" for token ids,
    whose text is their tokens', from the backend's ``prompt_logprobs``)."""

    index: int
    prompt_index: int
    inputs: dict[str, np.ndarray]
    echo_text: str = ""
    echo: bool = False


@dataclass(frozen=True)
class ChatFormat:
    """How the server reads chat outputs: its ``--tool-call-parser`` (resolved: the engine's
    own when it was ``auto``) and ``--reasoning-parser`` (None: none)."""

    tool_call_parser: str = "hermes"
    reasoning: ReasoningParser | None = None


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
    # vLLM's prompt_logprobs field: its k, or None (the answer then has no such field).
    prompt_logprobs: int | None = None
    # The k the backend was asked for (at least each of the client's): None when not asked.
    backend_prompt_logprobs: int | None = None
    # False for echo with max_tokens 0: the engine generates one token, which is dropped.
    generate: bool = True
    # Chat: what the request's tools ask of the output, and the server's reasoning parser.
    tools: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
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


def parse_completion_request(body: Any, served_model: str, chat: bool,
                             chat_format: ChatFormat | None = None,
                             lora_name: str | None = None) -> CompletionRequest:
    """Validate the shape of an OpenAI request body and build its engine requests
    (``chat_format``: how the server reads chat outputs). ``served_model``: the name the
    request's ``model`` may give (the base's, or the adapter's that ``lora_name`` selects:
    :meth:`.frontend.Frontend.resolve_model`).

    Raises:
        OpenAIError: 400 for a malformed body or an unsupported field, 404 for another model.
    """
    check_body(body, CHAT_FIELDS if chat else COMPLETION_FIELDS,
               "/v1/chat/completions" if chat else "/v1/completions")
    model = body.get("model")
    if model is not None and model != served_model:
        raise OpenAIError(404, f"The model `{short_repr(model, 60)[1:-1]}` does not exist; this "
                          f"server serves `{served_model}`", "model", code="model_not_found")
    n = int_field(body, "n", 1, 1, MAX_N)
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
    if lora_name is not None:  # the backend's own key (Triton's vLLM backend reads it there)
        sampling["lora_name"] = lora_name
    renamed: dict[str, str] = {}
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, renamed["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    echo = body.get("echo") is True and not chat
    # Echo with max_tokens 0 (lm-evaluation-harness's loglikelihood requests) generates
    # nothing: the engine makes at least one token, so it makes one and the answer drops it (as
    # vLLM's server does). Without echo, 0 goes on and the backend refuses it, naming it.
    generate = not (echo and max_tokens == 0)
    sampling["max_tokens"] = max_tokens if generate else 1  # None: as the context holds
    logprobs = _logprobs(body, chat, renamed)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    chat_format = chat_format or ChatFormat()
    texts = chat_texts(body) if chat else {}  # bounded before the plan compiles schemas
    plan = _tool_plan(body, chat_format.tool_call_parser) if chat else None
    if (plan is not None and plan.tools and "skip_special_tokens" not in sampling
            and chat_format.tool_call_parser in SPECIAL_TOKEN_PARSERS):
        sampling["skip_special_tokens"] = False  # the call opens with a special token
    if plan is not None and plan.constraint:
        sampling.update(plan.constraint)
        renamed.update(dict.fromkeys(plan.constraint, "tools"))
    sampling.update(_response_format(body.get("response_format"), sampling, renamed))
    prompts = _chat_prompt(texts, plan) if chat else _completion_prompts(body)
    # A token-id prompt's echo is its tokens' text: the backend's prompt_logprobs carry it.
    echo_ids = echo and any(not text for _, text in prompts)
    backend_k = _prompt_logprobs(body.get("prompt_logprobs"),
                                 logprobs if echo and logprobs is not None
                                 else 0 if echo_ids else None, renamed)
    if backend_k is not None:
        sampling["prompt_logprobs"] = backend_k
        _check_prompt_logprobs(prompts, n, backend_k, renamed)

    extra: dict[str, np.ndarray] = {
        name: _bytes_tensor(body[name]) for name in ("user", "cache_salt")
        if body.get(name) is not None}
    if body.get("priority") is not None:
        priority = int_field(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY)
        extra["priority"] = np.array([priority], dtype=np.int64)
    # One engine request of n sequences per prompt (they share its KV blocks; sequence j of a
    # seeded request draws from seed + j).
    extra["sampling_parameters"] = _sampling_tensor({**sampling, "n": n} if n > 1 else sampling,
                                                    renamed)

    if len(prompts) * n > MAX_SEQUENCES:
        raise bad_request(f"prompt holds {len(prompts)} prompts and n is {n}: "
                          f"{len(prompts) * n} sequences; the limit is {MAX_SEQUENCES} "
                          "(prompts x n)", "n")
    choices = []
    for p, (prompt_inputs, prompt_text) in enumerate(prompts):
        inputs = {**prompt_inputs, **extra,
                  "stream": np.array([True]),
                  "exclude_input_in_output": np.array([True])}
        for j in range(n):  # choice p * n + j is sequence j of prompt p's request
            choices.append(ChoiceRequest(p * n + j, p, inputs, prompt_text if echo else "",
                                         echo))
    return CompletionRequest(chat, served_model, stream, bool(options.get("include_usage")),
                             bool(options.get("continuous_usage_stats")), logprobs, choices,
                             renamed, n=n, prompt_logprobs=body.get("prompt_logprobs"),
                             backend_prompt_logprobs=backend_k, generate=generate,
                             tools=plan, reasoning=chat_format.reasoning if chat else None)


def _tool_plan(body: dict[str, Any], parser_name: str) -> ToolPlan:
    try:
        return plan_tools(body, parser_name)
    except ValueError as e:
        field = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise bad_request(str(e), field) from None


def _prompt_logprobs(own: int | None, echoed: int | None, renamed: dict[str, str]) -> int | None:
    """The ``prompt_logprobs`` the backend is asked for: the client's own (vLLM's field), or
    ``echoed``, the alternatives an echoed prompt's logprobs list (``logprobs``; 0 for an
    echoed token-id prompt, for its tokens' text); both: the larger. A value out of range goes
    on as it is, for the backend to refuse, naming the client's field."""
    if echoed is None:
        return own
    if own is None or (0 <= own <= MAX_LOGPROBS and echoed > own):
        if own is None or echoed > MAX_LOGPROBS:
            renamed["prompt_logprobs"] = "logprobs"  # the backend's errors name the client's
        return echoed
    return own


def _sampling_tensor(sampling: dict[str, Any], renamed: dict[str, str]) -> np.ndarray:
    """``sampling_parameters``, within the backend's limits on its JSON: past them, a 400 that
    names the client's field (of the fields together too big, the one that takes the most)."""
    text = json.dumps(sampling, ensure_ascii=False)
    # NOTE: never deeper than the backend allows: each field nests in sampling_parameters no
    # deeper than in the body, which checks.load_body bounds to MAX_BODY_JSON_DEPTH.
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


def chat_texts(body: dict[str, Any]) -> dict[str, str]:
    """``messages`` and ``tools`` as the JSON the backend gets, within its limits on that
    JSON: together no longer than one prompt's (the larger named), each nested no deeper."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects",
                          "messages")
    texts = {"messages": json.dumps(messages, ensure_ascii=False)}
    if body.get("tools"):
        texts["tools"] = json.dumps(body["tools"], ensure_ascii=False)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:  # checked by the engine's ChatPrompt (names, size, special tokens)
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object of template variables",
                              "chat_template_kwargs")
        texts["chat_template_kwargs"] = json.dumps(kwargs, ensure_ascii=False)
    total = sum(len(text) for text in texts.values())
    if total > MAX_MESSAGES_JSON_BYTES:
        name = max(texts, key=lambda k: len(texts[k]))
        together = f", of the {total} of messages and tools together" if len(texts) > 1 else ""
        raise bad_request(f"{name} is {len(texts[name])} characters as JSON{together}; the "
                          f"limit is {MAX_MESSAGES_JSON_BYTES}", name)
    for name, text in texts.items():
        try:  # the backend's own bounds, named for the client here
            check_json_bounds(name, text, MAX_MESSAGES_JSON_BYTES, MAX_MESSAGES_JSON_DEPTH
                              if name == "messages" else MAX_SAMPLING_JSON_DEPTH)
        except BadRequestError as e:
            raise bad_request(str(e), name) from None
    return texts


def _chat_prompt(texts: dict[str, str], plan: ToolPlan | None
                 ) -> list[tuple[dict[str, np.ndarray], str]]:
    """``messages`` goes to the backend as JSON (the engine's ChatPrompt checks each
    message), the tools the plan offers beside them (``tools``), as the client sent them."""
    inputs = {"messages": _bytes_tensor(texts["messages"])}
    if plan is not None and plan.tools:
        inputs["tools"] = _bytes_tensor(texts["tools"])
    if "chat_template_kwargs" in texts:
        inputs["chat_template_kwargs"] = _bytes_tensor(texts["chat_template_kwargs"])
    return [(inputs, "")]


def _check_prompt_logprobs(prompts: list[tuple[dict[str, np.ndarray], str]], n: int, k: int,
                           renamed: dict[str, str]) -> None:
    """A token-id prompt's logprobs, bounded here (a text's by the backend, once tokenized)."""
    for inputs, _ in prompts:
        if "input_ids" in inputs:
            try:
                check_prompt_logprobs(inputs["input_ids"].size, n, k)
            except ValueError as e:
                name = renamed.get("prompt_logprobs", "prompt_logprobs")
                raise bad_request(name + str(e).removeprefix("prompt_logprobs"), name) from None

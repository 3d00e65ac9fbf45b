"""A ``/v1/responses`` body -> a chat completions body, parsed by the chat path
(:func:`~kvflow.openai_api.protocol.parse_completion_request`): the Responses API is a thin
adapter, and every option is checked and sent where chat's is.

- ``input`` (a string, or items: messages of ``input_text``/``output_text`` parts,
  ``function_call``, ``function_call_output``; ``reasoning`` items are dropped, as chat
  templates drop earlier turns' reasoning) and ``instructions`` (a system turn first) ->
  ``messages``; with ``previous_response_id``, the stored conversation goes before the input
  (its instructions do not carry over, as in OpenAI's API). The rendered prompt then begins
  with the previous turn's, so the engine's prefix cache serves it.
- Function ``tools`` and ``tool_choice`` -> chat's; a built-in tool (web search, file search,
  computer use, ...) is a 400 naming it. ``text.format`` -> ``response_format`` (a JSON schema
  goes through the structured-output path). ``max_output_tokens`` ->
  ``max_completion_tokens``; ``temperature``, ``top_p``, ``user``, ``parallel_tool_calls`` and
  kvflow's sampling extras as they are.
- ``truncation`` ``auto`` is refused (kvflow drops no input; a prompt past the context is a
  400); ``store`` (default true), ``metadata``, ``reasoning`` and ``include`` are echoed.

Errors name the client's field: the chat path's (``messages``, ``max_completion_tokens``,
``response_format``) are renamed (:func:`client_error`). Pure Python.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.fields import SAMPLING_FIELDS
from kvflow.openai_api.protocol import ChatFormat, CompletionRequest, parse_completion_request
from kvflow.orchestrator.sampling.params import short_repr

# Fields read here; the chat path checks the types of those it is handed.
RESPONSES_FIELDS = ("model", "input", "instructions", "tools", "tool_choice",
                    "parallel_tool_calls", "text", "max_output_tokens", "temperature", "top_p",
                    "stream", "stream_options", "store", "previous_response_id", "metadata",
                    "reasoning", "truncation", "include", "user", "background", "top_logprobs",
                    "max_tool_calls", "prompt_cache_key", "safety_identifier", "service_tier",
                    "prompt_cache_retention", "prompt_cache_options")
# kvflow's sampling extras, passed to the chat path as they are.
EXTRA_FIELDS = tuple(f for f in SAMPLING_FIELDS if f not in ("temperature", "top_p"))
# Accepted and echoed or ignored: they change nothing kvflow serves.
INCLUDABLE = ("reasoning.encrypted_content", "message.input_image.image_url",
              "file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url")
# The chat path's field -> the Responses field the client sent.
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text.format"}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


@dataclass
class ResponsesRequest:
    """A parsed ``/v1/responses`` request: the chat request it runs as, the conversation it
    continues (``history``: chat messages, without instructions), and what the response
    object echoes."""

    chat: CompletionRequest
    history: list[dict[str, Any]]
    echo: dict[str, Any]
    store: bool = True
    id: str = field(default_factory=lambda: "resp_" + secrets.token_hex(24))
    created_at: int = field(default_factory=lambda: int(time.time()))


def parse_responses_request(body: Any, served_model: str, fmt: ChatFormat,
                            previous: dict[str, Any] | None,
                            lora_name: str | None = None) -> ResponsesRequest:
    """Translate ``body`` (``previous``: the stored record ``previous_response_id`` names,
    already found) and parse it as a chat request (``lora_name``: the adapter its ``model``
    selects, as :func:`.protocol.parse_completion_request` takes it).

    Raises:
        OpenAIError: a 400 naming the field, 404 for another model.
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body)
    history = conversation(previous) if previous is not None else []
    new = input_messages(body.get("input"))
    chat: dict[str, Any] = {"messages": _with_instructions(body.get("instructions"),
                                                           history + new)}
    for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls", "stream",
                 *EXTRA_FIELDS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = function_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        parsed = parse_completion_request(chat, served_model, True, fmt, lora_name)
    except OpenAIError as e:
        raise client_error(e) from None
    parsed.renamed = {k: RENAMED.get(v, v) for k, v in parsed.renamed.items()}
    parsed.renamed.setdefault("max_tokens", "max_output_tokens")
    store = body.get("store") is not False
    return ResponsesRequest(parsed, history + new, _echo(body, served_model), store)


def client_error(error: OpenAIError) -> OpenAIError:
    """``error`` (the chat path's, or the backend's) naming the Responses field the client
    sent."""
    param = error.param
    if param is None:  # the backend's, renamed already: its message begins with the field
        named = [f for f in set(RENAMED.values()) if error.message.startswith(f + " ")]
        if not named:
            return error
        return OpenAIError(error.status, error.message, named[0], error.type, error.code)
    if param.split(".")[0].split("[")[0] not in (*RENAMED, "tools", "prompt"):
        return error
    head = param.split(".")[0].split("[")[0]
    new_head = "input" if head == "prompt" else RENAMED.get(head, head)
    message = error.message
    if message.startswith(head):
        message = new_head + message[len(head):]
    message = message.replace(".function.", ".")  # tools[i].function.x -> tools[i].x
    return OpenAIError(error.status, message, new_head + param[len(head):], error.type,
                       error.code)


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(k for k in body if k not in RESPONSES_FIELDS and k not in EXTRA_FIELDS)
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(map(repr, unknown[:5]))}; known: "
                          f"{', '.join(sorted(RESPONSES_FIELDS))} and kvflow's sampling "
                          "fields", unknown[0])
    kinds = {"instructions": str, "previous_response_id": str, "store": bool,
             "include": list, "reasoning": dict, "text": dict, "metadata": dict,
             "stream_options": dict, "background": bool}
    for name, kind in kinds.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            what = {str: "a string", bool: "a boolean", list: "a list", dict: "an object"}[kind]
            raise bad_request(f"{name} must be {what}, got {short_repr(value)}", name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request(f"truncation must be 'disabled' (kvflow drops no input: a prompt past "
                          f"the context is refused), got {short_repr(body['truncation'])}",
                          "truncation")
    for name in ("background", "max_tool_calls", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise bad_request(f"{name} is not supported by kvflow's /v1/responses (got "
                              f"{short_repr(body[name])})", name)
    for i, value in enumerate(body.get("include") or ()):
        if value not in INCLUDABLE:
            raise bad_request(f"include[{i}] {short_repr(value)} is not served by kvflow; it "
                              f"accepts {', '.join(INCLUDABLE)}", "include")
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"metadata holds {len(metadata)} pairs; the limit is "
                          f"{MAX_METADATA_PAIRS}", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) \
                or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata[{short_repr(key, 40)}]: keys are at most "
                              f"{MAX_METADATA_KEY} characters, values strings of at most "
                              f"{MAX_METADATA_VALUE}", "metadata")


def _with_instructions(instructions: str | None,
                       messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": instructions}] if instructions else []) + messages


def conversation(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's whole conversation as chat messages: what came before it, then
    its output (whose items are valid input items)."""
    history: list[dict[str, Any]] = record["history"]
    return history + input_messages(record["response"]["output"], "previous_response_id")


def input_messages(value: Any, where: str = "input") -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages; a 400 names the item."""
    if value is None:
        raise bad_request("input is required: a string, or a list of input items", "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"input must be a string or a list of items, got {short_repr(value)}",
                          "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at} must be an object, got {short_repr(item)}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{at}.role must be user, system, developer or assistant, "
                                  f"got {short_repr(role)}", where)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_parts(item.get("content"), f"{at}.content",
                                                    where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", at, where), "type": "function",
                    "function": {"name": _string(item, "name", at, where),
                                 "arguments": _string(item, "arguments", at, where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn, several calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at, where),
                             "content": output if isinstance(output, str)
                             else _text_parts(output, f"{at}.output", where)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{at}.type {short_repr(kind)} is not served by kvflow; input "
                              "items are message, function_call, function_call_output and "
                              "reasoning", where)
    return messages


def _string(item: dict[str, Any], name: str, at: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{name} must be a string, got {short_repr(value)}", where)
    return value


def _text_parts(content: Any, at: str, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            raise bad_request(f"{at}[{j}] is {short_repr(kind)}: kvflow serves text parts "
                              "(input_text, output_text) only", where)
    return parts


def function_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' function tools in chat's shape; a built-in tool is a 400 naming it."""
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list, got {short_repr(tools)}", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] is the built-in tool {short_repr(kind)}, which "
                              "kvflow does not serve: only function tools (type: function)",
                              "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    if kind in ("allowed_tools", "mcp", "custom"):
        raise bad_request(f"tool_choice of type {kind} is not supported by kvflow",
                          "tool_choice")
    raise bad_request(f"tool_choice {short_repr(value)} names the built-in tool "
                      f"{short_repr(kind)}, which kvflow does not serve: only function tools",
                      "tool_choice")


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt["schema"]}}
    raise bad_request(f"text.format must be an object whose type is text, json_object or "
                      f"json_schema, got {short_repr(fmt)}", "text.format")


def _echo(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    text = body.get("text") or {}
    return {"model": model, "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [],
            "text": {"format": text.get("format") or {"type": "text"}},
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"), "store": body.get("store") is not False,
            "truncation": "disabled", "user": body.get("user"), "background": False,
            "service_tier": "default"}

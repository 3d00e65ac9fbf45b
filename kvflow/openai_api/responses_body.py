"""The Responses API's objects: the response (:func:`response_object`), its output items (a
chat message read into ``reasoning``, ``message`` and ``function_call`` items,
:func:`output_items`), its status and usage. Both the whole answer and the stream
(:mod:`.responses_stream`) build them here. Pure Python.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvflow.openai_api.completion_bodies import ChoiceState, usage
from kvflow.openai_api.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def reasoning_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str = "") -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A whole chat message (``reasoning_content``, ``content``, ``tool_calls``) as output
    items, in that order."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], status))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(message.get("content") or "", status))
    for call in message.get("tool_calls") or ():
        items.append(function_call_item(call["id"], call["function"]["name"],
                                        call["function"]["arguments"], status))
    return items


def outcome(state: ChoiceState) -> tuple[str, dict[str, Any] | None]:
    """The response's status and ``incomplete_details`` from its choice's finish: cut by
    ``max_output_tokens`` (or a tool call cut by a stop string) or by ``timeout_ms`` is
    ``incomplete``."""
    reason = (state.output.finish_reason(state.finish_reason) if state.output is not None
              else state.finish_reason)
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "timeout":
        return "incomplete", {"reason": "timeout"}
    return "completed", None


def response_usage(request: ResponsesRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """Usage in the Responses API's words: input (cached among them), output (reasoning
    among them) and total tokens."""
    chat = usage(request.chat, states)
    details = chat.get("completion_tokens_details") or {}
    cached = chat["prompt_tokens_details"]["cached_tokens"]
    # cache_write_tokens: the input tokens computed now (the KV cache keeps them, its prefix
    # cache every full block of them).
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached,
                                     "cache_write_tokens": chat["prompt_tokens"] - cached},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


def response_object(request: ResponsesRequest, status: str, output: list[dict[str, Any]],
                    usage_: dict[str, Any] | None = None,
                    incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object (``status``: in_progress, completed, incomplete or failed)."""
    return {"id": request.id, "object": "response", "created_at": request.created_at,
            "status": status, "error": error, "incomplete_details": incomplete,
            "output": output, "usage": usage_, **request.echo}


def whole_response(request: ResponsesRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """The answer to a request that was not streamed, from its one choice's state."""
    state = states[0]
    message = (state.output.message(state.text) if state.output is not None
               else {"role": "assistant", "content": state.text})
    status, incomplete = outcome(state)
    return response_object(request, status, output_items(message, status),
                           response_usage(request, states), incomplete)


def stored_record(request: ResponsesRequest, response: dict[str, Any]) -> dict[str, Any]:
    """What the store keeps of a response: it, and the conversation before its output."""
    return {"history": request.history, "response": response}

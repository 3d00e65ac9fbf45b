"""A streamed ``/v1/responses`` answer: chat's streamed deltas (``reasoning_content``,
``content``, ``tool_calls``, read by the same parsers as chat's) as the Responses API's
semantic events, each ``event: <type>`` with its JSON and a ``sequence_number``:

``response.created``, ``response.in_progress``; per output item ``response.output_item.added``,
for a message or reasoning ``response.content_part.added``, then its deltas
(``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), its ``.done`` events and
``response.output_item.done``; at the end ``response.completed``, ``response.incomplete``
(cut by ``max_output_tokens``) or ``response.failed``. Pure Python.
"""

from __future__ import annotations

import copy
from typing import Any

from kvflow.openai_api.completion_bodies import ChoiceState
from kvflow.openai_api.errors import OpenAIError
from kvflow.openai_api.responses_body import (
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_object,
    response_usage,
)
from kvflow.openai_api.responses_request import ResponsesRequest
from kvflow.openai_api.streaming import event


class ResponseEvents:
    """The events of one streamed response, built as its chat deltas arrive."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # chat's call index -> its item

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event(body, kind)

    def start(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``."""
        body = response_object(self.request, "in_progress", [])
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def delta(self, message: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta message."""
        out: list[bytes] = []
        if message.get("reasoning_content"):
            out += self._text("reasoning", message["reasoning_content"])
        if message.get("content"):
            out += self._text("message", message["content"])
        for call in message.get("tool_calls") or ():
            out += self._call(call)
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        item = self._open
        if item is None or item["type"] != kind:
            out += self._close()
            item = (reasoning_item("", "in_progress") if kind == "reasoning"
                    else message_item("", "in_progress"))
            item["content"] = []
            out += self._add(item)
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else output_text(""))
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.items) - 1, content_index=0,
                                   part=copy.deepcopy(part)))
        item["content"][0]["text"] += text
        if not text:
            return out
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                   output_index=len(self.items) - 1, content_index=0,
                                   delta=text))
        else:
            out.append(self._event("response.output_text.delta", item_id=item["id"],
                                   output_index=len(self.items) - 1, content_index=0,
                                   delta=text, logprobs=[]))
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        item = self._calls.get(call["index"])
        if item is None:
            out += self._close()
            item = function_call_item(call.get("id") or new_id("call"), fn.get("name") or "",
                                      "", "in_progress")
            self._calls[call["index"]] = item
            out += self._add(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self.items.index(item),
                                   delta=fn["arguments"]))
        return out

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=copy.deepcopy(item))]

    def _close(self, status: str = "completed") -> list[bytes]:
        """The ``.done`` events of the item being written."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                       output_index=index, content_index=0, text=part["text"]))
            else:
                out.append(self._event("response.output_text.done", item_id=item["id"],
                                       output_index=index, content_index=0, text=part["text"],
                                       logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, states: list[ChoiceState], status: str,
               incomplete: dict[str, Any] | None) -> tuple[list[bytes], dict[str, Any]]:
        """The closing events, and the finished response object."""
        out = self._close(status)
        for item in self.items:  # calls closed before the last one was written
            item["status"] = status
        if not self.items:  # an empty answer is still one (empty) message
            out += self._text("message", "") + self._close(status)
        body = response_object(self.request, status, self.items,
                               response_usage(self.request, states), incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=body)], body

    def failed(self, error: OpenAIError) -> bytes:
        """``response.failed``, with the error."""
        body = response_object(self.request, "failed", self.items,
                               error={"code": error.code or "server_error",
                                      "message": error.message})
        return self._event("response.failed", response=body)

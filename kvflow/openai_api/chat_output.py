"""One chat choice's generated text -> OpenAI's assistant message: ``reasoning_content`` (the
server's ``--reasoning-parser``), ``content`` and ``tool_calls`` (the request's
:class:`~kvflow.openai_api.tools.ToolPlan`), whole or as streamed deltas. A stream's deltas
always reassemble to the whole message: both read the same parsers. Pure Python.

Reasoning is split first; tool calls are read from the content that remains. A call cut off
(by ``max_tokens`` or by a stop string: under ``tool_choice`` required, named, or a begun
``hermes`` call in ``auto``, the stop string can cut the constrained JSON) is no finished call:
the choice finishes with ``length``, never ``tool_calls``. The reasoning
tokens are counted per backend response: a response's new tokens go to reasoning in
proportion to the characters of its text that fall inside the reasoning span (its markers
included), so the count is exact whenever each response carries one token.
"""

from __future__ import annotations

from typing import Any

from kvflow.openai_api.reasoning import ReasoningParser
from kvflow.openai_api.tool_parsers import ToolDelta, ToolStream
from kvflow.openai_api.tools import ToolPlan


class ChatOutput:
    """Reads one chat choice's text as it arrives (:meth:`feed`; ``final`` with the last
    piece) or whole (:meth:`message`)."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.plan = plan if plan is not None and plan.parser is not None else None
        self.reasoning = reasoning
        self._reasoning_stream = reasoning.stream() if reasoning else None
        self._tool_stream: ToolStream | None = (
            self.plan.parser.stream() if self.plan is not None and self.plan.parser else None)
        self._responses: list[tuple[int, int, int]] = []  # (text from, to, new tokens)
        self.has_calls = False
        self.calls_complete = True  # every call read ended (and the constrained list did)

    def count(self, text: str, delta: str, new_tokens: int) -> None:
        """Note that ``new_tokens`` brought ``delta``, which ends ``text``."""
        if self.reasoning is not None and new_tokens > 0:
            self._responses.append((len(text) - len(delta), len(text), new_tokens))

    def reasoning_tokens(self, text: str) -> int:
        """How many of the tokens counted went to reasoning, in the whole ``text``: each
        response's in proportion to its characters inside the reasoning span (a response
        without text: whether it came inside the span)."""
        span = self.reasoning.span(text) if self.reasoning is not None else None
        if span is None:
            return 0
        start, end = span[0], len(text) + 1 if span[1] is None else span[1]
        total = 0
        for a, b, tokens in self._responses:
            if a == b:
                total += tokens if start <= a < end else 0
            else:
                inside = max(0, min(b, end) - max(a, start))
                total += round(tokens * inside / (b - a))
        return total

    def feed(self, delta: str, final: bool = False) -> dict[str, Any]:
        """The delta message fields that ``delta`` makes certain (maybe none); ``final``: the
        output is complete, and everything left comes too."""
        reasoning, content = (self._reasoning_stream.feed(delta) if self._reasoning_stream
                              else ("", delta))
        if final and self._reasoning_stream is not None:
            more_reasoning, more_content = self._reasoning_stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tool_stream is None:
            pieces = [ToolDelta(content=content)] if content else []
        else:
            pieces = self._tool_stream.feed(content) if content else []
            if final:
                pieces += self._tool_stream.finish()
                self.calls_complete = self._tool_stream.complete
        return self._merge(reasoning, pieces)

    def _merge(self, reasoning: str, pieces: list[ToolDelta]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        content = "".join(p.content for p in pieces if p.index is None)
        if content:
            out["content"] = content
        calls: dict[int, dict[str, Any]] = {}
        for p in pieces:
            if p.index is None or (self.plan is not None and not self.plan.parallel
                                   and p.index > 0):
                continue
            self.has_calls = True
            call = p.to_openai()["tool_calls"][0]
            if p.index in calls:
                calls[p.index]["function"]["arguments"] += call["function"]["arguments"]
            else:
                calls[p.index] = call
        if calls:
            out["tool_calls"] = [calls[i] for i in sorted(calls)]
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of ``text``."""
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content or ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.plan is not None:
            assert self.plan.parser is not None
            read = self.plan.parser.read(content)
            calls = read.calls if self.plan.parallel else read.calls[:1]
            self.calls_complete = read.complete
            if calls:
                self.has_calls = True
                message["content"] = read.content or None
                message["tool_calls"] = [c.to_openai() for c in calls]
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for an output that stopped after whole calls; ``length``
        for one that stopped inside a call (a stop string cut its JSON: the arguments do
        not parse, and a client must not run it)."""
        if reason != "stop":
            return reason
        if not self.calls_complete:
            return "length"
        return "tool_calls" if self.has_calls else reason

"""Tool calls out of generated text: the ``hermes``, ``llama3_json`` and ``pythonic`` formats,
whole and streamed. Pure Python.

A :class:`ToolParser` turns a whole output into its ``content`` (the text outside calls) and
its :class:`ToolCall` list. :meth:`ToolParser.stream` gives a :class:`ToolStream`, fed the
output's text as it arrives, that emits OpenAI's deltas: content, then per call its id and
function name first and its argument text in fragments. A stream's deltas always reassemble
to what :meth:`ToolParser.parse` gives for the whole text: both read the same partial parse
(:meth:`ToolParser.partial`), the stream emitting only what can no longer change.

Formats (vLLM's parser names):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with
  text around them (Hermes, Qwen 2.5; kvflow's fallback prompt for templates without tools);
* ``llama3_json``: the whole output one JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` also read), optionally after ``<|python_tag|>``, several separated by ``;``;
* ``pythonic``: ``[f(a=1, b="x"), g()]``, Python call syntax with literal arguments (Llama 4,
  Llama 3.2); its arguments are emitted once the list is complete.
"""

from __future__ import annotations

import ast
import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvflow.openai_api.json_scan import PartialCall, object_call


@dataclass
class ToolCall:
    """One call: its id, the function's name and its arguments as JSON text (the model's own,
    as generated)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Partial:
    """A partial parse: the content that can no longer change, and the calls so far."""

    content: str
    calls: list[PartialCall]


@dataclass
class ToolDelta:
    """One streamed piece: content text, or for call ``index`` its id and name (the first
    piece of a call) or an argument fragment."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.index is None:
            return {"content": self.content}
        fn: dict = {"arguments": self.arguments}
        call: dict = {"index": self.index, "function": fn}
        if self.id is not None:
            call.update(id=self.id, type="function")
            fn["name"] = self.name
        return {"tool_calls": [call]}


class ToolParser(ABC):
    """Reads tool calls out of an output; see the module docstring."""

    name = ""

    @abstractmethod
    def partial(self, text: str, final: bool) -> Partial:
        """What ``text`` holds so far (``final``: it is the whole output)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls of a whole output. A call cut off after its name (the
        output ended inside it: ``finish_reason`` is then ``length``) keeps the arguments it
        has, as a stream would have sent them; one cut off before is content."""
        p = self.partial(text, final=True)
        calls = [ToolCall(c.name, c.arguments or ("{}" if c.complete else ""))
                 for c in p.calls if c.name is not None]
        return _visible(p.content, True, bool(calls)), calls

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """Incremental deltas of one output (:meth:`ToolParser.stream`)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # the calls begun: name sent, arguments so far
        self.args_sent: list[int] = []

    def feed(self, delta: str) -> list[ToolDelta]:
        """The deltas ``delta`` makes certain."""
        self.text += delta
        return self._emit(self.parser.partial(self.text, final=False), final=False)

    def finish(self) -> list[ToolDelta]:
        """The output is complete: everything left."""
        p = self.parser.partial(self.text, final=True)
        p.calls = [c for c in p.calls if c.name is not None]
        return self._emit(p, final=True)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _emit(self, p: Partial, final: bool) -> list[ToolDelta]:
        out: list[ToolDelta] = []
        content = _visible(p.content, final, bool(p.calls) or bool(self.calls))
        if len(content) > self.content_sent:
            out.append(ToolDelta(content=content[self.content_sent:]))
            self.content_sent = len(content)
        for i, c in enumerate(p.calls):
            if c.name is None:
                break  # arguments before the name: held until the name is known
            if i == len(self.calls):
                call = ToolCall(c.name, "")
                self.calls.append(call)
                self.args_sent.append(0)
                out.append(ToolDelta(index=i, id=call.id, name=c.name))
            if len(c.arguments) > self.args_sent[i]:
                fragment = c.arguments[self.args_sent[i]:]
                out.append(ToolDelta(index=i, arguments=fragment))
                self.calls[i].arguments += fragment
                self.args_sent[i] = len(c.arguments)
        return out


def _visible(content: str, final: bool, has_calls: bool) -> str:
    """The content a client sees: while streaming, trailing whitespace is held back (a call may
    follow it), and whitespace alone is no content; in the end, around calls, the same."""
    if not final:
        content = content.rstrip()
        return content if content.strip() else ""
    if has_calls:
        return content.rstrip() if content.strip() else ""
    return content


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (held back from
    content while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


# --- the formats ----------------------------------------------------------------------------------
class HermesParser(ToolParser):
    """``<tool_call>{...}</tool_call>`` blocks among text."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def partial(self, text: str, final: bool) -> Partial:
        content: list[str] = []
        calls: list[PartialCall] = []
        i = 0
        while True:
            j = text.find(self.START, i)
            if j < 0:
                rest = text[i:]
                keep = 0 if final else held_back(rest, self.START)
                content.append(rest[:len(rest) - keep])
                break
            content.append(text[i:j])
            k = j + len(self.START)
            while k < len(text) and text[k] in " \n\t\r":
                k += 1
            if k >= len(text):
                if final:
                    content.append(text[j:])
                break
            if text[k] != "{":  # not a call after all: the marker is text
                content.append(text[j:k])
                i = k
                continue
            call, end = object_call(text, k, ("arguments", "parameters"))
            if not call.complete:
                if final and call.name is None:
                    content.append(text[j:])  # cut off before its name: text
                else:
                    calls.append(call)
                break
            close = text.find(self.END, end)
            if close < 0 and not final:
                calls.append(PartialCall(call.name, call.arguments, False))
                break
            calls.append(call)
            i = close + len(self.END) if close >= 0 else len(text)
        return Partial("".join(content), calls)


class Llama3JsonParser(ToolParser):
    """The whole output is ``{"name": ..., "parameters": {...}}`` (``;``-separated for
    several), optionally after ``<|python_tag|>``; any other output is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def partial(self, text: str, final: bool) -> Partial:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG):
            stripped = stripped[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(stripped) and stripped:
            return Partial("", [])  # may be the tag: wait
        if not stripped:
            return Partial("" if not final else text, [])
        if stripped[0] != "{":
            return Partial(text, [])
        calls: list[PartialCall] = []
        i = 0
        while i < len(stripped):
            call, end = object_call(stripped, i, ("parameters", "arguments"))
            calls.append(call)
            if not call.complete:
                break
            i = end
            while i < len(stripped) and stripped[i] in " \n\t\r;":
                i += 1
            if i < len(stripped) and stripped[i] != "{":
                break
        if final and (not calls or not all(c.complete for c in calls)):
            return Partial(text, [])  # not calls after all
        return Partial("", calls)


class JsonListParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``: the output under ``tool_choice``
    ``required`` or a named function, which llguidance holds to this shape
    (:func:`kvflow.openai_api.tools.required_schema`). Not a ``--tool-call-parser``."""

    name = "json_list"

    def partial(self, text: str, final: bool) -> Partial:
        stripped = text.lstrip()
        if not stripped or stripped[0] != "[":
            return Partial(text if final else "", [])
        calls: list[PartialCall] = []
        i = 1
        while True:
            while i < len(stripped) and stripped[i] in " \n\t\r,":
                i += 1
            if i >= len(stripped) or stripped[i] != "{":
                break
            call, i = object_call(stripped, i, ("parameters", "arguments"))
            calls.append(call)
            if not call.complete:
                break
        return Partial("", calls)


class PythonicParser(ToolParser):
    """``[f(a=1, b="x"), g()]``: Python calls with literal arguments, emitted once the list
    is complete (a partial Python expression cannot be read safely)."""

    name = "pythonic"

    def partial(self, text: str, final: bool) -> Partial:
        stripped = text.strip()
        if not stripped:
            return Partial("" if not final else text, [])
        if stripped[0] != "[":
            return Partial(text, [])
        calls = _python_calls(stripped)
        if calls is None:
            return Partial(text if final else "", [])
        return Partial("", [PartialCall(n, a, True) for n, a in calls])


def _python_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    out = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        if None in args:
            return None
        out.append((node.func.id, json.dumps(args)))
    return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser)}


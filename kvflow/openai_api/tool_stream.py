"""The machinery of reading tool calls out of generated text, whole and streamed: a
:class:`ToolStream` fed the text as it arrives, emitting OpenAI's deltas (content, then per call
its id and function name first and its argument text in fragments), and a :class:`ToolParser`
that reads a whole output by feeding it to one stream at once, so that a stream's deltas
reassemble to the whole parse however the text is split. The formats are
:mod:`kvflow.openai_api.tool_parsers`'. Pure Python, synchronous: safe in a worker thread.

A stream keeps its place between pieces (the state of its format, the JSON scan of the call it
is in, a marker's first characters held back), so a streamed output costs O(its length),
whatever the number of pieces. Model output never raises: what cannot be read as calls is
content (or, after a call, left out), and a call cut off keeps the arguments it has
(:attr:`ToolStream.complete` is then False, and ``finish_reason`` ``length``).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvflow.openai_api.json_scan import ObjectScanner


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


@dataclass
class ParsedOutput:
    """A whole output read: its content (the text outside calls), its calls, and whether
    every call (and, for a constrained list, the list) ended (:attr:`ToolStream.complete`)."""

    content: str
    calls: list[ToolCall]
    complete: bool


class ToolStream(ABC):
    """The incremental reading of one output (:meth:`ToolParser.stream`): :meth:`feed` each
    piece of text, then :meth:`finish`; each returns the deltas it makes certain.

    A format implements :meth:`_step` (read from ``text[i]`` on, in the state it is in;
    return where it stopped, or hold the end back with :meth:`_hold`) and :meth:`_end` (the
    output is over). Content goes through :meth:`_content` (whitespace is held back: a call
    may follow it, and whitespace alone around calls is no content), calls through
    :meth:`_call_progress`."""

    # The keys an object call's arguments may come under, the first the format's own.
    ARGS_KEYS: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        # The calls begun (name sent); their arguments are whole once the stream finishes.
        self.calls: list[ToolCall] = []
        self.complete = True  # every call begun has ended (a format may ask more)
        self.chars_scanned = 0  # characters looked at, for tests of the cost
        self._out: list[ToolDelta] = []
        self._rest = ""  # the end of the last piece, held back (a marker may begin there)
        self._space: list[str] = []  # content whitespace not yet sent
        self._arguments: list[list[str]] = []  # per call, its argument fragments
        self._scanner: ObjectScanner | None = None
        self._scanner_call: int | None = None  # the index of the current scan's call
        self._scanned_before = 0
        self._final = False
        self._state = "text"  # the format's state: which part of its syntax the text is in

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> list[ToolDelta]:
        """The deltas ``delta`` makes certain."""
        self._run(delta)
        return self._take()

    def finish(self) -> list[ToolDelta]:
        """The output is complete: everything left."""
        self._final = True
        self._run("")
        self._end()
        if self._space and not self.calls:
            self._send_content("".join(self._space))
        self._space.clear()
        for call, parts in zip(self.calls, self._arguments, strict=True):
            call.arguments = "".join(parts)
        return self._take()

    # --- for the formats ---------------------------------------------------------------------
    @abstractmethod
    def _step(self, text: str, i: int) -> int:
        """Read on from ``text[i]``; return where this state stopped (> i, or len(text))."""

    @abstractmethod
    def _end(self) -> None:
        """The output ended in the state the stream is in."""

    def _hold(self, text: str, at: int) -> int:
        """Keep ``text[at:]`` for the next piece (not while finishing); returns len(text)."""
        if not self._final:
            self._rest = text[at:]
        return len(text)

    def _content(self, text: str) -> None:
        """Content text: sent once it is followed by something other than whitespace."""
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._space.append(text)
            return
        self._send_content("".join(self._space) + body)
        self._space = [text[len(body):]] if len(body) < len(text) else []

    def _new_call(self) -> ObjectScanner:
        self._scanner = ObjectScanner(self.ARGS_KEYS)
        self._scanner_call = None
        self._scanned_before = 0
        return self._scanner

    def _call_progress(self) -> None:
        """Send what the current call's scan has made certain: its name, once known, then
        its argument text; once it has closed as a valid call, ``{}`` if it had none."""
        scanner = self._scanner
        assert scanner is not None
        self.chars_scanned += scanner.chars_scanned - self._scanned_before
        self._scanned_before = scanner.chars_scanned
        if scanner.name is None:
            return  # arguments before the name: held until the name is known
        if self._scanner_call is None:
            self._scanner_call = self._begin_call(scanner.name)
        fragment = scanner.take_arguments()
        if scanner.done and scanner.valid and not scanner.has_arguments:
            fragment = "{}"
        self._add_arguments(self._scanner_call, fragment)

    def _begin_call(self, name: str) -> int:
        """A new call named ``name``: its id and name are sent; returns its index."""
        call = ToolCall(name, "")
        self.calls.append(call)
        self._arguments.append([])
        self._out.append(ToolDelta(index=len(self.calls) - 1, id=call.id, name=name))
        return len(self.calls) - 1

    def _add_arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self._arguments[index].append(fragment)
            self._out.append(ToolDelta(index=index, arguments=fragment))

    def _call_cut(self) -> None:
        """The output ended inside the current call."""
        if self._scanner is not None and self._scanner.name is not None:
            self.complete = False

    # --- inside --------------------------------------------------------------------------------
    def _run(self, delta: str) -> None:
        text, self._rest = self._rest + delta, ""
        self.chars_scanned += len(text) - len(delta)
        i = 0
        while i < len(text):
            state = self._state
            j = self._step(text, i)
            assert j > i or self._state != state, "a state reads on or hands over"
            i = j

    def _send_content(self, text: str) -> None:
        if text:
            self._out.append(ToolDelta(content=text))

    def _take(self) -> list[ToolDelta]:
        out, self._out = self._out, []
        return out


class ToolParser(ABC):
    """Reads tool calls out of an output; see the module docstring."""

    name = ""

    @abstractmethod
    def stream(self) -> ToolStream:
        """A stream to feed one output to."""

    def read(self, text: str) -> ParsedOutput:
        """The content, the calls and the completeness of a whole output."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        return ParsedOutput("".join(d.content for d in deltas if d.index is None),
                            stream.calls, stream.complete)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls of a whole output. A call cut off after its name (the
        output ended inside it: ``finish_reason`` is then ``length``) keeps the arguments it
        has, as a stream would have sent them; one cut off before is content."""
        out = self.read(text)
        return out.content, out.calls


class ObjectCallStream(ToolStream):
    """A stream whose calls are JSON objects, with the text held from where a call may begin
    (``_held``: content if it turns out not to be a call)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: list[str] = []

    def _scan_call(self, text: str, i: int) -> int:
        """Feed the current call's scan; returns where it stopped. Text is held while the call
        has no name (it may still turn out to be content)."""
        scanner = self._scanner
        assert scanner is not None
        end = scanner.feed(text, i)
        if scanner.name is None:
            self._held.append(text[i:end])
        else:
            self._held.clear()
        self._call_progress()
        return end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (held back from
    content while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

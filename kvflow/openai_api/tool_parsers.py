"""Tool calls out of generated text: the ``hermes``, ``llama3_json`` and ``pythonic`` formats
(vLLM's parser names), and the JSON list of ``tool_choice`` required, whole and streamed. Pure
Python; the streams' machinery (and the cost, the never-raising) is
:mod:`kvflow.openai_api.tool_stream`'s.

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with
  text around them (Hermes, Qwen 2.5; kvflow's fallback prompt for templates without tools);
* ``llama3_json``: the whole output one JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` also read), optionally after ``<|python_tag|>``, several separated by ``;``;
  text after the calls is left out;
* ``pythonic``: ``[f(a=1, b="x"), g()]``, Python call syntax with literal arguments (Llama 4,
  Llama 3.2); its arguments are emitted once the list is complete; text after it is left out;
* ``json_list`` (not a ``--tool-call-parser``): ``[{"name": ..., "parameters": {...}}, ...]``;
* ``mistral``, ``phi4_mini_json``: :mod:`kvflow.openai_api.tool_parsers_families`.

Each format's stream is a small state machine over the text (``_state``); an object call's JSON
is scanned by :class:`kvflow.openai_api.json_scan.ObjectScanner`.
"""

from __future__ import annotations

import ast
import json

from kvflow.openai_api.tool_parsers_families import MistralParser, Phi4MiniJsonParser
from kvflow.openai_api.tool_stream import (  # noqa: F401  (re-exported)
    ObjectCallStream,
    ParsedOutput,
    ToolCall,
    ToolDelta,
    ToolParser,
    ToolStream,
    held_back,
)

_SPACE = " \n\t\r"


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


class HermesStream(ObjectCallStream):
    """``<tool_call>{...}</tool_call>`` blocks among text."""

    START, END = "<tool_call>", "</tool_call>"

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if state in ("text", "close"):
            marker = self.START if state == "text" else self.END
            j = text.find(marker, i)
            if j < 0:
                self.chars_scanned += len(text) - i
                keep = 0 if self._final else min(held_back(text, marker), len(text) - i)
                if state == "text":
                    self._content(text[i:len(text) - keep])
                return self._hold(text, len(text) - keep)
            self.chars_scanned += j + len(marker) - i
            if state == "text":
                self._content(text[i:j])
                self._held = [marker]
            self._state = "open" if state == "text" else "text"
            return j + len(marker)
        if state == "open":  # after <tool_call>: a JSON object, or the marker was text
            k = _skip(text, i, _SPACE)
            self.chars_scanned += k - i
            self._held.append(text[i:k])
            if k == len(text):
                return k
            if text[k] == "{":
                self._new_call()
                self._state = "call"
            else:
                self._content("".join(self._held))
                self._held.clear()
                self._state = "text"
            return k
        if state == "call":
            end = self._scan_call(text, i)
            scanner = self._scanner
            assert scanner is not None
            if scanner.done:
                if scanner.valid:
                    self._state = "close"
                else:  # not JSON: the rest is content if the call had no name, else left out
                    self._call_cut()
                    self._state = "dead" if scanner.name is not None else "hold"
            return end
        if state == "hold":
            self._held.append(text[i:])
        return len(text)

    def _end(self) -> None:
        named = self._scanner is not None and self._scanner.name is not None
        if self._state in ("open", "hold") or self._state == "call" and not named:
            self._content("".join(self._held))
        elif self._state == "call":
            self._call_cut()


class Llama3JsonStream(ObjectCallStream):
    """The whole output ``{...}`` calls, ``;``-separated, optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"
    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"
        self._tag = 0  # characters of the tag read

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if state == "lead":  # whitespace and the tag, before the first call
            k = i
            while k < len(text):
                ch, m = text[k], self._tag
                if 0 < m < len(self.TAG):
                    if ch != self.TAG[m]:
                        break
                    self._tag += 1
                elif ch == self.TAG[0] and m == 0:
                    self._tag = 1
                elif ch not in _SPACE:
                    break
                k += 1
            self.chars_scanned += k - i + 1
            self._held.append(text[i:k])
            if k < len(text):
                if text[k] == "{" and self._tag in (0, len(self.TAG)):
                    self._new_call()
                    self._state = "call"
                else:  # not a call: all of it is content
                    self._content("".join(self._held))
                    self._held.clear()
                    self._state = "text"
            return k
        if state == "text":
            self._content(text[i:])
        elif state == "call":
            end = self._scan_call(text, i)
            scanner = self._scanner
            assert scanner is not None
            if scanner.done:
                if scanner.valid:
                    self._state = "sep"
                else:
                    self._call_cut()
                    self._state = "hold" if not self.calls else "dead"
            return end
        elif state == "sep":
            k = _skip(text, i, _SPACE + ";")
            self.chars_scanned += k - i
            if k < len(text):
                if text[k] == "{":
                    self._new_call()
                    self._state = "call"
                else:
                    self._state = "dead"
            return k
        elif state == "hold":
            self._held.append(text[i:])
        return len(text)

    def _end(self) -> None:
        named = self._scanner is not None and self._scanner.name is not None
        if self._state in ("lead", "hold") or self._state == "call" and not named:
            if not self.calls:
                self._content("".join(self._held))
        elif self._state == "call":
            self._call_cut()


class JsonListStream(ObjectCallStream):
    """``[{"name": ..., "parameters": {...}}, ...]``: complete only once the list closes."""

    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if state in ("lead", "list"):
            k = _skip(text, i, _SPACE if state == "lead" else _SPACE + ",")
            self.chars_scanned += k - i
            if state == "lead":
                self._held.append(text[i:k])
            if k == len(text):
                return k
            ch = text[k]
            if state == "lead":
                self._state = "list" if ch == "[" else "hold"
                if ch == "[":
                    self._held.clear()
                    return k + 1
                return k
            if ch == "{":
                self._new_call()
                self._state = "call"
                return k
            self._state = "closed" if ch == "]" else "dead"
            return k + 1
        if state == "call":
            end = self._scan_call(text, i)
            scanner = self._scanner
            assert scanner is not None
            if scanner.done:
                self._state = "list" if scanner.valid else "dead"
            return end
        if state == "hold":
            self._held.append(text[i:])
        return len(text)

    def _end(self) -> None:
        if self._state in ("lead", "hold"):
            self._content("".join(self._held))
        self.complete = self._state == "closed"


class PythonicStream(ToolStream):
    """``[f(a=1), g()]``: held until its brackets close, then read with Python's parser."""

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"
        self._held: list[str] = []
        self._depth = 0
        self._quote = ""  # the quote of the string the scan is in
        self._escaped = self._comment = False

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if state == "lead":
            k = _skip(text, i, _SPACE)
            self.chars_scanned += k - i
            self._held.append(text[i:k])
            if k < len(text):
                self._state = "list" if text[k] == "[" else "text"
                if self._state == "text":
                    self._content("".join(self._held))
                    self._held.clear()
            return k
        if state == "text":
            self._content(text[i:])
        elif state == "list":
            k = self._brackets(text, i)
            self._held.append(text[i:k])
            if self._depth == 0:
                self._read_list()
            return k
        return len(text)

    def _brackets(self, text: str, i: int) -> int:
        """Scan Python's brackets outside strings and comments; returns where the list
        closes (after its bracket) or len(text)."""
        k = i
        while k < len(text):
            ch = text[k]
            k += 1
            if self._comment:
                self._comment = ch != "\n"
            elif self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch == "#":
                self._comment = True
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    break
        self.chars_scanned += k - i
        return k

    def _read_list(self) -> None:
        text = "".join(self._held)
        self._held.clear()
        calls = python_calls(text.strip())
        if calls is None:
            self._content(text)
            self._state = "text"
            return
        for name, arguments in calls:
            self._add_arguments(self._begin_call(name), arguments)
        self._state = "after"

    def _end(self) -> None:
        if self._state == "lead":
            self._content("".join(self._held))
        elif self._state == "list":
            self._read_list()


# Whatever Python's parser and literal_eval raise on text that is not a call list: a model
# writes anything (bytes, sets and complex numbers are literals, but not JSON; nesting can
# exhaust the recursion limit; a literal can overflow).
_NOT_CALLS = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError)


def python_calls(text: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g()]`` -> ``[("f", '{"a": 1}'), ("g", "{}")]``: each call's name and its
    keyword arguments as JSON; None when ``text`` is not such a list (never an exception)."""
    try:
        tree = ast.parse(text, mode="eval")
        if not isinstance(tree.body, ast.List):
            return None
        out = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or \
                    node.args or any(kw.arg is None for kw in node.keywords):
                return None
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
            try:
                arguments.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\ud800"): kept as JSON's escape
                arguments = json.dumps(args, allow_nan=False)
            out.append((node.func.id, arguments))
        return out
    except _NOT_CALLS:
        return None


class HermesParser(ToolParser):
    """``<tool_call>{...}</tool_call>`` blocks among text."""

    name = "hermes"

    def stream(self) -> ToolStream:
        return HermesStream()


class Llama3JsonParser(ToolParser):
    """The whole output ``{"name": ..., "parameters": {...}}`` calls, ``;``-separated,
    optionally after ``<|python_tag|>``; any other output is content."""

    name = "llama3_json"

    def stream(self) -> ToolStream:
        return Llama3JsonStream()


class JsonListParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``: the output under ``tool_choice``
    ``required`` or a named function, which llguidance holds to this shape
    (:func:`kvflow.openai_api.tools.required_schema`). Not a ``--tool-call-parser``."""

    name = "json_list"

    def stream(self) -> ToolStream:
        return JsonListStream()


class PythonicParser(ToolParser):
    """``[f(a=1, b="x"), g()]``: Python calls with literal arguments, emitted once the list
    is complete (a partial Python expression cannot be read safely)."""

    name = "pythonic"

    def stream(self) -> ToolStream:
        return PythonicStream()


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, PythonicParser, MistralParser, Phi4MiniJsonParser)}

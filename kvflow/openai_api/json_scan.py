"""Scanning a JSON object that arrives piece by piece: the tool call it holds, its function's
name and its arguments' raw text, as far as the text goes. Pure Python;
:mod:`kvflow.openai_api.tool_parsers` reads calls out of generated text with it.

:class:`ObjectScanner` keeps its place between pieces (nesting depth, inside a string or not,
which member it is in), so each character is looked at once: reading a streamed call costs
O(its length) however it is split. Only the nesting is tracked while scanning; the object is
checked as JSON once, when it closes.
"""

from __future__ import annotations

import json
import re

# Inside a string only a quote or a backslash matters: jump to the next one.
_STRING_STOP = re.compile(r'["\\]')
_SPACE = " \n\t\r"
# A member's key is read only while it could still be one of the keys asked for (``name``,
# ``arguments``, ``parameters``: at most 16 characters, each perhaps a \uXXXX escape).
_MAX_KEY_CHARS = 6 * 16 + 2
# A function name is at most 64 characters (escaped: 6 each); past this it is no name.
_MAX_NAME_CHARS = 6 * 64 + 2

# Where the scanner is, among the top-level members: expecting a key, inside the key string,
# expecting the colon, expecting a value, inside a value, after a value.
_KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER = range(6)


def loads(text: str) -> object:
    """``json.loads`` that never raises: None for text that is not JSON (or nested past
    Python's recursion limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _utf8(text: str) -> bool:
    """Whether ``text`` can go into a response: JSON's ``\ud800`` escape decodes to a lone
    surrogate, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ObjectScanner:
    """One JSON object, fed from its ``{`` as its text arrives (:meth:`feed`).

    Read so far: :attr:`name` (the top-level ``"name"`` member's string, once the string has
    closed), the raw text of the first top-level member whose key is one of ``args_keys``
    (:meth:`take_arguments` gives what has come since it was last taken), :attr:`done` (the
    object has closed) and :attr:`valid` (it is then a JSON object with a name).
    :attr:`chars_scanned` counts the characters looked at, for tests of the cost.
    """

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.name: str | None = None
        self.done = False
        self.valid = False
        self.has_arguments = False  # an arguments member has begun
        self.chars_scanned = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._phase = _KEY
        self._member = ""  # the key of the top-level member being read ("" once unread)
        self._seen: set[str] = set()  # top-level members read: only the first of each counts
        self._scalar = False  # the current top-level value is a number, true, false, null
        self._raw: list[str] = []  # the object's text so far, checked as JSON once it closes
        self._capturing = False
        self._capture: list[str] | None = None  # the key or value being kept, its pieces
        self._capture_from = 0  # where in the current piece the capture resumes
        self._capture_size = 0
        self._arguments: list[str] = []  # argument text not yet taken

    def take_arguments(self) -> str:
        """The arguments' raw text that has come since the last call."""
        out = "".join(self._arguments)
        self._arguments.clear()
        return out

    def feed(self, text: str, start: int) -> int:
        """Scan ``text[start:]``, up to the object's closing brace; returns where the scan
        stopped (after that brace, or ``len(text)``)."""
        i, n = start, len(text)
        self._capture_from = start
        while i < n:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    i += 1
                    continue
                m = _STRING_STOP.search(text, i)
                if m is None:
                    self.chars_scanned += n - i
                    i = n
                    break
                self.chars_scanned += m.start() - i + 1
                i = m.start()
                if text[i] == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                    if self._depth == 1:
                        self._string_closed(text, i + 1)
                i += 1
                continue
            self.chars_scanned += 1
            ch = text[i]
            if self._depth == 1 and self._scalar and (ch in _SPACE or ch in ",}"):
                self._value_ended(text, i)
            if ch == '"':
                self._in_string = True
                if self._depth == 1:
                    if self._phase == _KEY:
                        self._phase = _IN_KEY
                        self._begin(i, keep=True)
                    elif self._phase == _VALUE:
                        self._value_begins(i)
            elif ch in "{[":
                if self._depth == 1 and self._phase == _VALUE:
                    self._value_begins(i)
                self._depth += 1
                if self._depth == 1:
                    self._phase = _KEY
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1 and self._phase == _IN_VALUE:
                    self._value_ended(text, i + 1)
                elif self._depth <= 0:
                    i += 1
                    self._close(text, start, i)
                    return i
            elif self._depth == 1:
                if ch == ":" and self._phase == _COLON:
                    self._phase = _VALUE
                elif ch == ",":
                    self._phase = _KEY
                elif self._phase == _VALUE and ch not in _SPACE:
                    self._value_begins(i)
                    self._scalar = True
            i += 1
        self._flush(text, n)
        self._raw.append(text[start:n])
        return n

    # --- the top-level members -------------------------------------------------------------
    def _begin(self, i: int, keep: bool) -> None:
        """Start keeping the text from ``i``: a key, the name, or (keep False) arguments,
        which go straight to the text to take."""
        self._capture = [] if keep else None
        self._capture_from = i
        self._capture_size = 0
        self._capturing = True

    def _flush(self, text: str, end: int) -> None:
        """Move the kept text of this piece, up to ``end``, where it goes."""
        if not self._capturing:
            return
        piece = text[self._capture_from:end]
        self._capture_from = end
        if self._capture is None:
            self._arguments.append(piece)
            return
        self._capture_size += len(piece)
        limit = _MAX_KEY_CHARS if self._phase == _IN_KEY else _MAX_NAME_CHARS
        if self._capture_size <= limit:
            self._capture.append(piece)

    def _end_capture(self, text: str, end: int) -> str | None:
        """Stop keeping; the kept text, or None if it grew past its limit (or was not kept)."""
        self._flush(text, end)
        self._capturing = False
        limit = _MAX_KEY_CHARS if self._phase == _IN_KEY else _MAX_NAME_CHARS
        if self._capture is None or self._capture_size > limit:
            return None
        return "".join(self._capture)

    def _string_closed(self, text: str, end: int) -> None:
        if self._phase == _IN_KEY:
            raw = self._end_capture(text, end)
            key = loads(raw) if raw is not None else None
            self._member = key if isinstance(key, str) and key not in self._seen else ""
            if isinstance(key, str):
                self._seen.add(key)
            self._phase = _COLON
        elif self._phase == _IN_VALUE:
            self._value_ended(text, end)

    def _value_begins(self, i: int) -> None:
        self._phase = _IN_VALUE
        if self._member == "name":
            self._begin(i, keep=True)
        elif self._member in self.args_keys and not self.has_arguments:
            self.has_arguments = True
            self._member = "\0arguments"
            self._begin(i, keep=False)
        else:
            self._member = ""

    def _value_ended(self, text: str, end: int) -> None:
        self._scalar = False
        self._phase = _AFTER
        if self._member == "name":
            raw = self._end_capture(text, end)
            value = loads(raw) if raw is not None else None
            self.name = value if isinstance(value, str) and _utf8(value) else None
        elif self._member == "\0arguments":
            self._end_capture(text, end)
        self._member = ""

    def _close(self, text: str, start: int, end: int) -> None:
        self._flush(text, end - 1)
        self._capturing = False
        self._raw.append(text[start:end])
        self.done = True
        value = loads("".join(self._raw))
        self._raw.clear()
        self.valid = isinstance(value, dict) and self.name is not None

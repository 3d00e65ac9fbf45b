"""Tool calls out of generated text in two families' own formats, whole and streamed: a JSON
list of call objects after a marker. Registered in :data:`kvflow.openai_api.tool_parsers.
TOOL_PARSERS` (vLLM's parser names). Pure Python, never raising on model output.

* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3,
  Mistral Nemo, Ministral 8B: what their templates write for an assistant's calls), and the
  newer ``[TOOL_CALLS]name[ARGS]{...}`` (or ``name[CALL_ID]id[ARGS]{...}``), one call per
  marker (Mistral Small 3.2, Devstral, Ministral 3), whose arguments stream as they come;
* ``phi4_mini_json``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``
  (Phi-4-mini's tool tokens; vLLM's ``functools[...]`` spelling is read too).

Both markers are special tokens, which the detokenizer leaves out unless
``skip_special_tokens`` is false: a list of call objects that opens the output is read as the
calls too. Text before a marker is content, as is an output that only looks like a list (its
first object has no ``"name"``); a list's objects take ``"parameters"`` for ``"arguments"``.
Text after a closed list is content again (another marker opens another list); a list cut off
keeps the calls it has, the last cut as :class:`~kvflow.openai_api.tool_stream.ToolStream`
says.
"""

from __future__ import annotations

from kvflow.openai_api.tool_stream import ObjectCallStream, ToolParser, ToolStream, held_back

# The parsers whose call marker is a special token: a chat offering tools under one of them is
# detokenized with skip_special_tokens false unless the client says otherwise (as vLLM does).
SPECIAL_TOKEN_PARSERS = ("mistral", "phi4_mini_json")

_SPACE = " \n\t\r"


class MarkedListStream(ObjectCallStream):
    """Content, then a marker (one of ``MARKERS``) and a JSON list of call objects, optionally
    closed by ``CLOSE``; a list that opens the output needs no marker."""

    MARKERS: tuple[str, ...] = ()
    CLOSE = ""

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"

    def _release(self) -> None:
        """The held text was not a call after all: content."""
        self._content("".join(self._held))
        self._held.clear()

    def _step(self, text: str, i: int) -> int:
        state = self._state
        if state in ("lead", "items"):
            return self._between(text, i)
        if state == "text":
            return self._text(text, i)
        if state == "open":  # after a marker: the list's bracket
            k = i
            while k < len(text) and text[k] in _SPACE:
                k += 1
            self.chars_scanned += k - i
            self._held.append(text[i:k])
            if k == len(text):
                return k
            if text[k] == "[":
                self._held.append("[")
                self._state = "items"
                return k + 1
            if self._named_call(text[k]):
                self._state = "fname"
                return k
            self._release()  # a marker not followed by a list: it was text
            self._state = "text"
            return k
        if state == "call":
            return self._call(text, i)
        if state == "hold":
            self._held.append(text[i:])
            return len(text)
        if state in ("fname", "fid", "args", "raw"):
            return self._named_step(text, i)
        if state == "close":  # after the list: its closing marker, if any
            if not self.CLOSE:
                self._state = "text"
                return i
            k = i
            while k < len(text) and text[k] in _SPACE:
                k += 1
            self.chars_scanned += k - i
            rest = text[k:k + len(self.CLOSE)]
            if k == len(text) or (len(rest) < len(self.CLOSE) and self.CLOSE.startswith(rest)
                                   and not self._final):
                return self._hold(text, i)
            self._state = "text"
            return k + len(self.CLOSE) if rest == self.CLOSE else k
        return len(text)  # dead: the rest is left out

    def _between(self, text: str, i: int) -> int:
        """Before the first call (``lead``: the output's start) or between a list's items."""
        lead = self._state == "lead"
        k = i
        while k < len(text) and (text[k] in _SPACE or not lead and text[k] == ","):
            k += 1
        self.chars_scanned += k - i
        if lead and not self._final and any(
                m.startswith(text[k:]) and len(text) - k < len(m) for m in self.MARKERS):
            return self._hold(text, i)  # may be a marker ("[" of "[TOOL_CALLS]")
        if lead or not self.calls:
            self._held.append(text[i:k])
        if k == len(text):
            return k
        ch = text[k]
        if lead:
            if ch == "[" and not any(text.startswith(m, k) for m in self.MARKERS):
                self._held.append("[")
                self._state = "items"
                return k + 1
            self._release()
            self._state = "text"
            return k
        if ch == "{":
            self._new_call()
            self._state = "call"
            return k
        if ch == "]" and self.calls:
            self._state = "close"
            return k + 1
        if not self.calls:  # "[" then no object: text
            self._release()
            self._state = "text"
            return k
        self._state = "dead"
        return k

    def _text(self, text: str, i: int) -> int:
        found = [(j, m) for m in self.MARKERS if (j := text.find(m, i)) >= 0]
        if not found:
            self.chars_scanned += len(text) - i
            keep = 0 if self._final else min(max(held_back(text, m) for m in self.MARKERS),
                                             len(text) - i)
            self._content(text[i:len(text) - keep])
            return self._hold(text, len(text) - keep)
        j, marker = min(found)
        self.chars_scanned += j + len(marker) - i
        self._content(text[i:j])
        self._held = [marker]
        self._state = "open"
        return j + len(marker)

    def _call(self, text: str, i: int) -> int:
        end = self._scan_call(text, i)
        scanner = self._scanner
        assert scanner is not None
        if scanner.done:
            if scanner.valid:
                self._state = "items"
            elif scanner.name is None and not self.calls:
                self._held.append(text[end:])  # not a call list: all of it is content
                self._state = "hold"
                return len(text)
            else:
                self._call_cut()
                self._state = "dead"
        return end

    def _named_call(self, ch: str) -> bool:
        """Whether the format has ``name[ARGS]{...}`` calls after its marker and ``ch`` may
        begin a name."""
        return False

    def _named_step(self, text: str, i: int) -> int:
        raise AssertionError("a format without name[ARGS] calls never enters their states")

    def _end(self) -> None:
        scanner = self._scanner
        named = scanner is not None and scanner.name is not None
        if self._state == "call" and named or self._state == "raw":
            self.complete = False  # cut inside a call's arguments
        elif self._state in ("open", "fname", "fid") or not self.calls and self._state in (
                "lead", "items", "call", "hold"):
            self._release()
        elif self._state == "args":
            self.complete = False


class MistralStream(MarkedListStream):
    """``[TOOL_CALLS][{...}, ...]``, or ``[TOOL_CALLS]name[ARGS]{...}``."""

    MARKERS = ("[TOOL_CALLS]",)
    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
    MAX_NAME = 64

    def __init__(self) -> None:
        super().__init__()
        self._name: list[str] = []
        self._id: list[str] = []  # a [CALL_ID]'s id: read past (kvflow gives its own ids)
        self._depth = 0
        self._quote = self._escaped = False

    def _named_call(self, ch: str) -> bool:
        return ch.isalnum() or ch in "_-"

    def _named_step(self, text: str, i: int) -> int:
        if self._state in ("fname", "fid"):  # the name (then [CALL_ID] and an id), [ARGS]
            k = i
            while k < len(text) and (text[k].isalnum() or text[k] in "_-"):
                k += 1
            self.chars_scanned += k - i
            part = self._name if self._state == "fname" else self._id
            part.append(text[i:k])
            self._held.append(text[i:k])
            size = sum(map(len, part))
            if k == len(text) and size <= self.MAX_NAME:
                return k
            rest = text[k:k + len(self.CALL_ID)]
            seps = (self.ARGS, self.CALL_ID) if self._state == "fname" else (self.ARGS,)
            sep = next((m for m in seps if rest.startswith(m)), None)
            if sep is not None and 0 < size <= self.MAX_NAME:
                if sep == self.CALL_ID:
                    self._held.append(sep)
                    self._state = "fid"
                    return k + len(sep)
                self._held.clear()
                self._begin_call("".join(self._name))
                self._name.clear()
                self._id.clear()
                self._state = "args"
                return k + len(sep)
            if any(m.startswith(rest) for m in seps) and size <= self.MAX_NAME and \
                    not self._final:
                self._held.pop()  # rescanned with the next piece
                part.pop()
                return self._hold(text, i)
            self._name.clear()
            self._id.clear()
            self._release()
            self._state = "text"
            return k
        if self._state == "args":  # the arguments' object
            k = i
            while k < len(text) and text[k] in _SPACE:
                k += 1
            self.chars_scanned += k - i
            if k < len(text):
                self._state = "raw" if text[k] == "{" else "dead"
                self.complete = self._state == "raw"  # a name without arguments: cut
            return k
        return self._raw(text, i)

    def _raw(self, text: str, i: int) -> int:
        """The arguments' JSON object, sent as it comes, up to its closing brace."""
        k = i
        while k < len(text):
            ch = text[k]
            k += 1
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._quote = False
            elif ch == '"':
                self._quote = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "text"
                    break
        self.chars_scanned += k - i
        self._add_arguments(len(self.calls) - 1, text[i:k])
        return k


class Phi4MiniStream(MarkedListStream):
    """``<|tool_call|>[{...}]<|/tool_call|>`` (or ``functools[{...}]``)."""

    MARKERS = ("<|tool_call|>", "functools")
    CLOSE = "<|/tool_call|>"


class MistralParser(ToolParser):
    """Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``."""

    name = "mistral"

    def stream(self) -> ToolStream:
        return MistralStream()


class Phi4MiniJsonParser(ToolParser):
    """Phi-4-mini's ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``."""

    name = "phi4_mini_json"

    def stream(self) -> ToolStream:
        return Phi4MiniStream()

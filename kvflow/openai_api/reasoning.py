"""Reasoning out of generated text: ``<think>...</think>`` (or a template's own markers) split
into ``reasoning_content`` and ``content``, whole and streamed, as vLLM's ``--reasoning-parser``
does. Pure Python.

The output may open with the start marker, or (templates that put it in the prompt) go
straight into reasoning and only close it: :class:`ReasoningParser` ``starts_open`` says which.
Text before a start marker is content. Without the end marker the whole output (after a start
marker) is reasoning: the model was cut off while thinking.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.openai_api.tool_parsers import held_back


@dataclass
class ReasoningSplit:
    """An output's reasoning and content (``None`` where it has none, as OpenAI sends)."""

    reasoning: str | None
    content: str | None


# --reasoning-parser names -> (start, end) markers. vLLM's deepseek_r1 and qwen3 are the same
# <think> markers.
REASONING_PARSERS = {"think": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>"),
                     "qwen3": ("<think>", "</think>")}


def reasoning_parser(name: str | None, starts_open: bool = False) -> ReasoningParser | None:
    """The parser ``--reasoning-parser name`` asks for (None: none); ``starts_open``: the chat
    template opens the reasoning in the prompt."""
    if name is None:
        return None
    start, end = REASONING_PARSERS[name]
    return ReasoningParser(start, end, starts_open)


class ReasoningParser:
    """Splits reasoning from content; a stream's pieces always join to the whole split."""

    def __init__(self, start: str = "<think>", end: str = "</think>",
                 starts_open: bool = False) -> None:
        self.start, self.end, self.starts_open = start, end, starts_open

    def split(self, text: str) -> ReasoningSplit:
        reasoning, content = self._split(text, final=True)
        return ReasoningSplit(reasoning if reasoning else None, content if content else None)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) so far; while streaming, a possible marker at the end is held
        back."""
        head = ""
        body = text
        if not self.starts_open:
            i = text.find(self.start)
            if i < 0:
                if final:
                    return "", text
                keep = held_back(text, self.start)
                return "", text[:len(text) - keep]
            head, body = text[:i], text[i + len(self.start):]
        j = body.find(self.end)
        if j < 0:
            keep = 0 if final else held_back(body, self.end)
            return body[:len(body) - keep], head
        return body[:j], head + body[j + len(self.end):]

    def span(self, text: str) -> tuple[int, int | None] | None:
        """Where the reasoning begins in ``text`` (its start marker) and ends (after its end
        marker; None while it is open), or None when it has not begun."""
        start = 0
        if not self.starts_open:
            found = text.find(self.start)
            if found < 0:
                return None
            start = found
        end = text.find(self.end, start)
        return start, None if end < 0 else end + len(self.end)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Incremental (reasoning delta, content delta) pairs of one output. It keeps its place
    (before the reasoning, in it, after it) and holds back only the end of a piece that may
    begin a marker, so a streamed output costs O(its length) however it is split."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = "in" if parser.starts_open else "before"
        self._rest = ""

    def feed(self, delta: str) -> tuple[str, str]:
        return self._run(delta, final=False)

    def finish(self) -> tuple[str, str]:
        return self._run("", final=True)

    def _run(self, delta: str, final: bool) -> tuple[str, str]:
        text, self._rest = self._rest + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        i = 0
        while i < len(text):
            if self._state == "after":
                content.append(text[i:])
                break
            before = self._state == "before"
            marker = self.parser.start if before else self.parser.end
            into = content if before else reasoning
            j = text.find(marker, i)
            if j < 0:
                keep = 0 if final else min(held_back(text, marker), len(text) - i)
                into.append(text[i:len(text) - keep])
                self._rest = text[len(text) - keep:]
                break
            into.append(text[i:j])
            self._state = "in" if before else "after"
            i = j + len(marker)
        return "".join(reasoning), "".join(content)

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

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Incremental (reasoning delta, content delta) pairs of one output."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = (0, 0)

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.parser._split(self.text, final)
        r0, c0 = self.sent
        self.sent = (max(r0, len(reasoning)), max(c0, len(content)))
        return reasoning[r0:], content[c0:]


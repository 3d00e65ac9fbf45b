"""Incremental detokenization with stop strings, for streaming one request's output text.

Decoding token by token is not the same as decoding the whole sequence: a SentencePiece
(Metaspace) decoder drops the leading space of the first token it sees, a character can be split
across several byte-level tokens or ``<0xXX>`` byte-fallback tokens, and a group of byte-fallback
tokens that turns out to hold invalid UTF-8 decodes to one U+FFFD per byte. This module follows
vLLM's ``prefix_offset``/``read_offset`` scheme: each step decodes a small window of recent tokens
with and without the new ones and emits the difference once the window's text is final. Text is
held back while it can still change; ``finish()`` flushes it with replacement characters.

Guarantee: with no stop string matched, the deltas from :meth:`IncrementalDetokenizer.step` plus
:meth:`IncrementalDetokenizer.finish` concatenate to the text the output tokens add to the
decoded prompt, ``decode(prompt + output)[len(decode(prompt)):]``, and to
``decode(output)`` when the prompt is empty. The two agree for byte-level BPE tokenizers; for
SentencePiece tokenizers the in-context text keeps the first output token's leading space, which
a standalone ``decode(output)`` strips. This holds however the output tokens are split into
steps, as long as the prompt decodes to a complete text (it does not end inside a character or an
open byte-fallback group).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded as left context of the first output token (vLLM uses the same 5): enough
# for the decoder to see that the first output token does not start the text.
_INITIAL_CONTEXT_TOKENS = 5
# If those tokens all decode to nothing (skipped special tokens), look this far back for text,
# so that a chat template ending in special tokens still gives the first token its leading space.
_MAX_CONTEXT_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"
# The most bytes of a UTF-8 character that can be waiting for the rest of it.
_MAX_OPEN_BYTES = 3


def _is_byte_fallback_token(token: str | None) -> bool:
    """Whether ``token`` is a SentencePiece byte-fallback piece such as ``<0xE2>``."""
    return (
        token is not None
        and len(token) == 6
        and token.startswith("<0x")
        and token.endswith(">")
        and all(c in "0123456789abcdefABCDEF" for c in token[3:5])
    )


def _decoder_has_byte_fallback(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's decoder (or one in its Sequence) is ``ByteFallback``."""
    decoder = tokenizer.decoder
    # The repr lists nested decoders, e.g. "Sequence(decoders=[Replace(...), ByteFallback(), ...".
    return decoder is not None and "ByteFallback" in repr(decoder)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas that are safe to stream.

    Args:
        tokenizer: The model's ``tokenizers.Tokenizer``.
        prompt_token_ids: The prompt; only its last few tokens are kept, as decoding context.
        skip_special_tokens: Leave special tokens out of the text, as ``Tokenizer.decode`` does.
        stop: Strings that end the request when they appear in the text (across tokens too).
        include_stop_str_in_output: Keep the matched stop string at the end of the text.

    Attributes:
        output_text: All text decoded so far: what was emitted plus what is held back because
            it may start a stop string; truncated at the stop string once one matched.
        stop_reason: The stop string that matched, or None.
        stopped: Whether a stop string matched; the request should then be finished, and
            further calls to :meth:`step` return "".

    When several stop strings occur, the one that is complete first in the text wins (on a tie,
    the one that starts first): that is the one a character-by-character scan would stop at,
    so the result does not depend on how the tokens were split into steps.

    Each :meth:`step` costs O(window + longest stop string), not O(output length): it decodes
    only the tokens since the last emitted boundary plus the tokens emitted at that boundary.
    The window grows only while the text cannot be final yet: an unfinished character (its
    last 3 tokens at most), an open run of byte-fallback tokens, or tokens that decode to
    nothing.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for i, s in enumerate(stop):
            if not s:
                # An empty stop string would match before the first character of every output.
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._stop_first_chars = frozenset(s[0] for s in self._stop)
        self._byte_fallback = _decoder_has_byte_fallback(tokenizer)
        self._special_ids: frozenset[int] | None = None  # computed on first need

        # vLLM's prefix_offset/read_offset window, with the tokens before prefix_offset dropped
        # (so prefix_offset is always 0 and memory stays O(window)): _tokens[:_read_offset] is
        # the context, already turned into text, whose decode is cached in _prefix_text;
        # _tokens[_read_offset:] are pending tokens whose text is not final yet.
        self._tokens: list[int] = self._initial_context(prompt_token_ids)
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens) if self._tokens else ""

        self._parts: list[str] = []  # emitted text, joined lazily by output_text
        self._held = ""  # decoded text not emitted yet: it may be the start of a stop string
        self.stop_reason: str | None = None
        self.stopped = False
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text emitted so far plus the text held back for stop strings."""
        if len(self._parts) > 1:
            # Join once and keep the result, so repeated reads stay cheap.
            self._parts = ["".join(self._parts)]
        return (self._parts[0] if self._parts else "") + self._held

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text that is now safe to stream (maybe "")."""
        if self._finished:
            raise RuntimeError("step() called after finish()")
        if self.stopped or len(new_token_ids) == 0:
            return ""
        # int(): ids may come as numpy integers, which Tokenizer.decode does not accept.
        self._tokens.extend(int(t) for t in new_token_ids)
        if self._byte_group_open():
            return ""
        new_text = self._decode(self._tokens)
        # Not longer: the new tokens were skipped special tokens (or the decoder merged them
        # into held text).
        if len(new_text) <= len(self._prefix_text):
            return ""
        # Ending in U+FFFD: most likely a character whose remaining bytes are still to come.
        # Only its last bytes can be waiting, so the text before them is released now.
        if new_text.endswith(_REPLACEMENT_CHAR):
            return self._release_before_open_tail(new_text)
        delta = new_text[len(self._prefix_text) :]
        self._advance(len(self._tokens))
        return self._accept(delta, final=False)

    def _advance(self, end: int) -> None:
        """Make the pending tokens before ``end`` (emitted now) the next decoding context.

        They produced text, so they include a token the decoder keeps, and decoders that strip
        the first token's leading space strip it from the context in both decodes, never from
        the tokens after it.
        """
        end -= self._read_offset
        del self._tokens[: self._read_offset]
        self._read_offset = end
        self._prefix_text = self._decode(self._tokens[:end])

    def _release_before_open_tail(self, new_text: str) -> str:
        """Emit the final text of a window whose text ends in U+FFFD; keep its last tokens.

        A UTF-8 character is at most 4 bytes, so at most its first 3 can be waiting for the
        rest: the text before the last 3 tokens that carry bytes is final if it is a prefix of
        the window's text (it is not when those tokens complete a character it cut). Without
        this, a run of invalid bytes (a small or random model emits them) would hold the whole
        stream until the next valid character, or until the end.
        """
        special = self._get_special_ids() if self._skip_special_tokens else frozenset()
        keep, carrying = len(self._tokens), 0
        while keep > self._read_offset and carrying < _MAX_OPEN_BYTES:
            keep -= 1
            carrying += self._tokens[keep] not in special
        if carrying < _MAX_OPEN_BYTES or keep == self._read_offset:
            return ""
        text = self._decode(self._tokens[:keep])
        if len(text) <= len(self._prefix_text) or not new_text.startswith(text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance(keep)
        return self._accept(delta, final=False)

    def finish(self) -> str:
        """Flush everything held back at the end of the request and return it.

        Pending tokens are decoded as they stand (an incomplete UTF-8 sequence becomes U+FFFD,
        as in a full decode) and a held partial stop string is released. A stop string completed
        by this text still ends the output there. Later calls return "".
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        delta = ""
        if self._read_offset < len(self._tokens):
            new_text = self._decode(self._tokens)
            delta = new_text[len(self._prefix_text) :]
        self._tokens.clear()
        return self._accept(delta, final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _initial_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        n = len(prompt_token_ids)
        width = min(n, _INITIAL_CONTEXT_TOKENS)
        context = [int(t) for t in prompt_token_ids[n - width :]]
        # Widen while the context decodes to nothing: otherwise the decoder would treat the
        # first output token as the start of the text and drop its leading space.
        while width < min(n, _MAX_CONTEXT_TOKENS) and not self._decode(context):
            width = min(n, _MAX_CONTEXT_TOKENS, 2 * width)
            context = [int(t) for t in prompt_token_ids[n - width :]]
        # Do not cut a run of byte-fallback tokens: the run is decoded as a whole (see
        # _byte_group_open), and the output may continue it, e.g. after a prompt ending in "🎉".
        if self._byte_fallback:
            while (
                width < min(n, _MAX_CONTEXT_TOKENS)
                and self._is_byte_token(prompt_token_ids[n - width])
                and self._is_byte_token(prompt_token_ids[n - width - 1])
            ):
                width += 1
                context.insert(0, int(prompt_token_ids[n - width]))
        return context

    def _is_byte_token(self, token_id: int) -> bool:
        return _is_byte_fallback_token(self._tokenizer.id_to_token(int(token_id)))

    def _byte_group_open(self) -> bool:
        """Whether the text still ends in a group of byte-fallback tokens that may grow.

        The ByteFallback decoder decodes each run of ``<0xXX>`` tokens as a whole and turns the
        entire run into U+FFFDs if any byte in it is invalid, so even complete characters in an
        open run may still change: hold the run until a token of another kind closes it.
        """
        if not self._byte_fallback:
            return False
        for token_id in reversed(self._tokens[self._read_offset :]):
            if self._is_byte_token(token_id):
                return True
            # A skipped special token does not reach the decoder, so it does not close the run.
            if not (self._skip_special_tokens and token_id in self._get_special_ids()):
                return False
        return False

    def _get_special_ids(self) -> frozenset[int]:
        if self._special_ids is None:
            added = self._tokenizer.get_added_tokens_decoder()
            self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        return self._special_ids

    def _accept(self, delta: str, *, final: bool) -> str:
        """Append final decoded text; apply stop strings; return what may be emitted now."""
        # A stop string cannot start in text already emitted (it would have been held), so
        # searching the held text plus the delta finds every match.
        text = self._held + delta
        self._held = ""
        match = self._find_stop(text) if self._stop else None
        if match is not None:
            start, stop_str = match
            text = text[: start + len(stop_str)] if self._include_stop else text[:start]
            self.stopped = True
            self.stop_reason = stop_str
        elif not final and self._stop:
            hold = self._partial_stop_len(text)
            if hold:
                text, self._held = text[:-hold], text[-hold:]
        if text:
            self._parts.append(text)
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that is complete first in ``text`` and where it starts."""
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop:
            start = text.find(stop_str)
            if start != -1:
                candidate = (start + len(stop_str), start, stop_str)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-length:]
            if suffix[0] in self._stop_first_chars and any(
                s.startswith(suffix) for s in self._stop
            ):
                return length
        return 0

"""Prompt -> token ids and grammar states: the work a request needs before it can be scheduled.

:class:`InputProcessor` tokenizes a request's prompt (rendering chat messages with the model's
chat template) and compiles its structured output. It is the one place prompts are tokenized,
and it is thread-safe: the served engine (:class:`~kvflow.orchestrator.engine_loop.EngineLoop`)
runs it on worker threads, so that a slow request (a huge prompt, a cold grammar) never stalls
the steps of the requests already running. :meth:`LLMEngine.add_request
<kvflow.orchestrator.engine.LLMEngine.add_request>` takes its result, or runs it inline.

Oversized text is refused before any expensive work, by its length: no token of the vocabulary
covers more than :attr:`InputProcessor.max_token_chars` characters, so a text longer than that
times ``max_model_len`` can never fit the context. A chat counts every text its template renders:
each message's content, name and tool calls, and each tool's name, description and parameters
(as JSON). A request's prompt logprobs are bounded too, once its prompt is tokenized and before
it takes any KV block: ``n`` x (``prompt_logprobs`` + 1) x prompt tokens entries at most
(:data:`MAX_PROMPT_LOGPROB_ENTRIES`), what one response may carry.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.orchestrator.outputs import ENGINE_ERROR_PREFIX, ErrorCode, RequestError
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.sampling.structured import Grammar, GrammarCompiler
from kvflow.text.tokenizer import ChatPrompt, EngineTokenizer, Prompt, tokenize_prompt

# Prompt logprob entries one request may ask for: n choices x (prompt_logprobs + 1: the top k
# and the prompt's own token) x prompt tokens. About 60 bytes each as JSON: 64 MB a response.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the scheduler: its token ids, and one grammar state per sequence
    (None where the request has no structured output)."""

    prompt_token_ids: list[int]
    grammars: list[Grammar | None]


class InputProcessor:
    """Tokenizes prompts and compiles structured outputs for one engine.

    Args:
        tokenizer: the engine's tokenizer (None: token-id prompts only, no structured output).
        vocab_size: the model's logits width (token ids at or past it are refused).
        eos_token_ids: the model's EOS ids (the grammars allow them when complete).
        max_model_len: the context length (bounds a text prompt's length before tokenizing).
        check_token_ids: refuse prompt ids outside the vocabulary (runners that embed them).
    """

    def __init__(self, tokenizer: EngineTokenizer | None, vocab_size: int,
                 eos_token_ids: Sequence[int], max_model_len: int,
                 check_token_ids: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.check_token_ids = check_token_ids
        self.max_token_chars = _max_token_chars(tokenizer)
        self._grammar_compiler: GrammarCompiler | None = None

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text that could still fit in ``max_model_len`` tokens."""
        return self.max_model_len * self.max_token_chars

    def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedPrompt:
        """The prompt's token ids and each sequence's grammar state.

        Raises:
            ValueError: the request cannot run (bad text, too long, ids outside the
                vocabulary, a structured output that does not compile); the message names
                the field. A :class:`RequestError` carries whose fault (``code``); any other
                ValueError is the request's.
        """
        self._check_length(prompt)
        prompt_ids = tokenize_prompt(self.tokenizer, prompt)
        self._check_token_ids(prompt_ids, params)
        check_prompt_logprobs(len(prompt_ids), params.n, params.prompt_logprobs)
        # Compiled (or found in the cache) before the scheduler sees the request: a bad schema
        # is refused here, having taken no KV block. One grammar state per sequence.
        grammars: list[Grammar | None] = [None] * params.n
        if params.structured is not None:
            try:
                grammar = self.grammar_compiler().compile(params.structured)
            except RuntimeError as e:  # the engine's fault (its tokenizer), not the request's
                raise RequestError(f"{ENGINE_ERROR_PREFIX}: structured outputs are "
                                   f"unavailable on this engine: {e}",
                                   ErrorCode.ENGINE_ERROR) from None
            grammars = [grammar, *(grammar.fork() for _ in range(params.n - 1))]
        return PreparedPrompt(prompt_ids, grammars)

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's structured-output compiler (built at the first constrained request:
        llguidance's view of the tokenizer takes about a second to build)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the engine's tokenizer, and this "
                                 "engine has none")
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.tokenizer.to_str(), self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _check_length(self, prompt: Prompt) -> None:
        """Refuse text that cannot fit the context, before tokenizing or rendering it."""
        self.check_text_length(prompt)

    def check_text_length(self, prompt: Prompt) -> None:
        """A ValueError, naming the field and the limit, if the text of ``prompt`` (a chat's
        messages and tools together) is longer than :attr:`max_prompt_chars`: it cannot fit
        the context whatever its tokens. Token ids pass (their count is checked elsewhere)."""
        limit = self.max_prompt_chars
        if isinstance(prompt, str):
            if len(prompt) > limit:
                raise ValueError(self._too_long("prompt", len(prompt)))
            return
        if not isinstance(prompt, ChatPrompt):
            return
        messages = sum(_message_chars(m) for m in prompt.messages)
        tools = [len(t.name) + len(t.description) + _json_chars(t.parameters)
                 for t in prompt.tools]
        total = messages + sum(tools)
        if total <= limit:
            return
        if sum(tools) <= messages:
            raise ValueError(self._too_long("messages", messages, total))
        for i, t in enumerate(prompt.tools):  # one description alone too long: named
            if len(t.description) > limit:
                raise ValueError(self._too_long(f"tools[{i}].function.description",
                                                len(t.description), total))
        raise ValueError(self._too_long("tools", sum(tools), total))

    def _too_long(self, field: str, chars: int, total: int | None = None) -> str:
        together = ("" if total is None or total == chars
                    else f" ({total} with the rest of the prompt's messages and tools)")
        return (f"{field} is {chars} characters{together}: more than max_model_len "
                f"({self.max_model_len} tokens) can hold, as no token covers more than "
                f"{self.max_token_chars} characters (the limit is {self.max_prompt_chars})")

    def _check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Token ids the model has no embedding for are refused, naming the vocabulary size."""
        vocab = self.vocab_size
        for i, t in enumerate(params.stop_token_ids):
            if t >= vocab:
                raise ValueError(f"stop_token_ids[{i}] is {t}; the vocabulary has {vocab} "
                                 f"tokens (ids 0..{vocab - 1})")
        if self.check_token_ids:
            check_in_vocab(prompt_ids, vocab, "prompt token {}")


def check_prompt_logprobs(num_prompt_tokens: int, n: int, prompt_logprobs: int | None) -> None:
    """A ValueError naming ``prompt_logprobs`` and ``n`` if a request of ``n`` sequences
    would get more than :data:`MAX_PROMPT_LOGPROB_ENTRIES` prompt logprob entries (module
    doc): refused before any work, where a response of that size would cost the frontend
    gigabytes."""
    if prompt_logprobs is None:
        return
    entries = n * (prompt_logprobs + 1) * num_prompt_tokens
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(
            f"prompt_logprobs {prompt_logprobs} for {num_prompt_tokens} prompt tokens and n "
            f"{n} is {entries} logprob entries (n x (prompt_logprobs + 1) x prompt tokens); "
            f"the limit is {MAX_PROMPT_LOGPROB_ENTRIES}: lower n or prompt_logprobs, or "
            "shorten the prompt")


def check_in_vocab(ids: Sequence[int], vocab: int, label: str) -> None:
    """A ValueError naming the first of ``ids`` outside the vocabulary (``label``: how an id
    is named, ``{}`` its index) and the vocabulary's size."""
    if ids and not (min(ids) >= 0 and max(ids) < vocab):
        i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
        raise ValueError(f"{label.format(i)} is {ids[i]}; the vocabulary has {vocab} tokens "
                         f"(ids 0..{vocab - 1})")


def _message_chars(message: dict[str, Any]) -> int:
    """The characters of a chat message its template renders: content, name, tool calls."""
    calls = message.get("tool_calls")
    return (len(message["content"]) + len(message.get("name", ""))
            + (_json_chars(calls) if calls else 0))


def _json_chars(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _max_token_chars(tokenizer: EngineTokenizer | None) -> int:
    """An upper bound on the characters of text one token covers: its longest vocabulary
    entry, doubled for what a normalizer may drop (byte-level entries are a byte a
    character, so at least one character each)."""
    if tokenizer is None:
        return 1
    longest = max((len(piece) for piece in tokenizer.tokenizer.get_vocab(True)), default=1)
    return 2 * max(longest, 1)

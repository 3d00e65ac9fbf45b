"""kvflow's Triton responses -> OpenAI's response bodies, streamed chunks, logprobs and usage.

A prompt's logprobs (the backend's ``prompt_logprobs`` output) go two ways: before the
generated tokens' in a completion's ``logprobs`` when it echoes the prompt (OpenAI's legacy
shape, the first token's logprob null), and as vLLM's ``prompt_logprobs`` field when asked for
by name. The backend sends a prompt's logprobs once, for all its ``n`` choices: they are parsed
once (:class:`PromptLogprobs`), converted once, and encoded once into every choice that carries
them (:class:`SharedJSON`, :func:`encode_body`). Pure Python.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvflow.openai_api.chat_output import ChatOutput
from kvflow.openai_api.protocol import ChoiceRequest, CompletionRequest
from kvflow.orchestrator.outputs import TokenLogprobs

# The engine's reasons as the API reports them. "timeout" (past timeout_ms) is kept as it is,
# as vLLM's server keeps its own: a client must not take a cut answer for a finished one.
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "timeout"}


class SharedJSON(list):  # type: ignore[type-arg]
    """A JSON list that several places of a body hold (one prompt's logprobs, in each of its
    choices): :func:`encode_body` encodes it once and copies the bytes."""

    _encoded: bytes | None = None

    def encoded(self) -> bytes:
        if self._encoded is None:
            self._encoded = json.dumps(self, ensure_ascii=False,
                                       separators=(",", ":")).encode()
        return self._encoded


def encode_body(body: dict[str, Any]) -> bytes:
    """``body`` as JSON (UTF-8, compact), each :class:`SharedJSON` value of the body or of one
    of its ``choices`` encoded once, however many choices hold it."""
    nonce = secrets.token_hex(8)  # NOTE: a placeholder no text of a client's can forge
    shared: list[SharedJSON] = []

    def swap(item: Any) -> Any:
        if not isinstance(item, dict) or not any(isinstance(v, SharedJSON)
                                                 for v in item.values()):
            return item
        out = dict(item)
        for key, value in item.items():
            if isinstance(value, SharedJSON):
                out[key] = f"{nonce}:{len(shared)}"
                shared.append(value)
        return out

    top = swap(body)
    if isinstance(body.get("choices"), list):
        top = {**top, "choices": [swap(c) for c in body["choices"]]}
    text = json.dumps(top, ensure_ascii=False, separators=(",", ":")).encode()
    if not shared:
        return text
    return re.sub(b'"' + nonce.encode() + rb':(\d+)"',
                  lambda m: shared[int(m.group(1))].encoded(), text)


class PromptLogprobs:
    """One prompt's logprobs, as the backend sent them (``wire``: its JSON), parsed once for
    all the prompt's choices, when first read (by the response's encoder, on a worker
    thread: never while the event loop collects the streams); each shape the API gives them
    in is built once too."""

    def __init__(self, wire: str) -> None:
        self.wire = wire
        self._entries: list[TokenLogprobs] | None = None
        self._vllm: dict[tuple[int, int], SharedJSON] = {}

    @property
    def entries(self) -> list[TokenLogprobs]:
        """Per prompt token (the first's logprob None)."""
        if self._entries is None:
            self._entries = [TokenLogprobs.from_wire(e) for e in json.loads(self.wire)]
        return self._entries

    def vllm(self, k: int, asked: int) -> SharedJSON:
        """vLLM's ``prompt_logprobs`` field (:func:`vllm_prompt_logprobs`), built once."""
        if (k, asked) not in self._vllm:
            self._vllm[k, asked] = SharedJSON(vllm_prompt_logprobs(self.entries, k, asked))
        return self._vllm[k, asked]


@dataclass
class ChoiceState:
    """What one choice has produced so far, from its Triton responses. ``generate`` False
    (echo with max_tokens 0): the one token the backend generated is dropped, text, logprobs
    and count, and the choice ends with ``length``."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding: the request's draft tokens verified, and of those accepted.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    generate: bool = True
    prompt_logprobs_new: bool = False  # the prompt's logprobs came with the last update
    # A chat choice whose text is read for reasoning or tool calls (None: the text is content).
    output: ChatOutput | None = None
    # The prompt's logprobs, parsed once for its choices: ``shared`` (prompt index -> them) is
    # the request's, common to all its states.
    prompt_index: int = 0
    shared: dict[int, PromptLogprobs] | None = None
    prompt_record: PromptLogprobs | None = None

    def update(self, outputs: dict[str, Any]) -> tuple[str, list[TokenLogprobs]]:
        """Apply one response's outputs (name -> decoded value); returns its new text and
        logprob entries (``output_logprobs``' JSON, parsed once, here)."""
        wire = outputs.get("prompt_logprobs")
        self.prompt_logprobs_new = bool(wire)
        if wire:
            record = self.shared.get(self.prompt_index) if self.shared is not None else None
            if record is None or not (record.wire is wire or record.wire == wire):
                record = PromptLogprobs(wire)
                if self.shared is not None:
                    self.shared[self.prompt_index] = record
            self.prompt_record = record
        self.prompt_tokens = outputs.get("num_input_tokens", self.prompt_tokens)
        self.cached_tokens = outputs.get("cached_tokens", self.cached_tokens)
        self.draft_tokens = outputs.get("num_draft_tokens", self.draft_tokens)
        self.accepted_tokens = outputs.get("num_accepted_tokens", self.accepted_tokens)
        reason = outputs.get("finish_reason") or None
        if reason:
            self.finish_reason = (OPENAI_FINISH_REASONS.get(reason, "stop") if self.generate
                                  else "length")
        if not self.generate:
            return "", []
        delta = outputs.get("text_output", "")
        self.text += delta
        before, self.completion_tokens = self.completion_tokens, outputs.get(
            "num_output_tokens", self.completion_tokens)
        if self.output is not None:
            self.output.count(self.text, delta, self.completion_tokens - before)
        entries = [TokenLogprobs.from_wire(e) for e in json.loads(outputs["output_logprobs"])
                   ] if outputs.get("output_logprobs") else []
        self.logprobs += entries
        return delta, entries

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """Per prompt token (the first's logprob None), once the backend sent them."""
        return None if self.prompt_record is None else self.prompt_record.entries

    def echo_text(self, choice: ChoiceRequest) -> str:
        """The text an echoing choice puts first: its prompt's text, or a token-id prompt's
        tokens' text (from its prompt logprobs)."""
        if not choice.echo or choice.echo_text:
            return choice.echo_text
        return "".join(e.token or "" for e in self.prompt_logprobs or ())


def new_states(request: CompletionRequest) -> list[ChoiceState]:
    """One empty state per choice of ``request``."""
    read = request.chat and (request.tools is not None and request.tools.parser is not None
                             or request.reasoning is not None)
    shared: dict[int, PromptLogprobs] = {}
    return [ChoiceState(c.index, generate=request.generate,
                        output=ChatOutput(request.tools, request.reasoning) if read else None,
                        prompt_index=c.prompt_index, shared=shared)
            for c in request.choices]


def _top(entry: TokenLogprobs, k: int) -> list[tuple[str, float]]:
    """The ``k`` likeliest alternatives of a logprob entry, as (token text, logprob)."""
    texts = entry.top_tokens or {}
    return [(texts.get(t, str(t)), lp) for t, lp in entry.top[:k]]


def chat_logprobs(entries: list[TokenLogprobs], k: int) -> dict[str, Any]:
    def item(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token or "", e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in _top(e, k)]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprobs], k: int, offset: int,
                        prompt: list[TokenLogprobs] | None = None) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs``; ``prompt``: an echoed prompt's entries, first (their
    offsets from 0, the first token's logprob and top_logprobs null), as vLLM returns them."""
    prompt = prompt or []
    tokens = [e.token or "" for e in prompt + entries]
    offsets, at = [], 0
    for i, t in enumerate(tokens):
        if i == len(prompt):
            at = offset
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in prompt + entries],
            "top_logprobs": [None if e.logprob is None and i < len(prompt)
                             else dict(_top(e, k)) for i, e in enumerate(prompt + entries)],
            "text_offset": offsets}


def vllm_prompt_logprobs(entries: list[TokenLogprobs], k: int,
                         asked: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None) its top ``k`` and itself,
    token id (a string) -> ``{"logprob", "rank", "decoded_token"}``. ``asked``: the top the
    backend listed (at least ``k``); a token below it has a rank it never saw: null."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, e in enumerate(entries):
        if i == 0 or e.logprob is None:
            out.append(None)
            continue
        texts = e.top_tokens or {}
        item: dict[str, dict[str, Any]] = {}
        for rank, (token, logprob) in enumerate(e.top, start=1):
            if rank <= k or token == e.token_id:
                item[str(token)] = {"logprob": logprob, "rank": rank if rank <= asked else None,
                                    "decoded_token": texts.get(token, e.token
                                                               if token == e.token_id else None)}
        out.append(item)
    return out


def usage(request: CompletionRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once (its first choice's counts), every choice's
    completion tokens summed."""
    firsts: dict[int, ChoiceState] = {}
    for choice, state in zip(request.choices, states, strict=True):
        firsts.setdefault(choice.prompt_index, state)
    prompt = sum(s.prompt_tokens for s in firsts.values())
    completion = sum(s.completion_tokens for s in states)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens
                                                          for s in firsts.values())}}
    details: dict[str, int] = {}
    drafts = sum(s.draft_tokens for s in firsts.values())
    if drafts:  # speculative decoding, in OpenAI's words for predicted outputs
        accepted = sum(s.accepted_tokens for s in firsts.values())
        details.update(accepted_prediction_tokens=accepted,
                       rejected_prediction_tokens=drafts - accepted)
    if request.reasoning is not None:
        details["reasoning_tokens"] = sum(s.output.reasoning_tokens(s.text) for s in states
                                          if s.output is not None)
    if details:
        out["completion_tokens_details"] = details
    return out


def _choice_logprobs(request: CompletionRequest, entries: list[TokenLogprobs], offset: int,
                     prompt: list[TokenLogprobs] | None = None) -> dict[str, Any] | None:
    if request.logprobs is None:
        return None
    if request.chat:
        return chat_logprobs(entries, request.logprobs)
    return completion_logprobs(entries, request.logprobs, offset, prompt)


def _prompt_field(request: CompletionRequest, state: ChoiceState) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` field, where the client asked for it (and it has come)."""
    if request.prompt_logprobs is None or state.prompt_record is None:
        return {}
    asked = request.backend_prompt_logprobs
    return {"prompt_logprobs": state.prompt_record.vllm(
        request.prompt_logprobs, request.prompt_logprobs if asked is None else asked)}


def final_response(request: CompletionRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """The whole (non-streamed) response body."""
    choices = []
    for choice, state in zip(request.choices, states, strict=True):
        echo = state.echo_text(choice)
        logprobs = _choice_logprobs(request, state.logprobs, len(echo),
                                    state.prompt_logprobs if choice.echo else None)
        if request.chat:
            message = (state.output.message(state.text) if state.output is not None
                       else {"role": "assistant", "content": state.text})
            reason = (state.output.finish_reason(state.finish_reason)
                      if state.output is not None else state.finish_reason)
            choices.append({"index": choice.index, "logprobs": logprobs,
                            "finish_reason": reason, "message": message})
        else:
            choices.append({"index": choice.index, "text": echo + state.text,
                            "logprobs": logprobs, "finish_reason": state.finish_reason,
                            **_prompt_field(request, state)})
    body = {"id": request.id, "object": "chat.completion" if request.chat
            else "text_completion", "created": request.created, "model": request.model,
            "choices": choices, "usage": usage(request, states)}
    if request.chat and states:  # vLLM's: the one prompt's, beside the choices
        body.update(_prompt_field(request, states[0]))
    return body


def chunk(request: CompletionRequest, choices: list[dict[str, Any]],
          usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk."""
    body: dict[str, Any] = {"id": request.id, "object": "chat.completion.chunk" if request.chat
                            else "text_completion", "created": request.created,
                            "model": request.model, "choices": choices}
    if request.include_usage or request.continuous_usage:
        body["usage"] = usage_
    return body


def choice_chunk(request: CompletionRequest, choice: ChoiceRequest, state: ChoiceState,
                 delta: str, entries: list[TokenLogprobs], first: bool) -> dict[str, Any]:
    """The streamed delta of one choice; ``first`` carries the role (chat) or the echo (and
    the echoed prompt's logprobs, first). vLLM's ``prompt_logprobs`` field goes on the choice
    of the chunk they came with (the first)."""
    echo = state.echo_text(choice)
    offset = len(echo) + len(state.text) - len(delta)
    prompt = state.prompt_logprobs if choice.echo and first else None
    logprobs = (_choice_logprobs(request, entries, offset, prompt) if entries or prompt
                else None)
    finish = state.finish_reason
    extra = _prompt_field(request, state) if state.prompt_logprobs_new else {}
    if request.chat:
        message: dict[str, Any] = {"role": "assistant"} if first else {}
        if state.output is None:
            message.update({"content": delta} if first or delta else {})
        else:
            message.update(state.output.feed(delta, final=bool(finish)))
            finish = state.output.finish_reason(finish)
            if first and "content" not in message and "tool_calls" not in message:
                message["content"] = ""
        return {"index": choice.index, "delta": message, "logprobs": logprobs,
                "finish_reason": finish, **extra}
    text = (echo if first else "") + delta
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            **extra}


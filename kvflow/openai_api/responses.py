"""kvflow's Triton responses -> OpenAI's response bodies, streamed chunks, logprobs and usage.

Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvflow.openai_api.protocol import ChoiceRequest, CompletionRequest
from kvflow.orchestrator.outputs import TokenLogprobs

# The engine's reasons as the API reports them. "timeout" (past timeout_ms) is kept as it is,
# as vLLM's server keeps its own: a client must not take a cut answer for a finished one.
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "timeout"}


@dataclass
class ChoiceState:
    """What one choice has produced so far, from its Triton responses."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def update(self, outputs: dict[str, Any]) -> tuple[str, list[TokenLogprobs]]:
        """Apply one response's outputs (name -> decoded value); returns its new text and
        logprob entries (``output_logprobs``' JSON, parsed once, here)."""
        delta = outputs.get("text_output", "")
        self.text += delta
        self.prompt_tokens = outputs.get("num_input_tokens", self.prompt_tokens)
        self.completion_tokens = outputs.get("num_output_tokens", self.completion_tokens)
        self.cached_tokens = outputs.get("cached_tokens", self.cached_tokens)
        reason = outputs.get("finish_reason") or None
        if reason:
            self.finish_reason = OPENAI_FINISH_REASONS.get(reason, "stop")
        entries = [TokenLogprobs.from_wire(e) for e in json.loads(outputs["output_logprobs"])
                   ] if outputs.get("output_logprobs") else []
        self.logprobs += entries
        return delta, entries


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


def completion_logprobs(entries: list[TokenLogprobs], k: int, offset: int) -> dict[str, Any]:
    tokens = [e.token or "" for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(_top(e, k)) for e in entries], "text_offset": offsets}


def usage(request: CompletionRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once (its first choice's counts), every choice's
    completion tokens summed."""
    firsts: dict[int, ChoiceState] = {}
    for choice, state in zip(request.choices, states, strict=True):
        firsts.setdefault(choice.prompt_index, state)
    prompt = sum(s.prompt_tokens for s in firsts.values())
    completion = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens
                                                           for s in firsts.values())}}


def _choice_logprobs(request: CompletionRequest, entries: list[TokenLogprobs],
                     offset: int) -> dict[str, Any] | None:
    if request.logprobs is None:
        return None
    if request.chat:
        return chat_logprobs(entries, request.logprobs)
    return completion_logprobs(entries, request.logprobs, offset)


def final_response(request: CompletionRequest, states: list[ChoiceState]) -> dict[str, Any]:
    """The whole (non-streamed) response body."""
    choices = []
    for choice, state in zip(request.choices, states, strict=True):
        text = choice.echo_text + state.text
        logprobs = _choice_logprobs(request, state.logprobs, len(choice.echo_text))
        if request.chat:
            choices.append({"index": choice.index, "logprobs": logprobs,
                            "finish_reason": state.finish_reason,
                            "message": {"role": "assistant", "content": text}})
        else:
            choices.append({"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": state.finish_reason})
    return {"id": request.id, "object": "chat.completion" if request.chat
            else "text_completion", "created": request.created, "model": request.model,
            "choices": choices, "usage": usage(request, states)}


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
    """The streamed delta of one choice; ``first`` carries the role (chat) or the echo."""
    offset = len(choice.echo_text) + len(state.text) - len(delta)
    logprobs = _choice_logprobs(request, entries, offset) if entries else None
    finish = state.finish_reason
    if request.chat:
        message: dict[str, Any] = ({"role": "assistant", "content": delta} if first
                                   else {"content": delta} if delta else {})
        return {"index": choice.index, "delta": message, "logprobs": logprobs,
                "finish_reason": finish}
    text = (choice.echo_text if first else "") + delta
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

"""A parsed request's Triton streams, started once for every generating endpoint
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``): one Triton request per
prompt (its ``n`` sequences are the prompt's ``n`` choices) on the server with the fewest
requests in flight, again on another server while one cannot be reached (nothing was sent yet),
cancelled when the client disconnects."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvflow.openai_api.completion_bodies import ChoiceState, new_states
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.protocol import CompletionRequest
from kvflow.openai_api.streaming import (
    all_or_cancel,
    backend_error,
    close_all,
    collect,
    until_disconnect,
)


@dataclass
class Generation:
    """A started request: its streams (one per choice) and states. Streamed: ``firsts`` holds
    each choice's first response (read, not yet applied to its state). Whole: every response
    has been applied and the streams are done (``firsts`` None)."""

    parsed: CompletionRequest
    generators: list[Any]
    states: list[ChoiceState]
    firsts: list[dict[str, Any]] | None


async def generate(fe: Frontend, request: Any, parsed: CompletionRequest) -> Generation:
    """Run ``parsed``: whole, or (``parsed.stream``) until every choice's first response has
    come, so that a rejected request (overload, bad input) gets its own status, not a 200
    stream.

    Raises:
        OpenAIError: the backend refused or failed the request.
        ClientGone: the client disconnected first (the Triton requests are cancelled).
    """
    avoid: frozenset[int] = frozenset()
    while True:
        # A batch runs a window of its prompts at a time: the next request waits behind that
        # window, not behind the whole batch.
        window = (asyncio.Semaphore(parsed.prompts_in_flight)
                  if len(parsed.choices) > parsed.n else None)
        generators = [g for c in parsed.choices if c.index % parsed.n == 0
                      for g in fe.pool.generate_n(c, f"{parsed.id}-{c.prompt_index}",
                                                  parsed.n, avoid, window)]
        states = new_states(parsed)
        try:
            if parsed.stream:
                firsts = await until_disconnect(request, all_or_cancel(
                    [anext(g) for g in generators]))
                return Generation(parsed, generators, states, firsts)
            await until_disconnect(request, all_or_cancel(
                [collect(g, s) for g, s in zip(generators, states, strict=True)]))
            return Generation(parsed, generators, states, None)
        except BackendError as e:
            await close_all(generators)
            if e.transport and e.server is not None and len(avoid) + 1 < len(fe.pool.urls):
                avoid |= {e.server}
                continue
            raise backend_error(e, parsed) from None
        except BaseException:
            await close_all(generators)
            raise

"""A completion request's Triton streams, read on the frontend's event loop: waited for until
the client disconnects (:func:`until_disconnect`), collected whole (:func:`collect`), or sent
on as Server-Sent Events (:func:`sse`); and a failed stream's error in OpenAI's shape
(:func:`backend_error`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from kvflow.openai_api.completion_bodies import ChoiceState, choice_chunk, chunk, encode_body, usage
from kvflow.openai_api.errors import OpenAIError, error_from_backend
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.protocol import CompletionRequest

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def backend_error(error: BackendError, parsed: CompletionRequest | None) -> OpenAIError:
    """The client's error for a failed Triton request."""
    if error.refused_key:  # the frontend's configuration: nothing a client can fix or retry
        return OpenAIError(502, str(error), code="backend_auth_failed")
    if error.transport:  # no server answered: the client may retry, here or elsewhere
        return OpenAIError(503, str(error), code="backend_unavailable")
    return error_from_backend(str(error), parsed, error.code)


async def until_disconnect(request: Any, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (and with it the Triton
    requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def all_or_cancel(awaitables: list[Any]) -> list[Any]:
    """All results; once one fails (or this is cancelled), the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(generator: AsyncIterator[dict[str, Any]], state: ChoiceState) -> None:
    """Apply every response of one choice's stream to its state."""
    async for outputs in generator:
        state.update(outputs)


async def close_all(generators: list[Any]) -> None:
    """Close every stream (cancelling the Triton requests still running)."""
    for g in generators:
        with contextlib.suppress(BaseException):
            await g.aclose()


def event(body: Any, name: str | None = None) -> bytes:
    """One Server-Sent Event of a JSON body (``name``: its ``event:`` line, as the Responses
    API names each event)."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + encode_body(body) + b"\n\n"


def stream_error(error: BaseException, parsed: CompletionRequest | None) -> OpenAIError:
    """The error a stream reports when one of its Triton streams fails mid-way."""
    if isinstance(error, BackendError):
        return backend_error(error, parsed)
    return OpenAIError(500, f"the frontend failed: {error!r}")


async def merged(generators: list[Any], states: list[ChoiceState],
                 firsts: list[dict[str, Any]]
                 ) -> AsyncGenerator[tuple[int, dict[str, Any], bool], None]:
    """Every choice's Triton responses as ``(choice, outputs, first)``, as they come: each
    choice's first (already read) first, then the rest in arrival order. The consumer
    applies each to ``states[choice]`` before asking for the next (a choice whose first
    response finished it is not read further). A failed stream raises its error. Closing
    this (the client disconnected) cancels the Triton requests."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for outputs in generators[k]:
                await queue.put((k, outputs))
            await queue.put((k, None))
        except Exception as e:  # noqa: BLE001  raised to the consumer
            await queue.put((k, e))

    tasks: list[asyncio.Task] = []
    try:
        open_choices = 0
        for k, outputs in enumerate(firsts):
            yield k, outputs, True
            if not states[k].finish_reason:
                open_choices += 1
                tasks.append(asyncio.create_task(pump(k)))
        while open_choices:
            k, item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item, False
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(generators)


async def sse(parsed: CompletionRequest, generators: list[Any], states: list[ChoiceState],
              firsts: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The Server-Sent Events of a streamed completion: every choice's deltas as they come,
    then the usage chunk (``include_usage``), then ``[DONE]``."""

    def render(k: int, outputs: dict[str, Any], first: bool) -> bytes:
        delta, entries = states[k].update(outputs)
        piece = choice_chunk(parsed, parsed.choices[k], states[k], delta, entries, first)
        if parsed.chat and not first and piece == {"index": piece["index"], "delta": {},
                                                   "logprobs": None, "finish_reason": None}:
            return b""  # nothing new to say (text held back, or read into a call later)
        body = chunk(parsed, [piece], usage(parsed, states) if parsed.continuous_usage else None)
        return event(body)

    responses = merged(generators, states, firsts)
    try:
        async for k, outputs, first in responses:
            piece = await render_off_loop(render, k, outputs, first)
            if piece:
                yield piece
    except Exception as e:  # noqa: BLE001  reported in the stream
        yield event(stream_error(e, parsed).body())
    finally:
        await responses.aclose()
    if parsed.include_usage:
        yield event({**chunk(parsed, []), "usage": usage(parsed, states)})
    yield b"data: [DONE]\n\n"


async def render_off_loop(render: Callable[[int, dict[str, Any], bool], T], k: int,
                          outputs: dict[str, Any], first: bool) -> T:
    """``render(k, outputs, first)``; on a thread for a response with the prompt's logprobs
    (megabytes of JSON, parsed and encoded meanwhile; no one else touches its state)."""
    if outputs.get("prompt_logprobs"):
        return await asyncio.to_thread(render, k, outputs, first)
    return render(k, outputs, first)

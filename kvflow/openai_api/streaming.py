"""A completion request's Triton streams, read on the frontend's event loop: waited for until
the client disconnects (:func:`until_disconnect`), collected whole (:func:`collect`), or sent
on as Server-Sent Events (:func:`sse`); and a failed stream's error in OpenAI's shape
(:func:`backend_error`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvflow.openai_api.errors import OpenAIError, error_from_backend
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.protocol import CompletionRequest
from kvflow.openai_api.responses import ChoiceState, choice_chunk, chunk, encode_body, usage

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


def event(body: Any) -> bytes:
    """One Server-Sent Event of a JSON body."""
    return b"data: " + encode_body(body) + b"\n\n"


async def sse(parsed: CompletionRequest, generators: list[Any], states: list[ChoiceState],
              firsts: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The Server-Sent Events of a streamed response: every choice's deltas as they come,
    then the usage chunk (``include_usage``), then ``[DONE]``. Cancelled when the client
    disconnects; the ``finally`` then cancels the Triton requests."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for outputs in generators[k]:
                await queue.put((k, outputs))
            await queue.put((k, None))
        except Exception as e:  # noqa: BLE001  reported in the stream
            await queue.put((k, e))

    def render(k: int, outputs: dict[str, Any], first: bool) -> bytes:
        delta, entries = states[k].update(outputs)
        piece = choice_chunk(parsed, parsed.choices[k], states[k], delta, entries, first)
        if parsed.chat and piece == {"index": piece["index"], "delta": {}, "logprobs": None,
                                     "finish_reason": None}:
            return b""  # nothing new to say (text held back, or read into a call later)
        body = chunk(parsed, [piece], usage(parsed, states) if parsed.continuous_usage else None)
        return event(body)

    async def render_off_loop(k: int, outputs: dict[str, Any], first: bool) -> bytes:
        # NOTE: a response with the prompt's logprobs (megabytes of JSON) is parsed and
        # encoded on a thread; meanwhile this stream waits and no one else touches its state.
        if outputs.get("prompt_logprobs"):
            return await asyncio.to_thread(render, k, outputs, first)
        return render(k, outputs, first)

    tasks: list[asyncio.Task] = []
    try:
        open_choices = 0
        for k, outputs in enumerate(firsts):
            yield await render_off_loop(k, outputs, True)  # the first (its role) always goes
            if not states[k].finish_reason:
                open_choices += 1
                tasks.append(asyncio.create_task(pump(k)))
        while open_choices:
            k, item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, BaseException):
                err = (backend_error(item, parsed) if isinstance(item, BackendError)
                       else OpenAIError(500, f"the frontend failed: {item!r}"))
                yield event(err.body())
                break
            else:
                piece = await render_off_loop(k, item, False)
                if piece:
                    yield piece
        if parsed.include_usage:
            yield event({**chunk(parsed, []), "usage": usage(parsed, states)})
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(generators)

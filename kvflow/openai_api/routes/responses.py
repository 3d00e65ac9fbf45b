"""The Responses API: ``POST /v1/responses`` (whole, or streamed as semantic events), ``GET``
and ``DELETE /v1/responses/{id}``. A request is translated into a chat request
(:mod:`kvflow.openai_api.responses_request`) and runs down the chat path
(:func:`.generation.generate`); a response created with ``store`` true is kept under its key
(:mod:`kvflow.openai_api.response_store`) for ``previous_response_id``, GET and DELETE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvflow.openai_api.checks import load_body
from kvflow.openai_api.completion_bodies import ChoiceState, choice_chunk, encode_body
from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.generation import Generation, generate
from kvflow.openai_api.protocol import ChatFormat
from kvflow.openai_api.response_store import ResponseStore
from kvflow.openai_api.responses_body import outcome, stored_record, whole_response
from kvflow.openai_api.responses_request import (
    ResponsesRequest,
    client_error,
    parse_responses_request,
)
from kvflow.openai_api.responses_stream import ResponseEvents
from kvflow.openai_api.streaming import merged, stream_error

ENDPOINT = "/v1/responses"


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.post(ENDPOINT)
    async def create(request: Request) -> Any:
        async def work() -> Any:
            namespace = fe.authorize(request)
            body = await fe.in_worker(load_body, await fe.read_body(request))
            model, lora = await fe.resolve_model(body)
            parsed = await fe.in_worker(_parse, body, model, lora, fe.format(), fe.store,
                                        namespace)
            try:
                run = await generate(fe, request, parsed.chat)
            except OpenAIError as e:
                raise client_error(e) from None
            if run.firsts is None:
                return Response(await fe.in_worker(_finish, fe.store, namespace, parsed,
                                                   run.states),
                                media_type="application/json")
            return StreamingResponse(_events(fe, namespace, parsed, run),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        return await fe.answer(ENDPOINT, work)

    @routes.get(ENDPOINT + "/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Any:
        async def work() -> Any:
            namespace = fe.authorize(request)
            if request.query_params.get("stream") in ("true", "1"):
                raise bad_request("stream is not supported when retrieving a response: it "
                                  "is kept only once finished", "stream")
            record = await fe.in_worker(fe.store.get, namespace, response_id)
            if record is None:
                raise _not_found(response_id, "response_id")
            return Response(encode_body(record["response"]), media_type="application/json")

        return await fe.answer(ENDPOINT + "/{id}", work)

    @routes.delete(ENDPOINT + "/{response_id}")
    async def delete(response_id: str, request: Request) -> Any:
        async def work() -> Any:
            namespace = fe.authorize(request)
            if not await fe.in_worker(fe.store.delete, namespace, response_id):
                raise _not_found(response_id, "response_id")
            return {"id": response_id, "object": "response.deleted", "deleted": True}

        return await fe.answer(ENDPOINT + "/{id}", work)

    return routes


def _not_found(response_id: str, param: str) -> OpenAIError:
    # NOTE: the same answer for an id never made, deleted, evicted or another key's: an id
    # tells nothing of other keys' responses.
    return OpenAIError(404, f"no stored response has the id {response_id[:80]!r} for this "
                       "API key (never stored, deleted, evicted from the store, or another "
                       "key's)", param, code="response_not_found")


def _parse(body: Any, model: str, lora: str | None, fmt: ChatFormat, store: ResponseStore,
           namespace: str) -> ResponsesRequest:
    previous = None
    previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise bad_request("previous_response_id must be a string", "previous_response_id")
        previous = store.get(namespace, previous_id)
        if previous is None:
            raise _not_found(previous_id, "previous_response_id")
    return parse_responses_request(body, model, fmt, previous, lora)


def _finish(store: ResponseStore, namespace: str, parsed: ResponsesRequest,
            states: list[ChoiceState]) -> bytes:
    body = whole_response(parsed, states)
    if parsed.store:
        store.put(namespace, parsed.id, stored_record(parsed, body))
    return encode_body(body)


async def _events(fe: Frontend, namespace: str, parsed: ResponsesRequest,
                  run: Generation) -> AsyncIterator[bytes]:
    """The stream's events (:class:`ResponseEvents`); the response is stored before the
    last event goes, so that a client may continue from it at once."""
    events = ResponseEvents(parsed)
    for piece in events.start():
        yield piece
    assert run.firsts is not None
    state, chat = run.states[0], parsed.chat
    responses = merged(run.generators, run.states, run.firsts)
    try:
        async for _k, outputs, first in responses:
            delta, entries = state.update(outputs)
            chunk = choice_chunk(chat, chat.choices[0], state, delta, entries, first)
            for piece in events.delta(chunk["delta"]):
                yield piece
    except Exception as e:  # noqa: BLE001  reported in the stream
        yield events.failed(client_error(stream_error(e, chat)))
        return
    finally:
        await responses.aclose()
    status, incomplete = outcome(state)
    closing, body = events.finish(run.states, status, incomplete)
    if parsed.store:
        await fe.in_worker(fe.store.put, namespace, parsed.id, stored_record(parsed, body))
    for piece in closing:
        yield piece

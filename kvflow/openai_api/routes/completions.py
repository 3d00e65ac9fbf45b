"""``POST /v1/completions``, and the path every completion takes (chat's too): body parsed and
translated on a worker, the Triton streams started (:func:`.generation.generate`), the answer
whole or as Server-Sent Events."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvflow.openai_api.checks import load_body
from kvflow.openai_api.completion_bodies import ChoiceState, encode_body, final_response
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.generation import generate
from kvflow.openai_api.protocol import CompletionRequest, parse_completion_request
from kvflow.openai_api.streaming import sse


async def serve_completion(fe: Frontend, request: Request, chat: bool) -> Any:
    """The answer to a completion (``chat``: a chat completion) request."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"

    async def work() -> Any:
        fe.authorize(request)
        body = await fe.in_worker(load_body, await fe.read_body(request))
        model, lora = await fe.resolve_model(body)
        parsed = await fe.in_worker(parse_completion_request, body, model, chat, fe.format(),
                                    lora)
        run = await generate(fe, request, parsed)
        if run.firsts is None:  # built and encoded off the loop: it may hold prompt logprobs
            return Response(await fe.in_worker(_final_body, parsed, run.states),
                            media_type="application/json")
        return StreamingResponse(sse(parsed, run.generators, run.states, run.firsts),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return await fe.answer(endpoint, work)


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/completions")
    async def v1_completions(request: Request) -> Any:
        return await serve_completion(fe, request, chat=False)

    return routes


def _final_body(parsed: CompletionRequest, states: list[ChoiceState]) -> bytes:
    return encode_body(final_response(parsed, states))

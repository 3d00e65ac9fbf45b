"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the engine tokenizes, as it would for a
completion (:mod:`kvflow.openai_api.tokenize` translates)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvflow.openai_api.checks import load_body
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.streaming import backend_error
from kvflow.openai_api.tokenize import (
    TOKENIZE_OUTPUTS,
    detokenize_request,
    detokenize_response,
    tokenize_error,
    tokenize_request,
    tokenize_response,
)
from kvflow.triton_backend.protocol import TOKENIZE_PARAMETER


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    async def tokenizer(request: Request, detokenize: bool) -> Any:
        async def work() -> Any:
            fe.authorize(request)
            body = await fe.in_worker(load_body, await fe.read_body(request))
            model, _lora = await fe.resolve_model(body)  # an adapter tokenizes as its base
            inputs, options = await fe.in_worker(_parse, body, model, detokenize)
            try:
                answer = await fe.pool.ask(inputs, {TOKENIZE_PARAMETER: True, **options},
                                           TOKENIZE_OUTPUTS)
            except BackendError as e:
                raise tokenize_error(backend_error(e, None)) from None
            return detokenize_response(answer) if detokenize else tokenize_response(answer)

        return await fe.answer("/detokenize" if detokenize else "/tokenize", work)

    @routes.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await tokenizer(request, detokenize=False)

    @routes.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await tokenizer(request, detokenize=True)

    return routes


def _parse(body: Any, model: str, detokenize: bool) -> tuple[dict[str, Any], dict[str, bool]]:
    if detokenize:
        return detokenize_request(body, model), {}
    return tokenize_request(body, model)

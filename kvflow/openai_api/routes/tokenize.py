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
            data = await fe.read_body(request)
            inputs, options = await fe.in_worker(_parse, data, await fe.model_name(),
                                                 detokenize)
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


def _parse(data: bytes, model: str, detokenize: bool) -> tuple[dict[str, Any], dict[str, bool]]:
    body = load_body(data)
    if detokenize:
        return detokenize_request(body, model), {}
    return tokenize_request(body, model)

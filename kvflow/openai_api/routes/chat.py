"""``POST /v1/chat/completions``: the completions path (:func:`.completions.serve_completion`)
with the chat template, tools and reasoning."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.routes.completions import serve_completion


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Any:
        return await serve_completion(fe, request, chat=True)

    return routes

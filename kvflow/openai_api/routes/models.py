"""``GET /v1/models``: the one model the servers serve, by its served name."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from kvflow.openai_api.frontend import Frontend


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def models(request: Request) -> Any:
        async def work() -> Any:
            fe.authorize(request)
            name = await fe.model_name()
            return {"object": "list", "data": [{"id": name, "object": "model",
                                                "created": int(time.time()),
                                                "owned_by": "kvflow"}]}

        return await fe.answer("/v1/models", work)

    return routes

"""``GET /v1/models``: the model the servers serve, by its served name, then each LoRA adapter
they hold (as vLLM lists them: ``parent`` the served name, ``root`` the adapter's path)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.streaming import backend_error


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def models(request: Request) -> Any:
        async def work() -> Any:
            fe.authorize(request)
            name = await fe.model_name()
            try:
                adapters = await fe.loras.adapters()
            except BackendError as e:
                if not e.transport:
                    raise backend_error(e, None) from None
                adapters = {}  # no server answers: the base, as the name needs none
            created = int(time.time())
            cards = [{"id": name, "object": "model", "created": created, "owned_by": "kvflow",
                      "root": name, "parent": None}]
            cards += [{"id": a, "object": "model", "created": created, "owned_by": "kvflow",
                       "root": info.get("path"), "parent": name}
                      for a, info in adapters.items()]
            return {"object": "list", "data": cards}

        return await fe.answer("/v1/models", work)

    return routes

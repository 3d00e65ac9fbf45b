"""vLLM's ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``), behind the API key: a 200 whose text says
what was done, or OpenAI's error: 400 naming the problem (LoRA off, a bad path or adapter, a
name in use, requests that still use the adapter), 404 for an adapter no server holds. The
servers do the work (:class:`~kvflow.openai_api.lora.LoraCatalog`).

Both read or drop files on the server's disk at a client's word, so they need the API key to
exist: a frontend started without ``--api-key`` answers them 403, saying so (vLLM keeps them
behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` for the same reason)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvflow.openai_api.checks import load_body
from kvflow.openai_api.errors import OpenAIError
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.lora import load_request, unload_request
from kvflow.openai_api.pool import BackendError
from kvflow.openai_api.streaming import backend_error

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
_FIELD = re.compile(r"^(lora_name|lora_path)\b")


def _authorize(fe: Frontend, request: Request) -> None:
    """A 403 on a keyless frontend (module doc), else the key's 401."""
    if not fe.cfg.api_key:
        raise OpenAIError(403, "loading and unloading LoRA adapters reads the server's files: "
                          "start kvflow with --api-key (or KVFLOW_API_KEY) to allow it; "
                          "--lora-modules loads adapters at start without one", None,
                          code="forbidden")
    fe.authorize(request)


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.post(LOAD)
    async def load(request: Request) -> Any:
        async def work() -> Any:
            _authorize(fe, request)
            body = await fe.in_worker(load_body, await fe.read_body(request))
            name, path = load_request(body, await fe.model_name())
            try:
                await fe.loras.load(name, path)
            except BackendError as e:
                raise _lora_error(e) from None
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        return await fe.answer(LOAD, work)

    @routes.post(UNLOAD)
    async def unload(request: Request) -> Any:
        async def work() -> Any:
            _authorize(fe, request)
            name = unload_request(await fe.in_worker(load_body, await fe.read_body(request)))
            try:
                if await fe.loras.find(name) is None:
                    raise OpenAIError(404, f"The lora adapter '{name}' cannot be found; loaded: "
                                      f"{sorted(await fe.loras.adapters())}", "lora_name",
                                      code="lora_adapter_not_found")
                await fe.loras.unload(name)
            except BackendError as e:
                raise _lora_error(e) from None
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        return await fe.answer(UNLOAD, work)

    return routes


def _lora_error(error: BackendError) -> OpenAIError:
    """A server's refusal as a 400 naming the field its message begins with (the backend's
    messages do: kvflow.triton_backend.lora_control); transport and key failures as the
    generating routes report them."""
    if error.transport or error.refused_key or error.code not in (None, "bad_request"):
        return backend_error(error, None)
    match = _FIELD.match(str(error))
    return OpenAIError(400, str(error), match.group(1) if match else None)

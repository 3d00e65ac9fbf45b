"""The live console (``/``, ``/console/...``, kvflow/console/static) behind the key (a browser
asks for it: HTTP Basic, any user), and ``GET /v1/kvflow/state``, the servers' engine
snapshots it draws (tenants and request ids hashed unless --console-show-tenants)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvflow.console.assets import CONSOLE_ASSETS, CONSOLE_HEADERS, console_file
from kvflow.openai_api.errors import OpenAIError
from kvflow.openai_api.frontend import Frontend
from kvflow.openai_api.security import StateRedactor
from kvflow.triton_backend.protocol import STATE_PARAMETER


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    def console_page(request: Request, content: bytes, media: str) -> Any:
        """A console response, behind the key (HTTP Basic counts here)."""
        try:
            fe.guard.check(request.headers, console_get=True)
        except OpenAIError as e:
            return Response(e.message, status_code=401, media_type="text/plain",
                            headers={**CONSOLE_HEADERS,
                                     "WWW-Authenticate": 'Basic realm="kvflow"'})
        return Response(content, media_type=media, headers=CONSOLE_HEADERS)

    @routes.get("/")
    async def console(request: Request) -> Any:
        """The live console's page."""
        return console_page(request, console_file("index.html"), "text/html")

    @routes.get("/console/token")
    async def console_token(request: Request) -> Any:
        """The token the console's scripts send to the API routes (security.KeyGuard)."""
        return console_page(request, json.dumps({"token": fe.guard.console_token}).encode(),
                            "application/json")

    @routes.get("/console/{name}")
    async def console_asset(name: str, request: Request) -> Any:
        if name not in CONSOLE_ASSETS:
            return Response("not found", status_code=404, media_type="text/plain",
                            headers=CONSOLE_HEADERS)
        return console_page(request, console_file(name), CONSOLE_ASSETS[name])

    @routes.get("/v1/kvflow/state")
    async def engine_state(request: Request) -> Any:
        """Each server's engine snapshot (kvflow.console.state), for the console and
        scripts."""
        async def work() -> Any:
            fe.authorize(request)
            pool = fe.pool
            answers = await asyncio.gather(*(pool.ask({}, {STATE_PARAMETER: True}, ("state",),
                                                      server=k)
                                             for k in range(len(pool.urls))),
                                           return_exceptions=True)
            snapshots = [answer if isinstance(answer, BaseException)
                         else bytes(answer["state"].reshape(-1)[0]) for answer in answers]
            body = await fe.in_worker(_state_body, fe.redactor, pool.urls, snapshots)
            return Response(body, media_type="application/json")

        return await fe.answer("/v1/kvflow/state", work)

    return routes


def _state_body(redactor: StateRedactor, urls: tuple[str, ...],
                snapshots: list[bytes | BaseException]) -> bytes:
    servers = []
    for url, snapshot in zip(urls, snapshots, strict=True):
        if isinstance(snapshot, BaseException):
            servers.append(json.dumps({"url": url, "error": str(snapshot)}).encode())
        else:
            servers.append(redactor.server_json(url, snapshot))
    return b'{"object": "kvflow.state", "servers": [' + b", ".join(servers) + b"]}"

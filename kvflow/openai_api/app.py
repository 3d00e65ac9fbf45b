"""``kvflow openai``: an OpenAI-compatible HTTP server in front of running tritonservers.

A FastAPI app on uvicorn, one process beside tritonserver (``kvflow serve`` starts it on port
9000). It holds no model state: every prompt of every request is one Triton request over its
own gRPC stream (``tritonclient.grpc.aio``; its ``n`` choices are that request's ``n``
sequences, which share the prompt's KV blocks), sent to the server with the fewest requests in
flight, so any number of frontends can stand in front of any number of servers.

- The routes, one module per endpoint family (:mod:`.routes`): ``GET /v1/models``,
  ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as Server-Sent Events,
  or whole; tool calls and reasoning read out of chat outputs), ``/v1/responses``,
  ``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``POST /v1/load_lora_adapter`` and
  ``POST /v1/unload_lora_adapter`` (vLLM's), ``GET /health``, ``GET /metrics``
  (the servers' Prometheus text, then the frontend's own counters), ``GET /v1/kvflow/state``
  and the console (``/``, ``/console/...``). This module only composes them.
- What they share lives once: :class:`.frontend.Frontend` (authentication, the body, error
  mapping and counting, the model's name and chat format), :mod:`.generation` (a request's
  Triton streams, retried on another server, cancelled when the client goes) and
  :mod:`.streaming` (Server-Sent Events, disconnects).
- The request translation is :mod:`.protocol`'s (after :mod:`.checks`' body checks), the
  response shapes :mod:`.completion_bodies`' and the errors :mod:`.errors`'; validation is
  the backend's. :mod:`.pool` holds the gRPC clients; :mod:`.security` says who may call
  what; :mod:`.config` holds the flags; :mod:`.process` runs this server as a child process.
- The event loop only moves bytes: parsing a body, translating it (tool schemas compiled
  included) and encoding a whole response run on :data:`.frontend.WORKER_THREADS` threads,
  so that one big request (a megabyte of tools) never holds up the others' streams.
- A client that disconnects, mid-stream or while waiting for a whole response, cancels its
  gRPC streams; Triton tells the backend, which aborts the requests and frees their KV blocks.
"""

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from kvflow.openai_api.config import (
    FrontendConfig,
    add_chat_format_args,
    add_console_args,
    config_from_args,
)
from kvflow.openai_api.config import add_args as add_args
from kvflow.openai_api.frontend import Frontend

__all__ = ["FrontendConfig", "add_args", "add_chat_format_args", "add_console_args",
           "config_from_args", "create_app", "main", "run"]

# How long an idle connection stays open. uvicorn's default, 5 s, is shorter than many client
# pools keep one (aiohttp 15 s, Go's net/http 90 s, requests until it is closed): a client that
# reuses a connection the server has just closed gets a reset. 75 s is nginx's default.
KEEP_ALIVE_S = 75


def create_app(cfg: FrontendConfig) -> Any:
    """The FastAPI application: every endpoint family's routes over one :class:`Frontend`."""
    from fastapi import FastAPI

    from kvflow.openai_api.routes import (
        chat,
        completions,
        console,
        health,
        lora,
        models,
        responses,
        tokenize,
    )

    fe = Frontend(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await fe.start()
        yield
        await fe.close()

    app = FastAPI(title="kvflow OpenAI-compatible API", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    for family in (console, health, models, completions, chat, responses, tokenize, lora):
        app.include_router(family.router(fe))
    return app


def run(cfg: FrontendConfig) -> int:
    """Serve until SIGINT/SIGTERM (streams still open get 5 s to finish)."""
    import uvicorn

    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
    return 0


def main(args: argparse.Namespace) -> int:
    return run(config_from_args(args))

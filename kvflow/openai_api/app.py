"""``kvflow openai``: an OpenAI-compatible HTTP server in front of running tritonservers.

A FastAPI app on uvicorn, one process beside tritonserver (``kvflow serve`` starts it on port
9000). It holds no model state: every prompt of every request is one Triton request over its
own gRPC stream (``tritonclient.grpc.aio``; its ``n`` choices are that request's ``n``
sequences, which share the prompt's KV blocks), sent to the server with the fewest requests in
flight, so any number of frontends can stand in front of any number of servers.

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
  Server-Sent Events, or whole; tool calls and reasoning read out of chat outputs),
  ``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health``, ``GET /metrics``
  (the servers' Prometheus text, then the frontend's own counters), ``GET /v1/kvflow/state``
  and the console (``/``, ``/console/...``).
- The request translation is :mod:`.protocol`'s (after :mod:`.checks`' body checks), the
  response shapes :mod:`.responses`' and the errors :mod:`.errors`'; validation is the
  backend's. :mod:`.pool` holds the gRPC clients, :mod:`.streaming` reads their streams;
  :mod:`.security` says who may call what; :mod:`.config` holds the flags; :mod:`.process`
  runs this server as a child process.
- The event loop only moves bytes: parsing a body, translating it (tool schemas compiled
  included) and encoding a whole response run on :data:`WORKER_THREADS` threads, so that one
  big request (a megabyte of tools) never holds up the others' streams.
- A client that disconnects, mid-stream or while waiting for a whole response, cancels its
  gRPC streams; Triton tells the backend, which aborts the requests and frees their KV blocks.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvflow.console.assets import CONSOLE_ASSETS, CONSOLE_HEADERS, console_file
from kvflow.openai_api.checks import load_body
from kvflow.openai_api.config import (
    FrontendConfig,
    add_chat_format_args,
    add_console_args,
    config_from_args,
)
from kvflow.openai_api.config import add_args as add_args
from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.pool import BackendError, TritonPool
from kvflow.openai_api.protocol import ChatFormat, CompletionRequest, parse_completion_request
from kvflow.openai_api.reasoning import reasoning_parser
from kvflow.openai_api.responses import ChoiceState, encode_body, final_response, new_states
from kvflow.openai_api.security import KeyGuard, StateRedactor, require_json
from kvflow.openai_api.streaming import (
    ClientGone,
    all_or_cancel,
    backend_error,
    close_all,
    collect,
    sse,
    until_disconnect,
)
from kvflow.openai_api.tokenize import (
    TOKENIZE_OUTPUTS,
    detokenize_request,
    detokenize_response,
    tokenize_error,
    tokenize_request,
    tokenize_response,
)
from kvflow.openai_api.tool_parsers import TOOL_PARSERS
from kvflow.triton_backend.protocol import (
    MODEL_NAME,
    REASONING_STARTS_OPEN_PARAMETER,
    SERVED_MODEL_NAME_PARAMETER,
    STATE_PARAMETER,
    TOKENIZE_PARAMETER,
    TOOL_CALL_PARSER_PARAMETER,
)

__all__ = ["FrontendConfig", "add_args", "add_chat_format_args", "add_console_args",
           "config_from_args", "create_app", "main", "run"]

T = TypeVar("T")
MAX_BODY_BYTES = 8 << 20
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"
# How long an idle connection stays open. uvicorn's default, 5 s, is shorter than many client
# pools keep one (aiohttp 15 s, Go's net/http 90 s, requests until it is closed): a client that
# reuses a connection the server has just closed gets a reset. 75 s is nginx's default.
KEEP_ALIVE_S = 75
# Threads for the CPU work of requests (module doc); more would only contend for the GIL.
WORKER_THREADS = 4


def create_app(cfg: FrontendConfig) -> Any:
    """The FastAPI application."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    state: dict[str, Any] = {"model": cfg.served_model_name}
    counts: Counter[tuple[str, int]] = Counter()
    guard = KeyGuard(cfg.api_key)
    redactor = StateRedactor(cfg.console_show_tenants)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        state["pool"] = TritonPool(cfg.triton_urls, cfg.api_key)
        state["workers"] = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="kvflow-openai")
        yield
        await state["pool"].close()
        state["workers"].shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvflow OpenAI-compatible API", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)

    async def in_worker(fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the event loop serves everyone meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(state["workers"], fn, *args)

    def error_response(err: OpenAIError, endpoint: str) -> JSONResponse:
        counts[endpoint, err.status] += 1
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def model_name() -> str:
        """The served name; on the first call that reaches a server, also the chat format
        its model config names (with --served-model-name, a server that cannot be reached
        yet is left for the request itself to find)."""
        if "chat_format" not in state:
            try:
                parameters = await state["pool"].model_parameters()
            except Exception as e:  # noqa: BLE001  not up yet, or the key refused
                if cfg.served_model_name:
                    return cfg.served_model_name
                if isinstance(e, BackendError) and e.refused_key:
                    raise OpenAIError(502, str(e), code="backend_auth_failed") from None
                if isinstance(e, BackendError):
                    raise
                raise OpenAIError(503, f"no tritonserver is ready yet ({e})",
                                  code="backend_not_ready") from None
            state["model"] = (cfg.served_model_name
                              or parameters.get(SERVED_MODEL_NAME_PARAMETER) or MODEL_NAME)
            state["chat_format"] = chat_format(cfg, parameters)
        return state["model"]

    def console_page(request: Request, content: bytes, media: str) -> Any:
        """A console response, behind the key (a browser asks for it: HTTP Basic, any user)."""
        try:
            guard.check(request.headers, console_get=True)
        except OpenAIError as e:
            return Response(e.message, status_code=401, media_type="text/plain",
                            headers={**CONSOLE_HEADERS,
                                     "WWW-Authenticate": 'Basic realm="kvflow"'})
        return Response(content, media_type=media, headers=CONSOLE_HEADERS)

    @app.get("/")
    async def console(request: Request) -> Any:
        """The live console's page (kvflow/console/static)."""
        return console_page(request, console_file("index.html"), "text/html")

    @app.get("/console/token")
    async def console_token(request: Request) -> Any:
        """The token the console's scripts send to the API routes (security.KeyGuard)."""
        return console_page(request, json.dumps({"token": guard.console_token}).encode(),
                            "application/json")

    @app.get("/console/{name}")
    async def console_asset(name: str, request: Request) -> Any:
        if name not in CONSOLE_ASSETS:
            return Response("not found", status_code=404, media_type="text/plain",
                            headers=CONSOLE_HEADERS)
        return console_page(request, console_file(name), CONSOLE_ASSETS[name])

    @app.get("/health")
    async def health() -> Any:
        ready = await state["pool"].ready()
        return PlainTextResponse("ok" if ready else "no tritonserver is ready",
                                 status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Any:
        texts = await asyncio.gather(*(asyncio.to_thread(_fetch, url)
                                       for url in cfg.metrics_urls))
        own = ["# HELP kvflow_openai_requests_total OpenAI API requests, by endpoint and "
               "HTTP status.", "# TYPE kvflow_openai_requests_total counter"]
        own += [f'kvflow_openai_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(counts.items())]
        own += ["# HELP kvflow_openai_requests_in_flight Triton requests in flight, by server.",
                "# TYPE kvflow_openai_requests_in_flight gauge"]
        own += [f'kvflow_openai_requests_in_flight{{server="{u}"}} {n}'
                for u, n in zip(cfg.triton_urls, state["pool"].in_flight, strict=True)]
        return PlainTextResponse("".join(texts) + "\n".join(own) + "\n",
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            guard.check(request.headers)
            name = await model_name()
        except OpenAIError as e:
            return error_response(e, "/v1/models")
        counts["/v1/models", 200] += 1
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": int(time.time()),
                                            "owned_by": "kvflow"}]}

    async def completions(request: Request, chat: bool) -> Any:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            guard.check(request.headers)
            data = await _read_body(request)
            model = await model_name()
            parsed = await in_worker(_parse_completion, data, model, chat,
                                     state.get("chat_format") or chat_format(cfg, {}))
        except OpenAIError as e:
            return error_response(e, endpoint)
        pool: TritonPool = state["pool"]
        avoid: frozenset[int] = frozenset()
        while True:  # again on another server while one cannot be reached (nothing sent yet)
            # One Triton request per prompt; its n sequences are the prompt's n choices. A
            # batch runs a window of its prompts at a time: the next request waits behind
            # that window, not behind the whole batch.
            window = (asyncio.Semaphore(parsed.prompts_in_flight)
                      if len(parsed.choices) > parsed.n else None)
            generators = [g for c in parsed.choices if c.index % parsed.n == 0
                          for g in pool.generate_n(c, f"{parsed.id}-{c.prompt_index}",
                                                   parsed.n, avoid, window)]
            states = new_states(parsed)
            try:
                if parsed.stream:
                    # The first response of every choice before the status line: a rejected
                    # request (overload, bad input) gets its own status, not a 200 stream.
                    firsts = await until_disconnect(request, all_or_cancel(
                        [anext(g) for g in generators]))
                else:
                    await until_disconnect(request, all_or_cancel(
                        [collect(g, s) for g, s in zip(generators, states, strict=True)]))
                break
            except BackendError as e:
                await close_all(generators)
                if e.transport and e.server is not None and len(avoid) + 1 < len(pool.urls):
                    avoid |= {e.server}
                    continue
                return error_response(backend_error(e, parsed), endpoint)
            except ClientGone:
                await close_all(generators)
                counts[endpoint, CLIENT_CLOSED] += 1
                return Response(status_code=CLIENT_CLOSED)  # read by no one
            except BaseException:
                await close_all(generators)
                raise
        counts[endpoint, 200] += 1
        if not parsed.stream:  # built and encoded off the loop: it may hold prompt logprobs
            return Response(await in_worker(_final_body, parsed, states),
                            media_type="application/json")
        return StreamingResponse(sse(parsed, generators, states, firsts),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def tokenizer(request: Request, detokenize: bool) -> Any:
        endpoint = "/detokenize" if detokenize else "/tokenize"
        try:
            guard.check(request.headers)
            data = await _read_body(request)
            inputs, options = await in_worker(_parse_tokenize, data, await model_name(),
                                              detokenize)
            try:
                answer = await state["pool"].ask(inputs, {TOKENIZE_PARAMETER: True, **options},
                                                 TOKENIZE_OUTPUTS)
            except BackendError as e:
                raise tokenize_error(backend_error(e, None)) from None
        except OpenAIError as e:
            return error_response(e, endpoint)
        counts[endpoint, 200] += 1
        return detokenize_response(answer) if detokenize else tokenize_response(answer)

    @app.get("/v1/kvflow/state")
    async def engine_state(request: Request) -> Any:
        """Each server's engine snapshot (kvflow.console.state), for the console and
        scripts; tenants and request ids hashed unless --console-show-tenants."""
        endpoint = "/v1/kvflow/state"
        try:
            guard.check(request.headers)
            pool: TritonPool = state["pool"]
            answers = await asyncio.gather(*(pool.ask({}, {STATE_PARAMETER: True}, ("state",),
                                                      server=k)
                                             for k in range(len(pool.urls))),
                                           return_exceptions=True)
        except OpenAIError as e:
            return error_response(e, endpoint)
        snapshots = [answer if isinstance(answer, BaseException)
                     else bytes(answer["state"].reshape(-1)[0]) for answer in answers]
        body = await in_worker(_state_body, redactor, pool.urls, snapshots)
        counts[endpoint, 200] += 1
        return Response(body, media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        return await tokenizer(request, detokenize=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        return await tokenizer(request, detokenize=True)

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Any:
        return await completions(request, chat=False)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Any:
        return await completions(request, chat=True)

    return app


def chat_format(cfg: FrontendConfig, parameters: dict[str, str]) -> ChatFormat:
    """How chat outputs are read: the configured parsers, ``auto`` resolved by the model
    config's parameters (the launcher's reading of the engine's chat template)."""
    parser = cfg.tool_call_parser
    if parser == "auto":
        parser = parameters.get(TOOL_CALL_PARSER_PARAMETER) or "hermes"
        parser = parser if parser in TOOL_PARSERS else "hermes"
    starts_open = parameters.get(REASONING_STARTS_OPEN_PARAMETER) == "true"
    return ChatFormat(parser, reasoning_parser(cfg.reasoning_parser, starts_open))


# --- the work done on worker threads ---------------------------------------------------------

def _parse_completion(data: bytes, model: str, chat: bool,
                      fmt: ChatFormat) -> CompletionRequest:
    return parse_completion_request(load_body(data), model, chat, fmt)


def _parse_tokenize(data: bytes, model: str, detokenize: bool
                    ) -> tuple[dict[str, Any], dict[str, bool]]:
    body = load_body(data)
    if detokenize:
        return detokenize_request(body, model), {}
    return tokenize_request(body, model)


def _final_body(parsed: CompletionRequest, states: list[ChoiceState]) -> bytes:
    return encode_body(final_response(parsed, states))


def _state_body(redactor: StateRedactor, urls: tuple[str, ...],
                snapshots: list[bytes | BaseException]) -> bytes:
    servers = []
    for url, snapshot in zip(urls, snapshots, strict=True):
        if isinstance(snapshot, BaseException):
            servers.append(json.dumps({"url": url, "error": str(snapshot)}).encode())
        else:
            servers.append(redactor.server_json(url, snapshot))
    return b'{"object": "kvflow.state", "servers": [' + b", ".join(servers) + b"]}"


async def _read_body(request: Any) -> bytes:
    """The request's body: declared JSON, at most MAX_BODY_BYTES (parsed on a worker)."""
    require_json(request.headers)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise bad_request(f"the request body is over {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
            return text if text.endswith("\n") else text + "\n"
    except OSError as e:
        return f"# {url} unreachable: {e}\n"


# --- the command line ------------------------------------------------------------------------

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

"""``kvflow openai``: an OpenAI-compatible HTTP server in front of running tritonservers.

A FastAPI app on uvicorn, one process beside tritonserver (``kvflow serve`` starts it on port
9000). It holds no model state: every prompt of every request is one Triton request over its
own gRPC stream (``tritonclient.grpc.aio``; its ``n`` choices are that request's ``n``
sequences, which share the prompt's KV blocks), sent to the server with the fewest requests in
flight, so any number of frontends can stand in front of any number of servers.

- ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as
  Server-Sent Events, or whole; tool calls and reasoning read out of chat outputs),
  ``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health``, ``GET /metrics``
  (the servers' Prometheus text, then the frontend's own counters).
- The request translation is :mod:`.protocol`'s (after :mod:`.checks`' body checks), the
  response shapes :mod:`.responses`' and the errors :mod:`.errors`'; validation is the
  backend's. :mod:`.pool` holds the gRPC clients; :mod:`.process` runs this server as a
  child process.
- A client that disconnects, mid-stream or while waiting for a whole response, cancels its
  gRPC streams; Triton tells the backend, which aborts the requests and frees their KV blocks.
"""

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvflow.openai_api.checks import load_body
from kvflow.openai_api.errors import OpenAIError, bad_request, error_from_backend
from kvflow.openai_api.pool import BackendError, TritonPool
from kvflow.openai_api.protocol import ChatFormat, CompletionRequest, parse_completion_request
from kvflow.openai_api.reasoning import REASONING_PARSERS, reasoning_parser
from kvflow.openai_api.responses import (
    ChoiceState,
    choice_chunk,
    chunk,
    final_response,
    new_states,
    usage,
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

MAX_BODY_BYTES = 8 << 20
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"
DISCONNECT_POLL_S = 0.25
# How long an idle connection stays open. uvicorn's default, 5 s, is shorter than many client
# pools keep one (aiohttp 15 s, Go's net/http 90 s, requests until it is closed): a client that
# reuses a connection the server has just closed gets a reset. 75 s is nginx's default.
KEEP_ALIVE_S = 75


@dataclass(frozen=True)
class FrontendConfig:
    """Where the frontend listens and which tritonservers (gRPC ``host:port``) it uses."""

    triton_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 9000
    served_model_name: str | None = None  # default: what the servers' model config names
    metrics_urls: tuple[str, ...] = ()  # the servers' Prometheus endpoints, for /metrics
    api_key: str | None = None  # clients send `Authorization: Bearer KEY`; passed on to Triton
    # How tool calls are read out of chat outputs: a TOOL_PARSERS name, or "auto" (the format
    # of the engine's chat template, which the server's model config names).
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None  # a REASONING_PARSERS name: reasoning_content

    def __post_init__(self) -> None:
        if self.tool_call_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(f"--tool-call-parser must be auto or one of "
                             f"{', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of "
                             f"{', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if not self.triton_urls:
            raise ValueError("--triton-url must name at least one tritonserver (host:port)")
        for url in self.triton_urls:
            host, _, port = url.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--triton-url must be host:port, got {url!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def create_app(cfg: FrontendConfig) -> Any:
    """The FastAPI application."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    state: dict[str, Any] = {"model": cfg.served_model_name}
    counts: Counter[tuple[str, int]] = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        state["pool"] = TritonPool(cfg.triton_urls, cfg.api_key)
        yield
        await state["pool"].close()

    app = FastAPI(title="kvflow OpenAI-compatible API", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)

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

    def authorize(request: Request) -> None:
        """The API key, as ``Authorization: Bearer KEY``, ``x-api-key: KEY`` or (a browser on
        the console) HTTP Basic with the key as the password."""
        if not cfg.api_key:
            return
        if api_key_of(request.headers) != cfg.api_key:
            raise OpenAIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                              code="invalid_api_key")

    @app.get("/")
    async def console(request: Request) -> Any:
        """The live console's page (kvflow/console/static)."""
        try:
            authorize(request)
        except OpenAIError as e:  # a browser asks for the key (any user name)
            return Response(e.message, status_code=401, media_type="text/plain",
                            headers={"WWW-Authenticate": 'Basic realm="kvflow"'})
        return Response(console_file("index.html"), media_type="text/html")

    @app.get("/console/{name}")
    async def console_asset(name: str, request: Request) -> Any:
        try:
            authorize(request)
        except OpenAIError as e:
            return error_response(e, "/console")
        if name not in CONSOLE_ASSETS:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(console_file(name), media_type=CONSOLE_ASSETS[name])

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
            authorize(request)
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
            authorize(request)
            body = await _read_json(request)
            parsed = parse_completion_request(body, await model_name(), chat,
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
                    firsts = await _until_disconnect(request, _all_or_cancel(
                        [anext(g) for g in generators]))
                else:
                    await _until_disconnect(request, _all_or_cancel(
                        [_collect(g, s) for g, s in zip(generators, states, strict=True)]))
                break
            except BackendError as e:
                await _close_all(generators)
                if e.transport and e.server is not None and len(avoid) + 1 < len(pool.urls):
                    avoid |= {e.server}
                    continue
                return error_response(_backend_error(e, parsed), endpoint)
            except ClientGone:
                await _close_all(generators)
                counts[endpoint, CLIENT_CLOSED] += 1
                return Response(status_code=CLIENT_CLOSED)  # read by no one
            except BaseException:
                await _close_all(generators)
                raise
        counts[endpoint, 200] += 1
        if not parsed.stream:
            return final_response(parsed, states)
        return StreamingResponse(_sse(parsed, generators, states, firsts),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def tokenizer(request: Request, detokenize: bool) -> Any:
        endpoint = "/detokenize" if detokenize else "/tokenize"
        try:
            authorize(request)
            body = await _read_json(request)
            model = await model_name()
            options: dict[str, bool] = {}
            if detokenize:
                inputs = detokenize_request(body, model)
            else:
                inputs, options = tokenize_request(body, model)
            try:
                answer = await state["pool"].ask(inputs, {TOKENIZE_PARAMETER: True, **options},
                                                 TOKENIZE_OUTPUTS)
            except BackendError as e:
                raise tokenize_error(_backend_error(e, None)) from None
        except OpenAIError as e:
            return error_response(e, endpoint)
        counts[endpoint, 200] += 1
        return detokenize_response(answer) if detokenize else tokenize_response(answer)

    @app.get("/v1/kvflow/state")
    async def engine_state(request: Request) -> Any:
        """Each server's engine snapshot (kvflow.console.state), for the console and
        scripts."""
        endpoint = "/v1/kvflow/state"
        try:
            authorize(request)
            pool: TritonPool = state["pool"]
            answers = await asyncio.gather(*(pool.ask({}, {STATE_PARAMETER: True}, ("state",),
                                                      server=k)
                                             for k in range(len(pool.urls))),
                                           return_exceptions=True)
        except OpenAIError as e:
            return error_response(e, endpoint)
        # The backend's JSON goes on as it is, with the server's URL in front: parsing and
        # re-encoding it (FastAPI's encoder) would cost more CPU than taking the snapshot.
        servers = []
        for url, answer in zip(pool.urls, answers, strict=True):
            head = json.dumps({"url": url})[:-1].encode()
            if isinstance(answer, BaseException):
                servers.append(head + b', "error": ' + json.dumps(str(answer)).encode() + b"}")
            else:
                servers.append(head + b", " + bytes(answer["state"].reshape(-1)[0])[1:])
        counts[endpoint, 200] += 1
        return Response(b'{"object": "kvflow.state", "servers": [' + b", ".join(servers)
                        + b"]}", media_type="application/json")

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


# The console's files (kvflow/console/static) and their media types.
CONSOLE_ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}


def console_file(name: str) -> bytes:
    from importlib.resources import files

    return files("kvflow.console").joinpath("static", name).read_bytes()


def api_key_of(headers: Any) -> str:
    """The key a request carries: ``Authorization: Bearer KEY``, ``x-api-key: KEY``, or
    ``Authorization: Basic`` with the key as the password."""
    given = headers.get("authorization", "")
    if given.lower().startswith("bearer "):
        return given[7:]
    if given.lower().startswith("basic "):
        try:
            return base64.b64decode(given[6:], validate=True).decode("utf-8").partition(":")[2]
        except ValueError:
            return ""
    return headers.get("x-api-key", "")


def chat_format(cfg: FrontendConfig, parameters: dict[str, str]) -> ChatFormat:
    """How chat outputs are read: the configured parsers, ``auto`` resolved by the model
    config's parameters (the launcher's reading of the engine's chat template)."""
    parser = cfg.tool_call_parser
    if parser == "auto":
        parser = parameters.get(TOOL_CALL_PARSER_PARAMETER) or "hermes"
        parser = parser if parser in TOOL_PARSERS else "hermes"
    starts_open = parameters.get(REASONING_STARTS_OPEN_PARAMETER) == "true"
    return ChatFormat(parser, reasoning_parser(cfg.reasoning_parser, starts_open))


def _backend_error(error: BackendError, parsed: CompletionRequest | None) -> OpenAIError:
    if error.refused_key:  # the frontend's configuration: nothing a client can fix or retry
        return OpenAIError(502, str(error), code="backend_auth_failed")
    if error.transport:  # no server answered: the client may retry, here or elsewhere
        return OpenAIError(503, str(error), code="backend_unavailable")
    return error_from_backend(str(error), parsed, error.code)


async def _read_json(request: Any) -> Any:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise bad_request(f"the request body is over {MAX_BODY_BYTES} bytes")
    return load_body(bytes(body))


async def _until_disconnect(request: Any, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (and with it the Triton
    requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _all_or_cancel(awaitables: list[Any]) -> list[Any]:
    """All results; once one fails (or this is cancelled), the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(generator: AsyncIterator[dict[str, Any]], state: ChoiceState) -> None:
    async for outputs in generator:
        state.update(outputs)


async def _close_all(generators: list[Any]) -> None:
    for g in generators:
        with contextlib.suppress(BaseException):
            await g.aclose()


def _event(body: Any) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def _sse(parsed: CompletionRequest, generators: list[Any], states: list[ChoiceState],
               firsts: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The Server-Sent Events of a streamed response: every choice's deltas as they come,
    then the usage chunk (``include_usage``), then ``[DONE]``. Cancelled when the client
    disconnects; the ``finally`` then cancels the Triton requests."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(k: int) -> None:
        try:
            async for outputs in generators[k]:
                await queue.put((k, outputs))
            await queue.put((k, None))
        except Exception as e:  # noqa: BLE001  reported in the stream
            await queue.put((k, e))

    def render(k: int, outputs: dict[str, Any], first: bool) -> bytes:
        delta, entries = states[k].update(outputs)
        piece = choice_chunk(parsed, parsed.choices[k], states[k], delta, entries, first)
        if parsed.chat and piece == {"index": piece["index"], "delta": {}, "logprobs": None,
                                     "finish_reason": None}:
            return b""  # nothing new to say (text held back, or read into a call later)
        body = chunk(parsed, [piece], usage(parsed, states) if parsed.continuous_usage else None)
        return _event(body)

    tasks: list[asyncio.Task] = []
    try:
        open_choices = 0
        for k, outputs in enumerate(firsts):
            yield render(k, outputs, True)  # the first chunk (its role) always goes
            if not states[k].finish_reason:
                open_choices += 1
                tasks.append(asyncio.create_task(pump(k)))
        while open_choices:
            k, item = await queue.get()
            if item is None:
                open_choices -= 1
            elif isinstance(item, BaseException):
                err = (_backend_error(item, parsed) if isinstance(item, BackendError)
                       else OpenAIError(500, f"the frontend failed: {item!r}"))
                yield _event(err.body())
                break
            else:
                event = render(k, item, False)
                if event:
                    yield event
        if parsed.include_usage:
            yield _event({**chunk(parsed, []), "usage": usage(parsed, states)})
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(generators)


def _fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
            return text if text.endswith("\n") else text + "\n"
    except OSError as e:
        return f"# {url} unreachable: {e}\n"


# --- the command line ------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--triton-url", default="127.0.0.1:8001",
                   help="gRPC host:port of the tritonserver(s), comma-separated")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--served-model-name", default=None, type=served_model_name_arg,
                   help="the model's name in the API (default: the engine's, from the server)")
    p.add_argument("--metrics-url", default="",
                   help="Prometheus endpoint(s) of the server(s), comma-separated, passed "
                        "through by /metrics")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: $KVFLOW_API_KEY)")
    add_chat_format_args(p)


def add_chat_format_args(p: argparse.ArgumentParser) -> None:
    """The flags that say how chat outputs are read (``kvflow openai`` and ``kvflow serve``)."""
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_PARSERS),
                   help="how tool calls are read out of chat outputs (default: the format of "
                        "the engine's chat template; hermes for kvflow's fallback prompt)")
    p.add_argument("--reasoning-parser", default=None, choices=tuple(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content (default: none)")


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    from kvflow import envs

    return FrontendConfig(
        tuple(u.strip() for u in args.triton_url.split(",") if u.strip()), args.host,
        args.port, args.served_model_name,
        tuple(u.strip() for u in args.metrics_url.split(",") if u.strip()),
        args.api_key or envs.api_key(), args.tool_call_parser, args.reasoning_parser)


def served_model_name_arg(text: str) -> str:
    if not text or len(text) > 256 or not text.isprintable():
        raise argparse.ArgumentTypeError("--served-model-name must be 1-256 printable "
                                         "characters")
    return text


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



"""What every route of the OpenAI frontend shares, written once: the configuration, the pool of
servers, the worker threads, authentication (:meth:`Frontend.authorize`), the request body
(:meth:`Frontend.read_body`), error mapping and request counting
(:meth:`Frontend.error_response`), the served model's name and its chat format, the ``model``
field resolved to the base or a LoRA adapter (:meth:`Frontend.resolve_model`), and the
``/v1/responses`` store."""

from __future__ import annotations

import asyncio
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvflow.openai_api.config import FrontendConfig
from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.lora import LoraCatalog, model_not_found
from kvflow.openai_api.pool import BackendError, TritonPool
from kvflow.openai_api.protocol import ChatFormat
from kvflow.openai_api.reasoning import REASONING_PARSERS, reasoning_parser
from kvflow.openai_api.response_store import ResponseStore
from kvflow.openai_api.security import KeyGuard, StateRedactor, require_json
from kvflow.openai_api.streaming import ClientGone, backend_error
from kvflow.openai_api.tool_parsers import TOOL_PARSERS
from kvflow.triton_backend.protocol import (
    MODEL_NAME,
    REASONING_PARSER_PARAMETER,
    REASONING_STARTS_OPEN_PARAMETER,
    SERVED_MODEL_NAME_PARAMETER,
    TOOL_CALL_PARSER_PARAMETER,
)

T = TypeVar("T")
MAX_BODY_BYTES = 8 << 20
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"
# Threads for the CPU work of requests (app's module doc); more would only contend for the GIL.
WORKER_THREADS = 4


class Frontend:
    """The state the routes share. :meth:`start` and :meth:`close` run in the app's lifespan
    (the gRPC clients need the running event loop)."""

    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        self.guard = KeyGuard(cfg.api_key)
        self.redactor = StateRedactor(cfg.console_show_tenants)
        self.counts: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status) -> requests
        self.model = cfg.served_model_name
        self.chat_format: ChatFormat | None = None  # read from the first server that answers
        self.store = ResponseStore(cfg.responses_store or ":memory:",
                                   cfg.responses_store_max_count, cfg.responses_store_max_bytes)
        self._pool: TritonPool | None = None
        self._loras: LoraCatalog | None = None
        self._workers: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._pool = TritonPool(self.cfg.triton_urls, self.cfg.api_key)
        self._loras = LoraCatalog(self._pool)
        self._workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="kvflow-openai")

    async def close(self) -> None:
        await self.pool.close()
        assert self._workers is not None
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    @property
    def pool(self) -> TritonPool:
        assert self._pool is not None, "the frontend has not started"
        return self._pool

    @property
    def loras(self) -> LoraCatalog:
        """The servers' LoRA adapters (:class:`~kvflow.openai_api.lora.LoraCatalog`)."""
        assert self._loras is not None, "the frontend has not started"
        return self._loras

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread: the event loop serves everyone meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    def authorize(self, request: Any) -> str:
        """A 401 unless ``request`` carries the key; returns the namespace of the store its
        key owns (security.KeyGuard.namespace)."""
        self.guard.check(request.headers)
        return self.guard.namespace(request.headers)

    def error_response(self, err: OpenAIError, endpoint: str) -> Any:
        """``err`` as OpenAI's JSON error, counted under ``endpoint``."""
        from fastapi.responses import JSONResponse

        self.counts[endpoint, err.status] += 1
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def count(self, endpoint: str, status: int = 200) -> None:
        self.counts[endpoint, status] += 1

    async def answer(self, endpoint: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """``work()``'s response, counted under ``endpoint``: an OpenAIError it raises becomes
        OpenAI's error body, a client gone before its answer nginx's 499 (read by no one)."""
        from fastapi.responses import Response

        try:
            response = await work()
        except OpenAIError as e:
            return self.error_response(e, endpoint)
        except ClientGone:
            self.count(endpoint, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        self.count(endpoint, getattr(response, "status_code", 200))
        return response

    async def model_name(self) -> str:
        """The served name; on the first call that reaches a server, also the chat format
        its model config names (with --served-model-name, a server that cannot be reached
        yet is left for the request itself to find)."""
        if self.chat_format is None:
            try:
                parameters = await self.pool.model_parameters()
            except Exception as e:  # noqa: BLE001  not up yet, or the key refused
                if self.cfg.served_model_name:
                    return self.cfg.served_model_name
                if isinstance(e, BackendError) and e.refused_key:
                    raise OpenAIError(502, str(e), code="backend_auth_failed") from None
                if isinstance(e, BackendError):
                    raise
                raise OpenAIError(503, f"no tritonserver is ready yet ({e})",
                                  code="backend_not_ready") from None
            self.model = (self.cfg.served_model_name
                          or parameters.get(SERVED_MODEL_NAME_PARAMETER) or MODEL_NAME)
            self.chat_format = chat_format(self.cfg, parameters)
        assert self.model is not None
        return self.model

    async def resolve_model(self, body: Any) -> tuple[str, str | None]:
        """The name a request's ``model`` field answers as, and the LoRA adapter it selects
        (None: the base model). A model that is neither the served name nor an adapter is a
        404 ``model_not_found``; a missing or non-string one is left to the body's checks."""
        served = await self.model_name()
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or model == served:
            return served, None
        try:
            found = await self.loras.find(model)
            if found is None:
                raise model_not_found(model, served, list(await self.loras.adapters()))
        except BackendError as e:
            raise backend_error(e, None) from None
        return model, model

    def format(self) -> ChatFormat:
        """How chat outputs are read (the flags alone until a server has answered)."""
        return self.chat_format or chat_format(self.cfg, {})

    async def read_body(self, request: Any) -> bytes:
        """The request's body: declared JSON, at most MAX_BODY_BYTES (parsed on a worker)."""
        require_json(request.headers)
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise bad_request(f"the request body is over {MAX_BODY_BYTES} bytes")
        return bytes(body)


def chat_format(cfg: FrontendConfig, parameters: dict[str, str]) -> ChatFormat:
    """How chat outputs are read: the configured parsers, ``auto`` resolved by the model
    config's parameters (the launcher's reading of the engine's chat template:
    ``kvflow.text.chat_tools.tool_call_format`` and ``reasoning_format``)."""
    parser = cfg.tool_call_parser
    if parser == "auto":
        parser = parameters.get(TOOL_CALL_PARSER_PARAMETER) or "hermes"
        parser = parser if parser in TOOL_PARSERS else "hermes"
    starts_open = parameters.get(REASONING_STARTS_OPEN_PARAMETER) == "true"
    reasoning = cfg.reasoning_parser
    if reasoning == "auto":
        reasoning = parameters.get(REASONING_PARSER_PARAMETER) or None
        if reasoning is None and starts_open:  # a template that opens <think> in the prompt
            reasoning = "think"
        reasoning = reasoning if reasoning in REASONING_PARSERS else None
    return ChatFormat(parser, reasoning_parser(reasoning, starts_open))


def fetch_metrics(url: str) -> str:
    """A server's Prometheus text (a comment when it cannot be reached)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
            return text if text.endswith("\n") else text + "\n"
    except OSError as e:
        return f"# {url} unreachable: {e}\n"

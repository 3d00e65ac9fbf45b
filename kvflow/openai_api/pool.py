"""The tritonservers behind one frontend: a gRPC aio client each, one stream per request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from kvflow.client import infer_inputs
from kvflow.openai_api.protocol import ChoiceRequest
from kvflow.triton_backend.protocol import (
    ERROR_OUTPUT_PARAMETER,
    GRPC_API_KEY_HEADER,
    MODEL_NAME,
)

_OUTPUTS = (("text_output", str), ("finish_reason", str), ("num_input_tokens", int),
            ("num_output_tokens", int), ("cached_tokens", int), ("output_logprobs", str),
            ("prompt_logprobs", str), ("num_draft_tokens", int), ("num_accepted_tokens", int))
# The outputs with one entry per sequence (n > 1); the others are the request's.
_PER_SEQUENCE = ("text_output", "finish_reason", "num_output_tokens", "output_logprobs")


class BackendError(Exception):
    """A Triton request failed. ``transport``: the server could not be reached or dropped the
    stream (the message is gRPC's); otherwise the message is the backend's error, and ``code``
    its ``error_code`` (bad_request, overloaded, engine_error; None: Triton's own error)."""

    def __init__(self, message: str, transport: bool = False, server: int | None = None,
                 refused_key: bool = False, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.transport = transport
        self.refused_key = refused_key  # the server refused this frontend's API key
        self.server = server  # the index of the server that failed


DOWN_S = 5.0  # a server whose stream failed is passed over this long (unless all are)
# How tritonserver refuses a missing or wrong key over gRPC: with UNAVAILABLE, which clients
# take for a server that is down and retry. It is this frontend's configuration: never retried.
RESTRICTED = "This protocol is restricted"


class TritonPool:
    """One gRPC aio client per server; each request goes to the least loaded one that has not
    just failed."""

    def __init__(self, urls: tuple[str, ...], api_key: str | None) -> None:
        import tritonclient.grpc.aio as grpcaio

        self.urls = urls
        self.clients = [grpcaio.InferenceServerClient(url) for url in urls]
        self.in_flight = [0] * len(urls)
        self.down_until = [0.0] * len(urls)
        self.headers = {GRPC_API_KEY_HEADER: api_key} if api_key else None
        self._turn = itertools.count()

    def _pick(self, avoid: frozenset[int]) -> int:
        start = next(self._turn) % len(self.clients)  # ties go round the servers
        order = [i for i in ((start + k) % len(self.clients) for k in range(len(self.clients)))
                 if i not in avoid]
        now = time.monotonic()
        up = [i for i in order if self.down_until[i] <= now]
        return min(up or order, key=lambda i: self.in_flight[i])

    async def model_parameters(self) -> dict[str, str]:
        """The string parameters ``kvflow serve`` wrote into the model config (the name it
        serves, the chat template's tool format), from the first server that answers."""
        error: Exception | None = None
        for client in self.clients:
            try:
                config = await client.get_model_config(MODEL_NAME, headers=self.headers,
                                                       as_json=True)
            except Exception as e:  # noqa: BLE001  try the next one
                error = (self._refused_key(self.clients.index(client), str(e))
                         if RESTRICTED in str(e) else e)
                continue
            parameters = config.get("config", {}).get("parameters", {})
            return {k: v.get("string_value", "") for k, v in parameters.items()
                    if isinstance(v, dict)}
        assert error is not None
        raise error

    async def ready(self) -> bool:
        for client in self.clients:
            with contextlib.suppress(Exception):
                if await client.is_model_ready(MODEL_NAME, headers=self.headers):
                    return True
        return False

    def generate_n(self, choice: ChoiceRequest, request_id: str, n: int,
                   avoid: frozenset[int] = frozenset(),
                   window: asyncio.Semaphore | None = None
                   ) -> list[AsyncIterator[dict[str, Any]]]:
        """The ``n`` sequences of one Triton request (``choice``'s inputs ask for ``n``), as
        one stream of outputs each; closing one early cancels the request."""
        return _Fanout(self.generate(choice, request_id, avoid, window), n).views()

    async def generate(self, choice: ChoiceRequest, request_id: str,
                       avoid: frozenset[int] = frozenset(),
                       window: asyncio.Semaphore | None = None
                       ) -> AsyncIterator[list[dict[str, Any]]]:
        """Yield the outputs of each response of one Triton request, one dict per sequence,
        until every sequence has finished, from a server not in ``avoid``. Closing the
        generator early cancels the request. With ``window`` (shared by the requests of one
        HTTP request), the request is sent only once it holds one of the window's places."""
        if window is None:
            async for outputs in self._generate(choice, request_id, avoid):
                yield outputs
            return
        async with window:
            async for outputs in self._generate(choice, request_id, avoid):
                yield outputs

    async def _generate(self, choice: ChoiceRequest, request_id: str,
                        avoid: frozenset[int]) -> AsyncIterator[list[dict[str, Any]]]:
        inputs = infer_inputs(choice.inputs)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            # The backend's errors as outputs: their code crosses as data (see params.py).
            yield {"model_name": MODEL_NAME, "inputs": inputs, "request_id": request_id,
                   "parameters": {ERROR_OUTPUT_PARAMETER: True}}
            await done.wait()  # NOTE: the stream stays open until the last response

        server = self._pick(avoid)
        self.in_flight[server] += 1
        responses = None
        finished = False
        try:
            responses = self.clients[server].stream_infer(requests(), headers=self.headers)
            async for result, error in responses:
                self._raise_failed(server, result, error)
                columns: dict[str, list[Any]] = {}
                for name, kind in _OUTPUTS:
                    array = result.as_numpy(name)
                    if array is not None:
                        columns[name] = [v.decode("utf-8") if kind is str else int(v)
                                         for v in array.reshape(-1)]
                n = len(columns.get("finish_reason", [""]))
                outputs = [{name: values[j] if name in _PER_SEQUENCE else values[0]
                            for name, values in columns.items()} for j in range(n)]
                finished = all(o.get("finish_reason") for o in outputs)
                yield outputs
                if finished:
                    return
            raise BackendError(f"tritonserver {self.urls[server]} closed the stream before the "
                               "request finished", transport=True, server=server)
        except Exception as e:
            if RESTRICTED in str(e):
                raise self._refused_key(server, str(e)) from e
            if isinstance(e, BackendError):
                if e.transport:
                    self.down_until[server] = time.monotonic() + DOWN_S
                raise
            self.down_until[server] = time.monotonic() + DOWN_S
            raise BackendError(f"tritonserver {self.urls[server]}: {e}", transport=True,
                               server=server) from e
        finally:
            done.set()
            if not finished and responses is not None:
                responses.cancel()  # the client left (or failed): Triton aborts the request
            self.in_flight[server] -= 1

    async def ask(self, inputs: dict[str, Any], parameters: dict[str, Any],
                  outputs: tuple[str, ...], server: int | None = None) -> dict[str, Any]:
        """The one answer of a request the backend answers at once (``parameters`` say which:
        :data:`TOKENIZE_PARAMETER`, :data:`STATE_PARAMETER`): its ``outputs`` as NumPy
        arrays (absent ones left out), from ``server`` (default: the least loaded)."""
        server = self._pick(frozenset()) if server is None else server
        request = {"model_name": MODEL_NAME, "inputs": infer_inputs(inputs),
                   "parameters": {ERROR_OUTPUT_PARAMETER: True, **parameters}}
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            await done.wait()  # NOTE: the stream stays open until the answer (see _generate)

        responses, answered = None, False
        try:
            responses = self.clients[server].stream_infer(requests(), headers=self.headers)
            async for result, error in responses:
                answered = True
                self._raise_failed(server, result, error)
                return {name: result.as_numpy(name) for name in outputs
                        if result.as_numpy(name) is not None}
        except BackendError:
            raise
        except Exception as e:
            if RESTRICTED in str(e):
                raise self._refused_key(server, str(e)) from e
            raise BackendError(f"tritonserver {self.urls[server]}: {e}", transport=True,
                               server=server) from e
        finally:
            done.set()
            if not answered and responses is not None:
                responses.cancel()
        raise BackendError(f"tritonserver {self.urls[server]} sent no answer", transport=True,
                           server=server)

    def _raise_failed(self, server: int, result: Any, error: Any) -> None:
        """Raise the BackendError of a failed response: a Triton error (the key refused, or
        another), or the backend's error as outputs (``error``, ``error_code``: see
        :data:`ERROR_OUTPUT_PARAMETER`)."""
        if error is not None:
            message = str(error.message() if hasattr(error, "message") else error)
            if RESTRICTED in message:
                raise self._refused_key(server, message)
            raise BackendError(message)
        code = result.as_numpy("error_code")
        if code is not None:
            text = result.as_numpy("error")
            raise BackendError("" if text is None else text.reshape(-1)[0].decode("utf-8"),
                               code=code.reshape(-1)[0].decode("utf-8"))

    def _refused_key(self, server: int, message: str) -> BackendError:
        return BackendError(f"tritonserver {self.urls[server]} refused this frontend's API key "
                            f"({message}): the frontend's --api-key must be the server's",
                            server=server, refused_key=True)

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()


class _Fanout:
    """One Triton request's stream of ``n`` sequences, read as ``n`` streams of one each.

    Each view yields its sequence's outputs (the first response always, then those that carry
    something for it) until its sequence finishes. The first view read starts the pump; a
    view closed before its sequence finished cancels the request, and the other views fail.
    """

    def __init__(self, source: AsyncIterator[list[dict[str, Any]]], n: int) -> None:
        self.source = source
        self.queues: list[asyncio.Queue[dict[str, Any] | BaseException]] = [
            asyncio.Queue() for _ in range(n)]
        self.task: asyncio.Future[None] | None = None
        self.open = n

    def views(self) -> list[AsyncIterator[dict[str, Any]]]:
        return [self._view(j) for j in range(len(self.queues))]

    async def _pump(self) -> None:
        first, done = True, [False] * len(self.queues)
        try:
            async for outputs in self.source:
                if len(outputs) != len(self.queues):
                    raise BackendError(f"the server returned {len(outputs)} sequences for a "
                                       f"request of {len(self.queues)}")
                for j, out in enumerate(outputs):
                    news = (out.get("text_output") or out.get("finish_reason")
                            or out.get("output_logprobs", "[]") != "[]")
                    if not done[j] and (first or news):
                        self.queues[j].put_nowait(out)
                        done[j] = bool(out.get("finish_reason"))
                first = False
        except BaseException as e:  # noqa: BLE001  every view reports it
            for q in self.queues:
                q.put_nowait(e)
            if isinstance(e, asyncio.CancelledError):
                raise

    async def _view(self, j: int) -> AsyncIterator[dict[str, Any]]:
        if self.task is None:
            self.task = asyncio.ensure_future(self._pump())
        finished = False
        try:
            while True:
                item = await self.queues[j].get()
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        raise BackendError("the request was cancelled")
                    raise item
                finished = bool(item.get("finish_reason"))
                yield item
                if finished:
                    return
        finally:
            self.open -= 1
            if not finished and not self.task.done():
                self.task.cancel()  # closes the source: Triton aborts the request

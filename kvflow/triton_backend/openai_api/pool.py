"""The tritonservers behind one frontend: a gRPC aio client each, one stream per request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from kvflow.triton_backend.client import infer_inputs
from kvflow.triton_backend.openai_api.protocol import ChoiceRequest
from kvflow.triton_backend.server import GRPC_API_KEY_HEADER, MODEL_NAME

_OUTPUTS = (("text_output", str), ("finish_reason", str), ("num_input_tokens", int),
            ("num_output_tokens", int), ("cached_tokens", int), ("output_logprobs", str))


class BackendError(Exception):
    """A Triton request failed. ``transport``: the server could not be reached or dropped the
    stream (the message is gRPC's); otherwise the message is the backend's error."""

    def __init__(self, message: str, transport: bool = False, server: int | None = None) -> None:
        super().__init__(message)
        self.transport = transport
        self.server = server  # the index of the server that failed


DOWN_S = 5.0  # a server whose stream failed is passed over this long (unless all are)


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

    async def served_model_name(self) -> str:
        """The name ``kvflow serve`` wrote into the model config, from the first server that
        answers."""
        error: Exception | None = None
        for client in self.clients:
            try:
                config = await client.get_model_config(MODEL_NAME, headers=self.headers,
                                                       as_json=True)
            except Exception as e:  # noqa: BLE001  try the next one
                error = e
                continue
            parameters = config.get("config", {}).get("parameters", {})
            return parameters.get("served_model_name", {}).get("string_value") or MODEL_NAME
        assert error is not None
        raise error

    async def ready(self) -> bool:
        for client in self.clients:
            with contextlib.suppress(Exception):
                if await client.is_model_ready(MODEL_NAME, headers=self.headers):
                    return True
        return False

    async def generate(self, choice: ChoiceRequest, request_id: str,
                       avoid: frozenset[int] = frozenset()) -> AsyncIterator[dict[str, Any]]:
        """Yield the outputs of each response of one Triton request, until it finishes, from
        a server not in ``avoid``. Closing the generator early cancels the request."""
        inputs = infer_inputs(choice.inputs)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": MODEL_NAME, "inputs": inputs, "request_id": request_id}
            await done.wait()  # NOTE: the stream stays open until the last response

        server = self._pick(avoid)
        self.in_flight[server] += 1
        responses = None
        finished = False
        try:
            responses = self.clients[server].stream_infer(requests(), headers=self.headers)
            async for result, error in responses:
                if error is not None:
                    raise BackendError(str(error.message() if hasattr(error, "message")
                                           else error))
                outputs = {}
                for name, kind in _OUTPUTS:
                    array = result.as_numpy(name)
                    if array is not None:
                        value = array.reshape(-1)[0]
                        outputs[name] = value.decode("utf-8") if kind is str else int(value)
                finished = bool(outputs.get("finish_reason"))
                yield outputs
                if finished:
                    return
            raise BackendError(f"tritonserver {self.urls[server]} closed the stream before the "
                               "request finished", transport=True, server=server)
        except Exception as e:
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

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()

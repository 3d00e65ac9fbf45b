"""The front doors a load can be driven through, behind one small interface.

``bench serve`` sends the same requests either way, so that the two are compared on one load:
``TritonGrpcClient`` (tritonclient gRPC streaming, Triton's vLLM-backend protocol) and
``OpenAIClient`` (``/v1/completions`` or ``/v1/chat/completions`` over plain HTTP, streamed as
Server-Sent Events, with vLLM's ``continuous_usage_stats`` so that every chunk says how many
tokens it holds). A request that fails raises :class:`RequestFailed`, whose ``kind`` is what
``bench serve`` counts failures by.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any, Protocol
from urllib.parse import urlsplit

# A kept-alive connection the server has closed (uvicorn closes one idle for 5 s) fails the
# next request with one of these before any byte of the response arrives: the send finds the
# socket reset (BrokenPipeError, ConnectionResetError) or the status line finds it closed
# (RemoteDisconnected, a ConnectionResetError).
STALE_CONNECTION_ERRORS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class RequestFailed(RuntimeError):
    """The server answered a request with an error; ``kind`` names the error for counting
    (``HTTP 400``, ``stream error``, ``triton error``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_message(body: bytes) -> str:
    """An error response's message: OpenAI's ``error.message``, else the body's start."""
    try:
        error = json.loads(body)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


class LoadClient(Protocol):
    """One way to send a greedy request and watch its tokens arrive."""

    name: str
    url: str

    def connect(self) -> Any: ...

    def stream(self, conn: Any, prompt: str, max_tokens: int,
               tenant: str | None = None) -> Iterator[tuple[int, int]]:
        """Yield (output tokens so far, prompt tokens) as responses arrive; ``tenant``: whom
        the request is accounted to."""
        ...

    def close(self, conn: Any) -> None: ...


class TritonGrpcClient:
    """Triton's gRPC streaming endpoint (one reusable stream per connection)."""

    name = "triton-grpc"

    def __init__(self, url: str) -> None:
        self.url = url  # gRPC host:port

    def connect(self) -> Any:
        from kvflow.client import StreamingClient

        return StreamingClient(self.url)

    def stream(self, conn: Any, prompt: str, max_tokens: int,
               tenant: str | None = None) -> Iterator[tuple[int, int]]:
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0,
                                    "ignore_eos": True}
        if tenant is not None:
            sampling["tenant"] = tenant
        try:
            for chunk in conn.generate(prompt, sampling):
                yield chunk.num_output_tokens, chunk.num_input_tokens
        except RuntimeError as e:  # the stream's error, as StreamingClient raises it
            raise RequestFailed("triton error", str(e)) from None

    def close(self, conn: Any) -> None:
        conn.close()


class OpenAIClient:
    """An OpenAI-compatible server (``kvflow openai``, or any other) over keep-alive HTTP.

    A request on a reused connection that fails before any byte of its response arrived (the
    server closed the idle connection: :data:`STALE_CONNECTION_ERRORS`) is sent once more on
    a fresh connection; ``stale_retries`` counts those. A fresh connection's errors are the
    server's, and are raised.
    """

    def __init__(self, base_url: str, chat: bool = False, model: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = base_url if "://" in base_url else f"http://{base_url}"
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.chat, self.timeout_s = chat, timeout_s
        self.name = "openai-chat" if chat else "openai-completions"
        self.stale_retries = 0
        self._lock = threading.Lock()
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        conn = self.connect()
        try:
            conn.request("GET", "/v1/models")
            return json.loads(conn.getresponse().read())["data"][0]["id"]
        finally:
            conn.close()

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def stream(self, conn: http.client.HTTPConnection, prompt: str,
               max_tokens: int, tenant: str | None = None) -> Iterator[tuple[int, int]]:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        body = self.request_body(prompt, max_tokens)
        if tenant is not None:
            body["user"] = tenant
        response = self._post(conn, path, json.dumps(body))
        if response.status != 200:
            raise RequestFailed(f"HTTP {response.status}",
                                f"{path}: {error_message(response.read())}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                response.read()  # NOTE: to the end of the body, so the connection is reusable
                self.after_stream(conn)
                return
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                raise RequestFailed("stream error", f"{path}: {error.get('message', error)}"
                                    if isinstance(error, dict) else f"{path}: {error}")
            counts = self.token_counts(event)
            if counts is not None:
                yield counts

    def _post(self, conn: http.client.HTTPConnection, path: str,
              body: str) -> http.client.HTTPResponse:
        """POST ``body`` and read the status line, once more on a fresh connection if a reused
        one turns out stale."""
        reused = conn.sock is not None
        headers = {"Content-Type": "application/json"}
        try:
            conn.request("POST", path, body, headers)
            return conn.getresponse()
        except STALE_CONNECTION_ERRORS:
            if not reused:
                raise
            conn.close()  # NOTE: the next request on this object opens a new socket
            with self._lock:
                self.stale_retries += 1
        conn.request("POST", path, body, headers)
        return conn.getresponse()

    def request_body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One greedy streamed request of exactly ``max_tokens`` tokens."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def token_counts(self, event: dict[str, Any]) -> tuple[int, int] | None:
        """(output tokens so far, prompt tokens) from one SSE event, if it says."""
        usage = event.get("usage")
        return (usage["completion_tokens"], usage["prompt_tokens"]) if usage else None

    def after_stream(self, conn: http.client.HTTPConnection) -> None:  # noqa: B027
        """Called once a response has ended (the connection is reused by default)."""

    def close(self, conn: http.client.HTTPConnection) -> None:
        conn.close()

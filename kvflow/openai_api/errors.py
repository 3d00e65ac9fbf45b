"""Errors in OpenAI's shape: :class:`OpenAIError`, and :func:`error_from_backend`, which turns
the backend's error (its message names a field in kvflow's terms) into the one the client
reads (the field named as the client sent it)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvflow.openai_api.fields import CHAT_FIELDS, COMMON_FIELDS
from kvflow.orchestrator.outputs import ErrorCode
from kvflow.orchestrator.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvflow.openai_api.protocol import CompletionRequest

RETRY_AFTER_S = 1


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        # NOTE: the body must encode as UTF-8: a lone surrogate of the client's is escaped.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {400: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error", 503: "server_error"}.get(status,
                                                                               "server_error")
        self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 (``invalid_request_error``) naming the client's field ``param``."""
    return OpenAIError(400, message, param)


_FIELD = re.compile(r"^(?:sampling_parameters\.)?([A-Za-z_]+)")
_PROMPT_WORDS = ("prompt", "text_input", "input_ids", "messages")


def error_from_backend(message: str, request: CompletionRequest | None = None,
                       code: str | None = None) -> OpenAIError:
    """The OpenAI error for a backend error and its ``error_code``: overload is 503 (retry), an
    engine failure 500, an adapter the engine does not hold 404 (``model_not_found``), anything
    else the client's (400, ``param`` the field its message names: the backend's messages
    begin with the field)."""
    if code == ErrorCode.OVERLOADED:
        return OpenAIError(503, message, type_="server_error", code="server_overloaded")
    if code == ErrorCode.ENGINE_ERROR:
        return OpenAIError(500, message, type_="server_error", code="engine_error")
    message = message.replace("sampling_parameters.", "")
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    renamed = request.renamed if request is not None else {}
    if param in renamed:
        message = renamed[param] + message[len(param):]
        param = renamed[param]
    if param == "model":  # an adapter unloaded since the frontend looked (LoraManager.get)
        return OpenAIError(404, message, "model", code="model_not_found")
    if param in _PROMPT_WORDS:
        param = "messages" if request is not None and request.chat else "prompt"
    elif param not in SamplingParams.field_names() and param not in COMMON_FIELDS \
            and param not in CHAT_FIELDS:
        param = None
    return OpenAIError(400, message, param)

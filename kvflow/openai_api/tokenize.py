"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` bodies -> the backend's tokenize request
(:mod:`kvflow.triton_backend.tokenize`), and its answer -> vLLM's response. The prompt is
tokenized by the engine, as a completion's would be: a chat is rendered with its template,
tools included. Pure Python + NumPy.

* ``/tokenize``: ``{"prompt": str, "add_special_tokens"?: bool}`` or ``{"messages": [...],
  "tools"?: [...], "chat_template_kwargs"?: {...}, "add_generation_prompt"?: bool}`` ->
  ``{"count", "max_model_len", "tokens", "token_strs": null}``;
* ``/detokenize``: ``{"tokens": [int, ...]}`` -> ``{"prompt": str}``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from kvflow.openai_api.checks import check_body
from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.protocol import chat_texts
from kvflow.orchestrator.sampling.params import short_repr
from kvflow.triton_backend.params import MAX_MESSAGES_JSON_BYTES

TOKENIZE_FIELDS = ("model", "prompt", "messages", "tools", "chat_template_kwargs",
                   "add_special_tokens", "add_generation_prompt", "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")
MAX_DETOKENIZE_TOKENS = 1 << 20


def _check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        raise OpenAIError(404, f"The model `{short_repr(model, 60)[1:-1]}` does not exist; this "
                          f"server serves `{served_model}`", "model", code="model_not_found")


def _text(text: str, limit: int, name: str) -> np.ndarray:
    if len(text) > limit:
        raise bad_request(f"{name} is {len(text)} characters; the limit is {limit}", name)
    return np.array([text.encode("utf-8")], dtype=np.object_)


def tokenize_request(body: Any, served_model: str) -> tuple[dict[str, np.ndarray],
                                                             dict[str, bool]]:
    """The backend inputs and options of a ``/tokenize`` body."""
    check_body(body, TOKENIZE_FIELDS, "/tokenize")
    _check_model(body, served_model)
    for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean, got {short_repr(body[name])}", name)
    if body.get("return_token_strs"):
        raise bad_request("return_token_strs is not supported by kvflow's /tokenize",
                          "return_token_strs")
    options = {k: body[k] for k in ("add_special_tokens", "add_generation_prompt")
               if body.get(k) is not None}
    prompt = body.get("prompt")
    if (prompt is None) == (body.get("messages") is None):
        raise bad_request("give exactly one of prompt (a string) and messages", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("prompt must be a non-empty string", "prompt")
        for name in ("tools", "chat_template_kwargs"):
            if body.get(name):
                raise bad_request(f"{name} belong to a chat: give them with messages", name)
        return {"text_input": _text(prompt, MAX_MESSAGES_JSON_BYTES, "prompt")}, options
    texts = chat_texts(body)  # bounded together, as a chat's
    return {name: np.array([text.encode("utf-8")], dtype=np.object_)
            for name, text in texts.items()}, options


def detokenize_request(body: Any, served_model: str) -> dict[str, np.ndarray]:
    """The backend inputs of a ``/detokenize`` body."""
    check_body(body, DETOKENIZE_FIELDS, "/detokenize")
    _check_model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and -(2**63) <= t < 2**63
            for t in tokens):
        raise bad_request("tokens must be a non-empty list of token ids", "tokens")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise bad_request(f"tokens has {len(tokens)} ids; the limit is "
                          f"{MAX_DETOKENIZE_TOKENS}", "tokens")
    return {"input_ids": np.array(tokens, dtype=np.int64)}


# The backend's parameter that asks for a tokenize answer, and the outputs it answers with.
TOKENIZE_OUTPUTS = ("token_ids", "max_model_len", "text_output")


def tokenize_response(answer: dict[str, np.ndarray]) -> dict[str, Any]:
    tokens = [int(t) for t in answer["token_ids"].reshape(-1)]
    return {"count": len(tokens), "max_model_len": int(answer["max_model_len"].reshape(-1)[0]),
            "tokens": tokens, "token_strs": None}


def detokenize_response(answer: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"prompt": answer["text_output"].reshape(-1)[0].decode("utf-8")}


def tokenize_error(error: OpenAIError) -> OpenAIError:
    """A backend error of a tokenize request, naming the client's field (the backend's
    ``input_ids`` are ``tokens``, its ``text_input`` ``prompt``)."""
    word = re.match(r"\w+", error.message)
    if error.status != 400 or word is None:
        return error
    name = {"input_ids": "tokens", "text_input": "prompt"}.get(word.group(), word.group())
    if name not in (*TOKENIZE_FIELDS, *DETOKENIZE_FIELDS):
        return error
    return bad_request(name + error.message[len(word.group()):], name)

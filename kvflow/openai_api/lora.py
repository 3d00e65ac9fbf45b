"""LoRA adapters behind the OpenAI frontend: which ones the servers hold, the ``model`` field
resolved to the base or an adapter, and vLLM's load and unload requests.

- :class:`LoraCatalog`: the adapters every server that answers holds (each server's
  ``kvflow_lora`` list: :mod:`kvflow.triton_backend.lora_control`), kept
  :data:`LORA_LIST_TTL_S`; a name not in it is looked up again at once (it may have been loaded
  through another frontend), at most every :data:`LORA_RECHECK_S`. This frontend's own load and
  unload drop the copy. A load goes to every server (undone on those that took it when
  one refuses: requests go to any server, so every one must hold the adapter).
- :func:`load_request` / :func:`unload_request`: vLLM's bodies,
  ``{"lora_name", "lora_path"}`` and ``{"lora_name"}``.
- :func:`model_not_found`: the 404 for a ``model`` that is neither the base nor an adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from kvflow.openai_api.errors import OpenAIError, bad_request
from kvflow.openai_api.pool import BackendError, TritonPool
from kvflow.orchestrator.sampling.params import short_repr
from kvflow.triton_backend.params import MAX_LORA_NAME_CHARS
from kvflow.triton_backend.protocol import LORA_OUTPUT, LORA_PARAMETER

LORA_LIST_TTL_S = 2.0
LORA_RECHECK_S = 0.25
MAX_LORA_PATH_CHARS = 4096
LOAD_FIELDS = ("lora_name", "lora_path", "load_inplace")
UNLOAD_FIELDS = ("lora_name", "lora_int_id")


class LoraCatalog:
    """The servers' adapters as this frontend knows them (module doc)."""

    def __init__(self, pool: TritonPool) -> None:
        self.pool = pool
        self._copy: tuple[float, dict[str, dict[str, Any]]] | None = None  # (taken, adapters)
        self._lock = asyncio.Lock()

    async def adapters(self, max_age_s: float = LORA_LIST_TTL_S) -> dict[str, dict[str, Any]]:
        """Adapter name -> its description (``LoraManager.info()``'s: path, rank, ...), for the
        adapters every server that answered holds; fetched again past ``max_age_s``."""
        async with self._lock:  # NOTE: one fetch at a time; the others wait for its answer
            if self._copy is None or time.monotonic() - self._copy[0] > max_age_s:
                self._copy = (time.monotonic(), await self._fetch())
            return self._copy[1]

    async def find(self, name: str) -> dict[str, Any] | None:
        """``name``'s description, or None when no server holds it (looked up again at once
        if the copy does not know it: another frontend may have loaded it)."""
        found = (await self.adapters()).get(name)
        return found if found is not None else (await self.adapters(LORA_RECHECK_S)).get(name)

    async def invalidate(self) -> None:
        """Drop the copy (after a load or unload: the next request fetches the list)."""
        async with self._lock:
            self._copy = None

    async def _fetch(self) -> dict[str, dict[str, Any]]:
        answers = await asyncio.gather(*(self._command({"op": "list"}, k)
                                         for k in range(len(self.pool.urls))),
                                       return_exceptions=True)
        lists = [a for a in answers if not isinstance(a, BaseException)]
        if not lists:
            error = answers[0]
            assert isinstance(error, BaseException)
            raise error
        common = set.intersection(*({entry["name"] for entry in a.get("loras", ())}
                                    for a in lists))
        return {entry["name"]: entry for entry in lists[0].get("loras", ())
                if entry["name"] in common}

    async def _command(self, command: dict[str, Any], server: int) -> dict[str, Any]:
        answer = await self.pool.ask({}, {LORA_PARAMETER: json.dumps(command)}, (LORA_OUTPUT,),
                                     server=server)
        if LORA_OUTPUT not in answer:
            raise BackendError(f"tritonserver {self.pool.urls[server]} sent no {LORA_OUTPUT} "
                               "output: is it an older kvflow?", server=server)
        value = json.loads(bytes(answer[LORA_OUTPUT].reshape(-1)[0]))
        assert isinstance(value, dict)
        return value

    async def load(self, name: str, path: str) -> None:
        """Load the adapter on every server; if one refuses, unload it from those that took it
        and raise that server's error."""
        servers = range(len(self.pool.urls))
        try:
            answers = await asyncio.gather(*(self._command(
                {"op": "load", "lora_name": name, "lora_path": path}, k) for k in servers),
                return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                took = [k for k, a in zip(servers, answers, strict=True)
                        if not isinstance(a, BaseException)]
                await asyncio.gather(*(self._command({"op": "unload", "lora_name": name}, k)
                                       for k in took), return_exceptions=True)
                raise failed[0]
        finally:
            await self.invalidate()

    async def unload(self, name: str) -> None:
        """Unload the adapter from every server that holds it (the first refusal raised)."""
        try:
            answers = await asyncio.gather(*(self._command({"op": "unload", "lora_name": name}, k)
                                             for k in range(len(self.pool.urls))),
                                           return_exceptions=True)
            failed = [a for a in answers if isinstance(a, BaseException)]
            if failed:
                raise failed[0]
        finally:
            await self.invalidate()


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name.strip():
        raise bad_request(f"lora_name must be a non-empty string, got {short_repr(name)}",
                          "lora_name")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise bad_request(f"lora_name is {len(name)} characters; the limit is "
                          f"{MAX_LORA_NAME_CHARS}", "lora_name")
    return name


def _fields(body: Any, known: tuple[str, ...], endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the {endpoint} body must be a JSON object")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise bad_request(f"{endpoint} has unknown field(s) "
                          f"{', '.join(short_repr(k, 40) for k in unknown[:8])}; known: "
                          f"{', '.join(known)}", unknown[0][:80])
    return body


def load_request(body: Any, served_model: str) -> tuple[str, str]:
    """The adapter's name and path of a ``/v1/load_lora_adapter`` body (vLLM's)."""
    body = _fields(body, LOAD_FIELDS, "/v1/load_lora_adapter")
    name = _name(body)
    if name == served_model:
        raise bad_request(f"lora_name {name!r} is the served model's name; an adapter needs a "
                          "name of its own", "lora_name")
    path = body.get("lora_path")
    if not isinstance(path, str) or not path.strip():
        raise bad_request(f"lora_path must be a non-empty string, got {short_repr(path)}",
                          "lora_path")
    if len(path) > MAX_LORA_PATH_CHARS:
        raise bad_request(f"lora_path is {len(path)} characters; the limit is "
                          f"{MAX_LORA_PATH_CHARS}", "lora_path")
    if body.get("load_inplace") not in (None, False):
        raise bad_request("load_inplace is not supported: unload the adapter, then load it "
                          "again", "load_inplace")
    return name, path


def unload_request(body: Any) -> str:
    """The adapter's name of a ``/v1/unload_lora_adapter`` body (vLLM's; ``lora_int_id`` is
    accepted and not used: kvflow names adapters)."""
    return _name(_fields(body, UNLOAD_FIELDS, "/v1/unload_lora_adapter"))


def model_not_found(model: Any, served_model: str, adapters: list[str]) -> OpenAIError:
    """The 404 (``model_not_found``, as vLLM's and OpenAI's) for a model the servers do not
    serve, naming what they do."""
    shown = ", ".join(f"`{a}`" for a in sorted(adapters)[:8])
    more = f" and {len(adapters) - 8} more" if len(adapters) > 8 else ""
    also = f", and the LoRA adapters {shown}{more}" if adapters else ""
    return OpenAIError(404, f"The model `{short_repr(model, 60)[1:-1]}` does not exist; this "
                       f"server serves `{served_model}`{also}", "model", code="model_not_found")

"""The ``kvflow_lora`` control request: load, unload or list the engine's LoRA adapters.

A request whose parameter ``kvflow_lora`` (:data:`~.protocol.LORA_PARAMETER`) is a JSON object
``{"op": "load", "lora_name": N, "lora_path": P}``, ``{"op": "unload", "lora_name": N}`` or
``{"op": "list"}`` is answered once, on the backend's answer workers (as the state snapshot
is), with the adapters after the operation as JSON in the output ``lora``:
``{"enabled": bool, "max_loras": int, "max_lora_rank": int, "loras": [...]}``, each adapter as
``LoraManager.info()`` describes it (name, path, rank, resident, slot, running).

Every refusal is a :class:`~.params.BadRequestError` whose message names the problem: LoRA off
(the server was started without ``--enable-lora`` / ``--lora-modules``), a bad name or path, an
adapter that does not fit the model, a name in use, an adapter running requests still use.
The engine does the work, on its own thread between steps (:meth:`EngineLoop.call`). Pure
Python: no Triton import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.orchestrator.sampling.params import short_repr
from kvflow.triton_backend.params import MAX_LORA_NAME_CHARS, BadRequestError
from kvflow.triton_backend.protocol import LORA_PARAMETER

LORA_OPS = ("load", "unload", "list")
MAX_LORA_COMMAND_BYTES = 16 << 10
MAX_LORA_PATH_CHARS = 4096
# Loading reads the adapter's files and writes it into a slot: longer than a state read.
LOAD_TIMEOUT_S = 600.0
LORA_OFF = ("LoRA is off: the server was started without --enable-lora / --lora-modules "
            "(engine options enable_lora, lora_modules)")

UPDATES_OFF = ("loading and unloading LoRA adapters reads the server's files: start kvflow "
               "with --api-key (or KVFLOW_API_KEY) to allow it; --lora-modules loads adapters "
               "at start without one")


@dataclass(frozen=True)
class LoraCommand:
    """One parsed ``kvflow_lora`` request."""

    op: str
    lora_name: str | None = None
    lora_path: str | None = None


def parse_lora_command(value: Any) -> LoraCommand:
    """The command in the ``kvflow_lora`` parameter (a JSON object as a string), refused
    with a message that names the key and the limit."""
    if isinstance(value, str):
        if len(value) > MAX_LORA_COMMAND_BYTES:
            raise BadRequestError(f"{LORA_PARAMETER} is {len(value)} characters; the limit is "
                                  f"{MAX_LORA_COMMAND_BYTES}")
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRequestError(f"{LORA_PARAMETER} is not valid JSON: {e.msg} at character "
                                  f"{e.pos}") from None
    if not isinstance(value, dict):
        raise BadRequestError(f"{LORA_PARAMETER} must be a JSON object, got "
                              f"{short_repr(value)}")
    op = value.get("op")
    if op not in LORA_OPS:
        raise BadRequestError(f"{LORA_PARAMETER}.op must be one of {', '.join(LORA_OPS)}, got "
                              f"{short_repr(op)}")
    known = {"op", *(("lora_name", "lora_path") if op == "load" else
                     ("lora_name",) if op == "unload" else ())}
    unknown = sorted(set(value) - known)
    if unknown:
        raise BadRequestError(f"{LORA_PARAMETER} ({op}) has unknown key(s) "
                              f"{', '.join(short_repr(k, 40) for k in unknown[:8])}; known: "
                              f"{', '.join(sorted(known))}")
    if op == "list":
        return LoraCommand(op)
    name = _text(value, "lora_name", MAX_LORA_NAME_CHARS)
    path = _text(value, "lora_path", MAX_LORA_PATH_CHARS) if op == "load" else None
    return LoraCommand(op, name, path)


def _text(value: dict[str, Any], key: str, limit: int) -> str:
    text = value.get(key)
    if not isinstance(text, str) or not text.strip():
        raise BadRequestError(f"{key} must be a non-empty string, got {short_repr(text)}")
    if len(text) > limit:
        raise BadRequestError(f"{key} is {len(text)} characters; the limit is {limit}")
    if key == "lora_name" and (text != text.strip() or not text.isprintable()):
        raise BadRequestError(f"lora_name must be printable, without leading or trailing "
                              f"spaces, got {short_repr(text, 60)}")
    return text


def absolute_lora_paths(modules: dict[str, Any]) -> dict[str, str]:
    """``lora_modules``' paths made absolute (the backend's working directory is not the
    launcher's); a path that does not exist is refused by name (ValueError)."""
    out = {}
    for name, path in modules.items():
        resolved = Path(path).expanduser().resolve()
        if not resolved.exists():
            raise ValueError(f"--lora-modules {name}={path}: no such file or folder")
        out[name] = str(resolved)
    return out


def run_lora_command(loop: Any, command: LoraCommand, served_model_name: str = "",
                     updates_allowed: bool = True) -> dict:
    """Carry out ``command`` on the engine of ``loop`` (an EngineLoop) and return the answer
    (module doc). ``served_model_name``: the name the OpenAI frontend serves the base model
    as, which no adapter may take (a request for it would get the base). ``updates_allowed``
    False (a server without an API key): load and unload are refused, as they make the
    server read its disk at a client's word.

    Raises:
        BadRequestError: the command was refused; the message says why.
    """
    options = loop.engine.options
    if not options.lora_enabled:
        if command.op == "list":
            return {"enabled": False, "loras": []}
        raise BadRequestError(LORA_OFF)
    if command.op != "list" and not updates_allowed:
        raise BadRequestError(UPDATES_OFF)
    name = command.lora_name
    try:
        if command.op == "load":
            if served_model_name and name == served_model_name:
                raise BadRequestError(f"lora_name {name!r} is the served model's name; an "
                                      "adapter needs a name of its own")
            # Read here, on the answer worker: the engine's thread only takes the result.
            adapter = loop.engine.read_lora(name, command.lora_path)
            loop.call(lambda engine: engine.add_lora(name, adapter), timeout_s=LOAD_TIMEOUT_S)
        elif command.op == "unload":
            loop.call(lambda engine: engine.remove_lora(name))
        loras = loop.call(lambda engine: engine.list_loras())
    except BadRequestError:
        raise
    except (ValueError, KeyError) as e:  # LoraAdapterError, LoraInUseError, a name in use
        raise BadRequestError(_message(e)) from None
    except OSError as e:  # the path cannot be read
        raise BadRequestError(f"lora_path {command.lora_path!r}: {e.strerror or e}") from None
    return {"enabled": True, "max_loras": getattr(options, "max_loras", None),
            "max_lora_rank": getattr(options, "max_lora_rank", None), "loras": loras}


def _message(error: BaseException) -> str:
    # NOTE: a KeyError's str() is its key's repr in quotes: the message is its one argument.
    if isinstance(error, KeyError) and len(error.args) == 1:
        return str(error.args[0])
    return str(error)

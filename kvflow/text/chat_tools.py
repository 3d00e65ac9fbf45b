"""Tools in a chat: the function tools a request offers, the tool turns of its messages, and
how both reach the chat template. Pure Python.

A template that renders a ``tools`` variable itself (HF's convention: Llama 3.1, Qwen 2.5,
Qwen3, Mistral) gets the tools, the assistant turns' ``tool_calls`` (their arguments as objects,
as vLLM passes them) and the tool turns (``role: tool``, ``tool_call_id``) as they are, with two
family rules:

* a template that checks Mistral's call ids (9 letters or digits) gets each id, in calls and in
  tool turns alike, as its last 9 letters and digits (vLLM's rule), so OpenAI ids render;
* Phi-4-mini's template reads the tools from the system message's ``tools`` key (a JSON list of
  functions, written between ``<|tool|>`` and ``<|/tool|>``): they are put there (in a system
  message of empty text if the request has none), and an assistant turn's calls are appended to
  its text as ``<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>``.

A template without tools (SmolLM2's, Gemma's, Phi-3.5's) gets kvflow's one documented fallback
instead:

* a system preamble that lists the tools as JSON and asks for calls written as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the ``hermes`` format);
* an assistant turn's calls appended to its text in that format;
* a tool turn as a user turn whose text is ``<tool_response>...</tool_response>``; the
  results of consecutive tool turns share one user turn (templates that require turns to
  alternate, Gemma's, accept the parallel results of one assistant turn).

Everything the fallback adds is message content, so the engine's protection of content (its
special-token text stays plain text) covers tools and results too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvflow.text.tool_schema import check_parameters

# The preamble's call format is the ``hermes`` parser's (kvflow.openai_api.tool_parsers).
PREAMBLE = (
    "You can call functions. The functions are listed below as JSON schemas.\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with the function's name and its arguments "
    "between <tool_call> and </tool_call>, like this:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"arg": "value"}}}}\n</tool_call>'
)
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024  # their JSON: flags and short strings, not documents
# Variables a request's chat_template_kwargs may not set: the renderer's own.
RESERVED_TEMPLATE_VARIABLES = frozenset((
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
    "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"))


@dataclass(frozen=True)
class FunctionTool:
    """One function tool: its name, description and parameters' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(value: Any) -> tuple[FunctionTool, ...]:
    """The request's ``tools`` (None or ``[]``: none), each checked; a ValueError names the
    field (``tools[1].function.name``)."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError("tools must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"tools has {len(value)} entries; the limit is {MAX_TOOLS}")
    tools: list[FunctionTool] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}.type must be "function" (the only tool type served)')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not all(
                c.isalnum() or c in "_-" for c in name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, _ or -, "
                             f"got {str(name)[:70]!r}")
        params = fn.get("parameters")
        # As OpenAI and vLLM: no parameters is a function of no arguments.
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        check_parameters(f"{where}.function.parameters", params)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        if any(t.name == name for t in tools):
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        tools.append(FunctionTool(name, description, params))
    return tuple(tools)


def check_tool_calls(where: str, value: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked (a ValueError names the field), in
    OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments"}}`` with the
    arguments as JSON text."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of tool calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f'{at} must be {{"id", "type": "function", "function": '
                             '{"name", "arguments"}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function.name must be a non-empty string")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise ValueError(f"{at}.function.arguments must be a string of JSON")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise ValueError(f"{at}.id must be a string")
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return calls


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``: None or a JSON object of at most
    MAX_TEMPLATE_KWARGS variables (MAX_TEMPLATE_KWARGS_BYTES of UTF-8 JSON), none of them the
    renderer's own (messages, tools, the special tokens); a ValueError names the field."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs must be an object of template variables, got "
                         f"{type(value).__name__}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs has {len(value)} entries; the limit is "
                         f"{MAX_TEMPLATE_KWARGS}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs key {str(key)[:40]!r} must be a name "
                             "(letters, digits, _)")
        if key in RESERVED_TEMPLATE_VARIABLES or key.startswith("_"):
            raise ValueError(f"chat_template_kwargs.{key} is set by the server, not the request")
    try:
        size = len(json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError, RecursionError):
        raise ValueError("chat_template_kwargs must hold JSON values of valid Unicode text "
                         "(no lone surrogate)") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs is {size} bytes of JSON; the limit is "
                         f"{MAX_TEMPLATE_KWARGS_BYTES}")
    return dict(value)


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the tools itself: a ``tools`` variable (HF's
    convention), or the system message's ``tools`` (Phi-4-mini)."""
    return bool(chat_template) and "tools" in str(chat_template)


def _system_tools(chat_template: str) -> bool:
    """Phi-4-mini's convention: the tools are the system message's ``tools`` string."""
    return "message['tools']" in chat_template or "message.tools" in chat_template


def _mistral_ids(chat_template: str) -> bool:
    return "length != 9" in chat_template


def tool_call_format(chat_template: str | None) -> str:
    """The ``--tool-call-parser`` that reads what a model writes when its chat template offers
    tools: the template's own format where it names one (Llama 3.x ``llama3_json``, Mistral's
    ``[TOOL_CALLS]`` ``mistral``, Phi-4-mini's ``<|tool|>`` ``phi4_mini_json``, ``pythonic``),
    else ``hermes`` (kvflow's fallback prompt's format, and Hermes', Qwen 2.5's and Qwen3's;
    Gemma's and Phi-3.5's templates have no tools, so they get the fallback)."""
    t = chat_template or ""
    if not template_supports_tools(t):
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if _system_tools(t) or "<|tool|>" in t:
        return "phi4_mini_json"
    if "[func_name1(" in t or "pythonic" in t:
        return "pythonic"
    return "hermes"


def reasoning_format(chat_template: str | None) -> str | None:
    """The ``--reasoning-parser`` a chat template implies: ``qwen3`` (``<think>...</think>``)
    for a template that writes or strips ``<think>`` (Qwen3, QwQ, DeepSeek-R1's distills),
    else None (the model does not reason apart)."""
    t = chat_template or ""
    return "qwen3" if "<think>" in t or "</think>" in t else None


def preamble(tools: tuple[FunctionTool, ...]) -> str:
    """The system text that lists the tools, for a chat template without tool support."""
    return PREAMBLE.format(tools="\n".join(json.dumps(t.to_openai(), ensure_ascii=False)
                                           for t in tools))


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def fallback_messages(messages: list[dict[str, Any]], tools: tuple[FunctionTool, ...],
                      system_turns: bool = True) -> list[dict[str, Any]]:
    """``messages`` for a template without tools: the preamble in the system turn (appended
    to the request's own system text), calls and results written into text (module doc).
    ``system_turns`` False (a template that refuses a system turn, Gemma 2's): the preamble
    opens the first user turn instead."""
    out: list[dict[str, Any]] = []
    for k, m in enumerate(messages):
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if k and messages[k - 1]["role"] == "tool":  # one user turn for parallel results
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{result}"}
            else:
                out.append({"role": "user", "content": result})
        elif m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": _arguments(c)},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"])
            text = m["content"]
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools and not system_turns and out and out[0]["role"] == "user":
        out[0] = {**out[0], "content": f"{preamble(tools)}\n\n{out[0]['content']}"}
    elif tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": preamble(tools)})
    return out


def template_messages(messages: list[dict[str, Any]], tools: tuple[FunctionTool, ...] = (),
                      chat_template: str = "") -> tuple[list[dict[str, Any]],
                                                      list[dict[str, Any]] | None, list[str]]:
    """``messages`` and ``tools`` for a template with tools: each call's arguments as an object
    where they are JSON (templates write them with ``tojson``), as vLLM passes them, and the
    family rules of the module doc (Mistral's ids, Phi-4-mini's system tools). Third, per
    message, the markup kvflow appended to its content (Phi-4-mini's calls; else ""): the
    model's own control tokens, not the client's text."""
    mistral, phi = _mistral_ids(chat_template), _system_tools(chat_template)
    out = []
    markup = []
    for m in messages:
        markup.append("")
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                     for c in m["tool_calls"]]
            if mistral:
                calls = [{**c, "id": mistral_call_id(c["id"])} for c in calls]
            m = {**m, "tool_calls": calls}
            if phi:
                listed = json.dumps([{"name": c["function"]["name"],
                                      "arguments": c["function"]["arguments"]} for c in calls],
                                    ensure_ascii=False)
                markup[-1] = f"<|tool_call|>{listed}<|/tool_call|>"
                m["content"] = f"{m['content']}{markup[-1]}"
        if mistral and m["role"] == "tool":
            m = {**m, "tool_call_id": mistral_call_id(m["tool_call_id"])}
        out.append(m)
    if phi and tools:
        listed = json.dumps([{"name": t.name, "description": t.description,
                              "parameters": t.parameters} for t in tools], ensure_ascii=False)
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
            markup.insert(0, "")
        out[0] = {**out[0], "tools": listed}
    return out, [t.to_openai() for t in tools] or None, markup


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates require it, 9 letters or digits: the id's last 9
    (vLLM's rule); an id with fewer is padded from a hash of it, so the same id always maps
    to the same 9."""
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    if len(alnum) >= 9:
        return alnum[-9:]
    import hashlib

    return (alnum + hashlib.sha256(call_id.encode("utf-8", "replace")).hexdigest())[:9]


def _arguments(call: dict[str, Any]) -> Any:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # the model's own broken arguments, sent back: as text
        return text

"""Tools in a chat: the function tools a request offers, the tool turns of its messages, and
how both reach the chat template. Pure Python.

A template that renders a ``tools`` variable itself (HF's convention: Llama 3.1, Qwen 2.5,
Hermes) gets the tools, the assistant turns' ``tool_calls`` (their arguments as objects, as
vLLM passes them) and the tool turns (``role: tool``, ``tool_call_id``) as they are. A template
without tools (SmolLM2's) gets kvflow's one documented fallback instead:

* a system preamble that lists the tools as JSON and asks for calls written as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the ``hermes`` format);
* an assistant turn's calls appended to its text in that format;
* a tool turn as a user turn whose text is ``<tool_response>...</tool_response>``.

Everything the fallback adds is message content, so the engine's protection of content (its
special-token text stays plain text) covers tools and results too.
"""

from __future__ import annotations

import json
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


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable itself (HF's convention)."""
    return bool(chat_template) and "tools" in str(chat_template)


def tool_call_format(chat_template: str | None) -> str:
    """The ``--tool-call-parser`` that reads what a model writes when its chat template offers
    tools: the template's own format where it names one, else ``hermes`` (kvflow's fallback
    prompt's format, and Hermes' and Qwen's)."""
    t = chat_template or ""
    if not template_supports_tools(t):
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    if "[func_name1(" in t or "pythonic" in t:
        return "pythonic"
    return "hermes"


def preamble(tools: tuple[FunctionTool, ...]) -> str:
    """The system text that lists the tools, for a chat template without tool support."""
    return PREAMBLE.format(tools="\n".join(json.dumps(t.to_openai(), ensure_ascii=False)
                                           for t in tools))


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def fallback_messages(messages: list[dict[str, Any]],
                      tools: tuple[FunctionTool, ...]) -> list[dict[str, Any]]:
    """``messages`` for a template without tools: the preamble in the system turn (appended
    to the request's own system text), calls and results written into text (module doc)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
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
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": preamble(tools)})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template with tools: each call's arguments as an object where they
    are JSON (templates write them with ``tojson``), as vLLM passes them."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _arguments(c)}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    text = call["function"]["arguments"]
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # the model's own broken arguments, sent back: as text
        return text

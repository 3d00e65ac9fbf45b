"""The OpenAI ``tools`` and ``tool_choice`` fields: checked (errors name the field), the JSON
schema that guarantees a call under ``required`` or a named function (vLLM's way: the output
is a JSON list of ``{"name", "parameters"}`` objects, constrained by llguidance), and the
system preamble for chat templates that know no tools. Pure Python.

Not yet wired into the frontend (issue 34): these are its parts, tested alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The preamble's call format is the ``hermes`` parser's (kvflow.openai_api.tool_parsers).
PREAMBLE = (
    "You can call functions. The functions are listed below as JSON schemas.\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with the function's name and its arguments "
    "between <tool_call> and </tool_call>, like this:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"arg": "value"}}}}\n</tool_call>'
)
TOOL_CHOICES = ("none", "auto", "required")


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


def parse_tools(value: Any) -> list[FunctionTool]:
    """The request's ``tools`` (None or ``[]``: none), each checked; a ValueError names the
    field (``tools[1].function.name``)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError("tools must be a list of function tools")
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
                             f"got {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        if any(t.name == name for t in tools):
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        tools.append(FunctionTool(name, description, params))
    return tools


def parse_tool_choice(value: Any, tools: list[FunctionTool]) -> str:
    """``none``, ``auto``, ``required`` or the name of the function to call (default: auto
    with tools, none without); a ValueError names the field and the known names."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named "
                             f"function, got {value!r}")
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be a string or {"type": "function", "function": '
                         '{"name": ...}}')
    if all(t.name != name for t in tools):
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                         f"({[t.name for t in tools]})")
    return name


def required_schema(tools: list[FunctionTool], choice: str, parallel: bool) -> dict[str, Any]:
    """The JSON schema of the output under ``required`` or a named function: a list of one
    call (several with ``parallel``), each ``{"name": <a tool>, "parameters": <its
    schema>}``."""
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    call = [{"type": "object",
             "properties": {"name": {"const": t.name}, "parameters": t.parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in chosen]
    items = call[0] if len(call) == 1 else {"anyOf": call}
    return {"type": "array", "items": items, "minItems": 1,
            **({} if parallel else {"maxItems": 1})}


def calls_of_required(text: str) -> list[tuple[str, str]]:
    """The (name, arguments JSON) of an output constrained by :func:`required_schema`."""
    return [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]


def preamble(tools: list[FunctionTool]) -> str:
    """The system text that lists the tools, for a chat template without tool support."""
    return PREAMBLE.format(tools="\n".join(json.dumps(t.to_openai()) for t in tools))


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable itself (HF's convention)."""
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]

"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> a
:class:`ToolPlan`: what the prompt offers, how the output is constrained, how it is read.

* ``none`` (or no tools): the tools are left out of the prompt, and nothing is parsed.
* ``required``, or a named function: vLLM's way of guaranteeing a call. The output is
  constrained (llguidance, ``guided_json``) to a JSON list of ``{"name", "parameters"}``
  objects, each one of the allowed tools with parameters valid against its schema: one call
  of a named function; under ``required`` one or more (one without ``parallel_tool_calls``).
  Even a 135M model then always makes a valid call.
* ``auto``: the model decides, and its output is read by the server's ``--tool-call-parser``.
  In the ``hermes`` format (kvflow's fallback prompt's) the output is free text until
  ``<tool_call>``, then constrained to a valid call of one of the tools (``guided_grammar``,
  :func:`auto_grammar`); the other formats are read as the model writes them.

Each tool's schema sits in the constraint's ``$defs`` under the tool's name, its own
references rewritten to point there (:func:`kvflow.text.tool_schema.embedded_parameters`:
``$defs``, ``definitions`` and recursive ``#`` resolve against the tool's schema, as they do in
``response_format``). Each tool's part is compiled here, so that one that llguidance cannot
compile is a 400 naming the tool. Pure Python (llguidance's schema check included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvflow.openai_api.tool_parsers import TOOL_PARSERS, JsonListParser, ToolParser
from kvflow.orchestrator.sampling.params import GUIDED_FIELDS
from kvflow.orchestrator.sampling.structured import JSON_OPTIONS, schema_error
from kvflow.orchestrator.sampling.structured_output import MAX_SPEC_BYTES
from kvflow.text.chat_tools import FunctionTool, parse_tools
from kvflow.text.tool_schema import embedded_parameters

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools shape it: ``tools`` go into the prompt, ``constraint``
    (guided field -> value) into its sampling parameters, and ``parser`` reads the output
    (None: no calls are read). ``renamed``: the constraint's field -> the client's, for the
    backend's errors."""

    choice: str
    tools: tuple[FunctionTool, ...] = ()
    parser: ToolParser | None = None
    parallel: bool = True
    constraint: dict[str, Any] = field(default_factory=dict)


def plan_tools(body: dict[str, Any], parser_name: str) -> ToolPlan:
    """The request's tool plan; a ValueError names the field (``tools[1].function.parameters``,
    ``tool_choice``)."""
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls") is not False
    if choice == "none":
        return ToolPlan("none")
    guided = [k for k in (*GUIDED_FIELDS, "response_format") if body.get(k) is not None]
    if choice != "auto" or (parser_name == "hermes" and not guided):
        _check_constraint_size(tools, choice)
    for i, tool in enumerate(tools):
        where = f"tools[{i}].function.parameters ({tool.name})"
        try:
            error = schema_error(required_schema([tool], tool.name, False))
        except ValueError as e:
            raise ValueError(f"{where} {e}") from None
        if error:
            # Pointers as the client wrote them, not as they sit in the call's schema.
            error = error.replace(f"/$defs/{tool.name}", "")
            raise ValueError(f"{where} is not a JSON schema kvflow can enforce: {error}")
    if choice != "auto":
        if guided:
            raise ValueError(f"tool_choice {choice!r} constrains the output itself: give it or "
                             f"{guided[0]}, not both")
        return ToolPlan(choice, tools, JsonListParser(), parallel,
                        {"guided_json": required_schema(tools, choice, parallel)})
    parser = TOOL_PARSERS[parser_name]()
    constraint = {} if guided or parser_name != "hermes" else {
        "guided_grammar": auto_grammar(tools, parallel)}
    return ToolPlan("auto", tools, parser, parallel, constraint)


def _check_constraint_size(tools: tuple[FunctionTool, ...], choice: str) -> None:
    """Refuse, before any schema is compiled, tools whose parameters alone exceed what a
    constrained output may carry (``MAX_SPEC_BYTES``): the call's schema holds them all."""
    chosen = [t for t in tools if choice in ("required", "auto") or t.name == choice]
    size = sum(len(json.dumps(t.parameters)) for t in chosen)
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"tools: the parameters of the tools a call may use are {size} bytes "
                         f"of JSON schema; a constrained tool call carries at most "
                         f"{MAX_SPEC_BYTES} ({MAX_SPEC_BYTES // 1024} KiB)")


def parse_tool_choice(value: Any, tools: tuple[FunctionTool, ...] | list[FunctionTool]) -> str:
    """``none``, ``auto``, ``required`` or the name of the function to call (default: auto
    with tools, none without); a ValueError names the field and the known names."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named "
                             f"function, got {value[:40]!r}")
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return "none" if not tools else value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be a string or {"type": "function", "function": '
                         '{"name": ...}}')
    if all(t.name != name for t in tools):
        raise ValueError(f"tool_choice names the function {name[:70]!r}, which is not in "
                         f"tools ({[t.name for t in tools]})")
    return name


def _chosen(tools: tuple[FunctionTool, ...] | list[FunctionTool], choice: str,
            args_key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One JSON schema per allowed call, ``{"name": <const>, args_key: <its schema>}``, and
    the ``$defs`` their schemas sit in (each under the tool's name: names are unique, and
    letters, digits, ``_`` and ``-``, so a JSON pointer takes them as they are)."""
    chosen = [t for t in tools if choice in ("required", "auto") or t.name == choice]
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name}, args_key: {"$ref": f"#/$defs/{t.name}"}},
              "required": ["name", args_key], "additionalProperties": False}
             for t in chosen]
    return calls, {t.name: embedded_parameters(t.parameters, t.name) for t in chosen}


def required_schema(tools: tuple[FunctionTool, ...] | list[FunctionTool], choice: str,
                    parallel: bool) -> dict[str, Any]:
    """The JSON schema of the output under ``required`` or a named function: a list of
    calls, each ``{"name": <a tool>, "parameters": <its schema>}``: one call of the named
    function (as vLLM and OpenAI make it), or under ``required`` at least one (exactly one
    without ``parallel``)."""
    calls, defs = _chosen(tools, choice, "parameters")
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    one = choice != "required" or not parallel
    return {"type": "array", "items": items, "minItems": 1, **({"maxItems": 1} if one else {}),
            "$defs": defs}


def auto_grammar(tools: tuple[FunctionTool, ...] | list[FunctionTool], parallel: bool) -> str:
    """llguidance's Lark for ``auto`` in the ``hermes`` format: free text, where each
    ``<tool_call>`` (found lazily: the first one ends the text) must go on with a valid call,
    ``{"name": <a tool>, "arguments": <valid>}``, and ``</tool_call>``; without ``parallel``,
    the output ends after one call."""
    calls, defs = _chosen(tools, "auto", "arguments")
    schema = {"anyOf": calls, "$defs": defs, "x-guidance": dict(JSON_OPTIONS)}
    # Without parallel calls, the output ends after its one call.
    start = "(before call)* TEXT" if parallel else "before call | TEXT"
    return ("start: " + start + "\n"
            "before[lazy]: /(.|\\n)*<tool_call>/\n"
            "call: /[ \\n]*/ %json " + json.dumps(schema) + " /[ \\n]*/ \"</tool_call>\"\n"
            "TEXT: /(.|\\n)*/\n")

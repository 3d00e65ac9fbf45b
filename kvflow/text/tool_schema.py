"""A function tool's ``parameters`` schema: checked to describe the arguments object, and made
self-contained so that it can sit inside kvflow's larger schema of a call. Pure Python.

A tool's schema is written to stand alone: ``{"$ref": "#/$defs/Address"}`` (what Pydantic
emits for nested models, and so LangChain and the OpenAI Agents SDK), ``#/definitions/...``
(Pydantic 1) and ``{"$ref": "#"}`` (a recursive model) all point into the tool's own schema.
Embedded in the schema of a call (:mod:`kvflow.openai_api.tools`), a reference would resolve
against the call's root instead. :func:`embedded_parameters` therefore rewrites each local
reference ``#<pointer>`` to ``#/$defs/<key><pointer>``, where the caller places the schema under
``$defs/<key>``: every pointer, recursive ones included, keeps its target.

A reference that leads only to itself (``{"$ref": "#"}``, ``A -> B -> A``) describes no value at
all: a constrained output could never be completed. :func:`check_parameters` refuses it by name,
as it refuses a schema of anything but an object (the arguments are a JSON object).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

# Values that hold data, not subschemas: a "$ref" inside them is data and is left alone.
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples", "example"))
# How many references one check may follow: a schema is bounded in size, this in work.
MAX_REF_STEPS = 10_000


def resolve_pointer(schema: Any, ref: str) -> Any | None:
    """The subschema a local reference (``#``, ``#/$defs/A``) points to in ``schema``, or None
    when it points nowhere (or is not a local JSON pointer)."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None
    node = schema
    for token in unquote(ref[2:]).split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def check_parameters(where: str, schema: dict[str, Any]) -> None:
    """A ValueError naming ``where`` if ``schema`` loops through references without ever
    describing a value, or describes something other than an object."""
    try:
        _check_no_empty_loop(where, schema)
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply") from None
    node, seen = schema, 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and "type" not in node:
        target = resolve_pointer(schema, node["$ref"])
        if target is None or seen > MAX_REF_STEPS:
            break  # an unresolvable reference: the schema compiler names it
        node, seen = target, seen + 1
    kind = node.get("type") if isinstance(node, dict) else None
    if kind is not None and kind != "object" and kind != ["object"]:
        raise ValueError(f'{where} must describe an object ("type": "object": the arguments '
                         f'are a JSON object), got "type": {_short(kind)}')


def embedded_parameters(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """``schema`` rewritten to be placed at ``#/$defs/<key>`` of a larger schema: each local
    ``$ref`` points to the same place under it; ``$id`` and ``$schema`` are dropped (an ``$id``
    would make its references resolve against itself again); a schema that does not say its
    type is held to an object. A ValueError if it is nested too deeply to walk."""
    base = f"#/$defs/{key}"
    try:
        out = _rewrite(schema, base)
    except RecursionError:
        raise ValueError("is nested too deeply") from None
    out.pop("$id", None)
    out.pop("$schema", None)
    if "type" not in out and "$ref" not in out:
        out["type"] = "object"
    return out


def _rewrite(node: Any, base: str) -> Any:
    if isinstance(node, list):
        return [_rewrite(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        else:
            out[k] = _rewrite(v, base)
    return out


def _refs(node: Any) -> list[str]:
    """The local references a subschema is made of at once: its own ``$ref`` and those of its
    ``allOf`` members (all must hold, so a loop through any of them describes nothing)."""
    if not isinstance(node, dict):
        return []
    out = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    members = node.get("allOf")
    if isinstance(members, list):
        for m in members:
            out += _refs(m)
    return [r for r in out if r == "#" or r.startswith("#/")]


def _check_no_empty_loop(where: str, schema: dict[str, Any]) -> None:
    """Follow every reference through references alone; coming back to one on the way is a
    loop that describes no value."""
    good: set[str] = set()
    steps = 0
    for start in _all_refs(schema):
        path: list[str] = []
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            ref, depth = stack.pop()
            del path[depth:]
            steps += 1
            if ref in good or steps > MAX_REF_STEPS:
                continue
            if ref in path:
                raise ValueError(f"{where}: the reference {ref!r} leads only back to itself "
                                 f"({' -> '.join([*path[path.index(ref):], ref])}) and "
                                 f"describes no value; a recursive schema must recurse inside "
                                 f"properties or items")
            path.append(ref)
            nxt = _refs(resolve_pointer(schema, ref))
            if not nxt:
                good.add(ref)  # a value at last: no loop goes through it
            stack += [(r, depth + 1) for r in nxt]


def _all_refs(node: Any) -> list[str]:
    """Every local reference in ``node`` (iteratively: a schema may be deeply nested)."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            for k, v in n.items():
                if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                    out.append(v)
                elif k not in _DATA_KEYWORDS:
                    stack.append(v)
        elif isinstance(n, list):
            stack += n
    return list(dict.fromkeys(out))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

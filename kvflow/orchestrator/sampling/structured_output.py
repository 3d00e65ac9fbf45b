"""What a request's output must match (structured outputs), as a sampling parameter.

:class:`StructuredOutput` is vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` / ``guided_json_object``, validated and made canonical when the request is
built. Compiling and enforcing it is :mod:`kvflow.orchestrator.sampling.structured`'s (llguidance).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# kind -> the vLLM request field it comes from; compiler errors are prefixed with it.
FIELD_NAMES = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
               "grammar": "guided_grammar", "json_object": "guided_json_object"}
MAX_SPEC_BYTES = 256 * 1024
MAX_ERROR_CHARS = 500
def describe_value(value: Any) -> str:
    """A value for an error message: its repr cut to 40 characters, and its type."""
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({type(value).__name__})"


def _canonical_json(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{field} must be a JSON schema (an object), but the string is "
                             f"not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field} must be a JSON schema (an object or its JSON text), got "
                         f"{describe_value(schema)}")
    try:
        # NOTE: keys keep their order: a schema's property order is the order they are
        # generated in.
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{field} is not serialisable as JSON: {e}") from None


def _canonical_choice(field: str, choices: Any) -> str:
    if isinstance(choices, str):  # a JSON list, as StructuredOutput.spec holds it
        try:
            choices = json.loads(choices)
        except ValueError:
            raise ValueError(f"{field} must be a JSON list of strings") from None
    if not isinstance(choices, list | tuple):
        raise ValueError(f"{field} must be a list of strings, got {describe_value(choices)}")
    if not choices:
        raise ValueError(f"{field} must have at least one choice")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"{field}[{i}] must be a non-empty string, got "
                             f"{describe_value(choice)}")
    return json.dumps(list(choices), ensure_ascii=False)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: ``kind`` (one of STRUCTURED_KINDS) and ``spec``.

    ``spec`` is canonical, so that equal constraints share one compiled grammar: for ``json``
    the schema as ``json.dumps(schema, separators=(",", ":"))`` (a dict or its
    JSON text is accepted and rewritten), for ``regex`` the pattern, for ``choice`` a JSON list
    of non-empty strings, for ``grammar`` Lark or GBNF text, for ``json_object`` (any JSON
    object) the empty string. Errors name the vLLM field (``guided_json``, ...) and the limit.
    """

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {describe_value(self.kind)}")
        field = self.field_name()
        if self.kind == "json" and isinstance(self.spec, dict):
            object.__setattr__(self, "spec", _canonical_json(field, self.spec))
        if not isinstance(self.spec, str):
            raise ValueError(f"{field} must be a string, got {describe_value(self.spec)}")
        try:
            size = len(self.spec.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} is not valid Unicode text: {e}") from None
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{field} is {size} bytes; the limit is {MAX_SPEC_BYTES} "
                             f"({MAX_SPEC_BYTES // 1024} KiB)")
        if self.kind == "json":
            object.__setattr__(self, "spec", _canonical_json(field, self.spec))
        elif self.kind == "choice":
            object.__setattr__(self, "spec", _canonical_choice(field, self.spec))
        elif self.kind == "json_object":
            if self.spec:
                raise ValueError(f"{field} takes no spec, got {describe_value(self.spec)}")
        elif not self.spec:
            raise ValueError(f"{field} must be a non-empty string")

    @classmethod
    def from_guided(cls, *, guided_json: Any = None, guided_regex: Any = None,
                    guided_choice: Any = None, guided_grammar: Any = None,
                    guided_json_object: Any = None) -> StructuredOutput | None:
        """The constraint of vLLM's ``guided_*`` request fields, or None when none is set.

        ``guided_json``: a schema dict or its JSON text; ``guided_regex``, ``guided_grammar``:
        strings; ``guided_choice``: a list of strings; ``guided_json_object``: a bool (True:
        any JSON object). At most one may be set; errors start with the field's name.
        """
        if guided_json_object is not None and not isinstance(guided_json_object, bool):
            raise ValueError("guided_json_object must be a bool, got "
                             f"{describe_value(guided_json_object)}")
        given = {"guided_json": guided_json, "guided_regex": guided_regex,
                 "guided_choice": guided_choice, "guided_grammar": guided_grammar,
                 "guided_json_object": guided_json_object or None}
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) > 1:
            raise ValueError(f"at most one of guided_json, guided_regex, guided_choice, "
                             f"guided_grammar, guided_json_object may be set; got "
                             f"{', '.join(given)}")
        if not given:
            return None
        (field, value), = given.items()
        kind = next(k for k, f in FIELD_NAMES.items() if f == field)
        if kind == "json":
            return cls("json", _canonical_json(field, value))
        if kind == "choice":
            if isinstance(value, str):
                raise ValueError(f"{field} must be a list of strings, got {describe_value(value)}")
            return cls("choice", _canonical_choice(field, value))
        if kind == "json_object":
            return cls("json_object", "")
        if not isinstance(value, str):
            raise ValueError(f"{field} must be a string, got {describe_value(value)}")
        return cls(kind, value)

    def field_name(self) -> str:
        """The vLLM request field this constraint came from (``guided_json``, ...)."""
        return FIELD_NAMES[self.kind]

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form; :meth:`from_dict` reads it back."""
        return {"kind": self.kind, "spec": self.spec}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructuredOutput:
        """The inverse of :meth:`to_dict`; unknown or missing keys raise ValueError."""
        if not isinstance(d, Mapping) or set(d) != {"kind", "spec"}:
            raise ValueError(f"structured output must be an object with exactly kind and spec, "
                             f"got {describe_value(d)}")
        return cls(d["kind"], d["spec"])

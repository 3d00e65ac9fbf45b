"""The Jinja environment chat templates are rendered in: the one HF's ``apply_chat_template``
builds (transformers 5.x, ``chat_template_utils``), so that a model's template renders here as
it does there. A chat template is untrusted code from a checkpoint: it runs sandboxed.

What a template sees, as in HF:

* ``trim_blocks`` and ``lstrip_blocks``; the ``loopcontrols`` extension (``{% break %}``,
  ``{% continue %}``) and the ``{% generation %}`` block (HF marks assistant text with it;
  here it renders its body);
* ``tojson`` as ``json.dumps`` (no HTML escaping, non-ASCII kept), with ``indent``,
  ``separators``, ``sort_keys`` and ``ensure_ascii`` options (Jinja's own escapes ``<`` and
  ``'`` and sorts keys, which changes every tool list a template writes);
* the globals ``raise_exception``, ``strftime_now``, a ``dict`` that only builds dicts, and a
  ``namespace`` that refuses underscore-prefixed attributes.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> Template:
    """``source`` compiled in HF's sandboxed chat-template environment (module doc). Raises
    jinja2's TemplateSyntaxError on a template that does not parse."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as written."""

        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)``, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace whose attributes cannot reach Python's internals (no ``_`` names)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the attribute {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)

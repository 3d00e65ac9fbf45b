"""The engine folder's tokenizer and chat template, without transformers at serving time."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from jinja2 import Template

from kvflow.orchestrator.sampling.params import check_text, list_unknown
from kvflow.text.chat_tools import (
    FunctionTool,
    check_template_kwargs,
    check_tool_calls,
    fallback_messages,
    has_tool_turns,
    parse_tools,
    template_messages,
    template_supports_tools,
)
from kvflow.text.jinja_env import compile_chat_template
from kvflow.text.stop_tokens import end_of_turn_ids


class ChatTemplateError(ValueError):
    """The engine has no chat template, or the messages do not render."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
# The named special tokens HF passes to a chat template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
MAX_CHAT_MESSAGES = 1024


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, and the function tools offered, rendered with the model's chat template
    when the engine tokenizes the request (tools and tool turns as :mod:`.chat_tools` says).

    Checked when built, naming the message and the field: ``role`` is one of ``system``,
    ``user``, ``assistant``, ``tool`` (OpenAI's ``developer`` is taken as ``system``);
    ``content`` is a string or a list of OpenAI text parts (``{"type": "text", "text": ...}``,
    joined; any other part, an image, is refused: the model reads text), or null for an
    assistant turn (taken as ""); an assistant turn may carry ``tool_calls``, a tool turn
    carries the ``tool_call_id`` it answers; text must be valid Unicode (no lone surrogate); an
    optional ``name`` is kept for the template. ``template_kwargs`` (a request's
    ``chat_template_kwargs``, e.g. Qwen3's ``{"enable_thinking": false}``) are more variables
    for the template (:func:`.chat_tools.check_template_kwargs`). Raises ValueError otherwise.
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[FunctionTool, ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, messages: Sequence[dict[str, Any]], tools: Any = None,
                 template_kwargs: Any = None) -> None:
        if not isinstance(messages, list | tuple) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        if len(messages) > MAX_CHAT_MESSAGES:
            raise ValueError(f"messages has {len(messages)} entries; the limit is "
                             f"{MAX_CHAT_MESSAGES}")
        object.__setattr__(self, "messages", tuple(_chat_message(i, m)
                                                   for i, m in enumerate(messages)))
        object.__setattr__(self, "tools", parse_tools(tools))
        object.__setattr__(self, "template_kwargs", check_template_kwargs(template_kwargs))
        for t in self.tools:
            check_text(t.description, f"tools ({t.name}).function.description")


_MESSAGE_KEYS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
                 "assistant": ("role", "content", "name", "tool_calls"),
                 "tool": ("role", "content", "name", "tool_call_id")}


def _chat_message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with role and content, got "
                         f"{type(message).__name__}")
    role = message.get("role")
    role = "system" if role == "developer" else role
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got "
                         f"{str(role)[:40]!r}")
    known = _MESSAGE_KEYS[role]
    unknown = sorted(set(message) - set(known), key=str)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {list_unknown([str(k) for k in unknown])}"
                         f" for role {role}; known: {', '.join(known)}")
    content = message.get("content")
    if content is None and role == "assistant":  # OpenAI allows it (the turn made tool calls)
        content = ""
    if isinstance(content, list):
        content = _text_parts(where, content)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got "
                         f"{type(content).__name__}")
    out: dict[str, Any] = {"role": role, "content": check_text(content, f"{where}.content")}
    if "name" in message:
        if not isinstance(message["name"], str):
            raise ValueError(f"{where}.name must be a string")
        out["name"] = check_text(message["name"], f"{where}.name")
    if message.get("tool_calls"):
        out["tool_calls"] = check_tool_calls(f"{where}.tool_calls", message["tool_calls"])
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError(f"{where}.tool_call_id must be the string id of the call this "
                             "tool turn answers")
        out["tool_call_id"] = check_text(call_id, f"{where}.tool_call_id")
    return out


def _text_parts(where: str, parts: list[Any]) -> str:
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_image", "image", "input_audio", "file"):
            raise ValueError(f"{where}.content[{k}] is an {kind} part; this model reads text "
                             "only")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{k}] must be a text part "
                             '{"type": "text", "text": "..."} (only text is supported)')
        texts.append(part["text"])
    return "".join(texts)


# What a request's prompt may be: text, token ids, or chat messages.
Prompt = str | Sequence[int] | ChatPrompt


def tokenize_prompt(tokenizer: EngineTokenizer | None, prompt: Prompt) -> list[int]:
    """The prompt's token ids: the one place where requests are tokenized
    (:meth:`kvflow.orchestrator.engine.LLMEngine.add_request` calls it)."""
    if isinstance(prompt, str | ChatPrompt):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        if isinstance(prompt, str):
            return tokenizer.encode(check_text(prompt, "prompt"))
        return tokenizer.encode_chat(list(prompt.messages), tools=prompt.tools,
                                     template_kwargs=prompt.template_kwargs)
    return [int(t) for t in prompt]


class EngineTokenizer:
    """``tokenizer.json`` + the chat template of an engine folder."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = self.config.get("chat_template")
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled: Template | None = None  # compiled at the first chat
        self._accepts_system: bool | None = None  # known at the first fallback
        # The same tokenizer, but special-token text is plain text: for message content.
        self._text_only = Tokenizer.from_str(self.tokenizer.to_str())
        self._text_only.encode_special_tokens = True
        self._special_texts = [t.content for t in
                               self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special tokens that end a turn, by their text (:mod:`.stop_tokens`): for a
        checkpoint without generation_config.json's list."""
        return end_of_turn_ids((i, t.content) for i, t in
                               self.tokenizer.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens of ``tokenizer_config.json`` (``bos_token``,
        ``eos_token``, ...) that are set: what HF gives a chat template besides the messages."""
        out = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = self.config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[name] = value
        return out

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: tuple[FunctionTool, ...] = (),
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template, where only the template's
        own markup becomes control tokens: special-token text inside a message's content (a
        user's ``<|im_end|>``) is encoded as plain text, so no message can forge a turn.
        ``template_kwargs``: more template variables (Qwen3's ``enable_thinking``); they are
        written outside any content, so special-token text in them is refused.

        Content without special-token text is encoded exactly as HF's ``apply_chat_template``
        + ``encode`` would. Otherwise the template is rendered with a random marker in place
        of each content; the markup between markers is encoded with special tokens parsed,
        each content without. A template that does not pass the markers through intact (it
        rewrites content) cannot be split so, and such a request is refused.
        """
        messages, tool_specs, markup = self._with_tools(messages, tools)
        kwargs = dict(template_kwargs or {})
        self._refuse_special("chat_template_kwargs", json.dumps(kwargs, ensure_ascii=False))
        # The client's text of each content, without the markup kvflow appended to it.
        contents = [c[:len(c) - len(s)] if isinstance(c := m.get("content"), str) else c
                    for m, s in zip(messages, markup, strict=True)]
        hostile = [i for i, c in enumerate(contents)
                   if isinstance(c, str) and any(t in c for t in self._special_texts)]
        if not hostile:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                        tool_specs, kwargs),
                               add_special_tokens=False)
        nonce = uuid.uuid4().hex
        masked = [{**m, "content": f"\x00{nonce}{i}\x00{s}"} if isinstance(c, str) else m
                  for i, (m, c, s) in enumerate(zip(messages, contents, markup, strict=True))]
        pieces = re.split(f"\x00{nonce}(\\d+)\x00",
                          self.apply_chat_template(masked, add_generation_prompt, tool_specs,
                                                   kwargs))
        if not set(hostile) <= {int(i) for i in pieces[1::2]}:
            raise ChatTemplateError(f"messages[{hostile[0]}].content holds special-token text, "
                                    "and this chat template rewrites content, so it cannot be "
                                    "kept plain text")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
            else:
                ids += self._text_only.encode(str(contents[int(piece)]),
                                              add_special_tokens=False).ids
        return ids

    def _with_tools(self, messages: list[dict[str, Any]], tools: tuple[FunctionTool, ...]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[str]]:
        """The messages and tools the template is given (:mod:`.chat_tools`): as they are for
        a template with tools, else the fallback, all in message content; and per message the
        markup kvflow appended to its content (encoded as the template's own)."""
        if not tools and not has_tool_turns(messages):
            return messages, None, [""] * len(messages)
        if not template_supports_tools(self.chat_template):
            out = fallback_messages(messages, tools, self._system_turns())
            return out, None, [""] * len(out)
        # The template writes these outside any content, where the content protection cannot
        # reach: special-token text there is refused.
        for where, text in [*((f"tools ({t.name})", json.dumps(t.to_openai())) for t in tools),
                            *((f"messages[{i}].tool_calls", json.dumps(m["tool_calls"]))
                              for i, m in enumerate(messages) if m.get("tool_calls"))]:
            self._refuse_special(where, text)
        return template_messages(messages, tools, self.chat_template or "")

    def _system_turns(self) -> bool:
        """Whether the template renders a system turn (Gemma 2's raises on one)."""
        if self._accepts_system is None:
            try:
                self.apply_chat_template([{"role": "system", "content": "s"},
                                          {"role": "user", "content": "u"}])
                self._accepts_system = True
            except ChatTemplateError:
                self._accepts_system = False
        return self._accepts_system

    def _refuse_special(self, where: str, text: str) -> None:
        special = next((t for t in self._special_texts if t in text), None)
        if special is not None:
            raise ChatTemplateError(f"{where} holds the special-token text {special!r}, "
                                    "which this chat template would not keep plain text")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render ``messages`` with the model's own template, as HF's ``apply_chat_template``
        does (:mod:`.jinja_env`: its sandboxed environment; the named special tokens, then
        ``template_kwargs``, as variables); ``tools``: OpenAI function tools, for a template
        that renders them."""
        if not self.chat_template:
            raise ChatTemplateError("this engine's tokenizer has no chat template")
        try:
            if self._compiled is None:
                self._compiled = compile_chat_template(self.chat_template)
            return self._compiled.render(
                **{**self.special_tokens(), **(template_kwargs or {})}, messages=messages,
                tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors of every kind
            raise ChatTemplateError(f"chat template failed: {e}") from e

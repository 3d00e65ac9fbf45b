"""The engine folder's tokenizer and chat template, without transformers at serving time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The engine has no chat template, or the messages do not render."""


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
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _special(self, name: str) -> str:
        value = self.config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value or ""

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own template (sandboxed Jinja, as HF does)."""
        if not self.chat_template:
            raise ChatTemplateError("this engine's tokenizer has no chat template")
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        try:
            return self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))
        except Exception as e:  # jinja errors of every kind
            raise ChatTemplateError(f"chat template failed: {e}") from e

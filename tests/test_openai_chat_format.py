"""How the frontend reads chat outputs: ``--tool-call-parser`` and ``--reasoning-parser``
``auto`` resolved from the parameters the launcher writes into the model config."""

from __future__ import annotations

import pytest

from kvflow.openai_api.config import FrontendConfig
from kvflow.openai_api.frontend import REASONING_PARSER_PARAMETER, chat_format
from kvflow.triton_backend.protocol import (
    REASONING_STARTS_OPEN_PARAMETER,
    TOOL_CALL_PARSER_PARAMETER,
)


def config(**kwargs) -> FrontendConfig:
    return FrontendConfig(("127.0.0.1:8001",), **kwargs)


def test_auto_is_the_default_and_follows_the_templates_formats():
    cfg = config()
    assert cfg.tool_call_parser == "auto" and cfg.reasoning_parser == "auto"
    plain = chat_format(cfg, {})
    assert plain.tool_call_parser == "hermes" and plain.reasoning is None
    qwen3 = chat_format(cfg, {TOOL_CALL_PARSER_PARAMETER: "hermes",
                              REASONING_PARSER_PARAMETER: "qwen3"})
    assert qwen3.reasoning is not None and not qwen3.reasoning.starts_open
    # A template that opens <think> in the prompt reasons, even where no format is named.
    opened = chat_format(cfg, {REASONING_STARTS_OPEN_PARAMETER: "true"})
    assert opened.reasoning is not None and opened.reasoning.starts_open


def test_a_named_or_no_parser_overrides_the_template():
    assert chat_format(config(reasoning_parser="none"),
                       {REASONING_PARSER_PARAMETER: "qwen3"}).reasoning is None
    assert config(reasoning_parser="none").reasoning_parser is None
    think = chat_format(config(reasoning_parser="think"), {})
    assert think.reasoning is not None and think.reasoning.start == "<think>"


def test_bad_flags_name_themselves():
    with pytest.raises(ValueError, match="--reasoning-parser"):
        config(reasoning_parser="r1")
    with pytest.raises(ValueError, match="--responses-store-max-count"):
        config(responses_store_max_count=0)

"""The OpenAI body fields kvflow knows: which go to the backend and how, their JSON types, and
the OpenAI fields kvflow ignores or does not serve. Tables only, read by :mod:`.checks` (which
fields a body may hold), :mod:`.protocol` (where each goes) and :mod:`.errors` (which field a
backend error names)."""

from __future__ import annotations

from typing import Any

from kvflow.orchestrator.sampling.params import GUIDED_FIELDS

# Body fields passed to the backend under the same name (SamplingParams validates them).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop", "stop_token_ids", "skip_special_tokens", "timeout_ms",
                   "speculative", *GUIDED_FIELDS)
# Body fields sent as request tensors of their own.
TENSOR_FIELDS = ("user", "priority", "cache_salt")
# prompt_logprobs (vLLM's extra) goes to the backend under its name too; on completions, echo
# with logprobs asks for it as well (see protocol._prompt_logprobs).
COMMON_FIELDS = ("model", "max_tokens", "n", "stream", "stream_options", "logprobs",
                 "prompt_logprobs", "response_format", *SAMPLING_FIELDS, *TENSOR_FIELDS)
COMPLETION_FIELDS = ("prompt", "echo", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "chat_template_kwargs", *COMMON_FIELDS)
# Fields packed for the backend: their text must be Unicode (UTF-8 cannot carry a lone
# surrogate).
PACKED_FIELDS = ("prompt", "messages", "tools", "chat_template_kwargs", "response_format",
                 *SAMPLING_FIELDS,
                 *TENSOR_FIELDS)
# OpenAI fields that change nothing kvflow serves and that clients send anyway: accepted
# whatever their value, and ignored with a warning in the log (as vLLM does).
IGNORED_FIELDS = ("metadata", "store", "reasoning_effort", "prompt_cache_key",
                  "safety_identifier", "verbosity", "service_tier")
# OpenAI fields kvflow does not serve, which would change the output: accepted only when
# absent, null or a value that asks for nothing.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "logit_bias": (None, {}),
    "functions": (None, []), "function_call": (None, "none", "auto"),
}
# The JSON type of each typed field; "10" is not an integer (OpenAI refuses it too).
FIELD_TYPES: dict[str, str] = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"), "a number"),
    **dict.fromkeys(("max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens",
                     "timeout_ms", "priority", "top_logprobs", "prompt_logprobs"),
                    "an integer"),
    **dict.fromkeys(("echo", "stream", "ignore_eos", "skip_special_tokens",
                     "guided_json_object", "speculative", "parallel_tool_calls"),
                    "a boolean"),
    **dict.fromkeys(("model", "user", "cache_salt", "guided_regex", "guided_grammar"),
                    "a string"),
    "guided_choice": "a list", "stop_token_ids": "a list", "tools": "a list",
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")

"""Every request bounded before work (issue 43), on a tiny engine, without a server: a chat's
tools count against the context before anything is tokenized, a request's prompt logprobs
(n x (k + 1) x prompt tokens) are bounded once its prompt is tokenized, and the tokenize
requests the backend answers are bounded by max_model_len. (Served: test_openai_hardening.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow import SamplingParams
from kvflow.orchestrator.input_processor import MAX_PROMPT_LOGPROB_ENTRIES, InputProcessor
from kvflow.text.tokenizer import ChatPrompt
from kvflow.triton_backend.params import BadRequestError
from kvflow.triton_backend.tokenize import tokenize_outputs


@pytest.fixture(scope="module")
def inputs(tiny_engines) -> InputProcessor:
    from kvflow.orchestrator.llm import create_engine

    engine = create_engine(str(tiny_engines["llama-gqa4", "torch"]))
    yield engine.inputs
    engine.close()


def tool(name: str, description: str, **parameters) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", **parameters}}}


HI = [{"role": "user", "content": "Hi"}]


def test_a_description_no_context_holds_is_named_before_tokenizing(inputs):
    limit = inputs.max_prompt_chars
    prompt = ChatPrompt(HI, [tool("small", "ok"), tool("big", "d" * (limit + 1))])
    with pytest.raises(ValueError, match=rf"^tools\[1\]\.function\.description is {limit + 1} "
                                         rf"characters .*the limit is {limit}\)$"):
        inputs.prepare(prompt, SamplingParams())


def test_tools_together_count_and_the_larger_part_is_named(inputs):
    limit = inputs.max_prompt_chars
    quarter = "d" * (limit // 4)
    many = [tool(f"t{i}", quarter) for i in range(5)]  # each fits, together they do not
    with pytest.raises(ValueError, match=r"^tools is \d+ characters \(\d+ with the rest"):
        inputs.prepare(ChatPrompt(HI, many), SamplingParams())
    # Parameters count, as their JSON: the template renders them.
    schema = {f"p{i}": {"type": "string", "description": quarter} for i in range(5)}
    with pytest.raises(ValueError, match=r"^tools is"):
        inputs.prepare(ChatPrompt(HI, [tool("f", "", properties=schema)]), SamplingParams())
    # Messages larger than the tools: messages are named.
    long = [{"role": "user", "content": "m" * limit}]
    with pytest.raises(ValueError, match=r"^messages is"):
        inputs.prepare(ChatPrompt(long, [tool("f", "short")]), SamplingParams())
    # Under the bound, tools are rendered and tokenized as before.
    assert inputs.prepare(ChatPrompt(HI, [tool("f", "short")]), SamplingParams()).prompt_token_ids


def test_prompt_logprobs_past_the_bound_are_refused_naming_n_and_k(inputs):
    n, k = 64, 20
    fits = MAX_PROMPT_LOGPROB_ENTRIES // (n * (k + 1))  # the longest prompt that fits
    params = SamplingParams(n=n, prompt_logprobs=k, max_tokens=1)
    inputs.prepare([3] * fits, params)
    with pytest.raises(ValueError, match=rf"^prompt_logprobs 20 for {fits + 1} prompt tokens "
                                         rf"and n 64 .*the limit is {MAX_PROMPT_LOGPROB_ENTRIES}"):
        inputs.prepare([3] * (fits + 1), params)
    inputs.prepare([3] * (fits + 1), SamplingParams(n=n, max_tokens=1))  # none asked: no bound


def text_input(text: str) -> dict[str, np.ndarray]:
    return {"text_input": np.array([text.encode()], dtype=object)}


def test_tokenize_and_detokenize_are_bounded_by_max_model_len(inputs):
    limit = inputs.max_model_len
    answer = tokenize_outputs(inputs, {"input_ids": np.array([3] * limit)}, {})
    assert answer["text_output"][0]
    with pytest.raises(BadRequestError, match=rf"^input_ids has {limit + 1} ids; the limit is "
                                              rf"max_model_len \({limit}\)$"):
        tokenize_outputs(inputs, {"input_ids": np.array([3] * (limit + 1))}, {})
    chars = inputs.max_prompt_chars
    assert tokenize_outputs(inputs, text_input("hi"), {})["max_model_len"][0] == limit
    with pytest.raises(BadRequestError, match=rf"^text_input is {chars + 1} characters"):
        tokenize_outputs(inputs, text_input("x" * (chars + 1)), {})
    messages = {"messages": np.array([json.dumps(HI).encode()], dtype=object),
                "tools": np.array([json.dumps([tool("f", "d" * (chars + 1))]).encode()],
                                  dtype=object)}
    with pytest.raises(BadRequestError, match=r"^tools\[0\]\.function\.description is"):
        tokenize_outputs(inputs, messages, {})

"""Tokenize and detokenize requests: the backend side of the OpenAI frontend's ``/tokenize``
and ``/detokenize`` (vLLM's endpoints), answered on a worker thread of the backend's (never
Triton's execute thread, which every generate request waits behind), without the engine loop.

A request with the parameter ``kvflow_tokenize: true`` carries a prompt as any request does
(``text_input``, ``messages`` with ``tools``, ``sampling_parameters`` and the rest ignored)
and gets one final response: ``token_ids``, the prompt's tokens as the engine would see them,
and ``max_model_len``. With ``input_ids`` alone it is a detokenize request: ``text_output`` is
their text, special tokens included (as ``tokenizer.decode`` gives it). The parameters
``add_special_tokens`` (text) and ``add_generation_prompt`` (messages) default to true.

Both are bounded by ``max_model_len`` before any work: a text as the engine bounds a prompt
(:meth:`~kvflow.orchestrator.input_processor.InputProcessor.check_text_length`: longer than
``max_model_len`` tokens could ever cover, messages and tools together), and at most
``max_model_len`` ids to detokenize.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvflow.orchestrator.input_processor import InputProcessor, check_in_vocab
from kvflow.orchestrator.sampling.params import list_unknown
from kvflow.text.tokenizer import ChatPrompt
from kvflow.triton_backend.params import REQUEST_PARAMETERS, BadRequestError, parse_request
from kvflow.triton_backend.protocol import TOKENIZE_PARAMETER

TOKENIZE_OPTIONS = ("add_special_tokens", "add_generation_prompt")


def tokenize_outputs(processor: InputProcessor, inputs: Mapping[str, np.ndarray],
                     parameters: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The outputs that answer one tokenize (or detokenize) request of the engine whose
    prompts ``processor`` prepares; a BadRequestError names the field and the limit."""
    tokenizer, max_model_len = processor.tokenizer, processor.max_model_len
    if tokenizer is None:
        raise BadRequestError("this engine has no tokenizer: it cannot tokenize")
    known = (*REQUEST_PARAMETERS, TOKENIZE_PARAMETER, *TOKENIZE_OPTIONS)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise BadRequestError(f"the tokenize request has unknown parameter(s) "
                              f"{list_unknown(unknown)}; known: {', '.join(known)}")
    options = {}
    for name in TOKENIZE_OPTIONS:
        value = parameters.get(name, True)
        if not isinstance(value, bool):
            raise BadRequestError(f"{name} must be a boolean, got {type(value).__name__}")
        options[name] = value
    ids_given = np.asarray(inputs.get("input_ids", ())).size
    if ids_given > max_model_len:  # before they are read
        raise BadRequestError(f"input_ids has {ids_given} ids; the limit is max_model_len "
                              f"({max_model_len})")
    parsed = parse_request(inputs, max_model_len)
    prompt = parsed.prompt
    if not isinstance(prompt, str | ChatPrompt):  # token ids: detokenize them
        prompt = list(prompt)
        try:
            check_in_vocab(prompt, tokenizer.vocab_size, "input_ids[{}]")
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    try:
        processor.check_text_length(prompt)
    except ValueError as e:  # "prompt is N characters": the text_input's
        raise BadRequestError(str(e).replace("prompt is", "text_input is", 1)) from None
    try:
        if isinstance(prompt, ChatPrompt):
            ids = tokenizer.encode_chat(list(prompt.messages), options["add_generation_prompt"],
                                        prompt.tools, prompt.template_kwargs)
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=options["add_special_tokens"])
    except ValueError as e:  # the chat template's errors
        raise BadRequestError(str(e)) from None
    return {"token_ids": np.array(ids, dtype=np.int64),
            "max_model_len": np.array([max_model_len], dtype=np.uint32)}

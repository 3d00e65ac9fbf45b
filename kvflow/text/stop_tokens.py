"""The control tokens that end a model's turn, by their text, for a checkpoint that does not
list them. Pure Python.

An HF folder lists them in ``generation_config.json``'s ``eos_token_id`` (Gemma 3: ``<eos>``
and ``<end_of_turn>``; Llama 3.x: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``; Qwen3:
``<|im_end|>`` and ``<|endoftext|>``; Phi-4-mini: ``<|end|>`` and ``<|endoftext|>``), and the
model loader reads them there. A GGUF keeps one ``tokenizer.ggml.eos_token_id`` (the
tokenizer config's, e.g. Gemma 3's ``<eos>`` or Phi-4-mini's ``<|endoftext|>``): a chat
would run past ``<end_of_turn>`` / ``<|end|>``. llama.cpp then marks end-of-generation
tokens by their text (``llama-vocab.cpp``, ``special_eog_ids``); :func:`end_of_turn_ids` is
that rule, for the same checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

# llama.cpp's end-of-generation texts, for the families kvflow runs (and their kin).
END_OF_TURN_TEXTS = frozenset((
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",  # Llama 3.x
    "<|im_end|>", "<|endoftext|>",                   # Qwen, Phi, SmolLM
    "<|end|>",                                       # Phi-3.x, Phi-4-mini
    "<end_of_turn>", "<eos>",                        # Gemma
    "</s>",                                          # Llama 2, Mistral
    "<EOT>", "<end_of_utterance>",
))


def end_of_turn_ids(control_tokens: Iterable[tuple[int, str]]) -> tuple[int, ...]:
    """The ids, in order, of the control (special) tokens among ``control_tokens`` (id, text)
    that end a turn (END_OF_TURN_TEXTS). Give only control tokens: a plain token that happens
    to read ``</s>`` ends nothing."""
    return tuple(sorted({i for i, text in control_tokens if text in END_OF_TURN_TEXTS}))
